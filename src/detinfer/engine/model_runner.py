"""Model runner: one scheduler step -> tensors -> the model over the paged KV cache -> logits.

For a `ScheduledBatch` it packs every scheduled chunk's tokens into one [T] vector (positions, KV slots),
builds the attention metadata (block tables [S, W], kv_lens [S], cu_q_lens [S+1]), runs the model with an
`attn` callable that writes each layer's new K/V into the pool (`write_kv`) BEFORE attending, and returns
the fp32 logits of the positions the scheduler asked logits for (`num_logits` trailing positions of each
chunk), in batch order.

Attention backend: the Triton kernels (`paged_attention` in deterministic mode, `paged_attention_fast` in
fast mode) on CUDA, and on CPU when Triton's interpreter is on (tests); otherwise, or for a head_dim the
kernels do not take (e.g. stories260k's 8), the pure-torch `paged_attention_ref` + `write_kv_ref`, which
are batch-invariant by construction and so keep deterministic mode's guarantee.

CUDA graphs (CUDA, kernel backend, unless enforce_eager): steps whose chunks are all one token long
(decodes) replay a graph captured for the smallest capture size >= the batch (1, 2, 4, 8, then multiples
of 16 up to max_num_seqs). Padding rows get slot -1 (write_kv skips them), q_len 0 and kv_len 0, so
attention leaves their output rows alone and reads no key for them. Every op of the model is row-wise
or batch-invariant in deterministic mode, so a real row computes the same bits in a graph of any size
as in an eager step of its own batch; graphs capture with max_kv_len = the block table's capacity, which
changes the attention kernel's grid but not its split boundaries (fixed `split_size` anchored at key 0).
In fast mode the same padding is used, but its kernels pick work splits from the batch shape, so bits
may move with the graph size: that is what fast mode trades for speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from detinfer.cache.paged_kv import KVCacheSpec, allocate_kv_cache, num_blocks_for_bytes
from detinfer.engine.config import EngineConfig
from detinfer.engine.scheduler import ScheduledBatch
from detinfer.kernels._launch import KERNEL_DTYPES, interpreting
from detinfer.kernels.attention import (
    SUPPORTED_HEAD_DIMS,
    paged_attention,
    paged_attention_fast,
    paged_attention_ref,
)
from detinfer.kernels.kv_write import write_kv, write_kv_ref
from detinfer.models.config import ModelConfig
from detinfer.models.transformer import Transformer

ATTENTION_BACKENDS = ("auto", "kernel", "ref")
# KV pool on CPU when num_kv_blocks is not given: CPU runs are tests and small models, so a fixed budget
# (capped at what max_num_seqs full-length sequences can use) rather than a fraction of host memory.
CPU_KV_CACHE_BYTES = 1 << 30
# GPU memory kept out of the KV pool for CUDA graphs' private pool and static buffers (decode steps of at
# most max_num_seqs tokens need far less than the profiled prefill step, but the pools are separate).
GRAPH_RESERVE_BYTES = 1 << 30


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes that get a CUDA graph: 1, 2, 4, 8, then every multiple of 16, up to and
    including max_num_seqs. A batch of n runs in the smallest size >= n."""
    sizes = {b for b in (1, 2, 4, 8) if b < max_num_seqs} | set(range(16, max_num_seqs, 16)) | {max_num_seqs}
    return sorted(sizes)


@dataclass(frozen=True)
class StepInputs:
    """Device tensors of one step (the same for every layer)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64; -1: padding row, nothing written
    block_tables: torch.Tensor  # [S, W] int32
    kv_lens: torch.Tensor  # [S] int32, keys per sequence including this step's
    cu_q_lens: torch.Tensor  # [S + 1] int32
    max_q_len: int  # host-side bounds: no device->host sync needed to size the grid
    max_kv_len: int


@dataclass(frozen=True)
class HostStep:
    """A step's metadata as Python lists, built from a ScheduledBatch (see `ModelRunner.host_step`)."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    kv_lens: list[int]
    block_tables: list[tuple[int, ...]]
    logit_rows: list[int]  # rows of the packed tokens whose logits are returned, in order

    @property
    def all_single_token(self) -> bool:
        return all(n == 1 for n in self.query_lens)


