"""Engine configuration: one frozen, validated dataclass, plus argparse glue generated from it.

Every field carries its help text in `field(metadata=...)`, so the CLI (and docs) are generated from this
file instead of being kept in sync by hand. Flag names follow vLLM's where they mean the same thing
(`--max-num-batched-tokens`, `--max-num-seqs`, `--block-size`, `--enable-prefix-caching`, ...), so users
can carry their command lines over.

This module must not import torch: the scheduler and block manager are pure Python and are tested (and
may run) without it. The mode names are therefore repeated here; a test checks they match `detinfer.ops`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from detinfer.constants import ENGINE_DTYPES, MODES

QUANTIZATION_CHOICES = ("auto", "fp8")  # auto: the checkpoint's; models/fp8.py says what fp8 accepts
MAX_SEED = (1 << 63) - 1  # seeds travel as int64 (the sampler hashes them with int64 tensor ops)
MAX_TENSOR_PARALLEL = 64  # a sanity bound; the model's head counts decide what actually divides


def _help(text: str, **extra: Any) -> dict:
    return {"help": text, **extra}


# Limits of what the engine can hold (token ids, counts and seeds travel as int64; temperatures and penalties
# divide float32 logits). They bound values only so that nothing overflows; error messages name them as
# limits (`_bound`), not as the range a user should aim for.
INT64_MAX = (1 << 63) - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_MIN_NORMAL = 1.1754943508222875e-38
_MACHINE_LIMITS = {INT64_MAX: "2**63 - 1, the int64 limit", FLOAT32_MAX: "the largest float32, ~3.4e38",
                   FLOAT32_MIN_NORMAL: "the smallest normal float32, ~1.2e-38"}


def _number(value: float) -> str:
    """1.0 -> '1', 0.5 -> '0.5': bounds read as a person writes them."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def _bound(value: float) -> str:
    limit = _MACHINE_LIMITS.get(value)
    return f"{value} ({limit})" if limit else _number(value)


