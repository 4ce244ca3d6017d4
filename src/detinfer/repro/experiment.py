"""The experiment: one prompt, N runs, each submitted while a random background load is in flight.

The load is a *plan* drawn from a seeded generator before anything runs, so the experiment itself is
reproducible and `--mode both` runs fast and deterministic mode under exactly the same load:

* run i arrives `randint(0, run_gap)` steps after run i-1 (runs overlap when the gap is short);
* around run i, `randint(0, max_background)` background requests arrive, each within `arrival_window`
  steps of it, with a random prompt (1..background_prompt_words words), a random max_tokens and either
  greedy or seeded sampling.

Offline, a "step" is one engine step: events due by the current step are added before it runs (the engine
jumps over idle stretches). Against a server, event k is sent `step * step_seconds` after the start, each
request its own concurrent task (see detinfer.repro.client).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from detinfer.cli_util import Interrupted
from detinfer.engine.config import MAX_SEED, check_float, check_int
from detinfer.repro.analysis import Completion

# Background prompts are made of plain words so that any tokenizer (or server) takes them.
WORDS = ("the", "model", "batch", "kernel", "token", "river", "mountain", "quantum", "history", "music",
         "why", "does", "a", "cat", "sleep", "explain", "write", "poem", "about", "numbers", "code", "in",
         "Python", "list", "seven", "reasons", "Paris", "ocean", "light", "gravity", "simple", "story",
         "translate", "French", "summarize", "this", "paragraph", "and", "of", "to", "is", "what")


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class ReproConfig:
    """What to run and under which load. Validated on construction; also generates the CLI flags."""

    n: int = field(default=1000, metadata=_help("Runs of the prompt."))
    max_tokens: int = field(default=256, metadata=_help("Most tokens per completion."))
    temperature: float = field(default=0.0, metadata=_help(
        "0: greedy. > 0: sampled, every run with the same --sampling-seed (a fixed seed must reproduce)."))
    sampling_seed: int = field(default=0, metadata=_help("Seed of every run when --temperature > 0."))
    logprobs: int | None = field(default=2, metadata=_help(
        "Request logprobs with this many alternatives per token (none: no logprobs)."))
    chat: bool = field(default=False, metadata=_help(
        "--chat: send the prompt as one user message through the chat template (server: "
        "/v1/chat/completions); --no-chat (the default, as `detinfer generate` and vLLM's completions): "
        "raw text (/v1/completions)."))
    load_seed: int = field(default=0, metadata=_help("Seed of the background-load plan."))
    max_background: int = field(default=4, metadata=_help(
        "Most background requests submitted around each run (0: no load)."))
    background_prompt_words: int = field(default=16, metadata=_help("Longest background prompt, in words."))
    background_max_tokens: int = field(default=32, metadata=_help("Most tokens a background request asks for."))
    run_gap: int = field(default=4, metadata=_help("Most steps between the arrivals of consecutive runs."))
    arrival_window: int = field(default=8, metadata=_help(
        "Background requests arrive within this many steps before or after their run."))
    step_seconds: float = field(default=0.05, metadata=_help("Against a server: seconds per plan step."))
    request_timeout: float = field(default=600.0, metadata=_help("Against a server: seconds per request."))
    max_connections: int = field(default=256, metadata=_help("Against a server: most concurrent connections."))
    max_pairs: int = field(default=100, metadata=_help("Most pairs of distinct completions analysed."))

    def __post_init__(self):
        check_int("n", self.n, minimum=1)
        check_int("max_tokens", self.max_tokens, minimum=1)
        check_float("temperature", self.temperature, minimum=0.0)
        check_int("sampling_seed", self.sampling_seed, minimum=0, maximum=MAX_SEED)
        check_int("logprobs", self.logprobs, minimum=0, maximum=20, optional=True)
        if not isinstance(self.chat, bool):
            raise TypeError(f"chat must be a bool, got {self.chat!r}")
        check_int("load_seed", self.load_seed, minimum=0)
        check_int("max_background", self.max_background, minimum=0)
        check_int("background_prompt_words", self.background_prompt_words, minimum=1)
        check_int("background_max_tokens", self.background_max_tokens, minimum=1)
        check_int("run_gap", self.run_gap, minimum=0)
        check_int("arrival_window", self.arrival_window, minimum=0)
        check_float("step_seconds", self.step_seconds, minimum=0.0)
        check_float("request_timeout", self.request_timeout, minimum=0.0, min_exclusive=True)
        check_int("max_connections", self.max_connections, minimum=1)
        check_int("max_pairs", self.max_pairs, minimum=0)


@dataclass(frozen=True)
class Event:
    """One request of the plan. run: the run index for the prompt's runs, None for background load."""

    step: int
    run: int | None
    prompt: str = ""  # background only (runs use the experiment's prompt)
    max_tokens: int = 0
    temperature: float = 0.0
    seed: int | None = None
    load: int = 0  # runs: background requests planned around this run


def make_plan(cfg: ReproConfig) -> list[Event]:
    """Every request of the experiment in arrival order (ties: planning order). A pure function of cfg."""
    rng = random.Random(cfg.load_seed)
    events: list[tuple[int, int, Event]] = []
    step = 0
    for run in range(cfg.n):
        step += rng.randint(0, cfg.run_gap) if run else 0
        count = rng.randint(0, cfg.max_background)
        events.append((step, len(events), Event(step, run, load=count)))
        for _ in range(count):
            at = max(0, step + rng.randint(-cfg.arrival_window, cfg.arrival_window))
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, cfg.background_prompt_words)))
            sampled = rng.random() < 0.5
            events.append((at, len(events), Event(
                at, None, prompt=words.capitalize(), max_tokens=rng.randint(1, cfg.background_max_tokens),
                temperature=0.8 if sampled else 0.0, seed=rng.randint(0, 2**31 - 1) if sampled else None)))
    return [e for _, _, e in sorted(events, key=lambda t: (t[0], t[1]))]


