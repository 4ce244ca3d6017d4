"""Load a HF-format model directory: config.json + model.safetensors, or sharded *.safetensors with
model.safetensors.index.json.

Everything is checked before any weight is read: tensor names against what the config implies (missing,
unexpected), shapes, and stored dtypes (floating point only: quantized or integer checkpoints are refused,
not silently cast). A file that is not a complete safetensors file (a truncated download) and a weight that
holds NaN or Inf (after the cast to the target dtype) are refused too, each error naming the file and the
tensor.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from detinfer.dtypes import resolve_dtype
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
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
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


def check_checkpoint(model_dir: str | Path, config: ModelConfig) -> dict[str, Path]:
    """Validate names, shapes and stored dtypes against the config; returns {name: file} of the tensors to
    load. Raises ValueError listing every problem found."""
    files = safetensors_files(model_dir)
    expected = config.family.hf_weight_shapes(config)
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
                if dt not in STORED_FLOAT_DTYPES:
                    problems.append(f"{name} is stored as {dt} (in {path.name}); supported stored dtypes: "
                                    f"{', '.join(STORED_FLOAT_DTYPES)} (quantized checkpoints are not)")
    if problems:
        raise ValueError(f"checkpoint in {model_dir} does not match its config.json "
                         f"({config.architecture}):\n  " + "\n  ".join(problems))
    return {name: files[name] for name in expected}


def load_model(model_dir: str | Path, dtype: torch.dtype | str | None = None,
               device: torch.device | str = "cpu", mode: str = "deterministic", *,
               attention: str = "auto") -> tuple[Transformer, ModelConfig]:
    """Build the model for `model_dir`, weights in `dtype` (None: the checkpoint's) on `device`, computing
    with the numerics backend `Ops(mode, device, dtype)` (`attention`: see detinfer.ops.backend)."""
    config = ModelConfig.from_dir(model_dir)
    dtype = resolve_dtype(dtype, config.dtype)
    device = torch.device(device)
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
    except ValueError as e:
        raise ValueError(f"{who}{e}") from None
    if config.family.hf_sources is None and size > 1:
        raise ValueError(f"{who}the {config.family.model_type} family has no hf_sources layout, so its checkpoints "
                         "cannot be loaded sharded; load the whole model and use LLMEngine.from_model")
    expected = config.family.hf_weight_shapes(config)
    device = torch.device(device)
    state = {}
    with contextlib.ExitStack() as stack:
        handles: dict[Path, object] = {}

        def read(name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
            path = to_load[name]
            if path not in handles:
                handles[path] = stack.enter_context(_open(path))
            return _read_tensor(handles[path], path, name, device, dtype, index, who)

        if config.family.hf_sources is None:  # whole tensors, fused by the family's own state_dict_from_hf
            return config.family.state_dict_from_hf(config, {name: read(name) for name in to_load})
        sources = config.family.hf_sources(config)
        for name, shape in full_parameter_shapes(config).items():
            spec = shard_spec(name, shape, config, rank, size)
            state[name] = _read_source(sources[name], spec, expected, read, shape, dtype, device)
    return state


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
