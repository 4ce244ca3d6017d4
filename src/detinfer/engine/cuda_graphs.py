"""CUDA graphs for engine steps: which captured shape a step replays, how it is padded to it, and capture.

Two families of graphs, one memory pool and one set of static buffers:

- decode graphs, for steps whose chunks are all one token long (decodes, 1-token prefill chunks): per batch
  size (`decode_batch_sizes`), captured with max_q_len = 1 so attention keeps its 16-row decode tiles, and
  with two kv bounds: max_kv_len = the block table's capacity, and max_kv_len = SHORT_KV_TOKENS for steps
  whose sequences all attend to at most that many keys (where the capacity is larger and
  EngineConfig.cuda_graph_short_kv is on). max_kv_len is the host-side bound attention picks its schedule
  and pipeline depth from: with the capacity, a step of short sequences pays the long-walk path
  (split-parallel + merge at small batches, a 3-stage pipeline prologue at large ones).
- mixed graphs, for steps with a prefill chunk: one per token count (`mixed_token_sizes`, up to
  EngineConfig.cuda_graph_max_tokens), the sequence count padded to min(tokens, max_num_seqs) (a step has
  at least one token per sequence), captured with max_q_len = the token count, max_kv_len = the capacity.

A step runs in the smallest shape that holds it (`pick_shape`); `pad_layout` appends padding tokens (id 0,
position 0, KV slot -1: `write_kv` skips them, no sequence owns them, so attention never writes or reads
them) and padding sequences (no query, no key: attention programs for them exit at once), and pads the
logits rows with copies of row 0 (computed, never returned). The logits rows are gathered inside the
graph from a padded index tensor, so the lm_head runs for at most `seqs` rows, never for every token.

Why padding does not move a bit in deterministic mode: every op outside attention is row-wise and
batch-invariant (a row's bits do not depend on the other rows, padding included); attention cuts keys
into fixed `split_size` splits anchored at key 0, so its reduction order depends on neither the grid
nor the bounds a graph is captured with. Those bounds (max_q_len = the token count, max_kv_len = the
table's capacity or SHORT_KV_TOKENS) only change the query-tile height, the number of (empty) programs,
the sequential / split-parallel schedule and the pipeline depth, which the kernel tests prove give the
same bits. Fast mode uses the same padding; its kernels pick work splits from the padded shape and the
kv bound, so its bits may move with the bucket (what fast mode trades for speed).

Mixed steps use whole-step graphs over padded token buckets, not piecewise graphs (every op but attention
captured, attention eager in between): both keep the bits (the argument above), but piecewise graphs
still launch attention and the KV write eagerly in every layer (2 x num_layers launches plus
num_layers + 1 graph launches per step, a few ms of host time for 36 layers), where a whole-step graph is
one launch. What the padded graph costs is GPU time on padding rows (at most 25% of a step above 128
tokens, see `mixed_token_sizes`) and idle attention programs for padding sequences, which exit at once;
large steps are compute-bound, so cuda_graph_max_tokens caps the graphed sizes.

Inputs are refreshed by one host->device copy per buffer (`StepInputs.fill`, through `paged_kv.upload`,
the engine's one upload path: int64 ids/positions/slots/logits rows, int32 kv lens / cu_q_lens, and the
used columns of the block tables); token ids the previous step sampled on the device are copied over the
ids buffer on the device. `ModelRunner.run_padded_eager` runs the same inputs and forward
(`padded_logits`) eagerly, which is how the CPU tests check the padding. Every shape reads the full-width
block table buffer: the kernel reads no column past a sequence's kv length, and its table width is only a
mask bound, so a narrower view for the short graphs would change nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from detinfer.cache.layout import StepLayout, padded_tables
from detinfer.cache.paged_kv import StepMetadata, upload
from detinfer.constants import SHORT_KV_TOKENS  # kv bound of the short decode graphs: one attention split
from detinfer.engine.paged_attention import PagedAttention
from detinfer.kernels.fp8_quant import FP8_DTYPE, QuantizedRows, num_blocks

logger = logging.getLogger(__name__)

# Smallest mixed-step graph: a step with a prefill chunk has >= 2 tokens, and below 16 tokens the padded
# rows cost less than a second graph would take to capture.
MIN_MIXED_TOKENS = 16

# A step with no sequence: padded to a shape, it is all padding (what capture warms up on).
EMPTY_STEP = StepLayout([], [], [], [], [], [], [], [])


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes that get a CUDA graph: 1, 2, 4, 8, then every multiple of 16, up to and
    including max_num_seqs. A batch of n runs in the smallest size >= n."""
    sizes = {b for b in (1, 2, 4, 8) if b < max_num_seqs} | set(range(16, max_num_seqs, 16)) | {max_num_seqs}
    return sorted(sizes)


