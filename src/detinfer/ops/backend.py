"""The numerics backend: one `Ops` object owns every numeric op a forward pass and the sampler use.

    ops = Ops("deterministic", device, dtype, head_dim=cfg.head_dim)   # chosen once
    model.set_ops(ops)                                                 # same weights, any backend

Model code (`models/transformer.py`), the engine (KV writes, paged attention, logits, logprobs), the
drop-in mode's aten implementations (`ops/aten_impls.py`) and the sampler's float reductions call these
methods and nothing else, so which implementation runs is decided here and only here.

Selection rule (`Ops.__post_init__`, from mode, device, dtype, head_dim and two switches):

- mode "fast": what a serving stack runs. On CUDA: cuBLAS (`F.linear`) for every linear and the logits
  (bf16 GEMM, then fp32), the fused RMSNorm(+residual) Triton kernel (one launch instead of ~7 stock
  ones; its row-per-program reduction is also what fused serving kernels do), the fused SiLU*mul kernel
  (`kernels/silu_mul.py`), torch's softmax / log_softmax / sums, and the split-picking
  `paged_attention_fast` kernel for attention. On CPU (and for dtypes the kernels do not take): stock
  torch, unfused.
- mode "deterministic", dense ops (linear, matmuls, RMSNorm, softmax, sums): the Triton kernel when the
  op's tensors are on the backend's CUDA device and of a kernel dtype (bf16/fp16/fp32); otherwise the
  op's pure-torch `*_ref` (fixed-order folds, batch-invariant by construction: the CPU path, and fp64
  anywhere). `cpu_triton=True` (the drop-in mode's testing switch) also runs fp32/fp16 CPU tensors
  through the kernels when Triton's interpreter is on (TRITON_INTERPRET=1).
- paged attention + KV write, both modes: the Triton kernels when the head_dim is one the kernels take
  and the tensors are CUDA ones of a kernel dtype, or fp32 CPU ones under the interpreter (how CI tests
  the kernels); otherwise `paged_attention_ref` + `write_kv_ref` (invariant by construction).
  `attention="kernel"` / `"ref"` forces one side (a kernel that cannot run here is an error).
- SiLU in deterministic mode on CPU is spelled with exp and a division (kernels/activations.py): torch's
  vectorized CPU SiLU rounds a tensor's SIMD tail differently, so an element's bits would depend on its
  position.
- SiLU*mul and the attention prologue (`qk_norm_rope`: per-head q/k RMSNorm + RoPE), both modes: one
  fused elementwise Triton launch each where the dense kernels run (CUDA), reading their inputs by strides
  out of the fused projections' outputs; they are row-wise, so batch-invariant in either mode. Under
  autograd (fast-mode training) they fall back to the torch composition; the deterministic trainer wraps
  the kernel itself (train/adapter.py). Elsewhere: the torch composition, the CPU definition.
  `qk_norm_rope_write_kv` (the engine's prologue) also stores the rotated k and v in the paged KV cache:
  one launch where both the prologue kernel and the KV-write kernel would run (same bits as the two),
  else exactly `qk_norm_rope` then `write_kv`.
- The SwiGLU MLP's gate_up projection + SiLU*mul (`linear_silu_mul`), deterministic mode: one launch with
  the same bits as the two (kernels/linear_silu_mul.py) for 16-bit decode-sized batches where the kernels
  run; otherwise (and in fast mode) `linear` then `silu_mul` as above.
- Block-scaled FP8 linears (`linear_fp8`, `linear_fp8_silu_mul`, `rms_norm_fp8`, `moe_fp8`; ops/fp8_ops.py,
  docs/fp8.md): deterministic mode runs the Triton fp8 kernels on CUDA and the exact-block-dot ref elsewhere
  (the same numerics up to the tensor cores' accumulation; each batch-invariant), and the norms and SiLU*mul
  that only FP8 linears read hand them their rows already quantized (`QuantizedRows`: the same bits, one
  launch fewer per linear on CUDA); fast mode runs torch's blockwise scaled_mm where it runs, else
  dequantize + F.linear. The FP8 MoE is this backend's routing and combine around the grouped FP8 expert
  GEMMs (CUDA, both modes) or per-expert `linear_fp8` calls (elsewhere).
- RoPE (kernels/rope.py), and the sampler's reductions (`fold_sum`, `cumsum`), are the same in both modes:
  elementwise or fixed-order, so batch-invariant on any device.

Adding an op (a trainer's backward): one method here (plus its kernel/ref in kernels/), as `moe` did:
deterministic -> kernels/moe.py's fused kernel (CUDA) or its ref (CPU); fast -> its M-tuned variant with
stock routing (CUDA) or the stock HF-style loop (CPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from detinfer.constants import MODES
from detinfer.kernels._fold import fold_sum
from detinfer.kernels._launch import KERNEL_DTYPES, SUPPORTED_HEAD_DIMS, interpreting
from detinfer.kernels.activations import silu_cpu
from detinfer.kernels.rope import apply_rope
from detinfer.kernels.scan import cumsum_ref
from detinfer.ops._kernel_modules import kernel_module as _kernels
from detinfer.ops.fp8_ops import Fp8Ops
from detinfer.ops.moe_ops import MoeOps

ATTENTION_BACKENDS = ("auto", "kernel", "ref")
# dtypes the kernels run correctly in Triton's CPU interpreter (its bf16 math is wrong).
_INTERPRETER_DENSE_DTYPES = frozenset({torch.float32, torch.float16})
_INTERPRETER_ATTENTION_DTYPES = frozenset({torch.float32})
# The fused gate_up + SiLU*mul launch: 16-bit models (fp32 keeps two launches; no model runs it for speed).
_FUSED_SWIGLU_DTYPES = frozenset({torch.float16, torch.bfloat16})


def _attention_kernel_runs(device: torch.device, dtype: torch.dtype, head_dim: int | None) -> bool:
    if head_dim not in SUPPORTED_HEAD_DIMS or dtype not in KERNEL_DTYPES:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreting()
                                     and dtype in _INTERPRETER_ATTENTION_DTYPES)


@functools.cache
def _fp32_out_gemm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch's CUDA GEMM takes 16-bit operands with an fp32 output and an fp32 accumulator
    (`torch.addmm(..., out_dtype=torch.float32)`; older versions have no `out_dtype` or require `self` to be
    16-bit): probed once per (device, dtype) on a 16 x 16 product."""
    try:
        a = torch.ones(16, 16, device=device, dtype=dtype)
        acc = torch.ones(16, 16, device=device, dtype=torch.float32)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return bool((acc == 17).all()) and torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


