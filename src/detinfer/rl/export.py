"""Export trained weights as a Hugging Face checkpoint that `transformers` (and detinfer) load as is.

The loader fuses HF tensors into detinfer's parameters following the family's `hf_sources`: q/k/v rows
into qkv_proj, gate/up rows into gate_up_proj, MoE experts stacked along a new first dim. Export is that
mapping run backwards, from the same `hf_sources`, so the two can never disagree: every fused parameter
is split back into its HF tensors by their row counts (`hf_weight_shapes`), each expert of a stacked one
back to its per-expert names. Tied embeddings stay tied (no lm_head.weight is written; config.json keeps
`tie_word_embeddings`). The values are copied bit for bit (no cast unless `dtype` asks for one).

    from detinfer.rl.export import export_hf
    export_hf(trainer, "trained-hf", "path/to/the/base/model")      # a GRPOTrainer, after training
    export_checkpoint("rl-out/deterministic/checkpoint", "trained-hf", "path/to/the/base/model")
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from detinfer.models.config import ModelConfig

# Files of a model directory that are not its weights: copied beside the exported weights (tokenizer,
# chat template, generation defaults, ...). Weight files are never copied: the export writes its own.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
_WEIGHT_INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def hf_state_dict(config: ModelConfig, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """detinfer's (full, TP=1) state dict -> HF-named tensors: the inverse of `hf_sources`' fusing."""
    if config.family.hf_sources is None:
        raise ValueError(f"the {config.family.model_type} family has no hf_sources layout, so its weights cannot "
                         "be exported to HF names")
    sources = config.family.hf_sources(config)
    shapes = config.family.hf_weight_shapes(config)
    missing, extra = sorted(set(sources) - set(state)), sorted(set(state) - set(sources))
    if missing or extra:
        raise ValueError(f"the weights do not match a {config.architecture} of this config.json (missing "
                         f"{missing[:5]}, unexpected {extra[:5]})")
    out: dict[str, torch.Tensor] = {}
    for name, source in sources.items():
        tensor = state[name].detach()
        if source.per_expert:  # experts stacked on dim 0; expert e = concatenation of k HF tensors
            k = source.per_expert
            for e in range(tensor.shape[0]):
                out.update(_split_rows(tensor[e], source.names[e * k:(e + 1) * k], shapes, name))
        else:
            out.update(_split_rows(tensor, source.names, shapes, name))
    return out


def _split_rows(tensor: torch.Tensor, names: tuple[str, ...], shapes: dict, fused: str) -> dict[str, torch.Tensor]:
    rows = [shapes[n][0] for n in names]
    if sum(rows) != tensor.shape[0]:
        raise ValueError(f"{fused} has {tensor.shape[0]} rows; its HF tensors {list(names)} have {sum(rows)}")
    parts = torch.split(tensor, rows, dim=0) if len(names) > 1 else (tensor,)
    out = {}
    for n, part in zip(names, parts):
        if tuple(part.shape) != tuple(shapes[n]):
            raise ValueError(f"{n} (from {fused}) would be {list(part.shape)}, config.json implies {list(shapes[n])}")
        out[n] = part.contiguous().clone()  # own storage: safetensors refuses views sharing memory
    return out


def _named_weights(source) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a GRPOTrainer / TrainableModel (trained weights: fp32 masters for 16-bit
    engines), a torch module (the engine's Transformer), or a mapping / iterable of pairs."""
    if hasattr(source, "named_parameters") and not isinstance(source, torch.nn.Module):
        return list(source.named_parameters())  # GRPOTrainer, TrainableModel
    if isinstance(source, torch.nn.Module):
        return list(source.state_dict().items())
    if isinstance(source, Mapping):
        return list(source.items())
    if isinstance(source, Iterable):
        return list(source)
    raise TypeError(f"cannot export weights from a {type(source).__name__}: give a GRPOTrainer, a torch "
                    "module, or a {name: tensor} mapping")


def export_hf(source, out_dir: str | Path, model_dir: str | Path, *, dtype: torch.dtype | None = None,
              overwrite: bool = False) -> Path:
    """Write `source`'s weights (see `_named_weights`) to `out_dir` as a HF checkpoint of the model in
    `model_dir` (the directory training started from: its config.json and tokenizer files are copied).
    `dtype`: cast the weights to it (None: as trained, bit for bit); config.json's dtype says which."""
    from safetensors.torch import save_file

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} holds no config.json: give the model directory training started from")
    if out_dir.resolve() == model_dir.resolve():
        raise ValueError(f"refusing to export into the source model directory {model_dir}")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty (pass overwrite=True / --overwrite to replace it)")
    config = ModelConfig.from_dir(model_dir)
    hf = hf_state_dict(config, {n: t.detach().cpu() for n, t in _named_weights(source)})
    if dtype is not None:
        hf = {n: t.to(dtype) for n, t in hf.items()}
    stored = {t.dtype for t in hf.values()}
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix not in _WEIGHT_SUFFIXES and path.name not in _WEIGHT_INDEX_NAMES:
            shutil.copy2(path, tmp / path.name)
    hf_config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if len(stored) == 1:  # the dtype the weights are stored in (transformers reads either key)
        name = str(next(iter(stored))).removeprefix("torch.")
        for key in ("torch_dtype", "dtype"):
            if key in hf_config or key == "torch_dtype":
                hf_config[key] = name
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
    save_file(hf, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, model_dir: str | Path, *,
                      dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """Export the weights of a `detinfer rl` checkpoint directory (weights.safetensors) as a HF checkpoint."""
    from safetensors.torch import load_file

    from detinfer.rl.checkpoint import read_state

    read_state(checkpoint_dir)  # refuses a directory that is not a complete checkpoint
    weights = load_file(str(Path(checkpoint_dir) / "weights.safetensors"))
    return export_hf(weights, out_dir, model_dir, dtype=dtype, overwrite=overwrite)


def build_parser():
    import argparse

    p = argparse.ArgumentParser(prog="detinfer export", description="Write the weights of a `detinfer rl` "
                                "checkpoint as a Hugging Face checkpoint (HF tensor names, config.json, tokenizer).")
    p.add_argument("checkpoint", help="checkpoint directory, e.g. rl-report/deterministic/checkpoint")
    p.add_argument("out", help="output directory (created)")
    p.add_argument("--model", required=True, help="the model directory the run started from (config.json, tokenizer)")
    p.add_argument("--dtype", default=None, help="store the weights in this dtype, e.g. bfloat16 (default: as trained)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    return p


def main(argv: list[str] | None = None) -> int:
    """`detinfer export CHECKPOINT OUT --model DIR [--dtype D] [--overwrite]`."""
    import sys

    from detinfer.dtypes import resolve_dtype

    ns = build_parser().parse_args(argv)
    try:
        dtype = None if ns.dtype is None else resolve_dtype(ns.dtype, None)
        out = export_checkpoint(ns.checkpoint, ns.out, ns.model, dtype=dtype, overwrite=ns.overwrite)
    except (ValueError, TypeError, FileNotFoundError, FileExistsError) as e:
        print(f"detinfer export: error: {e}", file=sys.stderr)
        return 2
    print(f"exported {out}")
    return 0