def mixed_token_sizes(max_tokens: int) -> list[int]:
    """Token counts of steps with prefill chunks that get a CUDA graph: 16, 32, 64, 128, then four sizes
    per doubling (160, 192, 224, 256, 320, ...), up to and including max_tokens (none for 0).

    Doubling up to 128: such steps are launch-bound, padded rows cost ~nothing. From 128 tokens on the
    matmuls start to cost per row, so padding is capped at 25% of the step (quarter-octave steps); that
    keeps the count at 4 graphs per doubling (20 up to 2048), which bounds capture time and memory."""
    if max_tokens <= 0:
        return []
    sizes, n = [], MIN_MIXED_TOKENS
    while n < max_tokens:
        sizes.append(n)
        n = 2 * n if n < 128 else n + (1 << (n.bit_length() - 1)) // 4
    return sizes + [max_tokens]


@dataclass(frozen=True)
class GraphShape:
    """A captured step shape: family ("decode" or "mixed"), token rows, sequences, logits rows, and the
    attention bounds it is captured with: max_q_len (1 for decode graphs, the token count for mixed ones)
    and max_kv_len (the block table's capacity, or SHORT_KV_TOKENS for short-KV decode graphs)."""
    kind: str
    tokens: int
    seqs: int
    logit_rows: int
    max_q_len: int
    max_kv_len: int

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.kind, self.tokens, self.max_kv_len)


def decode_kv_bounds(kv_capacity: int, short_kv: bool = True) -> list[int]:
    """The kv bounds decode graphs are captured with, largest first: the capacity, and SHORT_KV_TOKENS when
    `short_kv` and the capacity is larger (otherwise the capacity already is a short bound)."""
    return [kv_capacity] + ([SHORT_KV_TOKENS] if short_kv and kv_capacity > SHORT_KV_TOKENS else [])


def graph_shapes(decode_sizes: list[int], mixed_sizes: list[int], max_num_seqs: int, kv_capacity: int,
                 short_kv: bool = True) -> list[GraphShape]:
    """Every captured shape: decode graphs per batch size and kv bound (`decode_kv_bounds`), then mixed
    graphs per token count (max_kv_len = `kv_capacity`, the block table's tokens)."""
    shapes = [GraphShape("decode", b, b, b, 1, kv) for kv in decode_kv_bounds(kv_capacity, short_kv)
              for b in decode_sizes]
    for t in mixed_sizes:
        s = min(t, max_num_seqs)
        shapes.append(GraphShape("mixed", t, s, s, t, kv_capacity))
    return shapes


def pick_shape(layout: StepLayout, shapes: dict[tuple[str, int, int], GraphShape], decode_sizes: list[int],
               mixed_sizes: list[int], kv_capacity: int) -> GraphShape | None:
    """The smallest captured shape that holds this step, or None (it runs eagerly). A decode step whose
    sequences all attend to at most SHORT_KV_TOKENS keys (this step's token included) replays the short-KV
    graph of its batch size where there is one."""
    n_tok, n_seq, n_rows = layout.num_tokens, len(layout.query_lens), len(layout.logit_rows)
    if n_seq == 0:
        return None
    if layout.all_single_token:
        size = next((b for b in decode_sizes if b >= n_seq), None)
        short = layout.max_kv_len <= SHORT_KV_TOKENS and ("decode", size, SHORT_KV_TOKENS) in shapes
        shape = None if size is None else shapes[("decode", size, SHORT_KV_TOKENS if short else kv_capacity)]
    else:
        size = next((t for t in mixed_sizes if t >= n_tok), None)
        shape = None if size is None else shapes[("mixed", size, kv_capacity)]
    # Prompt logprobs can ask for more logits rows than the shape gathers: such a step runs eagerly.
    if shape is None or n_seq > shape.seqs or n_rows > shape.logit_rows:
        return None
    return shape


def pad_layout(layout: StepLayout, shape: GraphShape) -> StepLayout:
    """`layout` padded to `shape` (see the module doc); its first rows, sequences and logits rows are the
    real ones, unchanged."""
    pad_t = shape.tokens - layout.num_tokens
    pad_s = shape.seqs - len(layout.query_lens)
    pad_r = shape.logit_rows - len(layout.logit_rows)
    if min(pad_t, pad_s, pad_r) < 0:
        raise ValueError(f"a step of {layout.num_tokens} tokens, {len(layout.query_lens)} sequences and "
                         f"{len(layout.logit_rows)} logits rows does not fit the graph shape {shape}")
    n_rows = len(layout.logit_rows)
    return StepLayout(
        token_ids=layout.token_ids + [0] * pad_t, positions=layout.positions + [0] * pad_t,
        slots=layout.slots + [-1] * pad_t, query_lens=layout.query_lens + [0] * pad_s,
        kv_lens=layout.kv_lens + [0] * pad_s, block_tables=layout.block_tables + [()] * pad_s,
        logit_rows=layout.logit_rows + [0] * pad_r, logits_offsets=layout.logits_offsets + [n_rows] * pad_s)


