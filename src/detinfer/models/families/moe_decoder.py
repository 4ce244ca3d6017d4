"""Tensor names of mixture-of-experts decoders (Qwen3-MoE, Mixtral): the dense decoder's attention, norms
and embeddings (dense_decoder.py), and in each layer of `config.moe_layers` a router plus per-expert
gate / up / down projections instead of the dense MLP.

HF checkpoints (hub files, and what transformers 5's save_pretrained writes) store one [out, in] matrix
per expert and projection, e.g. `model.layers.3.mlp.experts.17.gate_proj.weight`; the families differ only
in the names (`MoeNames`). At load time they are stacked into the Transformer's
`mlp.gate_up_proj` [E, 2I, H] (each expert's gate rows then its up rows) and `mlp.down_proj` [E, H, I],
the layout the fused MoE kernel reads (kernels/moe.py).

llama.cpp's GGUFs stack each layer's experts: `blk.N.ffn_{gate,up,down}_exps.weight` [E, out, in] and the
router `blk.N.ffn_gate_inp.weight` [E, H]; `hf_name_from_gguf` names a stacked tensor with an `{expert}`
placeholder, which the GGUF reader fills in while splitting it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from detinfer.models.families import dense_decoder


@dataclass(frozen=True)
class MoeNames:
    """HF names inside a layer: `{block}.{router}.weight`, `{block}.experts.{e}.{gate|up|down}.weight`."""

    block: str
    router: str
    gate: str
    up: str
    down: str

    def router_name(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.block}.{self.router}.weight"

    def expert_name(self, layer: int, expert: int | str, proj: str) -> str:
        return f"model.layers.{layer}.{self.block}.experts.{expert}.{getattr(self, proj)}.weight"


GGUF_EXPERT_NAMES = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}

QWEN_MOE_NAMES = MoeNames(block="mlp", router="gate", gate="gate_proj", up="up_proj", down="down_proj")
MIXTRAL_NAMES = MoeNames(block="block_sparse_moe", router="gate", gate="w1", up="w3", down="w2")


def hf_weight_shapes(names: MoeNames, config) -> dict[str, tuple[int, ...]]:
    """Every tensor a HF checkpoint of this config must hold, with its shape."""
    shapes = dense_decoder.hf_weight_shapes(config)
    H, I, E = config.hidden_size, config.moe_intermediate_size, config.num_experts
    for i in config.moe_layers:
        shapes[names.router_name(i)] = (E, H)
        for e in range(E):
            shapes[names.expert_name(i, e, "gate")] = (I, H)
            shapes[names.expert_name(i, e, "up")] = (I, H)
            shapes[names.expert_name(i, e, "down")] = (H, I)
    return shapes


def hf_sources(names: MoeNames, config) -> dict[str, dense_decoder.HFSource]:
    """Transformer state-dict name -> its HF tensors: the dense decoder's, plus each sparse layer's router
    and its experts stacked (gate rows then up rows per expert; see the module doc)."""
    src = dense_decoder.hf_sources(config)
    for i in config.moe_layers:
        o, experts = f"layers.{i}.mlp.", range(config.num_experts)
        src[o + "router"] = dense_decoder.HFSource((names.router_name(i),))
        src[o + "gate_up_proj"] = dense_decoder.HFSource(tuple(
            names.expert_name(i, e, proj) for e in experts for proj in ("gate", "up")), per_expert=2)
        src[o + "down_proj"] = dense_decoder.HFSource(tuple(names.expert_name(i, e, "down") for e in experts),
                                                      per_expert=1)
    return src


def state_dict_from_hf(names: MoeNames, config, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors -> the Transformer's state dict (experts stacked; see the module doc)."""
    return {name: source.build(hf) for name, source in hf_sources(names, config).items()}


def hf_name_from_gguf(names: MoeNames, gguf_name: str) -> str:
    """llama.cpp name -> HF name; stacked expert tensors get an `{expert}` placeholder (see module doc)."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        layer, stem = int(parts[1]), parts[2]
        if stem == "ffn_gate_inp":
            return names.router_name(layer)
        if stem in GGUF_EXPERT_NAMES:
            return names.expert_name(layer, "{expert}", GGUF_EXPERT_NAMES[stem])
    return dense_decoder.hf_name_from_gguf(gguf_name)
