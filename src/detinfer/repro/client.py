"""The experiment against any OpenAI-compatible server (detinfer serve, vLLM, SGLang, llama.cpp, ...).

Every request of the plan (see detinfer.repro.experiment.make_plan) is its own asyncio task that sleeps
until `step * step_seconds` after the start and then posts, so runs and background load overlap on the
server the way independent clients would. Runs use /v1/chat/completions (with --chat) or
/v1/completions, asking for logprobs; the server's token strings are the units compared (token ids are
not part of the OpenAI API). A server that returns no logprobs is compared on text, character by
character.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

from detinfer.repro.analysis import Completion
from detinfer.repro.experiment import Event, ReproConfig, make_plan


class ServerError(RuntimeError):
    """The server could not be reached, or answered a run with an error."""


def api_base(url: str) -> str:
    """'http://host:8000', '.../' or '.../v1' -> 'http://host:8000/v1'."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"url must start with http:// or https://, got {url!r}")
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def request_body(cfg: ReproConfig, model: str, prompt: str, *, max_tokens: int, temperature: float,
                 seed: int | None, logprobs: int | None) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one request."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": float(temperature)}
    if seed is not None:
        body["seed"] = seed
    if cfg.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        if logprobs is not None:
            body.update(logprobs=True, top_logprobs=logprobs)
        return "/chat/completions", body
    body["prompt"] = prompt
    if logprobs is not None:
        body["logprobs"] = logprobs
    return "/completions", body


def token_unit(token: str, raw: list[int] | None = None) -> str:
    """The unit compared for one server token. A token that is only part of a UTF-8 character cannot be
    written as text; servers then send `bytes:\\xNN...` (OpenAI's convention) or a placeholder string
    plus its raw `bytes` (chat). Both are normalised to the `bytes:` form so that `decode_units` can
    rebuild the exact text."""
    if raw is not None and token.encode("utf-8") != bytes(raw):
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return token


_BYTES_UNIT = re.compile(r"bytes:((?:\\x[0-9a-fA-F]{2})+)")


def _unit_bytes(unit: str) -> bytes:
    m = _BYTES_UNIT.fullmatch(unit)  # anything else is text, even if it starts with "bytes:"
    return bytes.fromhex(m.group(1).replace("\\x", "")) if m else unit.encode("utf-8")


def decode_units(units) -> str:
    """Text of a run of server tokens (partial UTF-8 characters joined before decoding)."""
    return b"".join(_unit_bytes(u) for u in units).decode("utf-8", errors="replace")


def completion_from_response(run: int, data: dict[str, Any], chat: bool, meta: dict[str, Any]) -> Completion:
    """A Completion from a /v1/chat/completions or /v1/completions response (first choice)."""
    try:
        choice = data["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        lp = choice.get("logprobs")
        tokens = logprobs = top = None
        if chat and lp and lp.get("content") is not None:
            content = lp["content"]
            tokens = tuple(token_unit(e["token"], e.get("bytes")) for e in content)
            logprobs = tuple(e["logprob"] for e in content)
            top = tuple(tuple((token_unit(t["token"], t.get("bytes")), t["logprob"])
                              for t in e.get("top_logprobs") or ()) for e in content)
        elif not chat and lp and lp.get("tokens") is not None:
            tokens = tuple(lp["tokens"])
            logprobs = tuple(lp["token_logprobs"])
            top = tuple(tuple((d or {}).items()) for d in lp.get("top_logprobs") or [None] * len(tokens))
        return Completion(run=run, text=text or "", tokens=tokens, logprobs=logprobs, top_logprobs=top,
                          finish_reason=choice.get("finish_reason"), meta=meta)
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise ServerError(f"run {run}: unexpected response shape ({type(e).__name__}: {e}): "
                          f"{str(data)[:300]}") from None


async def _first_model(client, base: str) -> str:
    r = await client.get(base + "/models")
    if r.status_code != 200:
        raise ServerError(f"GET {base}/models answered {r.status_code}: {r.text[:300]}; pass --model-name")
    data = r.json().get("data") or []
    if not data:
        raise ServerError(f"GET {base}/models lists no model; pass --model-name")
    return data[0]["id"]


async def run_server_async(url: str, prompt: str, cfg: ReproConfig, *, model: str | None = None,
                           api_key: str | None = None, progress: bool = True,
                           label: str = "") -> tuple[list[Completion], dict[str, Any]]:
    """Run the plan against `url`; returns the N completions (by run) and a few statistics. Background
    failures are counted, not fatal (an overloaded server may refuse some load); a run that fails raises
    ServerError, since the experiment needs all N."""
    import httpx
    from tqdm import tqdm

    base = api_base(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=cfg.max_connections, max_keepalive_connections=cfg.max_connections)
    timeout = httpx.Timeout(cfg.request_timeout, connect=min(30.0, cfg.request_timeout))
    plan = make_plan(cfg)
    done: dict[int, Completion] = {}
    stats = {"background requests": 0, "background failures": 0}
    bar = tqdm(total=cfg.n, desc=label or "runs", unit="run", disable=not progress)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        try:
            model = model or await _first_model(client, base)
        except httpx.HTTPError as e:
            raise ServerError(f"cannot reach {base}: {type(e).__name__}: {e}") from None
        start = time.perf_counter()

        async def send(ev: Event) -> None:
            delay = ev.step * cfg.step_seconds - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            if ev.run is None:
                path, body = request_body(cfg, model, ev.prompt, max_tokens=ev.max_tokens,
                                          temperature=ev.temperature, seed=ev.seed, logprobs=None)
                stats["background requests"] += 1
                try:
                    r = await client.post(base + path, json=body)
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                stats["background failures"] += not ok
                return
            path, body = request_body(cfg, model, prompt, max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                                      seed=cfg.sampling_seed if cfg.temperature > 0 else None,
                                      logprobs=cfg.logprobs)
            sent = time.perf_counter()
            try:
                r = await client.post(base + path, json=body)
            except httpx.HTTPError as e:
                raise ServerError(f"run {ev.run}: {type(e).__name__}: {e}") from None
            if r.status_code != 200:
                raise ServerError(f"run {ev.run}: {base + path} answered {r.status_code}: {r.text[:300]}")
            meta = {"sent_s": round(sent - start, 4), "latency_s": round(time.perf_counter() - sent, 4),
                    "background_planned": ev.load}
            done[ev.run] = completion_from_response(ev.run, r.json(), cfg.chat, meta)
            bar.update(1)

        tasks = [asyncio.create_task(send(ev)) for ev in plan]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            bar.close()
    stats["model"] = model
    stats["elapsed_s"] = time.perf_counter() - start
    return [done[r] for r in range(cfg.n)], stats


def run_server(url: str, prompt: str, cfg: ReproConfig, **kwargs: Any) -> tuple[list[Completion], dict[str, Any]]:
    """Synchronous wrapper of `run_server_async`."""
    return asyncio.run(run_server_async(url, prompt, cfg, **kwargs))
