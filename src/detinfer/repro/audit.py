"""`detinfer audit`: is this model batch-invariant under the current build, and if not, which op breaks it?

For K random prompts, the model's engine step (the engine's own ModelRunner: paged KV cache, the mode's
kernels) runs each prompt
  * alone, twice (run-to-run determinism),
  * inside random batches (new prefills of other sequences and decodes of sequences with cached context,
    the prompt at a random place in the pack),
  * split into random chunks across steps (chunked prefill; trailing one-token chunks look like decodes),
    each step shared with random other sequences.
A forward hook on every module records the prompt's rows of that module's output (attention's output is
taken at o_proj's input, and the logits at the end). Rows are compared bit for bit with the alone run in
execution order, so the first name that differs is the first op whose result depended on the batch.

Steps run eagerly (hooks do not fire inside a replayed CUDA graph); graphs are covered by the engine tests.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field

import torch

from detinfer.cli_util import INTERRUPTED_EXIT_STATUS, Parser, add_model_argument, interrupt_handling, model_path
from detinfer.constants import MODES
from detinfer.engine.config import EngineConfig, add_dataclass_args, check_int, from_args

SCENARIOS = ("alone again", "batch", "chunked")


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class AuditConfig:
    prompts: int = field(default=4, metadata=_help("Random prompts to check (K)."))
    max_len: int = field(default=48, metadata=_help("Longest random prompt, in tokens."))
    batches: int = field(default=2, metadata=_help("Random batches per prompt."))
    chunkings: int = field(default=2, metadata=_help("Random chunkings per prompt."))
    max_others: int = field(default=6, metadata=_help("Most other sequences sharing a step."))
    seed: int = field(default=0, metadata=_help("Seed of the prompts, batches and chunkings."))

    def __post_init__(self):
        check_int("prompts", self.prompts, minimum=1)
        check_int("max_len", self.max_len, minimum=2, maximum=4096)
        check_int("batches", self.batches, minimum=0)
        check_int("chunkings", self.chunkings, minimum=0)
        check_int("max_others", self.max_others, minimum=1)
        check_int("seed", self.seed, minimum=0)


@dataclass(frozen=True)
class Finding:
    """One scenario's verdict: name is None when every recorded output matched bit for bit."""

    prompt: int
    scenario: str
    name: str | None = None
    token: int | None = None  # first prompt position whose row differs
    max_abs_diff: float | None = None
    num_diff: int = 0  # differing elements in that output
    numel: int = 0