def _fast_weight_grad(dy: torch.Tensor, x: torch.Tensor, dw_out: torch.Tensor | None) -> torch.Tensor:
    """Fast mode's dW = dy^T @ x in fp32, added into `dw_out` in place when given. 16-bit CUDA inputs: one
    cuBLAS GEMM that writes fp32 and adds the accumulator in its epilogue (`out_dtype`, in place). The
    three-op spelling (16-bit GEMM, `.to(float32)`, `add_`) moved a weight-sized tensor ~5 times per call:
    at a 151936 x 4096 output layer scored in 512-row chunks, ~190 GB of memory traffic per backward of
    8192 rows (~60 ms at 3 TB/s, an estimate) instead of ~80 GB. Elsewhere (CPU, where aten has no
    `out_dtype` GEMM; fp32; a torch without it) the stock matmul, then the add."""
    if dy.is_cuda and dy.dtype in (torch.float16, torch.bfloat16) and _fp32_out_gemm_runs(dy.device, dy.dtype):
        if dw_out is None:
            return torch.mm(dy.t(), x, out_dtype=torch.float32)
        return torch.addmm(dw_out, dy.t(), x, out_dtype=torch.float32, out=dw_out)
    part = torch.mm(dy.t(), x).to(torch.float32)
    return part if dw_out is None else dw_out.add_(part)


