"""Route Hugging Face "eager" attention through the batch-invariant SDPA while the mode is on.

HF's eager attention is `softmax(Q K^T * s + mask) V` spelled with separate matmul/softmax calls. Each op
is overridden already, but with LEFT padding a row's real keys start at the pad length, which shifts them
against the reductions' fixed block boundaries. The SDPA override re-anchors keys at each row's first
attended key; so, while the mode is on, each loaded `transformers.models.*.modeling_*` module's
`eager_attention_forward` is swapped for one that calls `F.scaled_dot_product_attention` (which dispatches
to our override). Restored on disable. Modules imported after enable() are not patched: build the model
first, then enter the mode (the model classes import their modeling module).
"""

from __future__ import annotations

import sys

import torch.nn.functional as F

from detinfer.ops.aten_impls import NotBatchInvariantError

_UNSUPPORTED_KWARGS = ("softcap", "sinks", "s_aux")


def invariant_eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0,
                                      **kwargs):
    """Drop-in for HF's eager_attention_forward: q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] ->
    (out [B, Lq, Hq, D], None). Attention weights are not returned (output_attentions gives None)."""
    if dropout and getattr(module, "training", False):
        raise NotBatchInvariantError("batch_invariant mode: attention dropout in training mode is random; "
                                     "call model.eval()")
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotBatchInvariantError(f"batch_invariant mode: eager attention with {name!r} is not supported")
    if attention_mask is not None:
        attention_mask = attention_mask[..., : key.shape[-2]]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def patch_loaded_modules() -> dict:
    """Swap eager_attention_forward in every loaded HF modeling module; returns what to restore."""
    saved = {}
    for name, mod in list(sys.modules.items()):
        if not (name.startswith("transformers.models.") and ".modeling_" in name) or mod is None:
            continue
        orig = getattr(mod, "eager_attention_forward", None)
        if callable(orig) and orig is not invariant_eager_attention_forward:
            saved[name] = orig
            mod.eager_attention_forward = invariant_eager_attention_forward
    return saved


def restore_modules(saved: dict) -> None:
    for name, orig in saved.items():
        mod = sys.modules.get(name)
        if mod is not None:
            mod.eager_attention_forward = orig


__all__ = ["invariant_eager_attention_forward", "patch_loaded_modules", "restore_modules"]