class _Recorder:
    """Forward hooks collecting the target rows of every module output of one step."""

    def __init__(self, model: torch.nn.Module):
        self.rows: slice | None = None
        self.total = 0
        self.out: dict[str, list[torch.Tensor]] = {}
        self.order: list[str] = []
        self._calls: dict[str, int] = {}
        self.handles = []
        for name, mod in model.named_modules():
            self.handles.append(mod.register_forward_hook(self._hook(name or "model")))
            if name.endswith("o_proj"):  # its input is the attention kernel's output
                self.handles.append(mod.register_forward_pre_hook(self._pre_hook(name[:-6] + "attention")))

    def begin(self, rows: slice, total: int) -> None:
        self.rows, self.total, self._calls = rows, total, {}

    def add(self, name: str, t) -> None:
        if isinstance(t, (tuple, list)):
            for i, x in enumerate(t):
                self.add(f"{name}[{i}]", x)
            return
        if self.rows is None or not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != self.total:
            return  # a step without the target (warm-up), or not a per-token output
        # A module called several times per step (the shared rotary) gets one name per call.
        k = self._calls.get(name, 0)
        self._calls[name] = k + 1
        key = name if k == 0 else f"{name}#{k}"
        if key not in self.out:
            self.out[key] = []
            self.order.append(key)
        self.out[key].append(t[self.rows].detach().clone())

    def _hook(self, name):
        return lambda mod, args, output: self.add(name, output)

    def _pre_hook(self, name):
        return lambda mod, args: self.add(name, args[0])

    def take(self) -> dict[str, torch.Tensor]:
        out = {k: torch.cat(v) for k, v in self.out.items()}
        self.out, self.order = {}, []
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class _Stepper:
    """Runs hand-built steps through the engine's ModelRunner, with fresh KV blocks per scenario."""

    def __init__(self, runner, vocab: int):
        from detinfer.engine.sampling_params import SamplingParams

        self.runner, self.vocab, self.bs = runner, vocab, runner.block_size
        self._params = SamplingParams(max_tokens=1)
        self.reset()

    def reset(self) -> None:
        self.next_block, self.tables, self.done, self.seqs = 0, {}, {}, {}

    def _table(self, key, upto: int) -> tuple[int, ...]:
        table = self.tables.setdefault(key, [])
        while len(table) * self.bs < upto:
            if self.next_block >= self.runner.num_kv_blocks:
                raise RuntimeError("audit: the KV pool is too small for this scenario; lower --max-len")
            table.append(self.next_block)
            self.next_block += 1
        return tuple(table)

    def step(self, entries, tokens_of, recorder: _Recorder, target="T") -> torch.Tensor:
        """entries: [(key, n_tokens, num_logits)]; feeds each key's next n tokens. Returns the target's
        logits rows (recording its module rows), None when the target is not in the step."""
        from detinfer.engine.scheduler import ScheduledBatch, ScheduledSequence
        from detinfer.engine.sequence import Sequence

        items, off, lrow, rows, lrows = [], 0, 0, None, None
        for key, n, num_logits in entries:
            start = self.done.get(key, 0)
            toks = tokens_of[key][start:start + n]
            seq = self.seqs.setdefault(key, Sequence(len(self.seqs), str(key), list(tokens_of[key]),
                                                     self._params, None))
            items.append(ScheduledSequence(seq=seq, token_ids=tuple(toks), start_pos=start, num_logits=num_logits,
                                           sample=False, output_position=0,
                                           block_table=self._table(key, start + n), block_size=self.bs))
            if key == target:
                rows, lrows = slice(off, off + n), slice(lrow, lrow + num_logits)
            self.done[key] = start + n
            off, lrow = off + n, lrow + num_logits
        recorder.begin(rows, off)
        logits = self.runner.execute(ScheduledBatch(scheduled=tuple(items), num_batched_tokens=off))
        return None if lrows is None else logits[lrows].detach().clone()


def _plan(rng: random.Random, kind: str, L: int, cfg: AuditConfig, vocab: int):
    """(steps, tokens_of) for one scenario: steps are lists of (key, n, num_logits)."""
    tokens_of: dict = {}

    def other(n: int) -> str:
        key = f"o{len(tokens_of)}"
        tokens_of[key] = [rng.randrange(vocab) for _ in range(n + 8)]
        return key

    if kind == "alone again":
        return [[("T", L, L)]], tokens_of
    if kind == "batch":
        cuts = [L]
    else:
        k = rng.randint(2, min(L, 6))
        cuts = sorted(rng.sample(range(1, L), k - 1)) + [L]
    warm = [other(rng.randint(1, cfg.max_len)) for _ in range(rng.randint(1, cfg.max_others))]
    steps = [[(key, len(tokens_of[key]) - 8, 0) for key in warm]]  # context for later decodes
    prev = 0
    for cut in cuts:
        entries = [(key, 1, rng.randint(0, 1)) for key in warm if rng.random() < 0.7]  # decodes
        entries += [(other(m), m, rng.randint(0, 1)) for m in
                    (rng.randint(1, cfg.max_len) for _ in range(rng.randint(0, cfg.max_others)))]
        entries.insert(rng.randint(0, len(entries)), ("T", cut - prev, cut - prev))
        steps.append(entries)
        prev = cut
    return steps, tokens_of