class StepInputs:
    """The static input buffers of a set of shapes (shared: one step runs at a time) and `fill`, which copies
    a step padded to its shape into them. int64: [ids | positions | slots] of `tokens` rows each, then the
    logits row index; int32: [kv lens | cu_q_lens]; block tables [S, width]."""

    def __init__(self, shapes: list[GraphShape], width: int, device: torch.device):
        sizes = buffer_sizes(shapes, width)
        self.width = width
        self.i64 = torch.zeros(sizes["i64"], dtype=torch.int64, device=device)
        self.i32 = torch.zeros(sizes["i32"], dtype=torch.int32, device=device)
        self.tables = torch.zeros((max(s.seqs for s in shapes), width), dtype=torch.int32, device=device)

    def views(self, shape: GraphShape) -> tuple[StepMetadata, torch.Tensor]:
        """The step metadata and the [logit_rows] row index a step of `shape` reads (views of the buffers)."""
        t, s, r = shape.tokens, shape.seqs, shape.logit_rows
        meta = StepMetadata(cu_q_lens=self.i32[s:2 * s + 1], kv_lens=self.i32[:s], block_tables=self.tables[:s],
                            slot_mapping=self.i64[2 * t:3 * t], max_q_len=shape.max_q_len,
                            max_kv_len=shape.max_kv_len, input_ids=self.i64[:t], positions=self.i64[t:2 * t])
        return meta, self.i64[3 * t:3 * t + r]

    def fill(self, layout: StepLayout, shape: GraphShape,
             input_ids: torch.Tensor | None = None) -> tuple[StepMetadata, torch.Tensor]:
        """Copy `layout` padded to `shape` into the buffers (asynchronously, `paged_kv.upload`); `input_ids`
        ([real tokens] int64 on the device: pending ids of overlapped scheduling) then replace the layout's
        token ids. Returns `views(shape)`."""
        padded = pad_layout(layout, shape)
        i64 = padded.token_ids + padded.positions + padded.slots + padded.logit_rows
        i32 = padded.kv_lens + padded.cu_q_lens
        upload(i64, torch.int64, self.i64.device, out=self.i64[:len(i64)])
        upload(i32, torch.int32, self.i32.device, out=self.i32[:len(i32)])
        # Only the real sequences' tables, only the columns they use: a padding sequence has kv_len 0 and a
        # real one reads no column past its own kv_len, so stale entries elsewhere are never read.
        tables = layout.block_tables
        width = min(self.width, max((len(t) for t in tables), default=0))
        if width:
            upload(padded_tables([t[:width] for t in tables], width), torch.int32, self.tables.device,
                   out=self.tables[:len(tables), :width])
        if input_ids is not None:
            self.i64[:input_ids.shape[0]].copy_(input_ids)
        return self.views(shape)


def padded_local_logits(runner, meta: StepMetadata, rows: torch.Tensor, attn_out: torch.Tensor | None = None,
                        quant_out=None) -> torch.Tensor:
    """The forward a graph captures: the model over a padded step's metadata, this rank's logits columns
    (`Transformer.local_logits`: all of them without tensor parallelism) of the `rows` index (fp32, one per
    row of the index). `attn_out` / `quant_out`: the graph's fixed attention output buffers (16-bit rows;
    `QuantizedRows` for an FP8 o_proj)."""
    attn = PagedAttention(runner.kv_cache, meta, runner.ops, runner.model_config.softmax_scale, attn_out,
                          quant_out)
    hidden = runner.model(meta.input_ids, meta.positions, attn)
    return runner.model.local_logits(hidden.index_select(0, rows))


