"""Model runner: one scheduler step -> tensors -> the model over the paged KV cache -> logits.

For a `ScheduledBatch` it turns the batch's one layout (`batch.layout`: packed tokens, positions, KV
slots, block tables, logits rows; see `cache.layout`) into tensors (`cache.paged_kv.step_tensors`), runs
the model with an `attn` callable that writes each layer's new K/V into the pool BEFORE attending (in the
attention prologue's launch where the kernels run: `PagedAttention.prologue`), and returns the fp32 logits
of the layout's logits rows, in batch order.

Every numeric op, attention and the KV write included, is the model's numerics backend (`model.ops`, see
`detinfer.ops.backend`, which also says when attention runs the Triton kernels and when the pure-torch
`paged_attention_ref` + `write_kv_ref`); the runner only checks that it matches the engine's mode.

CUDA graphs (CUDA, kernel backend, unless enforce_eager): a step that fits a captured shape replays its
graph, padded to it (`engine.cuda_graphs` has the shapes, the padding, why padding moves no bit in
deterministic mode, and the capture); any other step runs eagerly. Under tensor parallelism every rank's
runner captures the same graphs, collectives inside (`tp_group`, engine/tp_runner.py).
"""

from __future__ import annotations

import dataclasses

import torch

from detinfer.cache.layout import StepLayout
from detinfer.cache.paged_kv import (
    KVCacheSpec,
    allocate_kv_cache,
    num_blocks_for_bytes,
    step_tensors,
    upload,
)
from detinfer.cache.releasable import ReleasableKV
from detinfer.engine.config import EngineConfig
from detinfer.engine.cuda_graphs import (
    GraphShape,
    StepGraphs,
    StepInputs,
    decode_batch_sizes,
    graph_shapes,
    local_vocab,
    mixed_token_sizes,
    padded_logits,
    pick_shape,
    static_buffer_bytes,
)
from detinfer.engine.paged_attention import PagedAttention
from detinfer.engine.sampler import sample
from detinfer.engine.sampling_params import SamplingParams
from detinfer.engine.scheduler import ScheduledBatch
from detinfer.models.config import ModelConfig
from detinfer.models.fp8 import lay_out_fp8_linears
from detinfer.models.transformer import Transformer

# KV pool on CPU when num_kv_blocks is not given: CPU runs are tests and small models, so a fixed budget
# (capped at what max_num_seqs full-length sequences can use) rather than a fraction of host memory.
CPU_KV_CACHE_BYTES = 1 << 30
# GPU memory kept out of the KV pool for CUDA graphs on top of what is measured (the profiled peak of the
# largest graphed step, which is what its capture allocates in the graphs' private pool, plus the static
# buffers): allocator rounding in the private pool, and attention workspaces a graph sizes from the table
# capacity where the profiled eager step sized them from its own lengths.
GRAPH_RESERVE_SLACK_BYTES = 256 << 20
# The private pool of many graphs of different sizes is larger than one step's allocation peak: segments
# are rounded and split per size, and graphs of other sizes reuse them only partly. Measured on an H100
# (Qwen3-8B shapes, 20 decode + 20 mixed graphs up to 2048 tokens): pool 570 MiB for a profiled peak of
# 256 MiB (2.2x); decode graphs alone: 278 MiB for 225 MiB (1.24x). Measured before the short-KV decode
# graphs (a second graph per decode batch size): each allocates no more than the capacity graph of its batch
# size (one split, no split-parallel workspace) and is captured right after it into the same pool.
GRAPH_POOL_FACTOR = 2.5