def _compare(ref: dict, got: dict, order: list[str], prompt: int, scenario: str) -> Finding:
    for name in order + ["logits"]:
        a, b = ref[name], got.get(name)
        if b is None or a.shape != b.shape:
            return Finding(prompt, scenario, name)
        same = (a == b) | (torch.isnan(a) & torch.isnan(b)) if a.is_floating_point() else a == b
        if not bool(same.all()):
            bad_rows = (~same).reshape(a.shape[0], -1).any(dim=1).nonzero()
            diff = (a.float() - b.float()).abs()
            return Finding(prompt, scenario, name, int(bad_rows[0]), float(diff[~same].max()),
                           int((~same).sum()), a.numel())
    return Finding(prompt, scenario)


def audit(runner, vocab: int, cfg: AuditConfig, on_finding=None) -> list[Finding]:
    """Run every scenario for K random prompts on `runner` (an engine ModelRunner). on_finding(finding) is
    called as each scenario completes (progress)."""
    rng = random.Random(cfg.seed)
    recorder, stepper = _Recorder(runner.model), _Stepper(runner, vocab)
    findings = []
    try:
        for p in range(cfg.prompts):
            L = rng.randint(2, cfg.max_len)
            prompt = [rng.randrange(vocab) for _ in range(L)]
            kinds = ["alone again"] + ["batch"] * cfg.batches + ["chunked"] * cfg.chunkings
            ref = None
            for kind in ["alone"] + kinds:
                steps, tokens_of = _plan(rng, "alone again" if kind == "alone" else kind, L, cfg, vocab)
                tokens_of["T"] = prompt
                stepper.reset()
                logits = [stepper.step(entries, tokens_of, recorder) for entries in steps]
                order = list(recorder.order)
                got = recorder.take()
                got["logits"] = torch.cat([x for x in logits if x is not None])
                if ref is None:
                    ref, ref_order = got, order
                else:
                    findings.append(_compare(ref, got, ref_order, p, kind))
                    if on_finding is not None:
                        on_finding(findings[-1])
    finally:
        recorder.close()
    return findings


def finding_line(f: Finding, label: str) -> str:
    verdict = "invariant" if f.name is None else (
        f"DIFFERS first at {f.name}" + ("" if f.token is None else
                                        f" (prompt token {f.token}; {f.num_diff}/{f.numel} elements, "
                                        f"max |diff| {f.max_abs_diff:.3g})"))
    return f"  [{label}] prompt {f.prompt} {f.scenario:<12} {verdict}"


def report(findings: list[Finding], label: str, lines_too: bool = True) -> str:
    lines = [finding_line(f, label) for f in findings] if lines_too else []
    bad = [f for f in findings if f.name is not None]
    lines.append(f"{label}: {len(findings) - len(bad)}/{len(findings)} scenarios bit-identical to the prompt alone")
    return "\n".join(lines)


def build_runner(model_dir, random_model, mode: str, engine_config: EngineConfig, device, random_seed: int):
    """(ModelRunner, vocab size) for a checkpoint or a random-weight preset, in `mode`, steps eager."""
    from detinfer.engine.llm_engine import LLMEngine
    from detinfer.repro.random_model import random_engine

    config = engine_config.replace(mode=mode, enforce_eager=True)
    if random_model:
        engine = random_engine(random_model, config, device, random_seed)
    else:
        engine = LLMEngine(model_dir, config, device)  # a directory or a hub id
    return engine.runner, engine.model_config.vocab_size


# On a CPU a 135M-parameter model's audit with the GPU-sized defaults took a quarter of an hour; these keep
# it under a minute on 2 cores while still covering alone-again, batch and chunked scenarios.
CPU_DEFAULTS = {"prompts": 2, "max_len": 24, "max_others": 3, "batches": 1, "chunkings": 1}


