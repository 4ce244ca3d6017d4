"""Model runner: one scheduler step -> tensors -> the model over the paged KV cache -> logits.

For a `ScheduledBatch` it turns the batch's one layout (`batch.layout`: packed tokens, positions, KV
slots, block tables, logits rows; see `cache.layout`) into tensors (`cache.paged_kv.step_tensors`), runs
the model with an `attn` callable that writes each layer's new K/V into the pool BEFORE attending, and
returns the fp32 logits of the layout's logits rows, in batch order.

Every numeric op, attention and the KV write included, is the model's numerics backend (`model.ops`, see
`detinfer.ops.backend`, which also says when attention runs the Triton kernels and when the pure-torch
`paged_attention_ref` + `write_kv_ref`); the runner only checks that it matches the engine's mode.

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

import dataclasses

import torch

from detinfer.cache.layout import StepLayout
from detinfer.cache.paged_kv import (
    KVCacheSpec,
    StepMetadata,
    allocate_kv_cache,
    num_blocks_for_bytes,
    staged,
    step_tensors,
    upload,
)
from detinfer.engine.config import EngineConfig
from detinfer.engine.scheduler import ScheduledBatch
from detinfer.models.config import ModelConfig
from detinfer.models.transformer import Transformer
from detinfer.ops import Ops

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


class PagedAttention:
    """The model's `attn(layer_idx, q, k, v)` for one step: write this step's K/V into the layer's pools,
    then attend over the pools (both through the numerics backend). `out` (graphs) is a fixed buffer the
    kernel writes the real rows of."""

    def __init__(self, kv_cache, meta: StepMetadata, ops: Ops, scale: float, out: torch.Tensor | None):
        self.kv_cache, self.meta, self.ops = kv_cache, meta, ops
        self.scale, self.out = scale, out

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m = self.meta
        k_cache, v_cache = self.kv_cache[layer_idx]
        # validate=False: the metadata comes from the scheduler's checked state, and value checks would
        # cost a device->host sync per layer (and are impossible under graph capture).
        self.ops.write_kv(k, v, k_cache, v_cache, m.slot_mapping, validate=False)
        return self.ops.paged_attention(q, k_cache, v_cache, m.block_tables, m.kv_lens, m.cu_q_lens, self.scale,
                                        max_q_len=m.max_q_len, max_kv_len=m.max_kv_len, validate=False,
                                        out=self.out)


class ModelRunner:
    """Owns the KV pools (and CUDA graphs) of one model; `execute(batch)` runs one step."""

    def __init__(self, model: Transformer, model_config: ModelConfig, config: EngineConfig,
                 num_kv_blocks: int | None = None):
        if config.max_model_len is None:
            raise ValueError("ModelRunner needs config.max_model_len resolved, got None")
        ops = model.ops
        if ops.mode != config.mode:
            raise ValueError(f"the model was built with Ops({ops.mode!r}) but the engine mode is "
                             f"{config.mode!r}; switch it with model.set_ops(model.ops.replace(mode=...))")
        self.model, self.model_config, self.config, self.ops = model, model_config, config, ops
        self.device, self.dtype = model.embed_tokens.device, model.embed_tokens.dtype
        if (ops.device.type, ops.dtype, ops.head_dim) != (self.device.type, self.dtype, model_config.head_dim):
            raise ValueError(f"the model's Ops were chosen for {ops.device.type} {ops.dtype} head_dim "
                             f"{ops.head_dim}, but its weights are {self.device.type} {self.dtype} and its "
                             f"head_dim {model_config.head_dim}: build them with Ops(mode, device, dtype, "
                             "head_dim=...)")
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        self.num_kv_blocks = self._pick_num_blocks() if num_kv_blocks is None else num_kv_blocks
        if self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        spec = KVCacheSpec(self.num_kv_blocks, self.block_size, model_config.num_key_value_heads,
                           model_config.head_dim, self.dtype)
        self.kv_cache = allocate_kv_cache(spec, model_config.num_hidden_layers, self.device)
        # An MoE layer on a host-syncing path (fast mode's stock loop) cannot be captured: eager steps then.
        moe_ok = not model_config.num_experts or ops.moe_graph_safe
        self.use_graphs = (self.device.type == "cuda" and not config.enforce_eager and self.backend == "kernel"
                           and moe_ok)
        self.graph_sizes = graph_batch_sizes(config.max_num_seqs) if self.use_graphs else []
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.use_graphs:
            self._capture_graphs()

    @property
    def backend(self) -> str:
        """Which attention implementation the model's Ops run: "kernel" (Triton) or "ref"."""
        return self.ops.attention_impl

    # -- execution -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step; returns logits [R, V] fp32 for the R rows of `batch.layout.logit_rows`, in batch
        order. The tensor may be a view of a graph's static buffer: use it before the next `execute`.
        `input_ids` ([T] int64 on the device), when given, replaces the layout's token ids (overlapped
        scheduling: some were sampled by the previous step and never came to the host). On CUDA nothing
        here waits for the device: host data goes up through pinned memory with non-blocking copies."""
        if batch.is_empty:
            raise ValueError("execute: the batch is empty")
        if self.model.ops is not self.ops:  # graphs and the KV pools were set up for self.ops
            raise RuntimeError("the model's Ops were switched after this engine was built; build a new engine "
                               "for the other backend")
        layout = batch.layout
        if self.use_graphs and layout.all_single_token and len(layout.query_lens) <= self.graph_sizes[-1]:
            return self._run_graph(layout, input_ids)
        return self._run_eager(layout, input_ids)

    def _run_eager(self, layout: StepLayout, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        dev = self.device
        meta = step_tensors(layout, dev)
        if input_ids is not None:
            meta = dataclasses.replace(meta, input_ids=input_ids)
        attn = PagedAttention(self.kv_cache, meta, self.ops, self.model_config.softmax_scale, None)
        hidden = self.model(meta.input_ids, meta.positions, attn)
        if not layout.logit_rows:
            return torch.empty((0, self.model_config.vocab_size), dtype=torch.float32, device=dev)
        if len(layout.logit_rows) != hidden.shape[0]:
            hidden = hidden[upload(layout.logit_rows, torch.int64, dev)]
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
                meta = StepMetadata(input_ids=self._g_i64[0, :b], positions=self._g_i64[1, :b],
                                    slot_mapping=self._g_i64[2, :b], block_tables=self._g_bt[:b],
                                    kv_lens=self._g_kv[:b], cu_q_lens=self._g_cu[:b + 1], max_q_len=1,
                                    max_kv_len=width * self.block_size)
                attn = PagedAttention(self.kv_cache, meta, self.ops, cfg.softmax_scale, self._g_out[:b])

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

    def _run_graph(self, layout: StepLayout, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        n = len(layout.query_lens)
        b = next(s for s in self.graph_sizes if s >= n)
        pad = b - n
        width = self.max_blocks_per_seq
        tables = [list(t[:width]) + [0] * (width - len(t)) for t in layout.block_tables] + [[0] * width] * pad
        # Host rows go up from pinned memory (non-blocking copies never wait for the running step).
        dev = self.device
        self._g_i64[:, :b].copy_(staged([layout.token_ids + [0] * pad, layout.positions + [0] * pad,
                                         layout.slots + [-1] * pad], torch.int64, dev), non_blocking=True)
        if input_ids is not None:
            self._g_i64[0, :n].copy_(input_ids)
        self._g_kv[:b].copy_(staged(layout.kv_lens + [0] * pad, torch.int32, dev), non_blocking=True)
        # Real rows have one query each; padding sequences have none (cu_q_lens stays at n).
        self._g_cu[:b + 1].copy_(staged(list(range(n + 1)) + [n] * pad, torch.int32, dev), non_blocking=True)
        self._g_bt[:b].copy_(staged(tables, torch.int32, dev), non_blocking=True)
        self._graphs[b].replay()
        if layout.logit_rows == list(range(n)):
            return self._g_logits[:n]
        return self._g_logits[upload(layout.logit_rows, torch.int64, self.device)]

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
        num_logits, left = [], rows  # logits for the last `rows` packed tokens
        for n in reversed(lens):
            num_logits.insert(0, min(n, left))
            left -= num_logits[0]
        ids = [i % cfg.vocab_size for i in range(total)]
        starts = [sum(lens[:s]) for s in range(len(lens))]
        layout = StepLayout.build(tables, [0] * len(lens), lens, bs, num_logits=num_logits,
                                  token_ids=[ids[a:a + n] for a, n in zip(starts, lens)])
        try:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            logits = self._run_eager(layout)
            params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50)] * rows
            sample(logits, params, [0] * rows, [0] * rows)
            torch.cuda.synchronize(dev)
            return torch.cuda.max_memory_allocated(dev) - base
        finally:
            self.kv_cache = saved
