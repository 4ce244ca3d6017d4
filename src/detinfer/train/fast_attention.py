"""Fast mode's training attention: stock kernels, batched the way a stock trainer would batch them.

Every implementation here is `attn(layer_idx, q, k, v)` over a packed batch (q [N, Hq, D], k/v [N, Hkv, D],
sequences given by cu_seqlens), full causal attention within each sequence, plain autograd. None makes a
determinism claim: they are the baseline that deterministic mode's cost is measured against, so the
strongest one available is the default ("auto"):

  varlen        torch.nn.attention.varlen.varlen_attn (flash attention over the packed batch, one call);
  flash-attn    flash_attn.flash_attn_varlen_func (the flash-attn package), the same idea;
  padded-sdpa   scaled_dot_product_attention over a right-padded [S, H, max_len, D] batch, one call;
  per-sequence  one SDPA call per sequence (the old fast path; kept for the benchmark's comparison).

The two varlen kernels take CUDA, fp16/bf16 and head_dim a multiple of 8 up to 256. "auto" picks torch's
varlen kernel where it runs (its GPU tests in tests/train/test_fast_attention.py passed on an H200 with
torch 2.11, 2026-11-26), else padded-sdpa; flash-attn is never picked by "auto" (not installed on the GPUs
these tests ran on, so never checked).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

__all__ = ["FAST_ATTENTION", "PaddedSDPAAttention", "SDPAAttention", "VarlenAttention",
           "build_fast_attention", "resolve_fast_attention"]

FAST_ATTENTION = ("auto", "varlen", "flash-attn", "padded-sdpa", "per-sequence")
# What "auto" tries, strongest first (see the module doc for why flash-attn is not in it).
AUTO_ORDER = ("varlen",)


def _expand_kv(q, k, v):
    """k, v with their heads repeated to q's head count (grouped-query attention), for kernels that
    take equal head counts."""
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)


class SDPAAttention:
    """per-sequence: torch's scaled_dot_product_attention, causal, one call per sequence."""

    def __init__(self, cu_seqlens: list[int], scale: float):
        self.cu, self.scale = cu_seqlens, scale

    def __call__(self, layer_idx, q, k, v):
        if q.shape[0] == 0:
            return q.clone()
        k, v = _expand_kv(q, k, v)
        outs = []
        for a, b in zip(self.cu[:-1], self.cu[1:]):
            if b == a:
                continue
            # [1, H, L, D]: the fused (flash / memory-efficient) backends take 4-D inputs only
            qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale)[0]
                        .transpose(0, 1))
        return torch.cat(outs, 0)


class PaddedSDPAAttention:
    """padded-sdpa: the packed batch scattered into a right-padded [S, H, max_len, D] batch, one causal
    SDPA call, gathered back. Right padding makes `is_causal` enough: a real query at position i sees keys
    0..i, all real tokens of its own sequence; the padded rows' outputs are dropped (no gradient)."""

    def __init__(self, cu_seqlens: list[int], scale: float, device: torch.device):
        lens = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        self.scale, self.num_seqs, self.max_len = scale, len(lens), max([0] + lens)
        self.seq_index = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens, dtype=torch.int64)
                                                 ).to(device)
        self.pos_index = (torch.cat([torch.arange(n) for n in lens]) if lens else
                          torch.zeros(0, dtype=torch.int64)).to(device)

    def _padded(self, t):
        """[N, H, D] -> [S, H, max_len, D], zeros in the padding."""
        out = t.new_zeros((self.num_seqs, self.max_len, t.shape[1], t.shape[2]))
        return out.index_put((self.seq_index, self.pos_index), t).transpose(1, 2)

    def __call__(self, layer_idx, q, k, v):
        if q.shape[0] == 0:
            return q.clone()
        k, v = _expand_kv(q, k, v)
        out = F.scaled_dot_product_attention(self._padded(q), self._padded(k), self._padded(v), is_causal=True,
                                             scale=self.scale)
        return out.transpose(1, 2)[self.seq_index, self.pos_index]


@functools.cache  # looked up once: called per layer
def _torch_varlen():
    """torch's varlen_attn and the keyword arguments that make it causal (and grouped-query, where it
    takes enable_gqa), or None where the installed torch lacks it or a causal option: the signature
    changed across versions (is_causal=True in the first ones, window_size=(-1, 0) later)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, _varlen_causal_kwargs(varlen_attn)


def _varlen_causal_kwargs(fn) -> dict | None:
    params = inspect.signature(fn).parameters
    if "scale" not in params:  # the model's softmax scale must be passed through
        return None
    if "window_size" in params:
        kwargs = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        kwargs = {"is_causal": True}
    else:
        return None
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs


@functools.cache
def _flash_attn_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


class VarlenAttention:
    """varlen / flash-attn: one variable-length flash attention call over the packed batch."""

    def __init__(self, impl: str, cu_seqlens: list[int], scale: float, device: torch.device):
        self.impl, self.scale = impl, scale
        self.cu = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
        self.max_len = max([0] + [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])])

    def __call__(self, layer_idx, q, k, v):
        if q.shape[0] == 0:
            return q.clone()
        if self.impl == "flash-attn":  # takes fewer kv heads as they are
            return _flash_attn_varlen()(q, k, v, self.cu, self.cu, self.max_len, self.max_len,
                                        softmax_scale=self.scale, causal=True)
        fn, kwargs = _torch_varlen()
        if "enable_gqa" not in kwargs:
            k, v = _expand_kv(q, k, v)
        return fn(q, k, v, self.cu, self.cu, self.max_len, self.max_len, scale=self.scale, **kwargs)


def _varlen_unsupported(impl: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why `impl` (varlen / flash-attn) cannot run here, or None."""
    if impl == "varlen":
        found = _torch_varlen()
        if found is None or found[1] is None:
            return f"torch {torch.__version__} has no causal torch.nn.attention.varlen.varlen_attn"
    elif _flash_attn_varlen() is None:
        return "the flash-attn package is not installed"
    if torch.device(device).type != "cuda":
        return f"it runs on CUDA only, the model is on {device}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"it takes fp16/bf16, the model is {dtype}"
    if head_dim % 8 or head_dim > 256:
        return f"it takes head_dim a multiple of 8 up to 256, the model has {head_dim}"
    return None


def resolve_fast_attention(name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The implementation `name` stands for on this device / dtype / head_dim: "auto" -> the first of
    AUTO_ORDER available, else padded-sdpa; an explicit one that cannot run -> a ValueError saying why."""
    if name not in FAST_ATTENTION:
        raise ValueError(f"fast_attention must be one of {FAST_ATTENTION}, got {name!r}")
    if name == "auto":
        for impl in AUTO_ORDER:
            if _varlen_unsupported(impl, device, dtype, head_dim) is None:
                return impl
        return "padded-sdpa"
    if name in ("varlen", "flash-attn"):
        reason = _varlen_unsupported(name, device, dtype, head_dim)
        if reason is not None:
            raise ValueError(f"fast_attention={name!r} is not available: {reason}; use 'auto', 'padded-sdpa' "
                             "or 'per-sequence'")
    return name


def build_fast_attention(impl: str, cu_seqlens: list[int], scale: float, device: torch.device):
    """The `attn` of one packed batch for a resolved implementation name."""
    if impl == "per-sequence":
        return SDPAAttention(cu_seqlens, scale)
    if impl == "padded-sdpa":
        return PaddedSDPAAttention(cu_seqlens, scale, device)
    return VarlenAttention(impl, cu_seqlens, scale, device)