class ModelRunner:
    """Owns the KV pools (and CUDA graphs) of one model; `execute(batch)` runs one step."""

    def __init__(self, model: Transformer, model_config: ModelConfig, config: EngineConfig,
                 num_kv_blocks: int | None = None, tp_group=None):
        """`tp_group` (a `distributed.group.TPGroup`): this runner is one rank of tensor parallelism. Every
        rank then builds its runner at the same time, in lockstep: the profiling steps and the graphs'
        warm-up steps run the model's collectives, the KV block count is agreed (the smallest any rank can
        allocate) BEFORE the pools are allocated and the graphs capture their addresses, and every rank
        captures the same shapes in the same order."""
        if config.max_model_len is None:
            raise ValueError("ModelRunner needs config.max_model_len resolved, got None")
        ops = model.ops
        if ops.mode != config.mode:
            raise ValueError(f"the model was built with Ops({ops.mode!r}) but the engine mode is "
                             f"{config.mode!r}; switch it with model.set_ops(model.ops.replace(mode=...))")
        self.model, self.model_config, self.config, self.ops = model, model_config, config, ops
        self.device, self.dtype = model.embed_tokens.device, model.embed_tokens.dtype
        lay_out_fp8_linears(model, ops)  # FP8 weights in the layout ops' kernel reads fastest (models/fp8.py)
        if (ops.device.type, ops.dtype, ops.head_dim) != (self.device.type, self.dtype, model_config.head_dim):
            raise ValueError(f"the model's Ops were chosen for {ops.device.type} {ops.dtype} head_dim "
                             f"{ops.head_dim}, but its weights are {self.device.type} {self.dtype} and its "
                             f"head_dim {model_config.head_dim}: build them with Ops(mode, device, dtype, "
                             "head_dim=...)")
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        # An MoE layer on a host-syncing path (fast mode's stock loop) cannot be captured: eager steps then.
        moe_ok = not model_config.num_experts or ops.moe_graph_safe
        self.use_graphs = (self.device.type == "cuda" and not config.enforce_eager and self.backend == "kernel"
                           and moe_ok)
        # Shapes are fixed by the config alone (the CPU padding tests use them with graphs off).
        self.graph_sizes = decode_batch_sizes(config.max_num_seqs)
        self.mixed_graph_tokens = mixed_token_sizes(min(config.cuda_graph_max_tokens,
                                                        config.max_num_batched_tokens))
        self.kv_capacity = self.max_blocks_per_seq * self.block_size  # tokens a block table row covers
        shapes = graph_shapes(self.graph_sizes, self.mixed_graph_tokens, config.max_num_seqs, self.kv_capacity,
                              short_kv=config.cuda_graph_short_kv)
        self._shapes = {s.key: s for s in shapes}
        self.graph_reserve_bytes = self.graph_step_peak_bytes = 0  # set by _pick_num_blocks (KV pool sizing)
        self.tp_group = tp_group
        self.num_kv_blocks = self._pick_num_blocks() if num_kv_blocks is None else num_kv_blocks
        if tp_group is not None:  # one block table must be valid on every rank
            self.num_kv_blocks = tp_group.agree_min(self.num_kv_blocks)
        if self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        spec = KVCacheSpec(self.num_kv_blocks, self.block_size, model_config.num_key_value_heads,
                           model_config.head_dim, self.dtype)
        self._kv = ReleasableKV(spec, model_config.num_hidden_layers, self.device) \
            if config.releasable_kv_cache else None
        self.kv_cache = allocate_kv_cache(spec, model_config.num_hidden_layers, self.device) \
            if self._kv is None else self._kv.pools
        self.graphs: StepGraphs | None = None
        if self.use_graphs:
            self.graphs = StepGraphs(self, shapes)
            self.graphs.capture()

    # -- the KV pool's memory, handed back and taken again (config.releasable_kv_cache) -----------------------
    @property
    def kv_released(self) -> bool:
        return self._kv is not None and self._kv.released

    def release_kv_cache(self) -> None:
        """Give the KV pool's memory back; the engine drops its prefix cache first and steps nothing until
        `restore_kv_cache` (graphs captured on the pool stay valid: same addresses after the restore)."""
        if self._kv is None:
            raise RuntimeError("release_kv_cache: this engine's KV pool is not releasable; build it with "
                               "releasable_kv_cache=True")
        self._kv.release()
        self.kv_cache = self._kv.pools

    def restore_kv_cache(self) -> None:
        if self._kv is not None:
            self._kv.restore()
            self.kv_cache = self._kv.pools

    @property
    def backend(self) -> str:
        """Which attention implementation the model's Ops run: "kernel" (Triton) or "ref"."""
        return self.ops.attention_impl

    # -- execution -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None,
                argmax_only: bool = False) -> torch.Tensor:
        """Run one step; returns logits [R, V] fp32 for the R rows of `batch.layout.logit_rows`, in batch
        order, or with `argmax_only` each row's argmax [R] int64 (`Transformer.greedy_ids`: what argmax of
        the logits gives, without gathering tensor-parallel logits). The tensor may be a view of a graph's
        static buffer: use it before the next `execute`.
        `input_ids` ([T] int64 on the device), when given, replaces the layout's token ids (overlapped
        scheduling: some were sampled by the previous step and never came to the host). On CUDA nothing
        here waits for the device: host data goes up through pinned memory with non-blocking copies."""
        if batch.is_empty:
            raise ValueError("execute: the batch is empty")
        if self.kv_released:  # the pool has no memory behind it: a kernel would fault
            raise RuntimeError("execute: the KV cache is released (release_kv_cache); restore it first")
        if self.model.ops is not self.ops:  # graphs and the KV pools were set up for self.ops
            raise RuntimeError("the model's Ops were switched after this engine was built; build a new engine "
                               "for the other backend")
        layout = batch.layout
        shape = self.graph_shape(layout) if self.use_graphs else None
        if shape is not None:
            return self._run_graph(layout, shape, input_ids, argmax_only)
        return self._run_eager(layout, input_ids, argmax_only)

    def graph_shape(self, layout: StepLayout) -> GraphShape | None:
        """The captured shape this step replays (None: it runs eagerly), whether or not graphs are on."""
        return pick_shape(layout, self._shapes, self.graph_sizes, self.mixed_graph_tokens, self.kv_capacity)

    def _run_eager(self, layout: StepLayout, input_ids: torch.Tensor | None = None,
                   argmax_only: bool = False) -> torch.Tensor:
        dev = self.device
        meta = step_tensors(layout, dev)
        if input_ids is not None:
            meta = dataclasses.replace(meta, input_ids=input_ids)
        attn = PagedAttention(self.kv_cache, meta, self.ops, self.model_config.softmax_scale, None)
        hidden = self.model(meta.input_ids, meta.positions, attn)
        if not layout.logit_rows:  # (the same on every tensor-parallel rank: none calls a collective)
            if argmax_only:
                return torch.empty(0, dtype=torch.int64, device=dev)
            return torch.empty((0, self.model_config.vocab_size), dtype=torch.float32, device=dev)
        if len(layout.logit_rows) != hidden.shape[0]:
            hidden = hidden[upload(layout.logit_rows, torch.int64, dev)]
        local = self.model.local_logits(hidden)
        return self.model.greedy_ids(local) if argmax_only else self.model.gather_logits(local)

    def _run_graph(self, layout: StepLayout, shape: GraphShape, input_ids: torch.Tensor | None = None,
                   argmax_only: bool = False) -> torch.Tensor:
        return self.graphs.run(layout, shape, input_ids, argmax_only)

    @torch.inference_mode()
    def run_padded_eager(self, layout: StepLayout, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Test hook: the step with the inputs and forward of its graph (`StepInputs.fill` into buffers of
        its shape, `padded_logits`), run eagerly; returns the real rows' logits. Proves on any device that
        the padding is harmless."""
        shape = self.graph_shape(layout)
        if shape is None:
            raise ValueError(f"no graph shape holds this step ({layout.num_tokens} tokens, "
                             f"{len(layout.query_lens)} sequences, {len(layout.logit_rows)} logits rows)")
        meta, rows = StepInputs([shape], self.max_blocks_per_seq, self.device).fill(layout, shape, input_ids)
        return padded_logits(self, meta, rows)[:len(layout.logit_rows)]

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
        (max_num_batched_tokens tokens, then logits + sampling for max_num_seqs rows), minus, when graphs
        are on, `_graph_reserve_bytes`."""
        useful = self.config.max_num_seqs * self.max_blocks_per_seq
        if self.device.type != "cuda":
            return max(self.max_blocks_per_seq, min(useful, self._blocks_per_byte_budget(CPU_KV_CACHE_BYTES)))
        peak = self._profile_peak_bytes()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        reserve = self._graph_reserve_bytes(peak) if self.use_graphs else 0
        self.graph_reserve_bytes = reserve
        budget = self.config.gpu_memory_utilization * total - (total - free) - peak - reserve
        blocks = self._blocks_per_byte_budget(budget)
        if blocks < self.max_blocks_per_seq:
            raise ValueError(
                f"not enough GPU memory for the KV cache: {budget / 2**30:.2f} GiB left after weights "
                f"({(total - free) / 2**30:.2f} GiB in use), activations ({peak / 2**30:.2f} GiB) and CUDA "
                f"graphs ({reserve / 2**30:.2f} GiB; lower cuda_graph_max_tokens) gives "
                f"{blocks} blocks, fewer than one max_model_len={self.config.max_model_len} sequence needs "
                f"({self.max_blocks_per_seq}); raise gpu_memory_utilization, lower max_model_len or "
                "max_num_batched_tokens, or set num_kv_blocks")
        return min(blocks, max(useful, self.max_blocks_per_seq))

    def _graph_reserve_bytes(self, step_peak: int) -> int:
        """What the CUDA graphs take: their private pool holds what the largest graphed step allocates
        (profiled like the eager worst case, without sampling: reused when that step is the same size)
        times GRAPH_POOL_FACTOR, plus the static buffers and GRAPH_RESERVE_SLACK_BYTES. After capture the
        pool's real size is logged against this (`StepGraphs.capture`)."""
        cfg, shapes = self.model_config, list(self._shapes.values())
        tokens = max(s.tokens for s in shapes)
        self.graph_step_peak_bytes = step_peak if tokens >= self.config.max_num_batched_tokens else \
            self._profile_peak_bytes(tokens, sample_rows=False)
        elem = torch.empty((), dtype=self.dtype).element_size()
        return int(GRAPH_POOL_FACTOR * self.graph_step_peak_bytes) + GRAPH_RESERVE_SLACK_BYTES \
            + static_buffer_bytes(shapes, self.max_blocks_per_seq, cfg.q_size, cfg.vocab_size, elem,
                                  local_vocab(self.model), cfg.quantization == "fp8")

    @torch.inference_mode()
    def _profile_peak_bytes(self, total: int | None = None, sample_rows: bool = True) -> int:
        """Peak extra device memory of an eager step of `total` tokens (default max_num_batched_tokens)
        with logits for min(max_num_seqs, total) rows, plus sampling them (its temporaries only)."""
        cfg, dev, bs = self.model_config, self.device, self.block_size
        total = self.config.max_num_batched_tokens if total is None else total
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
            if sample_rows:
                params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50)] * rows
                sample(logits, params, [0] * rows, [0] * rows)
            torch.cuda.synchronize(dev)
            return torch.cuda.max_memory_allocated(dev) - base
        finally:
            self.kv_cache = saved