def build_parser() -> Parser:
    from detinfer.models.families import preset_names

    p = Parser(prog="detinfer audit", conflict_handler="resolve",
               description="Check that a model's logits for random prompts are bit-identical alone, in random "
                           "batches and in random chunkings; name the first module whose output differs.")
    add_model_argument(p, "HF-format model directory or Hugging Face hub id")
    p.add_argument("--random-model", help=f"a random-weight preset instead ({', '.join(preset_names())})")
    p.add_argument("--random-seed", type=int, default=0, help="seed of --random-model's weights")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    add_dataclass_args(p, AuditConfig)
    add_dataclass_args(p, EngineConfig)
    p.add_argument("--mode", choices=(*MODES, "both"), default="deterministic",
                   help="ops to audit; both: fast, then deterministic (default: deterministic)")
    p.set_defaults(**{k: None for k in CPU_DEFAULTS})  # None: not given, filled in by device in main
    for action in p._actions:
        if action.dest in CPU_DEFAULTS:
            gpu = getattr(AuditConfig, action.dest)
            action.help = f"{action.help.rstrip('.')} (default: {gpu}; {CPU_DEFAULTS[action.dest]} on a CPU)."
    return p


def _fill_defaults(ns: argparse.Namespace) -> None:
    import torch

    cpu = (str(ns.device).startswith("cpu") if ns.device is not None else not torch.cuda.is_available())
    left_out = [k for k in CPU_DEFAULTS if getattr(ns, k) is None]
    for k in left_out:
        setattr(ns, k, CPU_DEFAULTS[k] if cpu else getattr(AuditConfig, k))
    if cpu and left_out:
        print("detinfer audit: no GPU: CPU-sized defaults " + " ".join(
            f"--{k.replace('_', '-')} {getattr(ns, k)}" for k in left_out), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    done: list[tuple[str, Finding]] = []  # (mode, finding) of every finished scenario, for a Ctrl-C summary
    with interrupt_handling():
        try:
            return _main(argv, done)
        except KeyboardInterrupt:
            if not done:
                print("detinfer audit: interrupted (Ctrl-C) before any scenario had finished", file=sys.stderr)
            else:
                bad = sum(f.name is not None for _, f in done)
                modes = ", ".join(dict.fromkeys(m for m, _ in done))
                print(f"detinfer audit: interrupted (Ctrl-C); partial result ({modes} mode): "
                      f"{len(done) - bad}/{len(done)} finished scenarios bit-identical to the prompt alone "
                      "(lines above)", file=sys.stderr)
            return INTERRUPTED_EXIT_STATUS


def _main(argv: list[str] | None, done: list) -> int:
    p = build_parser()
    ns = p.parse_args(argv)
    model_dir = model_path(p, ns)
    if (model_dir is None) == (ns.random_model is None):
        p.error("give a model directory (MODEL_DIR or --model DIR) or --random-model NAME (one of them)")
    _fill_defaults(ns)
    modes = ("fast", "deterministic") if ns.mode == "both" else (ns.mode,)
    try:
        cfg = from_args(AuditConfig, ns)
        engine_config = from_args(EngineConfig, argparse.Namespace(**{**vars(ns), "mode": "deterministic"}))
        if engine_config.max_model_len is None:
            engine_config = engine_config.replace(max_model_len=max(2 * cfg.max_len, 64) + 16)
        failed = False
        for mode in modes:
            started = time.perf_counter()
            print(f"{mode}: loading {model_dir or ns.random_model} ...", flush=True)
            runner, vocab = build_runner(model_dir, ns.random_model, mode, engine_config, ns.device,
                                         ns.random_seed)
            total = cfg.prompts * (1 + cfg.batches + cfg.chunkings)
            print(f"{mode}: loaded in {time.perf_counter() - started:.1f} s; {total} scenarios "
                  f"({cfg.prompts} prompts x (alone again + {cfg.batches} batch + {cfg.chunkings} chunked))",
                  flush=True)
            def on_finding(f: Finding, mode=mode) -> None:
                done.append((mode, f))
                print(finding_line(f, mode), flush=True)

            findings = audit(runner, vocab, cfg, on_finding=on_finding)
            print(report(findings, mode, lines_too=False) + f" ({time.perf_counter() - started:.1f} s)")
            failed |= mode == "deterministic" and any(f.name is not None for f in findings)
            del runner
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as e:
        print(f"detinfer audit: error: {e}", file=sys.stderr)
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