@dataclass(frozen=True)
class Ops(MoeOps, Fp8Ops):
    """The numerics backend for one (mode, device, dtype); see the module docstring for the rule (its FP8 ops
    live in ops/fp8_ops.py, its MoE ops in ops/moe_ops.py)."""

    mode: str = "deterministic"
    device: torch.device | str = "cpu"
    dtype: torch.dtype = torch.float32
    head_dim: int | None = None
    attention: str = "auto"
    cpu_triton: bool = False
    # Resolved once from the fields above.
    dense_kernel_dtypes: frozenset = field(init=False, repr=False)
    attention_impl: str = field(init=False)  # "kernel" or "ref"
    # Fast mode's fused norm / activation kernels: dtypes they run for on this device (CUDA only).
    fused_dtypes: frozenset = field(init=False, repr=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention!r}")
        device = torch.device(self.device)
        object.__setattr__(self, "device", device)
        if device.type == "cuda":
            dense = KERNEL_DTYPES
        elif self.cpu_triton and device.type == "cpu" and interpreting():
            dense = _INTERPRETER_DENSE_DTYPES
        else:
            dense = ()
        object.__setattr__(self, "dense_kernel_dtypes", frozenset(dense))
        fused = KERNEL_DTYPES if self.mode == "fast" and device.type == "cuda" else ()
        object.__setattr__(self, "fused_dtypes", frozenset(fused))
        kernel_ok = _attention_kernel_runs(device, self.dtype, self.head_dim)
        if self.attention == "kernel" and not kernel_ok:
            raise ValueError(f"the Triton attention kernels cannot run here (device {device}, dtype "
                             f"{self.dtype}, head_dim {self.head_dim}; kernels take head_dim in "
                             f"{SUPPORTED_HEAD_DIMS} on CUDA, or fp32 on CPU under TRITON_INTERPRET=1)")
        impl = ("kernel" if kernel_ok else "ref") if self.attention == "auto" else self.attention
        object.__setattr__(self, "attention_impl", impl)

    @property
    def deterministic(self) -> bool:
        return self.mode == "deterministic"

    def replace(self, **changes) -> Ops:
        """Another backend for the same model (e.g. `ops.replace(mode="fast")`), re-selected by the rule."""
        return replace(self, **changes)

    def _kernel(self, *tensors: torch.Tensor | None) -> bool:
        """Deterministic dense ops: whether these tensors go to the Triton kernel (else the *_ref)."""
        return self._runs_on(self.dense_kernel_dtypes, tensors)

    def _fused(self, *tensors: torch.Tensor | None) -> bool:
        """Fast mode: whether these tensors go to the fused norm / activation kernels (else stock torch).
        Not while autograd records them: the kernels have no backward, and fast-mode training relies on
        stock torch's autograd."""
        if not self._runs_on(self.fused_dtypes, tensors):
            return False
        return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))

    def _runs_on(self, kinds: frozenset, tensors: tuple) -> bool:
        if not kinds:
            return False
        cuda = self.device.type == "cuda"  # `is_cuda` is a cheaper read than building `t.device`
        for t in tensors:
            if t is not None and (t.dtype not in kinds or t.is_cuda != cuda or not (cuda or t.device.type == "cpu")):
                return False
        return True

    # -- dense ops -------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ weight[N, K]^T (+ bias[N]) -> [..., N]."""
        if not self.deterministic:
            return F.linear(x, weight, bias)
        mm = _kernels("matmul")
        return (mm.linear if self._kernel(x, weight, bias) else mm.linear_ref)(x, weight, bias)

    def linear_backward(self, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                        dw_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients of y = linear(x [T, K], weight [N, K]) (no bias) for dy [T, N]: (dx in x.dtype, dW fp32,
        added into `dw_out` when given). Deterministic: the fixed-order kernels (or their reference);
        fast: two stock matmuls (dW: `_fast_weight_grad`)."""
        if self.deterministic:
            dx, dw, _ = _kernels("linear_backward").linear_backward(dy, x, weight, False, dw_out=dw_out)
            return dx, dw
        dx = torch.mm(dy, weight.to(dy.dtype)).to(x.dtype)
        return dx, _fast_weight_grad(dy, x.to(dy.dtype), dw_out)

    def linear_tree(self, x: torch.Tensor, weight: torch.Tensor, num_chunks: int) -> torch.Tensor:
        """x [..., K] @ weight[N, K]^T as `num_chunks` fp32 K-chunk partials added in a fixed pairwise tree ->
        fp32 [..., N] (kernels/chunked_linear.py: how row-parallel layers give the same bits at any TP size).
        Fast mode: stock matmuls per chunk, same tree."""
        cl = _kernels("chunked_linear")
        if not self.deterministic:
            return cl.pairwise_tree_sum(self.linear_parts(x, weight, num_chunks))
        return (cl.linear_tree if self._kernel(x, weight) else cl.linear_tree_ref)(x, weight, num_chunks)

    def linear_parts(self, x: torch.Tensor, weight: torch.Tensor, num_chunks: int, push=None) -> torch.Tensor:
        """`linear_tree` before its tree: fp32 [num_chunks, ..., N], for a consumer that adds the tree itself
        (`tree_sum_rounded`, the two-GPU peer sum). Fast mode: stock matmuls per chunk. `push` (a
        `kernels.peer_push.PeerPush`; the deterministic kernel path only, one chunk): the matmul also sends
        its output to the other GPU's fused sum + norm, which then only receives."""
        cl = _kernels("chunked_linear")
        if push is not None:
            if not self.pushes_parts(x, weight):
                raise ValueError("linear_parts: only the deterministic Triton matmul pushes its output to a peer")
            return cl.linear_parts(x, weight, num_chunks, push)
        if not self.deterministic:
            cl.check_chunks("linear_parts", x, weight, num_chunks)
            return torch.stack([F.linear(xc.float(), wc.float()) for xc, wc in
                                zip(x.chunk(num_chunks, -1), weight.chunk(num_chunks, -1))])
        return (cl.linear_parts if self._kernel(x, weight) else cl.linear_parts_ref)(x, weight, num_chunks)

    def pushes_parts(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `linear_parts(x, weight, 1, push)` can send its output to a peer as it stores it (the
        deterministic Triton matmul; `kernels.peer_push`)."""
        return self.deterministic and self._kernel(x, weight)

    def tree_sum_rounded(self, parts: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """`(tree_sum(parts) [+ bias.float()]).to(dtype)`: a row-parallel layer's epilogue on one GPU (TP=1
        with the chunk tree), one launch where the kernels run (elementwise adds: the same bits)."""
        ps = _kernels("peer_sum")
        if self.deterministic and self._kernel(parts) and parts.shape[0] in ps.LOCAL_PARTS and parts.is_contiguous():
            out = torch.empty(parts.shape[1:], dtype=dtype, device=parts.device)
            ps.launch_peer_sum(parts, bias, out, 0, None, None, None)
            return out
        return ps.peer_sum_ref(parts, None, bias, dtype)

    @staticmethod
    def tree_sum(parts: torch.Tensor) -> torch.Tensor:
        """parts [C, ...] -> [...] in the fixed pairwise tree of `linear_tree` (elementwise: any mode)."""
        return _kernels("chunked_linear").pairwise_tree_sum(parts)

    def mm(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """[M, K] @ [K, N] (float) (+ bias [N], added once after the reduction as `linear` does: aten's
        addmm, which F.linear with a bias becomes, without building the transposed weight view)."""
        if not self.deterministic:
            return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
        mm = _kernels("matmul")
        if self._kernel(a, b, bias):
            return mm.matmul(a, b, bias=bias)
        return mm.matmul_ref(a, b) if bias is None else mm.linear_ref(a, b.t(), bias)

    def bmm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """[B, M, K] @ [B, K, N] (float)."""
        if not self.deterministic:
            return torch.bmm(a, b)
        mm = _kernels("matmul")
        return (mm.bmm if self._kernel(a, b) else mm.bmm_ref)(a, b)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                 residual: torch.Tensor | None = None):
        """HF-style RMSNorm over the last dim; with `residual`, returns (normed(x + residual), x + residual)."""
        if not self.deterministic:
            if self._fused(x, weight, residual) and (residual is None or residual.dtype == x.dtype):
                rmsnorm = _kernels("rmsnorm")
                if x.shape[-1] <= rmsnorm.MAX_D:
                    return rmsnorm.rms_norm(x, weight, eps, residual=residual)
            h = x if residual is None else x + residual
            hf = h.float()
            y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
            if weight is not None:
                y = weight * y
            return y if residual is None else (y, h)
        rmsnorm = _kernels("rmsnorm")
        fn = rmsnorm.rms_norm if self._kernel(x, weight, residual) else rmsnorm.rms_norm_ref
        return fn(x, weight, eps, residual=residual)

    def _fused_kernel(self, *tensors: torch.Tensor | None) -> bool:
        """Elementwise fused kernels (SiLU*mul, qk-norm + RoPE), both modes: where the dense kernels run,
        and not under autograd (the kernels have no backward; the trainer wraps these ops itself)."""
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
            return False
        return self._kernel(*tensors)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up (the SwiGLU MLP's elementwise part). Where the kernels run: one Triton launch
        reading gate/up by strides (`kernels.silu_mul`, both modes); else torch."""
        if self._fused_kernel(gate, up):
            return _kernels("silu_mul").silu_mul(gate, up)
        if self.deterministic and not gate.is_cuda:
            return silu_cpu(gate) * up
        return F.silu(gate) * up

    # Rows up to which the gate_up projection runs fused with SiLU*mul. Speed only: both paths give the same
    # bits (tests/kernels/test_linear_silu_mul.py proves it on the GPU), so the launch choice may look at
    # the batch. Decode batches are weight-bandwidth bound, where dropping the second launch pays; larger
    # M is compute bound and keeps the plain matmul's TMA tiles.
    FUSED_SWIGLU_MAX_ROWS = 64

    def linear_silu_mul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """The SwiGLU MLP up to down_proj: silu_mul of the two halves of linear(x, weight [2I, K], bias)
        (gate rows, then up rows) -> [..., I]. Deterministic mode, 16-bit, where the kernels run, not under
        autograd, at most FUSED_SWIGLU_MAX_ROWS rows: one launch (`kernels.linear_silu_mul`, the same bits);
        otherwise `linear` then `silu_mul`, exactly as two calls."""
        if (self.deterministic and x.dtype in _FUSED_SWIGLU_DTYPES and x.dim() >= 1
                and x.numel() <= self.FUSED_SWIGLU_MAX_ROWS * x.shape[-1] and self._fused_kernel(x, weight, bias)):
            return _kernels("linear_silu_mul").linear_silu_mul(x, weight, bias)
        gate, up = self.linear(x, weight, bias).split(weight.shape[0] // 2, dim=-1)
        return self.silu_mul(gate, up)

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor):
        """Rotary embedding of q and k (`kernels.rope.apply_rope`)."""
        return apply_rope(positions, q, k, inv_freq)

    def qk_norm_rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor,
                     q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                     eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention prologue: per-head RMSNorm of q [T, Hq, D] and k [T, Hkv, D] (when the weights are
        given: Qwen3's qk_norm), then RoPE. Where the kernels run: one Triton launch reading q/k by strides
        (`kernels.rope_qk`, both modes); else `rms_norm` per head then `rope` (the CPU definition)."""
        rope_qk = _kernels("rope_qk")
        if self._fused_kernel(q, k, q_weight, k_weight) and rope_qk.kernel_takes(q, k, q_weight):
            return rope_qk.qk_norm_rope(positions, q, k, inv_freq, q_weight, k_weight, eps)
        if q_weight is not None:
            q, k = self.rms_norm(q, q_weight, eps), self.rms_norm(k, k_weight, eps)
        return self.rope(positions, q, k, inv_freq)

    def qk_norm_rope_write_kv(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              inv_freq: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                              eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                              *, validate: bool = True) -> torch.Tensor:
        """The attention prologue with the paged KV write: `qk_norm_rope` of q, k, then `write_kv` of the
        rotated k and v [T, Hkv, D] at `slot_mapping`; returns q'. Where both would run their kernels and the
        step is short (T <= rope_qk.FUSED_KV_WRITE_MAX_TOKENS): one launch (`kernels.rope_qk.
        qk_norm_rope_write_kv`) with the same q' and cache bits; else the two calls."""
        rope_qk = _kernels("rope_qk")
        if (self.attention_impl == "kernel" and q.shape[0] <= rope_qk.FUSED_KV_WRITE_MAX_TOKENS
                and self._fused_kernel(q, k, v, q_weight, k_weight) and rope_qk.kernel_takes(q, k, q_weight)):
            return rope_qk.qk_norm_rope_write_kv(positions, q, k, v, inv_freq, q_weight, k_weight, eps, k_cache,
                                                 v_cache, slot_mapping, validate=validate)[0]
        q, k = self.qk_norm_rope(positions, q, k, inv_freq, q_weight, k_weight, eps)
        self.write_kv(k, v, k_cache, v_cache, slot_mapping, validate=validate)
        return q

    def softmax(self, x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = torch.float32):
        if not self.deterministic:
            return torch.softmax(x, dim=dim, dtype=dtype)
        softmax = _kernels("softmax")
        return (softmax.softmax if self._kernel(x) else softmax.softmax_ref)(x, dim=dim, dtype=dtype)

    def log_softmax(self, x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = torch.float32):
        if not self.deterministic:
            return torch.log_softmax(x, dim=dim, dtype=dtype)
        softmax = _kernels("softmax")
        return (softmax.log_softmax if self._kernel(x) else softmax.log_softmax_ref)(x, dim=dim, dtype=dtype)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] @ weight[vocab, hidden]^T -> logits [S, vocab] fp32."""
        return self.linear(hidden, weight).float()

    def sum_dim(self, x: torch.Tensor, dims: list[int], keepdim: bool = False, dtype=None) -> torch.Tensor:
        """Sum over `dims` into a float result (an integer x needs a float dtype); the kernel only for a
        float x and an fp32 or same-dtype result."""
        return self._reduce(x, dims, keepdim, dtype, mean=False)

    def mean_dim(self, x: torch.Tensor, dims: list[int], keepdim: bool = False, dtype=None) -> torch.Tensor:
        return self._reduce(x, dims, keepdim, dtype, mean=True)

    def _reduce(self, x, dims, keepdim, dtype, mean: bool) -> torch.Tensor:
        if not self.deterministic:
            x = x if x.is_floating_point() else x.to(dtype)
            return (torch.mean if mean else torch.sum)(x, dims, keepdim=keepdim, dtype=dtype)
        reduce = _kernels("reduce")

        kernel = x.is_floating_point() and self._kernel(x) and dtype in (None, torch.float32, x.dtype)
        if mean:
            fn = reduce.mean_dim if kernel else reduce.mean_dim_ref
        else:
            fn = reduce.sum_dim if kernel else reduce.sum_dim_ref
        return fn(x if x.is_floating_point() else x.to(dtype), dims, keepdim=keepdim, dtype=dtype)

    # -- the sampler's reductions (fixed order in both modes: sampling is always a pure row function) -----
    @staticmethod
    def fold_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
        return fold_sum(x, dim=dim, keepdim=keepdim)

    @staticmethod
    def cumsum(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
        return cumsum_ref(x, dim, dtype=dtype)

    # -- paged KV cache ----------------------------------------------------------------------------------
    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, *, validate: bool = True) -> None:
        """Store this step's k/v [T, Hkv, D] at `slot_mapping` [T] (-1: skip) of the layer's pools."""
        from detinfer.kernels import kv_write

        fn = kv_write.write_kv if self.attention_impl == "kernel" else kv_write.write_kv_ref
        fn(k, v, k_cache, v_cache, slot_mapping, validate=validate)

    def paged_attention(self, q, k_cache, v_cache, block_tables, kv_lens, cu_q_lens, scale, *, max_q_len,
                        max_kv_len, validate: bool = True, out: torch.Tensor | None = None,
                        lse_out: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of packed queries q [T, Hq, D] over each sequence's paged keys (prefill,
        chunked prefill and decode are one call); see kernels.attention for the metadata. lse_out: an
        optional fp32 [T, Hq] buffer for the rows' log-sum-exps (the trainer's backward input), filled by
        every implementation (kernels.attention.paged_attention's definition)."""
        kwargs = {} if out is None else {"out": out}
        if lse_out is not None:
            kwargs["lse_out"] = lse_out
        if self.attention_impl == "kernel":
            from detinfer.kernels import attention

            fn = attention.paged_attention if self.deterministic else attention.paged_attention_fast
        else:
            from detinfer.kernels.attention_ref import paged_attention_ref as fn
        return fn(q, k_cache, v_cache, block_tables, kv_lens, cu_q_lens, scale, max_q_len=max_q_len,
                  max_kv_len=max_kv_len, validate=validate, **kwargs)


__all__ = ["ATTENTION_BACKENDS", "MODES", "Ops"]