def range_error(name: str, value: Any, minimum: float | None, maximum: float | None,
                min_exclusive: bool = False) -> ValueError:
    """The ValueError for `value` outside [minimum, maximum], in the words a user needs: the one bound it
    crossed ("n must be >= 1"), or both when both are meaningful ("top_p must be in (0.0, 1.0]"); a bound
    that is only a machine limit (int64, float32) is named as such, never shown as the allowed range."""
    low = "(" if min_exclusive else "["
    human = minimum is not None and maximum is not None and not {minimum, maximum} & _MACHINE_LIMITS.keys()
    if human:
        return ValueError(f"{name} must be in {low}{_number(minimum)}, {_number(maximum)}], got {value}")
    below = minimum is not None and (value <= minimum if min_exclusive else value < minimum)
    if below and minimum == FLOAT32_MIN_NORMAL:  # "positive", as far as float32 division can go
        return ValueError(f"{name} must be > 0 (at least {_MACHINE_LIMITS[minimum]}), got {value}")
    if below:
        return ValueError(f"{name} must be {'>' if min_exclusive else '>='} {_bound(minimum)}, got {value}")
    return ValueError(f"{name} must be <= {_bound(maximum)}, got {value}")


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
              optional: bool = False) -> None:
    """Raise a ValueError/TypeError naming `name` unless `value` is an int in [minimum, maximum]."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an int or None" if optional else "an int"
        raise TypeError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum or maximum is not None and value > maximum:
        raise range_error(name, value, minimum, maximum)


def check_float(name: str, value: Any, *, minimum: float | None = None, maximum: float | None = None,
                min_exclusive: bool = False) -> None:
    """Raise unless `value` is a finite real number in the given range (ints are accepted, bools not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    lo_bad = minimum is not None and (value <= minimum if min_exclusive else value < minimum)
    if lo_bad or (maximum is not None and value > maximum):
        raise range_error(name, value, minimum, maximum, min_exclusive)


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine schedules, caches and computes. Validated on construction."""

    max_num_batched_tokens: int = field(default=4096, metadata=_help(
        "Token budget of one engine step: decode tokens plus prefill (chunk) tokens."))
    max_num_seqs: int = field(default=256, metadata=_help(
        "Most sequences running at once (each sample of an n > 1 request counts)."))
    block_size: int = field(default=16, metadata=_help(
        "Tokens per paged KV-cache block (a power of two)."))
    num_kv_blocks: int | None = field(default=None, metadata=_help(
        "Number of KV-cache blocks; default: sized from --gpu-memory-utilization."))
    gpu_memory_utilization: float = field(default=0.9, metadata=_help(
        "Fraction of GPU memory the engine may use (weights + activations + KV cache), in (0, 1]. "
        "Ignored when --num-kv-blocks is given."))
    enable_prefix_caching: bool = field(default=True, metadata=_help(
        "Reuse KV blocks of identical prompt prefixes across requests (same bits as recomputing)."))
    enable_chunked_prefill: bool = field(default=True, metadata=_help(
        "Split long prompts across steps and mix them with decodes. Without it, "
        "max_num_batched_tokens must be >= max_model_len."))
    max_model_len: int | None = field(default=None, metadata=_help(
        "Most tokens (prompt + output) in one sequence; default: the model's context length."))
    mode: str = field(default="deterministic", metadata=_help(
        "deterministic: batch-invariant kernels; fast: stock torch kernels (batch-variant).",
        choices=MODES))
    dtype: str = field(default="auto", metadata=_help(
        "Weight/activation dtype; auto: the checkpoint's dtype.", choices=ENGINE_DTYPES))
    quantization: str = field(default="auto", metadata=_help(
        "Weight quantization; auto: the checkpoint's (FP8 checkpoints run in FP8, others unquantized); fp8: "
        "block-scaled FP8 W8A8 linears (a 16/32-bit checkpoint or random model is quantized at load in "
        "128x128 blocks). See docs/fp8.md.", choices=QUANTIZATION_CHOICES))
    enforce_eager: bool = field(default=False, metadata=_help(
        "Never capture CUDA graphs; run every step eagerly."))
    cuda_graph_max_tokens: int = field(default=2048, metadata=_help(
        "Largest token count of a step with prefill chunks that replays a CUDA graph (padded to a captured "
        "size: 16, 32, 64, 128, then 4 sizes per doubling); larger ones run eagerly (they are compute-bound). "
        "0: only decode-only steps use graphs. Capped at max_num_batched_tokens."))
    cuda_graph_short_kv: bool = field(default=True, metadata=_help(
        "Also capture each decode graph with attention bounded to 256 keys, replayed by decode steps whose "
        "sequences are all that short (attention then skips its long-walk schedule; same bits)."))
    async_scheduling: bool = field(default=True, metadata=_help(
        "Overlap the host's work for the next step (scheduling, inputs, output processing) with the "
        "device's current step; outputs come one step later, with the same bits as without it."))
    seed: int | None = field(default=0, metadata=_help(
        "Seed from which per-request seeds are drawn for sampled requests that give none "
        "(None: draw them from the OS)."))
    tensor_parallel_size: int = field(default=1, metadata=_help(
        "Split the model over this many processes (one per GPU; gloo processes on CPU): column-parallel "
        "qkv/gate_up, row-parallel o/down, vocab-parallel embedding and lm_head. See docs/tensor-parallel.md."))
    releasable_kv_cache: bool = field(default=False, metadata=_help(
        "Allocate the KV pool so that LLM.release_kv_cache() can hand its memory back while the engine is idle "
        "and restore_kv_cache() take it again at the same addresses (CUDA graphs stay valid): a colocated RL "
        "loop frees it for the trainer. See cache/releasable.py."))
    tp_invariant_reduction: bool = field(default=False, metadata=_help(
        "Deterministic mode: row-parallel layers sum fixed K chunks in a fixed tree, so TP=1, 2, 4, ... give "
        "the same bits (also changes TP=1's bits; off by default until its cost is measured). Ignored in fast mode."))

    def __post_init__(self):
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        check_int("block_size", self.block_size, minimum=1, maximum=1024)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two in [1, 1024], got {self.block_size}")
        check_int("num_kv_blocks", self.num_kv_blocks, minimum=1, optional=True)
        check_float("gpu_memory_utilization", self.gpu_memory_utilization, minimum=0.0, maximum=1.0,
                    min_exclusive=True)
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "cuda_graph_short_kv",
                     "async_scheduling", "tp_invariant_reduction", "releasable_kv_cache"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        check_int("max_model_len", self.max_model_len, minimum=1, optional=True)
        check_int("cuda_graph_max_tokens", self.cuda_graph_max_tokens, minimum=0)
        check_choice("mode", self.mode, MODES)
        check_choice("dtype", self.dtype, ENGINE_DTYPES)
        check_choice("quantization", self.quantization, QUANTIZATION_CHOICES)
        check_int("seed", self.seed, minimum=0, maximum=MAX_SEED, optional=True)
        check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1, maximum=MAX_TENSOR_PARALLEL)
        # Every running sequence must be able to decode in every step, or a step could starve one.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs})")
        # Without chunking a (re)prefill runs in one step, so the longest one must fit the budget.
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(f"with enable_chunked_prefill=False, max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}) must be >= max_model_len "
                             f"({self.max_model_len})")

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def resolved(self, context_len: int) -> EngineConfig:
        """The config an engine runs (a new one: configs are never changed in place): max_model_len defaulted
        to the model's context length `context_len` and checked against it; tp_invariant_reduction off in fast
        mode, whose all-reduce has no fixed order to make invariant (`--mode both` runs one flag set for both
        modes)."""
        max_len = context_len if self.max_model_len is None else self.max_model_len
        if max_len > context_len:
            raise ValueError(f"max_model_len={max_len} exceeds the model's max_position_embeddings={context_len}")
        invariant = self.tp_invariant_reduction and self.mode == "deterministic"
        try:
            return self.replace(max_model_len=max_len, tp_invariant_reduction=invariant)
        except ValueError as e:
            raise ValueError(f"with max_model_len resolved to {max_len} (the model's context length): {e}; "
                             "set max_model_len explicitly") from None


# ---------------------------------------------------------------------------------------------------
# argparse glue

def _flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _scalar_type(annotation: Any) -> tuple[type, bool]:
    """(base type, optional) for annotations like `int`, `int | None`, `Optional[float]`."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported field annotation for a CLI flag: {annotation!r}")
        return args[0], True
    return annotation, False


def _parse_optional(base: type):
    def parse(text: str):
        return None if text.lower() == "none" else base(text)

    parse.__name__ = base.__name__  # argparse names the type in its error messages
    return parse


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> argparse.ArgumentParser:
    """Add one flag per field of dataclass `cls` (help, choices and defaults taken from the dataclass).

    bool fields become `--flag/--no-flag` pairs; optional fields also accept the value `none`.
    """
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        base, optional = _scalar_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": f.metadata.get("help", "")}
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif base in (int, float, str):
            kwargs["type"] = _parse_optional(base) if optional else base
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
            kwargs["help"] += f" (default: {default})"
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no CLI flag for type {base!r}")
        group.add_argument(_flag_name(f.name), **kwargs)
    return parser


def from_args(cls: type, namespace: argparse.Namespace):
    """Build (and so validate) `cls` from a namespace filled by a parser set up by `add_dataclass_args`."""
    names = [f.name for f in dataclasses.fields(cls)]
    return cls(**{n: getattr(namespace, n) for n in names if hasattr(namespace, n)})