def padded_logits(runner, meta: StepMetadata, rows: torch.Tensor, attn_out: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """`padded_local_logits` gathered into full rows [R, V] (what a step's graphs compute, run eagerly)."""
    return runner.model.gather_logits(padded_local_logits(runner, meta, rows, attn_out))


class StepGraphs:
    """Static buffers and captured graphs of one model runner (see the module doc).

    `run(layout, shape, input_ids)` pads the step, copies it into the buffers, replays, and returns the
    [R, V] fp32 logits of the real rows: a view of the static logits buffer, valid until the next replay.

    A tensor-parallel model (`gathers_logits`) finishes its logits after the step's graph, in one of two
    small graphs per logits row count, both captured: the full rows gathered from every rank, or only each
    row's argmax (`Transformer.greedy_ids`, for steps that need nothing else). Every rank replays the
    same one (rank 0 sends `argmax_only` with the step), so their collectives match."""

    def __init__(self, runner, shapes: list[GraphShape]):
        self.runner = runner
        self.shapes = {s.key: s for s in shapes}
        cfg, dev = runner.model_config, runner.device
        self.inputs = StepInputs(shapes, runner.max_blocks_per_seq, dev)
        t_all, r_all = max(s.tokens for s in shapes), max(s.logit_rows for s in shapes)
        # Attention rows of padding tokens are never written: zeroed once so they never hold NaN garbage.
        self._attn_out = torch.zeros((t_all, cfg.num_attention_heads, cfg.head_dim), dtype=runner.dtype,
                                     device=dev)
        # FP8 models: the rows an FP8 o_proj takes quantized from the attention kernel (ops.paged_attention_fp8)
        self._attn_quant = quantized_rows_buffers(t_all, cfg.q_size, runner.dtype, dev) \
            if cfg.quantization == "fp8" else None
        self._logits = torch.zeros((r_all, cfg.vocab_size), dtype=torch.float32, device=dev)
        self.local_vocab = local_vocab(runner.model)
        self._local = self._logits if not self.local_vocab else \
            torch.zeros((r_all, self.local_vocab), dtype=torch.float32, device=dev)
        self._ids = torch.zeros(r_all, dtype=torch.int64, device=dev)
        self._graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        # (logits rows, argmax_only) -> the graph finishing a tensor-parallel model's logits
        self._finish: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        self.pool_bytes = 0

    def static_bytes(self) -> int:
        cfg = self.runner.model_config
        return static_buffer_bytes(list(self.shapes.values()), self.inputs.width, cfg.q_size, cfg.vocab_size,
                                   self._attn_out.element_size(), self.local_vocab, self._attn_quant is not None)

    def _quant_rows(self, tokens: int):
        """The first `tokens` rows of the fixed quantized attention buffers (None: not an FP8 model)."""
        b = self._attn_quant
        return None if b is None else QuantizedRows(b.q[:tokens], b.scale[:tokens], b.dtype)

    # -- capture ---------------------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every shape, largest first (the others fit in its memory pool); logs the time taken and
        the pool's size (`pool_bytes`, what `ModelRunner._graph_reserve_bytes` must cover)."""
        runner, dev = self.runner, self.runner.device
        start = time.perf_counter()
        forwards = {}
        with torch.inference_mode():
            for shape in sorted(self.shapes.values(), key=lambda s: (s.tokens, s.max_q_len, s.max_kv_len),
                                reverse=True):
                meta, rows = self.inputs.views(shape)

                def forward(shape=shape, meta=meta, rows=rows):
                    local = padded_local_logits(runner, meta, rows, self._attn_out[:shape.tokens],
                                                self._quant_rows(shape.tokens))
                    self._local[:shape.logit_rows].copy_(local)

                # All rows are padding here (slots -1, no sequence has a query): compiles and autotunes
                # outside the capture (and outside the measured pool), writes nothing into the KV pools.
                self.inputs.fill(EMPTY_STEP, shape)
                forward()
                forwards[shape] = forward
            if self.local_vocab:
                for key in self._finish_keys():
                    self._finish_forward(*key)()  # warm-up (and the collectives' first use) outside capture
            torch.cuda.synchronize(dev)
            # Each capture starts with empty_cache(): measure from the same point, so the difference is the
            # private pool alone.
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved(dev)
            pool = None
            # "thread_local": this thread's unsafe calls (a device or stream sync, say) still fail
            # the capture, other threads' do not: a process group's watchdog thread queries the events of
            # earlier collectives (tensor parallelism captures the collectives too, every rank the same shapes
            # in the same order), and a trainer or another engine may share this process.
            mode = "thread_local"
            # A side stream of this runner's GPU: torch's default capture stream is made once per process,
            # on whichever GPU was current at the first capture (another engine's, in a process with two).
            stream = torch.cuda.Stream(dev)
            for shape, forward in forwards.items():
                self.inputs.fill(EMPTY_STEP, shape)
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=mode):
                    forward()
                pool = graph.pool() if pool is None else pool
                self._graphs[shape.key] = graph
            for key in self._finish_keys() if self.local_vocab else ():
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=mode):
                    self._finish_forward(*key)()
                self._finish[key] = graph
        torch.cuda.synchronize(dev)
        self.capture_seconds = time.perf_counter() - start
        self.pool_bytes = torch.cuda.memory_reserved(dev) - before
        decode = sorted({s.tokens for s in self.shapes.values() if s.kind == "decode"})
        bounds = sorted({s.max_kv_len for s in self.shapes.values() if s.kind == "decode"}, reverse=True)
        mixed = sorted(s.tokens for s in self.shapes.values() if s.kind == "mixed")
        logger.info("captured %d CUDA graphs (%d decode batch sizes x kv bounds %s, %d mixed-step token counts up "
                    "to %s) in %.1f s; graph pool %.0f MiB, static buffers %.0f MiB", len(self._graphs),
                    len(decode), bounds, len(mixed), mixed[-1] if mixed else "-", self.capture_seconds,
                    self.pool_bytes / 2**20, self.static_bytes() / 2**20)
        reserve = getattr(runner, "graph_reserve_bytes", 0)
        if reserve and self.pool_bytes + self.static_bytes() > reserve:
            logger.warning("CUDA graphs took %.0f MiB, more than the %.0f MiB kept out of the KV pool for them: "
                           "GPU memory use may exceed gpu_memory_utilization", (self.pool_bytes + self.static_bytes())
                           / 2**20, reserve / 2**20)

    def _finish_keys(self) -> list[tuple[int, bool]]:
        """(logits rows, argmax_only) of every finishing graph, in one order on every rank (largest first)."""
        return [(r, a) for r in sorted({s.logit_rows for s in self.shapes.values()}, reverse=True)
                for a in (False, True)]

    def _finish_forward(self, rows: int, argmax_only: bool):
        model = self.runner.model

        def finish():
            if argmax_only:
                self._ids[:rows].copy_(model.greedy_ids(self._local[:rows]))
            else:
                self._logits[:rows].copy_(model.gather_logits(self._local[:rows]))
        return finish

    def run(self, layout: StepLayout, shape: GraphShape, input_ids: torch.Tensor | None = None,
            argmax_only: bool = False) -> torch.Tensor:
        """Fill the inputs (`StepInputs.fill`) and replay the graph of `shape` (and its finishing graph):
        the real rows' logits, or with `argmax_only` their argmax ids [R] int64."""
        self.inputs.fill(layout, shape, input_ids)
        self._graphs[shape.key].replay()
        n = len(layout.logit_rows)
        if self.local_vocab:
            self._finish[(shape.logit_rows, argmax_only)].replay()
            return self._ids[:n] if argmax_only else self._logits[:n]
        return self.runner.model.greedy_ids(self._logits[:n]) if argmax_only else self._logits[:n]


