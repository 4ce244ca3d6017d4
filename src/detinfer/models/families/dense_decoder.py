"""The Llama-style dense decoder's tensor names, shared by the Llama, Qwen2 and Qwen3 families: HF
checkpoint names and shapes, their mapping onto `detinfer.models.transformer.Transformer`'s parameters, and
llama.cpp's GGUF names for the same tensors. Which optional tensors exist (biases, q/k norms) follows the
`ModelConfig` flags, so one layout serves every family whose checkpoints differ only in those. Layers listed in
`config.moe_layers` get no dense MLP tensors here: moe_decoder.py adds their experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# GGUF tensor name stems -> HF names (the ".weight" / ".bias" suffix is kept as is).
GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def hf_weight_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor a HF checkpoint of this config must hold, with its shape (lm_head only when untied)."""
    H, I, D = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.q_size, config.kv_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, H),
                                          "model.norm.weight": (H,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, H)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        for name, out_dim in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[p + f"self_attn.{name}.weight"] = (out_dim, H)
            if config.qkv_bias:
                shapes[p + f"self_attn.{name}.bias"] = (out_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (H, q)
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (H,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (D,)
            shapes[p + "self_attn.k_norm.weight"] = (D,)
        if i in config.moe_layers:  # a sparse block instead (see moe_decoder.py)
            continue
        for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            shapes[p + f"mlp.{name}.weight"] = shape
            if config.mlp_bias:
                shapes[p + f"mlp.{name}.bias"] = shape[:1]
    return shapes


@dataclass(frozen=True)
class HFSource:
    """How one Transformer parameter is made of HF tensors: `names` concatenated along dim 0 (q/k/v ->
    qkv_proj, gate/up -> gate_up_proj; one name: as stored), or with `per_expert` = k > 0, experts stacked
    along a new dim 0, expert e being the concatenation of names[e k:(e + 1) k]. Both the whole-model loader
    and the sharded one (which reads only a rank's rows of each name) follow it."""

    names: tuple[str, ...]
    per_expert: int = 0

    def build(self, hf: dict[str, torch.Tensor]) -> torch.Tensor:
        if not self.per_expert:
            return hf[self.names[0]] if len(self.names) == 1 else torch.cat([hf[n] for n in self.names], dim=0)
        k = self.per_expert
        return torch.stack([torch.cat([hf[n] for n in self.names[e:e + k]], dim=0)
                            for e in range(0, len(self.names), k)])


def hf_sources(config) -> dict[str, HFSource]:
    """Transformer state-dict name -> its HF tensors (exactly `hf_weight_shapes(config)`'s names)."""
    src = {"embed_tokens": HFSource(("model.embed_tokens.weight",)), "norm.weight": HFSource(("model.norm.weight",))}
    if not config.tie_word_embeddings:
        src["lm_head"] = HFSource(("lm_head.weight",))
    for i in range(config.num_hidden_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            src[o + f"{norm}.weight"] = HFSource((p + f"{norm}.weight",))
        for kind in ("weight", "bias") if config.qkv_bias else ("weight",):
            src[o + f"self_attn.qkv_proj.{kind}"] = HFSource(tuple(p + f"self_attn.{n}_proj.{kind}" for n in "qkv"))
        for kind in ("weight", "bias") if config.o_bias else ("weight",):
            src[o + f"self_attn.o_proj.{kind}"] = HFSource((p + f"self_attn.o_proj.{kind}",))
        if config.qk_norm:
            for norm in ("q_norm", "k_norm"):
                src[o + f"self_attn.{norm}.weight"] = HFSource((p + f"self_attn.{norm}.weight",))
        for kind in () if i in config.moe_layers else ("weight", "bias") if config.mlp_bias else ("weight",):
            src[o + f"mlp.gate_up_proj.{kind}"] = HFSource((p + f"mlp.gate_proj.{kind}", p + f"mlp.up_proj.{kind}"))
            src[o + f"mlp.down_proj.{kind}"] = HFSource((p + f"mlp.down_proj.{kind}",))
    return src


def state_dict_from_hf(config, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map HF-named tensors (exactly `hf_weight_shapes(config)`) to the Transformer's state dict, fusing
    q/k/v -> qkv_proj and gate/up -> gate_up_proj along the output dim (`hf_sources`)."""
    return {name: source.build(hf) for name, source in hf_sources(config).items()}


def hf_name_from_gguf(gguf_name: str) -> str:
    """llama.cpp tensor name ("blk.3.attn_q.weight") -> HF name ("model.layers.3.self_attn.q_proj.weight")."""
    base, _, kind = gguf_name.rpartition(".")
    if base in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{GGUF_LAYER_NAMES[parts[2]]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no HF counterpart here")
