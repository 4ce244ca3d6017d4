"""The block-scaled FP8 GEMM for prefill-sized M on Hopper: warp-specialized and persistent (Gluon, Triton's
explicit-layout language), the same bits as kernels/fp8_tiles.py's kernel at more of the GPU's rate.

Why a second kernel: at 1000+ rows the Triton kernel's 64 x 128 tiles (two programs per SM) read operands out
of the L2 at 87% of its throughput (ncu on an H100, gate_up at M = 4096: the TMA wait is the top stall), and its
128 x 128 tiles on 8 warps stall on the MMA wait instead, both warpgroups in lockstep behind the CTA barriers
the pipeliner places every K block (docs/performance.md, "FP8, tenth pass"). Here each persistent CTA owns
128 x 128 output tiles in turn: one producer warp issues the TMA loads into a STAGES-deep ring of shared-memory
slots, and two consumer warpgroups, each its own partition (so no CTA barrier couples them), compute 64 rows
each. While one consumer folds a block's product into its accumulator, the other's MMA runs.

Bits: each consumer does, per 128-wide K block in ascending order, the same wgmma instructions over the same
products into a fresh fp32 tile (use_acc=False), the same fp32 scale product sx[m, kb] * sw[n, kb] and the same
fma into an accumulator that starts at 0.0; a long K is the same two runs, their chains added (fp8_linear's
module doc). So every element's operations are those of the Triton kernel, whatever the tile or the CTA that
computes it: asserted bitwise against it on the GPU (tests/kernels/test_fp8_linear.py) for every shape class,
ragged M, both weight layouts, bias and fp32 output. The choice between the two kernels (`takes`) follows M,
which changes no bit.

Where it runs (`takes`): CUDA devices of compute capability 9.x with a Triton that has Gluon's Hopper API
(3.6: `async_copy_global_to_shared`; later: `async_load`), at least MIN_ROWS rows, weight rows whose 128-row
groups share their block scales (UNIFORM), a K of whole blocks, 16-byte aligned operands, an [N, K] weight with
unit inner stride or a whole-tile tiled one. Elsewhere the Triton kernel runs.
"""

from __future__ import annotations

import functools

import torch

try:  # Gluon's Hopper API; without it `available()` is False and nothing here runs
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _GLUON = hasattr(gl, "warp_specialize")
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _GLUON = False

BLOCK_K = 128  # the scale block: one MMA group and one fma per K block
BLOCK_N = 128  # a tile's columns: inside one 128-row group of weight scales (UNIFORM: one scale per K block)
# Fewest rows this kernel takes (speed only). H100, `python bench/bench_fp8.py` shapes (Qwen3-8B), us per call
# on quantized rows, the Triton kernel -> this one (docs/performance.md, "FP8, tenth pass"): 1024 rows qkv 61.2
# -> 59.5, o 42.0 -> 40.2, gate_up 253.9 -> 241.4, down 128.4 -> 114.8; 4096 rows gate_up 971.5 -> 906.0, down
# 511.7 -> 467.5; at 512 rows gate_up 131.7 -> 121.0, down 64.5 -> 58.4 (qkv 36.4 -> 37.1); at 256 rows slower
# on three of four shapes (o 13.0 -> 18.8: half the SMs idle with 128-row tiles).
MIN_ROWS = 512
STAGES = 4  # ring slots of one K block (2 x 8 KB activation boxes + 16 KB of weight); 6 measured slower
GROUP_M = 8  # row tiles that walk the columns together (operand reuse in the L2)
# Registers per thread: the consumers hold a 64 x 128 fp32 accumulator and the block's product (64 each);
# the producer only addresses. The kernel's 12 warps (4 + 4 + 1, padded to a warpgroup) at MAXNREG fill the
# 64K-register file; the compiler moves registers from the producer's warpgroup to the consumers.
CONSUMER_REGS, PRODUCER_REGS, MAXNREG = 232, 40, 168

