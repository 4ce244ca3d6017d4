"""Load a HF-format model directory: config.json + model.safetensors, or sharded *.safetensors with
model.safetensors.index.json.

Everything is checked before any weight is read: tensor names against what the config implies (missing,
unexpected), shapes, and stored dtypes (floating point only: integer or other quantized checkpoints are
refused, not silently cast; block-scaled FP8 ones load as FP8, see models/fp8.py and docs/fp8.md). A file
that is not a complete safetensors file (a truncated download) and a weight that holds NaN or Inf (after the
cast to the target dtype) are refused too, each error naming the file and the tensor.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from detinfer.dtypes import resolve_dtype
from detinfer.kernels.fp8_quant import FP8_DTYPE, expand_block_rows, num_blocks, quantize_weight_rows
from detinfer.models import fp8
from detinfer.models.config import ModelConfig
from detinfer.models.sharding import ShardSpec, shard_spec
from detinfer.models.transformer import Transformer
from detinfer.ops import Ops

# safetensors dtype codes a checkpoint may store weights in.
STORED_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# Names some exporters add that carry no weights (recomputed from the config here).
_IGNORABLE_SUFFIXES = (".rotary_emb.inv_freq",)
INDEX_FILE = "model.safetensors.index.json"


def _open(path: Path):
    """safe_open, with a corrupt or truncated file reported as a ValueError naming it."""
    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) for unreadable files
        raise ValueError(f"{path}: not a readable safetensors file ({e}); it may be truncated or corrupt "
                         "(download it again)") from None


def _read_tensor(f, path: Path, name: str, device: torch.device, dtype: torch.dtype,
                 index: tuple[slice, ...] | None = None, who: str = "") -> torch.Tensor:
    """Tensor `name` (or its `index` slice, read alone) as `dtype` on `device`; `who` prefixes errors."""
    try:
        t = (f.get_tensor(name) if index is None else f.get_slice(name)[index]).to(device=device, dtype=dtype)
    except (torch.OutOfMemoryError, MemoryError):
        raise
    except Exception as e:
        raise ValueError(f"{who}{path}: cannot read tensor {name} ({e}); the file may be truncated or "
                         "corrupt") from None
    if t.is_floating_point() and not bool(torch.isfinite(t.float() if t.dtype == FP8_DTYPE else t).all()):
        bad = "NaN" if bool(torch.isnan(t).any()) else "Inf"
        raise ValueError(f"{who}{path}: tensor {name} holds {bad} values (as {str(dtype).removeprefix('torch.')}); "
                         "the checkpoint is corrupt or does not fit this dtype")
    return t


def safetensors_files(model_dir: str | Path) -> dict[str, Path]:
    """Map each tensor name to the file that holds it (single file or index-listed shards)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    index = model_dir / INDEX_FILE
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map' (tensor name -> shard file)")
        shards = {name: model_dir / shard for name, shard in weight_map.items()}
        missing = sorted({p.name for p in shards.values() if not p.is_file()})
        if missing:
            raise FileNotFoundError(f"{index} lists shard file(s) missing from {model_dir}: "
                                    f"{', '.join(missing)}")
        return shards
    single = model_dir / "model.safetensors"
    if single.is_file():
        with _open(single) as f:
            return {name: single for name in f.keys()}
    weight_suffixes = (".safetensors", ".bin", ".pt", ".gguf")
    others = sorted(p.name for p in model_dir.iterdir() if p.suffix in weight_suffixes)
    hint = f" (found {', '.join(others)}; only safetensors checkpoints are supported)" if others else ""
    raise FileNotFoundError(f"no model.safetensors or {INDEX_FILE} in {model_dir}{hint}")


