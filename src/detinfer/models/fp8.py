"""FP8 models: which checkpoints are accepted, which parameters are FP8, and how their scales are named.

Accepted: Hugging Face's block-scaled FP8 format (Qwen3-*-FP8, DeepSeek-V3 style), config.json
`quantization_config` = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme":
"dynamic", optional "fmt": "e4m3"}: every linear weight of the attention and MLP / experts stored as
float8_e4m3fn with a `<name>_scale_inv` fp32 tensor of one scale per 128 x 128 block beside it. Embeddings,
norms, routers and lm_head stay in the model dtype. Anything else is refused, naming the field.

Some FP8 checkpoints leave linears unquantized and name them in `quantization_config.modules_to_not_convert`
(Hugging Face's spelling) or `ignored_layers` (vLLM's): those weights are stored in the model dtype and run
the 16-bit linear (`unquantized_linears`). Patterns match HF module names as transformers matches them
(`module_listed`). A fused projection (q/k/v, gate/up) is one linear here, so it must be all listed or all
FP8: a checkpoint listing only some of its parts is refused, naming them (re-quantizing the listed part or
dequantizing the others would change numbers the checkpoint fixed). Listed MoE experts are refused too.

In the model an FP8 parameter `p` (qkv_proj.weight, o_proj.weight, gate_up_proj.weight, down_proj.weight,
the stacked experts mlp.gate_up_proj / mlp.down_proj) has its scales in `p + "_scale"`, expanded per row
(kernels/fp8_quant.py): the fused parameter's scales are the concatenation of its parts' scales, exactly
as the weight is the concatenation of its parts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

QUANTIZATIONS = ("fp8",)
SCALE_SUFFIX = "_scale"  # model parameter p -> its scales p + SCALE_SUFFIX
HF_SCALE_SUFFIX = "_scale_inv"  # HF tensor "x.weight" -> its block scales "x.weight_scale_inv"
STORED_FP8 = "F8_E4M3"  # safetensors dtype code of float8_e4m3fn
SCALE_STORED_DTYPES = ("F32", "BF16", "F16")
WEIGHT_BLOCK = [128, 128]
# quantization_config keys listing modules left unquantized: Hugging Face's, then vLLM's spelling.
UNQUANTIZED_KEYS = ("modules_to_not_convert", "ignored_layers")


def parse_quantization_config(cfg: Mapping[str, Any]) -> str | None:
    """config.json's `quantization_config` -> "fp8" or None (absent); anything unsupported raises a
    ValueError naming the field and what is allowed."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise ValueError(f"quantization_config must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; detinfer loads "
                         "quant_method 'fp8' (block-scaled float8_e4m3fn weights) only")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt {fmt!r} is not supported; FP8 weights must be 'e4m3' "
                         "(float8_e4m3fn)")
    block = q.get("weight_block_size")
    if list(block or []) != WEIGHT_BLOCK:
        raise ValueError(f"quantization_config.weight_block_size {block!r} is not supported; only "
                         f"{WEIGHT_BLOCK} block scales are (per-tensor or per-channel FP8 is not)")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme {scheme!r} is not supported; only 'dynamic' "
                         "(activations quantized per token per 128-group at run time) is")
    return "fp8"