if _GLUON:
    # Triton 3.6 names the TMA load `async_copy_global_to_shared`; later versions `async_load`.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _BK = gl.constexpr(BLOCK_K)

    @gluon.jit
    def _tile_origin(tile, M, N, BLOCK_M: gl.constexpr, BN: gl.constexpr, GROUP: gl.constexpr):
        """The (row, column) origin of output tile number `tile` in a grouped raster."""
        tiles_n = gl.cdiv(N, BN)
        per_group = GROUP * tiles_n
        first_m = (tile // per_group) * GROUP
        size_m = gl.minimum(gl.cdiv(M, BLOCK_M) - first_m, GROUP)
        return (first_m + (tile % per_group) % size_m) * BLOCK_M, ((tile % per_group) // size_m) * BN

    @gluon.jit
    def _load_partition(a_desc, w_desc, a0_bufs, a1_bufs, w_bufs, ready, empty, sx_ptr, sw_ptr, b_ptr, y_ptr,
                        M, N, KB, H, group_rows, stride_sxm, stride_swn, stride_ym, HAS_BIAS: gl.constexpr,
                        TILED: gl.constexpr, TWO_RUNS: gl.constexpr, NUM_STAGES: gl.constexpr,
                        GROUP: gl.constexpr):
        """One warp: the TMA loads of every (tile, K block) this CTA computes, in the consumers' order, each
        into the next slot the two consumers have released."""
        BN: gl.constexpr = w_bufs.type.shape[1]  # worker arguments: constexprs read off the buffers' types
        NBYTES: gl.constexpr = 2 * 64 * 128 + BN * 128  # fp8: two 64-row activation boxes and the weight box
        it = 0
        for tile in range(gl.program_id(0), gl.cdiv(M, 128) * gl.cdiv(N, BN), gl.num_programs(0)):
            off_m, off_n = _tile_origin(tile, M, N, 128, BN, GROUP)
            for kb in range(KB):
                s = it % NUM_STAGES
                mbarrier.wait(empty.index(s), ((it // NUM_STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
                bar = ready.index(s)
                mbarrier.expect(bar, NBYTES)
                _tma_load(a_desc, [off_m, kb * _BK], bar, a0_bufs.index(s))
                _tma_load(a_desc, [off_m + 64, kb * _BK], bar, a1_bufs.index(s))
                if TILED:  # fp8_quant's tiles read as 128-byte rows: group g's block kb, row r
                    _tma_load(w_desc, [(off_n // _BK) * group_rows + kb * _BK + off_n % _BK, 0], bar, w_bufs.index(s))
                else:
                    _tma_load(w_desc, [off_n, kb * _BK], bar, w_bufs.index(s))
                it += 1

    @gluon.jit
    def _k_run(a_bufs, w_bufs, ready, empty, sx_rows, row_ok, sw_row, kb_lo, kb_hi, it,
               NUM_STAGES: gl.constexpr, BN: gl.constexpr, mma: gl.constexpr):
        """acc = 0, then acc = fma(dot_kb, sx * sw, acc) for kb in [kb_lo, kb_hi): fp8_tiles.k_run's operations.
        A block's scales are loaded during the block before and multiplied once its MMA is issued."""
        zero = gl.zeros((64, BN), gl.float32, mma)
        acc = gl.zeros((64, BN), gl.float32, mma)
        sx = gl.load(sx_rows + kb_lo, mask=row_ok & (kb_lo < kb_hi), other=0.0)
        sw = gl.load(sw_row + kb_lo, mask=kb_lo < kb_hi, other=0.0)
        for kb in range(kb_lo, kb_hi):
            s = it % NUM_STAGES
            mbarrier.wait(ready.index(s), (it // NUM_STAGES) & 1)
            tok = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).permute((1, 0)), zero, use_acc=False,
                                is_async=True)
            more = kb + 1 < kb_hi
            sx_next = gl.load(sx_rows + kb + 1, mask=row_ok & more, other=0.0)
            sw_next = gl.load(sw_row + kb + 1, mask=more, other=0.0)
            scale = sx * sw
            part = warpgroup_mma_wait(num_outstanding=0, deps=(tok, a_bufs.index(s), w_bufs.index(s)))[0]
            mbarrier.arrive(empty.index(s), count=1)  # this warpgroup is done with the slot
            acc = gl.fma(part, gl.expand_dims(scale, 1), acc)
            sx = sx_next
            sw = sw_next
            it += 1
        return acc, it

    @gluon.jit
    def _mma_partition(a_bufs, w_bufs, ready, empty, sx_ptr, sw_ptr, b_ptr, y_ptr, M, N, KB, H, stride_sxm,
                       stride_swn, stride_ym, ROW0: gl.constexpr, HAS_BIAS: gl.constexpr, TWO_RUNS: gl.constexpr,
                       NUM_STAGES: gl.constexpr, GROUP: gl.constexpr):
        """One warpgroup: rows ROW0 .. ROW0 + 63 of every tile this CTA computes, + bias, stored in y's dtype."""
        BN: gl.constexpr = w_bufs.type.shape[1]
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BN, 32])
        it = 0
        for tile in range(gl.program_id(0), gl.cdiv(M, 128) * gl.cdiv(N, BN), gl.num_programs(0)):
            off_m, off_n = _tile_origin(tile, M, N, 128, BN, GROUP)
            rows = off_m + ROW0 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
            row_ok = rows < M
            sx_rows = sx_ptr + rows.to(gl.int64) * stride_sxm
            sw_row = sw_ptr + off_n.to(gl.int64) * stride_swn  # UNIFORM: the tile's first row holds its group's
            if TWO_RUNS:
                acc, it = _k_run(a_bufs, w_bufs, ready, empty, sx_rows, row_ok, sw_row, 0, H, it, NUM_STAGES, BN,
                                 mma)
                acc2, it = _k_run(a_bufs, w_bufs, ready, empty, sx_rows, row_ok, sw_row, H, KB, it, NUM_STAGES,
                                  BN, mma)
                acc = acc + acc2
            else:
                acc, it = _k_run(a_bufs, w_bufs, ready, empty, sx_rows, row_ok, sw_row, 0, KB, it, NUM_STAGES, BN,
                                 mma)
            cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
            col_ok = cols < N
            if HAS_BIAS:
                acc = acc + gl.expand_dims(gl.load(b_ptr + cols, mask=col_ok, other=0.0).to(gl.float32), 0)
            ptrs = y_ptr + gl.expand_dims(rows.to(gl.int64) * stride_ym, 1) + gl.expand_dims(cols, 0)
            gl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=gl.expand_dims(row_ok, 1) & gl.expand_dims(col_ok, 0))

    @gluon.jit
    def _upper_rows(a_desc, w_desc, a0_bufs, a1_bufs, w_bufs, ready, empty, sx_ptr, sw_ptr, b_ptr, y_ptr,
                    M, N, KB, H, group_rows, stride_sxm, stride_swn, stride_ym, HAS_BIAS: gl.constexpr,
                    TILED: gl.constexpr, TWO_RUNS: gl.constexpr, NUM_STAGES: gl.constexpr, GROUP: gl.constexpr):
        """The second consumer (a worker partition: the load partition's arguments)."""
        _mma_partition(a1_bufs, w_bufs, ready, empty, sx_ptr, sw_ptr, b_ptr, y_ptr, M, N, KB, H, stride_sxm,
                       stride_swn, stride_ym, 64, HAS_BIAS, TWO_RUNS, NUM_STAGES, GROUP)

    @gluon.jit
    def fp8_prefill_gemm_kernel(a_desc, w_desc, sx_ptr, sw_ptr, b_ptr, y_ptr, M, N, KB, H, group_rows, stride_sxm,
                                stride_swn, stride_ym, HAS_BIAS: gl.constexpr, TILED: gl.constexpr,
                                TWO_RUNS: gl.constexpr, NUM_STAGES: gl.constexpr, GROUP: gl.constexpr,
                                MMA_REGS: gl.constexpr, LOAD_REGS: gl.constexpr):
        a0_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
        a1_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES] + w_desc.block_type.shape, w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=1)  # the producer's expect + the TMA bytes
            mbarrier.init(empty.index(i), count=2)  # both consumers release a slot
        workers = (a_desc, w_desc, a0_bufs, a1_bufs, w_bufs, ready, empty, sx_ptr, sw_ptr, b_ptr, y_ptr, M, N, KB,
                   H, group_rows, stride_sxm, stride_swn, stride_ym, HAS_BIAS, TILED, TWO_RUNS, NUM_STAGES, GROUP)
        gl.warp_specialize([
            (_mma_partition, (a0_bufs, w_bufs, ready, empty, sx_ptr, sw_ptr, b_ptr, y_ptr, M, N, KB, H, stride_sxm,
                              stride_swn, stride_ym, 0, HAS_BIAS, TWO_RUNS, NUM_STAGES, GROUP)),
            (_upper_rows, workers),
            (_load_partition, workers),
        ], [4, 1], [MMA_REGS, LOAD_REGS])


def available(device: torch.device) -> bool:
    """Gluon's Hopper API is importable and `device` is a Hopper GPU (wgmma: compute capability 9.x)."""
    return _GLUON and device.type == "cuda" and _capability(device.index)[0] == 9


@functools.cache
def _capability(index) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def takes(a: torch.Tensor, w_q: torch.Tensor, y: torch.Tensor, kb: int, uniform: bool) -> bool:
    """Whether this kernel computes `fp8_linear.linear_fp8_quantized`'s y here (module doc; else the Triton
    kernel: the same bits)."""
    if a.shape[0] < MIN_ROWS or not uniform or not available(a.device) or a.shape[1] != kb * BLOCK_K:
        return False
    if w_q.dim() == 4:  # tiled: whole tiles, 128-byte rows
        w_ok = w_q.stride()[1:] == (BLOCK_K * BLOCK_K, BLOCK_K, 1) and w_q.stride(0) % BLOCK_K == 0
    else:
        w_ok = w_q.dim() == 2 and w_q.stride(1) == 1
    return w_ok and a.stride(1) == 1 and y.stride(1) == 1 and _aligned(a) and _aligned(w_q)


def _desc(t: torch.Tensor, shape, strides, block) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv)
    return TensorDescriptor(t, list(shape), list(strides), list(block), layout)


@functools.cache
def _num_sms(index) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def gemm(a: torch.Tensor, sa: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
         y: torch.Tensor, kb: int, h: int) -> torch.Tensor:
    """y [M, N] = the FP8 GEMM of fp8 a [M, K] (fp32 scales sa [M, KB]) and w_q ([N, K] or tiled, per-row block
    scales w_scale [N, KB], UNIFORM) in K runs [0, h) and [h, kb) (h == kb: one run), + bias; callers check
    `takes` first."""
    import triton

    m, n = y.shape
    a_desc = _desc(a, a.shape, a.stride(), [64, BLOCK_K])
    if w_q.dim() == 4:  # 128-byte rows: group g's K block j, row r is row g * group_rows + j * 128 + r
        group_rows = w_q.stride(0) // BLOCK_K
        rows = (w_q.shape[0] - 1) * group_rows + w_q.shape[1] * BLOCK_K
        w_desc = _desc(w_q, (rows, BLOCK_K), (BLOCK_K, 1), [BLOCK_N, BLOCK_K])
    else:
        group_rows = 0
        w_desc = _desc(w_q, w_q.shape, w_q.stride(), [BLOCK_N, BLOCK_K])
    tiles = triton.cdiv(m, 128) * triton.cdiv(n, BLOCK_N)
    grid = (min(tiles, _num_sms(a.device.index)),)  # persistent: a CTA per SM walks the tiles
    fp8_prefill_gemm_kernel[grid](
        a_desc, w_desc, sa, w_scale, bias if bias is not None else w_scale, y, m, n, kb, h, group_rows,
        sa.stride(0), w_scale.stride(0), y.stride(0), HAS_BIAS=bias is not None, TILED=w_q.dim() == 4,
        TWO_RUNS=h < kb, NUM_STAGES=STAGES, GROUP=GROUP_M, MMA_REGS=CONSUMER_REGS, LOAD_REGS=PRODUCER_REGS,
        num_warps=4, maxnreg=MAXNREG)
    return y