def stored_quantization(model_dir: str | Path) -> str | None:
    """The checkpoint's own quantization (its config.json's quantization_config): "fp8" or None. A directory
    without config.json (a bare weights file loaded into a running engine) holds unquantized weights."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        return fp8.parse_quantization_config(json.load(f))


def _stored_dtype_problem(name: str, dt: str, fp8_names: set[str]) -> str | None:
    """Why tensor `name` stored as `dt` cannot be loaded (None: it can)."""
    if name in fp8_names:
        if dt == "F8_E5M2":
            return (f"{name} is stored as F8_E5M2; FP8 weights must be float8_e4m3fn (F8_E4M3): e5m2 "
                    "checkpoints are not supported")
        return None if dt == fp8.STORED_FP8 else (f"{name} is stored as {dt}; quantization_config says fp8, "
                                                 f"so it must be {fp8.STORED_FP8}")
    if name.endswith(fp8.HF_SCALE_SUFFIX):
        return None if dt in fp8.SCALE_STORED_DTYPES else (f"{name} is stored as {dt}; block scales must be "
                                                          f"one of {', '.join(fp8.SCALE_STORED_DTYPES)}")
    if dt not in STORED_FLOAT_DTYPES:
        return (f"{name} is stored as {dt}; supported stored dtypes: {', '.join(STORED_FLOAT_DTYPES)} (quantized "
                "weights only with a quantization_config of quant_method 'fp8')")
    return None


def _fp8_layout(config: ModelConfig, stored_fp8: bool) -> tuple[dict, set[str], dict[str, tuple[int, ...]]]:
    """(model parameter -> HFSource, including FP8 scales; the HF weights that are FP8; HF name -> shape as
    stored, scales included when the checkpoint stores them)."""
    expected = config.family.hf_weight_shapes(config)
    sources = config.family.hf_sources(config) if config.family.hf_sources is not None else {}
    if config.quantization != "fp8":
        return sources, set(), expected
    if config.family.hf_sources is None:
        raise ValueError(f"the {config.family.model_type} family has no hf_sources layout: no FP8 support")
    shapes = full_parameter_shapes(config)
    sources = fp8.add_scale_sources(sources, shapes)
    fp8_names = fp8.fp8_hf_weights(sources, shapes)
    if stored_fp8:
        for n in fp8_names:
            expected[fp8.hf_scale_name(n)] = (num_blocks(expected[n][0]), num_blocks(expected[n][1]))
    return sources, fp8_names, expected


def check_checkpoint(model_dir: str | Path, config: ModelConfig) -> dict[str, Path]:
    """Validate names, shapes and stored dtypes against the config; returns {name: file} of the tensors to
    load. Raises ValueError listing every problem found."""
    files = safetensors_files(model_dir)
    stored_fp8 = stored_quantization(model_dir) == "fp8"
    if stored_fp8 and config.quantization != "fp8":
        raise ValueError(f"{model_dir} holds an FP8 checkpoint (quantization_config); it loads with "
                         "quantization 'fp8' only")
    _, fp8_names, expected = _fp8_layout(config, stored_fp8)
    fp8_names = fp8_names if stored_fp8 else set()
    ignorable = {n for n in files if n.endswith(_IGNORABLE_SUFFIXES)}
    if config.tie_word_embeddings:
        ignorable.add("lm_head.weight")  # some exporters store the tied copy; the embedding is used
    missing = sorted(set(expected) - set(files))
    unexpected = sorted(set(files) - set(expected) - ignorable)
    problems = []
    if missing:
        problems.append(f"missing tensors: {_abbrev(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_abbrev(unexpected)}")
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        if name in files:
            by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with _open(path) as f:
            stored = set(f.keys())
            for name in names:
                if name not in stored:
                    problems.append(f"{name} is listed for {path.name} but not stored there")
                    continue
                sl = f.get_slice(name)
                shape, dt = tuple(sl.get_shape()), sl.get_dtype()
                if shape != expected[name]:
                    problems.append(f"{name} has shape {list(shape)}, config implies {list(expected[name])} "
                                    f"(in {path.name})")
                problem = _stored_dtype_problem(name, dt, fp8_names)
                if problem:
                    problems.append(f"{problem} (in {path.name})")
    if problems:
        raise ValueError(f"checkpoint in {model_dir} does not match its config.json "
                         f"({config.architecture}):\n  " + "\n  ".join(problems))
    return {name: files[name] for name in expected}


def load_model(model_dir: str | Path, dtype: torch.dtype | str | None = None,
               device: torch.device | str = "cpu", mode: str = "deterministic", *,
               attention: str = "auto") -> tuple[Transformer, ModelConfig]:
    """Build the model for `model_dir`, weights in `dtype` (None: the checkpoint's; "auto": as
    `dtypes.resolve_dtype` decides for `device`) on `device`, computing with the numerics backend
    `Ops(mode, device, dtype)` (`attention`: see detinfer.ops.backend)."""
    config = ModelConfig.from_dir(model_dir)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, config.dtype, device)
    ops = Ops(mode, device, dtype, head_dim=config.head_dim, attention=attention)
    return model_from_state(config, ops, load_state(model_dir, config, dtype, device)), config


def model_from_state(config: ModelConfig, ops: Ops, state: dict[str, torch.Tensor]) -> Transformer:
    """The full `Transformer` over `state` (its tensors are used as they are: no copy)."""
    with torch.device("meta"):
        model = Transformer(config, ops)
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary.reset_parameters(ops.device)
    model.eval()
    return model


def full_parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The full (TP=1) Transformer's parameter names and shapes (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = Transformer(config, Ops("deterministic", torch.device("cpu"), torch.float32,
                                        head_dim=config.head_dim))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def load_state(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
               rank: int = 0, size: int = 1) -> dict[str, torch.Tensor]:
    """Rank `rank` of `size`'s Transformer state dict (size 1: the whole model), reading from the checkpoint
    only the rows / columns / experts that rank holds (`models.sharding.shard_spec`) of each HF tensor,
    cast to `dtype` on `device`. Under tensor parallelism every rank calls this for itself: no rank reads
    or holds the full weights. Errors name the tensor and, when size > 1, the rank."""
    who = f"rank {rank} of {size}: " if size > 1 else ""
    try:
        to_load = check_checkpoint(model_dir, config)
        stored_fp8 = stored_quantization(model_dir) == "fp8"
        sources, fp8_names, expected = _fp8_layout(config, stored_fp8)
    except ValueError as e:
        raise ValueError(f"{who}{e}") from None
    if config.family.hf_sources is None and size > 1:
        raise ValueError(f"{who}the {config.family.model_type} family has no hf_sources layout, so its checkpoints "
                         "cannot be loaded sharded; load the whole model and use LLMEngine.from_model")
    device = torch.device(device)
    state = {}
    with contextlib.ExitStack() as stack:
        handles: dict[Path, object] = {}

        def read_as(name: str, as_dtype: torch.dtype, index: tuple[slice, ...] | None = None) -> torch.Tensor:
            path = to_load[name]
            if path not in handles:
                handles[path] = stack.enter_context(_open(path))
            return _read_tensor(handles[path], path, name, device, as_dtype, index, who)

        fp8_reader = _Fp8Reader(read_as, fp8_names, expected, stored_fp8)

        def read(name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
            if fp8_names and (name in fp8_names or name.endswith(fp8.HF_SCALE_SUFFIX)):
                return fp8_reader.read(name, index)
            return read_as(name, dtype, index)

        if config.family.hf_sources is None:  # whole tensors, fused by the family's own state_dict_from_hf
            return config.family.state_dict_from_hf(config, {name: read(name) for name in to_load})
        # `expected` gives the concatenation offsets: a scale tensor's rows are its weight's (expanded).
        rows = {**expected, **{fp8.hf_scale_name(n): expected[n] for n in fp8_names}}
        for name, shape in full_parameter_shapes(config).items():
            spec = shard_spec(name, shape, config, rank, size)
            state[name] = _read_source(sources[name], spec, rows, read, shape, dtype, device)
    return state


class _Fp8Reader:
    """Reads an FP8 parameter's HF parts: the fp8 weight and its block scales expanded per row
    (kernels/fp8_quant.py). From an FP8 checkpoint: as stored (weights read sliced; the small block scales
    whole, then expanded and sliced). From a 16/32-bit one (`--quantization fp8`): each HF weight quantized
    whole in its own 128 x 128 blocks, exactly what an FP8 checkpoint of it would store, so the scales
    never straddle two fused parts; its scales are kept until read, right after the weight."""

    def __init__(self, read_as, fp8_names: set[str], expected: dict, stored_fp8: bool):
        self.read_as, self.fp8_names, self.expected, self.stored = read_as, fp8_names, expected, stored_fp8
        self.pending: dict[str, torch.Tensor] = {}  # HF scale name -> row scales of a weight quantized here

    def read(self, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        if name in self.fp8_names:
            if self.stored:
                return self.read_as(name, FP8_DTYPE, index)
            q, scales = quantize_weight_rows(self.read_as(name, torch.float32))
            self.pending[fp8.hf_scale_name(name)] = scales
            return q if index is None else q[index]
        weight = name.removesuffix(fp8.HF_SCALE_SUFFIX)
        if self.stored:
            scales = expand_block_rows(self.read_as(name, torch.float32), self.expected[weight][0])
        else:
            scales = self.pending.pop(name, None)
            if scales is None:
                scales = quantize_weight_rows(self.read_as(weight, torch.float32))[1]
        return scales if index is None else scales[index]


def _read_source(source, spec, expected: dict[str, tuple[int, ...]], read, shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`spec`'s slice of the parameter `source` makes (dense_decoder.HFSource), reading only that slice."""
    if source.per_expert:  # stacked experts: spec (if any) selects whole experts along dim 0
        k = source.per_expert
        experts = range(shape[0]) if spec.dim is None else [e for a, b in spec.ranges for e in range(a, b)]
        return torch.stack([torch.cat([read(n) for n in source.names[e * k:(e + 1) * k]])
                            for e in experts])
    if spec.dim is None:
        parts = [read(n) for n in source.names]
    elif spec.dim == 1:  # columns (row-parallel weights: one HF tensor each)
        (name,) = source.names
        parts = [read(name, (slice(None), slice(a, b))) for a, b in spec.ranges]
    else:  # rows of the concatenation: each range's overlap with each part
        parts = []
        for a, b in spec.ranges:
            offset = 0
            for n in source.names:
                rows = expected[n][0]
                lo, hi = max(a, offset), min(b, offset + rows)
                if lo < hi:
                    parts.append(read(n, (slice(lo - offset, hi - offset),)))
                offset += rows
    if spec.dim is not None and spec.pad:
        pad_shape = list(ShardSpec(spec.dim, spec.ranges).local_shape(shape))
        pad_shape[spec.dim] = spec.pad
        parts.append(torch.zeros(pad_shape, dtype=dtype, device=device))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.dim or 0)


def load_tokenizer(model_dir: str | Path):
    """The model directory's tokenizer (see detinfer.models.tokenizer.Tokenizer)."""
    from detinfer.models.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


def _abbrev(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