class PagedAttention:
    """The model's `attn(layer_idx, q, k, v)` for one step: write this step's K/V into the layer's pools,
    then attend over the pools. `out` (graphs) is a fixed buffer the kernel writes the real rows of."""

    def __init__(self, kv_cache, meta: StepInputs, attend, write, scale: float, out: torch.Tensor | None):
        self.kv_cache, self.meta, self.attend, self.write = kv_cache, meta, attend, write
        self.scale, self.out = scale, out

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m = self.meta
        k_cache, v_cache = self.kv_cache[layer_idx]
        # validate=False: the metadata comes from the scheduler's checked state, and value checks would
        # cost a device->host sync per layer (and are impossible under graph capture).
        self.write(k, v, k_cache, v_cache, m.slot_mapping, validate=False)
        kwargs = {} if self.out is None else {"out": self.out}
        return self.attend(q, k_cache, v_cache, m.block_tables, m.kv_lens, m.cu_q_lens, self.scale,
                           max_q_len=m.max_q_len, max_kv_len=m.max_kv_len, validate=False, **kwargs)


class ModelRunner:
    """Owns the KV pools (and CUDA graphs) of one model; `execute(batch)` runs one step."""

    def __init__(self, model: Transformer, model_config: ModelConfig, config: EngineConfig,
                 num_kv_blocks: int | None = None, *, attention_backend: str = "auto"):
        if config.max_model_len is None:
            raise ValueError("ModelRunner needs config.max_model_len resolved, got None")
        if model.ops.mode != config.mode:
            raise ValueError(f"the model was built with Ops({model.ops.mode!r}) but the engine mode is "
                             f"{config.mode!r}")
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
        self.model, self.model_config, self.config = model, model_config, config
        self.device, self.dtype = model.embed_tokens.device, model.embed_tokens.dtype
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        kernel_ok = ((self.device.type == "cuda" or (interpreting() and self.dtype == torch.float32))
                     and model_config.head_dim in SUPPORTED_HEAD_DIMS and self.dtype in KERNEL_DTYPES)
        if attention_backend == "kernel" and not kernel_ok:
            raise ValueError(f"the Triton attention kernels cannot run here (device {self.device}, dtype "
                             f"{self.dtype}, head_dim {model_config.head_dim}; kernels take head_dim in "
                             f"{SUPPORTED_HEAD_DIMS} on CUDA, or fp32 on CPU under TRITON_INTERPRET=1)")
        self.backend = ("kernel" if kernel_ok else "ref") if attention_backend == "auto" else attention_backend
        if self.backend == "kernel":
            self._attend = paged_attention if config.mode == "deterministic" else paged_attention_fast
            self._write = write_kv
        else:
            self._attend, self._write = paged_attention_ref, write_kv_ref
        self.num_kv_blocks = self._pick_num_blocks() if num_kv_blocks is None else num_kv_blocks
        if self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        spec = KVCacheSpec(self.num_kv_blocks, self.block_size, model_config.num_key_value_heads,
                           model_config.head_dim, self.dtype)
        self.kv_cache = allocate_kv_cache(spec, model_config.num_hidden_layers, self.device)
        self.use_graphs = self.device.type == "cuda" and not config.enforce_eager and self.backend == "kernel"
        self.graph_sizes = graph_batch_sizes(config.max_num_seqs) if self.use_graphs else []
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.use_graphs:
            self._capture_graphs()

    # -- host-side packing ---------------------------------------------------------------------------
    def host_step(self, batch: ScheduledBatch) -> HostStep:
        ids, pos, slots, q_lens, kv_lens, tables, rows = [], [], [], [], [], [], []
        offset = 0
        for item in batch.scheduled:
            n = item.query_len
            if len(item.block_table) * self.block_size < item.context_len:
                raise RuntimeError(f"sequence {item.seq.seq_id}: {len(item.block_table)} blocks cannot hold "
                                   f"{item.context_len} tokens")
            ids.extend(item.token_ids)
            pos.extend(item.positions)
            slots.extend(item.slot_mapping())
            q_lens.append(n)
            kv_lens.append(item.context_len)
            tables.append(item.block_table)
            rows.extend(range(offset + n - item.num_logits, offset + n))
            offset += n
        return HostStep(ids, pos, slots, q_lens, kv_lens, tables, rows)

    # -- execution -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run one step; returns logits [R, V] fp32 for the R requested positions, in batch order. The
        tensor may be a view of a graph's static buffer: use it before the next `execute`."""
        if batch.is_empty:
            raise ValueError("execute: the batch is empty")
        host = self.host_step(batch)
        if self.use_graphs and host.all_single_token and len(host.query_lens) <= self.graph_sizes[-1]:
            return self._run_graph(host)
        return self._run_eager(host)

    def _run_eager(self, host: HostStep) -> torch.Tensor:
        dev = self.device
        width = max(len(t) for t in host.block_tables)
        cu = [0]
        for n in host.query_lens:
            cu.append(cu[-1] + n)
        meta = StepInputs(
            input_ids=torch.tensor(host.token_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(host.positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(host.slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor([list(t) + [0] * (width - len(t)) for t in host.block_tables],
                                      dtype=torch.int32, device=dev),
            kv_lens=torch.tensor(host.kv_lens, dtype=torch.int32, device=dev),
            cu_q_lens=torch.tensor(cu, dtype=torch.int32, device=dev),
            max_q_len=max(host.query_lens), max_kv_len=max(host.kv_lens))
        attn = PagedAttention(self.kv_cache, meta, self._attend, self._write, self.model_config.softmax_scale,
                              None)
        hidden = self.model(meta.input_ids, meta.positions, attn)
        if not host.logit_rows:
            return torch.empty((0, self.model_config.vocab_size), dtype=torch.float32, device=dev)
        if len(host.logit_rows) != hidden.shape[0]:
            hidden = hidden[torch.tensor(host.logit_rows, dtype=torch.int64, device=dev)]
        return self.model.compute_logits(hidden)

    # -- CUDA graphs ---------------------------------------------------------------------------------
    def _capture_graphs(self) -> None:
        cfg, dev = self.model_config, self.device
        bmax, width = self.graph_sizes[-1], self.max_blocks_per_seq
        self._g_i64 = torch.zeros((3, bmax), dtype=torch.int64, device=dev)  # ids, positions, slots
        self._g_i64[2].fill_(-1)
        self._g_kv = torch.zeros(bmax, dtype=torch.int32, device=dev)
        self._g_cu = torch.zeros(bmax + 1, dtype=torch.int32, device=dev)
        self._g_bt = torch.zeros((bmax, width), dtype=torch.int32, device=dev)
        # Attention output rows of padding are never written: zeroed once so they never hold NaN garbage.
        self._g_out = torch.zeros((bmax, cfg.num_attention_heads, cfg.head_dim), dtype=self.dtype, device=dev)
        self._g_logits = torch.zeros((bmax, cfg.vocab_size), dtype=torch.float32, device=dev)
        pool = None
        with torch.inference_mode():
            for b in reversed(self.graph_sizes):  # largest first: the others fit in its memory pool
                meta = StepInputs(self._g_i64[0, :b], self._g_i64[1, :b], self._g_i64[2, :b], self._g_bt[:b],
                                  self._g_kv[:b], self._g_cu[:b + 1], max_q_len=1,
                                  max_kv_len=width * self.block_size)
                attn = PagedAttention(self.kv_cache, meta, self._attend, self._write, cfg.softmax_scale,
                                      self._g_out[:b])

                def forward(b=b, meta=meta, attn=attn):
                    hidden = self.model(meta.input_ids, meta.positions, attn)
                    self._g_logits[:b].copy_(self.model.compute_logits(hidden))

                forward()  # all rows are padding here; compiles and autotunes outside the capture
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    forward()
                pool = graph.pool() if pool is None else pool
                self._graphs[b] = graph
        torch.cuda.synchronize(dev)

    def _run_graph(self, host: HostStep) -> torch.Tensor:
        n = len(host.query_lens)
        b = next(s for s in self.graph_sizes if s >= n)
        pad = b - n
        width = self.max_blocks_per_seq
        i64 = torch.tensor([host.token_ids + [0] * pad, host.positions + [0] * pad, host.slots + [-1] * pad],
                           dtype=torch.int64)
        tables = [list(t[:width]) + [0] * (width - len(t)) for t in host.block_tables] + [[0] * width] * pad
        self._g_i64[:, :b].copy_(i64, non_blocking=True)
        self._g_kv[:b].copy_(torch.tensor(host.kv_lens + [0] * pad, dtype=torch.int32), non_blocking=True)
        # Real rows have one query each; padding sequences have none (cu_q_lens stays at n).
        self._g_cu[:b + 1].copy_(torch.tensor(list(range(n + 1)) + [n] * pad, dtype=torch.int32),
                                 non_blocking=True)
        self._g_bt[:b].copy_(torch.tensor(tables, dtype=torch.int32), non_blocking=True)
        self._graphs[b].replay()
        if host.logit_rows == list(range(n)):
            return self._g_logits[:n]
        return self._g_logits[torch.tensor(host.logit_rows, dtype=torch.int64, device=self.device)]

    # -- KV pool sizing ------------------------------------------------------------------------------
    def _blocks_per_byte_budget(self, budget: int) -> int:
        cfg = self.model_config
        return num_blocks_for_bytes(max(0, int(budget)), block_size=self.block_size,
                                    num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                                    dtype=self.dtype, num_layers=cfg.num_hidden_layers)

    def _pick_num_blocks(self) -> int:
        """num_kv_blocks when the config gives none. CPU: CPU_KV_CACHE_BYTES, capped at what max_num_seqs
        full-length sequences can use. CUDA: gpu_memory_utilization x total memory, minus what is in use
        (weights, CUDA context, other processes), minus the peak activations of a profiled worst-case step
        (max_num_batched_tokens tokens, then logits + sampling for max_num_seqs rows), minus
        GRAPH_RESERVE_BYTES when graphs are on."""
        useful = self.config.max_num_seqs * self.max_blocks_per_seq
        if self.device.type != "cuda":
            return max(self.max_blocks_per_seq, min(useful, self._blocks_per_byte_budget(CPU_KV_CACHE_BYTES)))
        peak = self._profile_peak_bytes()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        reserve = GRAPH_RESERVE_BYTES if (not self.config.enforce_eager and self.backend == "kernel") else 0
        budget = self.config.gpu_memory_utilization * total - (total - free) - peak - reserve
        blocks = self._blocks_per_byte_budget(budget)
        if blocks < self.max_blocks_per_seq:
            raise ValueError(
                f"not enough GPU memory for the KV cache: {budget / 2**30:.2f} GiB left after weights "
                f"({(total - free) / 2**30:.2f} GiB in use) and activations ({peak / 2**30:.2f} GiB) gives "
                f"{blocks} blocks, fewer than one max_model_len={self.config.max_model_len} sequence needs "
                f"({self.max_blocks_per_seq}); raise gpu_memory_utilization, lower max_model_len or "
                "max_num_batched_tokens, or set num_kv_blocks")
        return min(blocks, max(useful, self.max_blocks_per_seq))

    @torch.inference_mode()
    def _profile_peak_bytes(self) -> int:
        """Peak extra device memory of the largest eager step plus sampling (its temporaries only)."""
        from detinfer.engine.sampler import sample
        from detinfer.engine.sampling_params import SamplingParams

        cfg, dev, bs = self.model_config, self.device, self.block_size
        total = self.config.max_num_batched_tokens
        longest = min(total, self.config.max_model_len)
        lens = [longest] * (total // longest) + ([total % longest] if total % longest else [])
        tables, next_block = [], 0
        for n in lens:
            k = -(-n // bs)
            tables.append(list(range(next_block, next_block + k)))
            next_block += k
        spec = KVCacheSpec(next_block, bs, cfg.num_key_value_heads, cfg.head_dim, self.dtype)
        saved, self.kv_cache = getattr(self, "kv_cache", None), allocate_kv_cache(spec, cfg.num_hidden_layers, dev)
        rows = min(self.config.max_num_seqs, total)
        host = HostStep(
            token_ids=[i % cfg.vocab_size for i in range(total)],
            positions=[p for n in lens for p in range(n)],
            slots=[t[p // bs] * bs + p % bs for t, n in zip(tables, lens) for p in range(n)],
            query_lens=lens, kv_lens=lens, block_tables=[tuple(t) for t in tables],
            logit_rows=list(range(total - rows, total)))
        try:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            logits = self._run_eager(host)
            params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50)] * rows
            sample(logits, params, [0] * rows, [0] * rows)
            torch.cuda.synchronize(dev)
            return torch.cuda.max_memory_allocated(dev) - base
        finally:
            self.kv_cache = saved