def buffer_sizes(shapes: list[GraphShape], width: int) -> dict[str, int]:
    """Elements of the shared static input buffers: the largest any shape needs."""
    return {"i64": max(3 * s.tokens + s.logit_rows for s in shapes),
            "i32": max(2 * s.seqs + 1 for s in shapes),
            "tables": max(s.seqs for s in shapes) * width}


def local_vocab(model) -> int:
    """A tensor-parallel model's logits columns per rank (0: the model has all of them: no separate buffer)."""
    return model.output_weight.shape[0] if model.gathers_logits else 0


def quantized_rows_buffers(tokens: int, width: int, dtype: torch.dtype, device):
    """Zeroed `QuantizedRows` of [tokens, width] standing for `dtype` rows (padding rows hold zeros, never
    NaN garbage, as the 16-bit attention buffer)."""
    return QuantizedRows(torch.zeros((tokens, width), dtype=FP8_DTYPE, device=device),
                         torch.zeros((tokens, num_blocks(width)), dtype=torch.float32, device=device), dtype)


def static_buffer_bytes(shapes: list[GraphShape], width: int, hidden_out: int, vocab: int, elem: int,
                        local_vocab: int = 0, quantized_attention: bool = False) -> int:
    """Device bytes of the static buffers (`StepGraphs.static_bytes`) before they exist (KV pool sizing)."""
    sizes = buffer_sizes(shapes, width)
    t_all = max(s.tokens for s in shapes)
    r_all = max(s.logit_rows for s in shapes)
    quant = t_all * (hidden_out + 4 * num_blocks(hidden_out)) if quantized_attention else 0
    return 8 * sizes["i64"] + 4 * sizes["i32"] + 4 * sizes["tables"] + t_all * hidden_out * elem \
        + 4 * r_all * (vocab + local_vocab) + 8 * r_all + quant