def parse_unquantized_modules(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """The module-name patterns an FP8 config.json leaves unquantized (both keys of UNQUANTIZED_KEYS, in
    order, duplicates dropped); () for other configs. Malformed lists raise, naming the key."""
    q = cfg.get("quantization_config")
    if not isinstance(q, Mapping) or q.get("quant_method") != "fp8":
        return ()
    patterns: list[str] = []
    for key in UNQUANTIZED_KEYS:
        listed = q.get(key)
        if listed is None:
            continue
        if not isinstance(listed, list) or not all(isinstance(p, str) and p for p in listed):
            raise ValueError(f"quantization_config.{key} must be a list of module names, got {listed!r}")
        for p in listed:
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(f"quantization_config.{key} entry {p!r} is not a valid module pattern ({e})") from None
        patterns += listed
    return tuple(dict.fromkeys(patterns))


def module_listed(module: str, patterns: Iterable[str]) -> bool:
    """Whether HF module `module` ("model.layers.3.mlp.down_proj") is one a pattern names, by the rule
    transformers applies to modules_to_not_convert: the pattern, as a regex, matches from the start and ends
    on a module boundary ("model.layers.1" names layer 1, not layer 11; "model.layers.*.self_attn" every
    attention), or the name ends with it ("lm_head", "down_proj")."""
    return any(re.match(rf"(?:{p})(?:(?=\.)|$|(?<=\.))", module) or module.endswith(p) for p in patterns)


def unquantized_linears(config, fp8_linears: Iterable[str], expert_stacks: Iterable[str]) -> list[str]:
    """Which of the model's FP8 linear modules (names as in the Transformer: "layers.0.self_attn.qkv_proj")
    the checkpoint leaves in the model dtype (`config.fp8_unquantized` patterns, matched against the HF
    modules each one is made of). Refuses a fused linear with only some parts listed, and listed experts
    (`expert_stacks`: the sparse layers' stacked-expert parameters), naming the modules."""
    patterns = config.fp8_unquantized
    if config.quantization != "fp8" or not patterns:
        return []
    if config.family.hf_sources is None:
        raise ValueError(f"the {config.family.model_type} family has no hf_sources layout: no FP8 support")
    sources = config.family.hf_sources(config)
    keys = "/".join(UNQUANTIZED_KEYS)
    keep, problems = [], []
    for stack in expert_stacks:
        listed = [n.removesuffix(".weight") for n in sources[stack].names
                  if module_listed(n.removesuffix(".weight"), patterns)]
        if listed:
            problems.append(f"{', '.join(listed[:3])}{' ...' if len(listed) > 3 else ''}: unquantized MoE experts "
                            "are not supported")
    for linear in fp8_linears:
        modules = [n.removesuffix(".weight") for n in sources[linear + ".weight"].names]
        listed = [m for m in modules if module_listed(m, patterns)]
        if len(listed) == len(modules):
            keep.append(linear)
        elif listed:
            rest = [m for m in modules if m not in listed]
            problems.append(f"{', '.join(listed)} listed but not {', '.join(rest)}: they run fused as one "
                            f"{linear.rsplit('.', 1)[-1]}, which must be all FP8 or all unquantized")
    if problems:
        raise ValueError(f"quantization_config.{keys} cannot be followed:\n  " + "\n  ".join(problems))
    return keep


def quantization_config_json() -> dict[str, Any]:
    """The `quantization_config` this package writes for FP8 checkpoints (tests, exports)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(WEIGHT_BLOCK)}


def fp8_parameters(param_shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """The model's FP8 parameters: those with a scales parameter beside them."""
    return [p for p in param_shapes if p + SCALE_SUFFIX in param_shapes]


def hf_scale_name(hf_weight: str) -> str:
    return hf_weight + HF_SCALE_SUFFIX


def add_scale_sources(sources: dict, param_shapes: Mapping[str, tuple[int, ...]]) -> dict:
    """`sources` (model parameter -> dense_decoder.HFSource) plus each FP8 parameter's scales, made of its
    HF tensors' `_scale_inv` tensors in the same order (so fusing and expert stacking match the weight's)."""
    from detinfer.models.families.dense_decoder import HFSource

    out = dict(sources)
    for p in fp8_parameters(param_shapes):
        src = sources[p]
        out[p + SCALE_SUFFIX] = HFSource(tuple(hf_scale_name(n) for n in src.names), src.per_expert)
    return out


def fp8_hf_weights(sources: Mapping, param_shapes: Mapping[str, tuple[int, ...]]) -> set[str]:
    """The HF tensor names stored (or to be quantized) as FP8."""
    return {n for p in fp8_parameters(param_shapes) for n in sources[p].names}


def with_quantization(config, quantization: str):
    """The ModelConfig to build for EngineConfig.quantization: "auto" keeps the checkpoint's, "fp8" makes
    every linear FP8 (quantized at load where the checkpoint is not FP8 already)."""
    import dataclasses

    if quantization == "auto" or config.quantization == quantization:
        return config
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be 'auto' or one of {QUANTIZATIONS}, got {quantization!r}")
    return dataclasses.replace(config, quantization=quantization)


def lay_out_fp8_linears(model, ops) -> int:
    """Store each FP8 linear's weight (a module with `weight` [N, K], or tiled, and `weight_scale`; not the MoE
    expert stacks, which their grouped kernel reads as [E, N, K]) in the layout `ops` reads fastest
    (`ops.fp8_weight_layout`: tiled for the deterministic CUDA kernel, [N, K] for the others). The same
    values, so the same bits; the same bytes, so each rank's resident weight bytes are unchanged. Returns how
    many were laid out anew."""
    changed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if getattr(module, "weight_scale", None) is None or weight is None or weight.dim() not in (2, 4):
            continue
        laid = ops.fp8_weight_layout(weight)
        if laid is not weight:  # (a Parameter's .data is a new alias at every access: compare the parameter)
            weight.data = laid  # the Parameter object stays (hooks and references see the new layout)
            changed += 1
    return changed