def completion_from_engine(run: int, out, meta: dict[str, Any]) -> Completion:
    """A Completion from an engine CompletionOutput (token ids, raw logprobs, top alternatives)."""
    lps = out.logprobs
    return Completion(run=run, text=out.text, tokens=tuple(out.token_ids),
                      logprobs=None if lps is None else tuple(e.logprob for e in lps),
                      top_logprobs=None if lps is None else tuple(tuple(e.top_logprobs.items()) for e in lps),
                      finish_reason=out.finish_reason, meta=meta)


def sampling_params(cfg: ReproConfig):
    from detinfer.engine.sampling_params import SamplingParams

    sampled = cfg.temperature > 0
    return SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                          seed=cfg.sampling_seed if sampled else None, logprobs=cfg.logprobs)


def run_offline(engine, prompt_ids: Sequence[int], cfg: ReproConfig, *,
                encode: Callable[[str], list[int]], text_of: Callable[[Any], str] | None = None,
                progress: bool = True, label: str = "") -> tuple[list[Completion], dict[str, Any]]:
    """Run the plan on an `LLMEngine`; returns the N completions (by run) and engine statistics.

    encode: text -> token ids for background prompts. text_of: CompletionOutput -> text, for engines
    without a tokenizer (whose outputs carry no text)."""
    from tqdm import tqdm

    from detinfer.engine.drive import drive
    from detinfer.engine.sampling_params import SamplingParams

    if engine.has_unfinished_requests():
        raise ValueError("the engine already has unfinished requests; the experiment needs it idle")
    params = sampling_params(cfg)
    plan = make_plan(cfg)
    arrivals = [(ev.step, f"run-{ev.run}", list(prompt_ids), params) if ev.run is not None else
                (ev.step, f"bg-{i}", encode(ev.prompt),
                 SamplingParams(max_tokens=ev.max_tokens, temperature=ev.temperature, seed=ev.seed))
                for i, ev in enumerate(plan)]
    run_events = {f"run-{ev.run}": ev for ev in plan if ev.run is not None}
    runs_at: dict[str, tuple[Event, int]] = {}  # a run's request id -> (its event, requests in flight then)
    done: dict[int, Completion] = {}
    start = time.perf_counter()
    # Progress in generated tokens of the N runs (a bar counting finished runs sat at 0 for minutes on a CPU):
    # the total is N * max_tokens; a run that stops early is topped up to max_tokens when it finishes.
    bar = tqdm(total=cfg.n * cfg.max_tokens, desc=label or "runs", unit="tok", disable=not progress,
               postfix={"runs done": f"0/{cfg.n}"})
    shown: dict[str, int] = {}

    def add(rid: str, prompt: list[int], p) -> None:
        in_flight = engine.get_num_unfinished_requests()
        try:
            engine.add_request(rid, prompt, p)
        except ValueError as e:
            if rid in run_events:
                raise
            raise ValueError(f"the engine refused a background request ({e}); lower "
                             "--background-prompt-words / --background-max-tokens") from None
        if rid in run_events:
            runs_at[rid] = (run_events[rid], in_flight)

    def on_output(out, step: int) -> None:
        if out.request_id not in runs_at:
            return
        if progress:
            have = cfg.max_tokens if out.finished else len(out.outputs[0].token_ids)
            bar.update(have - shown.get(out.request_id, 0))
            shown[out.request_id] = have
        if out.finished:
            ev, in_flight = runs_at.pop(out.request_id)
            meta = {"arrival_step": ev.step, "finish_step": step, "in_flight_at_arrival": in_flight,
                    "background_planned": ev.load}
            c = out.outputs[0]
            if text_of is not None:
                c = _with_text(c, text_of(c))
            done[ev.run] = completion_from_engine(ev.run, c, meta)
            bar.set_postfix({"runs done": f"{len(done)}/{cfg.n}"}, refresh=False)

    try:
        drive(engine, arrivals, add=add, on_output=on_output)
    except KeyboardInterrupt:  # Ctrl-C: hand back the runs that finished
        finished = [done[r] for r in sorted(done)]
        raise Interrupted((finished, _extra(engine, plan, start)), f"after {len(done)} of {cfg.n} runs") from None
    finally:
        bar.close()
    return [done[r] for r in range(cfg.n)], _extra(engine, plan, start)


def _extra(engine, plan: list[Event], start: float) -> dict[str, Any]:
    stats, elapsed = engine.stats(), time.perf_counter() - start
    # Output tokens of runs and background alike: what the engine served in the wall time (the figure to
    # compare across modes, which run the same plan).
    return {"engine steps": stats.num_steps, "background requests": sum(e.run is None for e in plan),
            "preemptions": stats.num_preemptions, "prefix-cache hit tokens": stats.prefix_cache_hit_tokens,
            "output tokens": stats.generation_tokens,
            "output tokens/s": round(stats.generation_tokens / elapsed, 1) if elapsed > 0 else None,
            "elapsed_s": elapsed}


def _with_text(c, text: str):
    import dataclasses

    return dataclasses.replace(c, text=text)
