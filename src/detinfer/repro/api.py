"""Python API of the experiment: run it against the offline engine (per mode) or servers, get `Section`s
for `detinfer.repro.report.write_report`.

    from detinfer.repro import ReproConfig, repro_offline, write_report
    sections = repro_offline("path/to/model", "Tell me about Richard Feynman", ReproConfig(n=100),
                             modes=("fast", "deterministic"))
    write_report("out", sections, {"prompt": "Tell me about Richard Feynman"})
    print([s.summary.num_unique for s in sections])
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from detinfer.cli_util import Interrupted
from detinfer.constants import MODES
from detinfer.engine.config import EngineConfig
from detinfer.models.hub import resolve_model_path
from detinfer.repro.analysis import summarize
from detinfer.repro.experiment import ReproConfig, run_offline
from detinfer.repro.random_model import encode_bytes
from detinfer.repro.report import Section


def _check_prompt(prompt: str) -> None:
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("the prompt must be a non-empty string")


def _engine_for(mode: str, model_dir, random_model, engine_config: EngineConfig, device, random_seed: int):
    """(engine, prompt ids function, decode function, text_of, what) for one mode."""
    from detinfer.dtypes import dtype_name
    from detinfer.engine.llm_engine import LLMEngine
    from detinfer.repro import random_model as rm

    config = engine_config.replace(mode=mode)
    if random_model is None:
        engine = LLMEngine(model_dir, config, device)
        tok = engine.tokenizer
        return engine, tok, (lambda ids: tok.decode(ids, skip_special_tokens=False)), None, f"model {model_dir}"
    engine = rm.random_engine(random_model, config, device, random_seed)
    what = f"random {random_model} (seed {random_seed}, {dtype_name(engine.dtype)} on {engine.device})"
    return engine, None, rm.decode_ids, (lambda c: rm.decode_ids(c.token_ids)), what


def prompt_ids_for(tokenizer, prompt: str, chat: bool) -> list[int]:
    """The ids a run sends: the chat template around one user message (chat), else the plain encoding.
    Without a tokenizer (random models): the prompt's UTF-8 bytes."""
    if tokenizer is None:
        return encode_bytes(prompt)
    if chat:
        if tokenizer.chat_template is None:
            raise ValueError("the model has no chat template; pass --no-chat (chat=False) to send raw text")
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True)
    return tokenizer.encode(prompt)


def repro_offline(model_dir: str | Path | None, prompt: str, cfg: ReproConfig, *,
                  modes: Sequence[str] = ("deterministic",), engine_config: EngineConfig | None = None,
                  device=None, random_model: str | None = None, random_seed: int = 0,
                  progress: bool = True) -> list[Section]:
    """Run the experiment on the offline engine once per mode, each with a fresh engine and the same
    load plan. Give `model_dir`, or `random_model` (a preset of detinfer.repro.random_model)."""
    _check_prompt(prompt)
    if not isinstance(cfg, ReproConfig):
        raise TypeError(f"cfg must be a ReproConfig, got {type(cfg).__name__}")
    if (model_dir is None) == (random_model is None):
        raise ValueError("give exactly one of model_dir and random_model")
    if model_dir is not None:  # a directory or a hub id; fail here, before any mode runs
        model_dir = resolve_model_path(model_dir)
    modes = tuple(modes)
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise ValueError(f"modes must be distinct values of {MODES}, got {modes!r}")
    engine_config = EngineConfig() if engine_config is None else engine_config
    sections = []
    for i, mode in enumerate(modes):
        try:
            section, interrupted = _run_mode(i, modes, model_dir, random_model, prompt, cfg, engine_config,
                                             device, random_seed, progress)
        except KeyboardInterrupt:  # while loading: the modes before this one are finished
            raise Interrupted(sections, f"while loading {mode} mode{_not_run(modes[i + 1:])}") from None
        if section is not None:
            sections.append(section)
        if interrupted is not None:
            raise Interrupted(sections, f"in {mode} mode {interrupted}{_not_run(modes[i + 1:])}")
    return sections


def _not_run(modes: Sequence[str]) -> str:
    return f"; not run: {', '.join(modes)} mode" if modes else ""


def _run_mode(i: int, modes: Sequence[str], model_dir, random_model, prompt: str, cfg: ReproConfig,
              engine_config: EngineConfig, device, random_seed: int, progress: bool):
    """(this mode's Section or None, None or where Ctrl-C stopped it). A Section of an interrupted mode
    holds the runs that finished, and says so in its extra["partial"]."""
    mode, started = modes[i], time.perf_counter()
    if progress:
        print(f"[{i + 1}/{len(modes)}] {mode} mode: loading {model_dir or random_model} ...", file=sys.stderr,
              flush=True)
    engine, tok, decode, text_of, what = _engine_for(mode, model_dir, random_model, engine_config, device,
                                                      random_seed)
    if progress:
        print(f"[{i + 1}/{len(modes)}] {mode} mode: loaded in {time.perf_counter() - started:.1f} s; "
              f"{cfg.n} runs of up to {cfg.max_tokens} tokens under load", file=sys.stderr, flush=True)
    interrupted = None
    try:
        ids = prompt_ids_for(tok, prompt, cfg.chat)
        encode = tok.encode if tok is not None else encode_bytes
        try:
            completions, extra = run_offline(engine, ids, cfg, encode=encode, text_of=text_of,
                                             progress=progress, label=mode)
        except Interrupted as e:
            (completions, extra), interrupted = e.partial, e.where
            extra["partial"] = f"interrupted (Ctrl-C) {e.where}"
        prompt_text = decode(ids)
    finally:
        engine.close()  # a tensor-parallel engine's workers hold their GPUs until stopped
        del engine
        _free_memory()
    if not completions:
        return None, interrupted
    elapsed = extra.pop("elapsed_s")
    return Section(label=mode, target=f"offline engine, {mode} mode, {what}", prompt=prompt_text,
                   summary=summarize(completions, decode, cfg.max_pairs), completions=tuple(completions),
                   elapsed_s=elapsed, extra=extra), interrupted


def repro_server(urls: Sequence[str], prompt: str, cfg: ReproConfig, *, model: str | None = None,
                 api_key: str | None = None, progress: bool = True) -> list[Section]:
    """Run the experiment against each OpenAI-compatible server in turn (one section per URL)."""
    from detinfer.repro.client import decode_units, run_server

    _check_prompt(prompt)
    if isinstance(urls, str) or not urls:
        raise ValueError("urls must be a non-empty list of server URLs")
    sections = []
    for i, url in enumerate(urls):
        try:
            completions, extra = run_server(url, prompt, cfg, model=model, api_key=api_key, progress=progress,
                                            label=url)
        except KeyboardInterrupt:  # the servers before this one are finished
            not_run = f"; not run: {', '.join(urls[i + 1:])}" if urls[i + 1:] else ""
            raise Interrupted(sections, f"while running against {url}{not_run}") from None
        elapsed = extra.pop("elapsed_s")
        label = url if list(urls).count(url) == 1 else f"{url} #{i}"
        endpoint = "/v1/chat/completions" if cfg.chat else "/v1/completions"
        sections.append(Section(label=label, target=f"server {url} ({endpoint}, model {extra['model']})",
                                prompt=prompt, summary=summarize(completions, decode_units, cfg.max_pairs),
                                completions=tuple(completions), elapsed_s=elapsed, extra=extra))
    return sections


def _free_memory() -> None:
    """Drop the previous mode's engine (weights, KV pool, graphs) before the next one is built."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass
