"""LLMEngine: requests in, one continuous-batching step at a time, cumulative outputs out.

One step: the scheduler picks a batch (decodes, then prefill chunks) -> the model runner computes
the logits the batch needs -> the sampler draws a token for every sequence whose chunk reached its end
(a pure function of the logits row, the request's seed, the output position and the sample index) ->
logprobs if asked (all on the device, read back with one copy) -> the scheduler records the step and
decides every finish (asking the request's `RequestState.text_stop`, which feeds the sequence's incremental
detokenizer, for stop strings) -> a `RequestOutput` for every request that progressed. The logits rows of each
sequence come from the batch's one layout (`ScheduledBatch.layout`), which the model runner computed the
logits by.

Overlapped scheduling (`EngineConfig.async_scheduling`): step n+1 is scheduled and launched before step
n's results are read back, so the host's work (scheduling, inputs, launches, then step n's logprobs,
detokenization, stop checks and finishes) runs while the device computes. The scheduler treats step n's
sampled tokens as pending (`Scheduler.advance`); decodes of them take their input id on the device
(`device_step`); `Scheduler.resolve` fills the ids in when they arrive. Outputs come one step later and
carry the same bits. See docs/architecture.md ("A request's lifecycle") for what happens to sequences that
finish, are preempted or aborted while a step is in flight.

In deterministic mode every kernel is batch-invariant, so what a request gets (token ids, logprobs,
text) does not depend on which other requests share its steps, how its prompt was chunked, whether its
prefix came from the cache, or whether it was preempted and recomputed.

dtype "auto": the checkpoint's torch_dtype on CUDA (bf16 if it names none), float32 on CPU. KV pool
size: `EngineConfig.num_kv_blocks` if given, else see `ModelRunner._pick_num_blocks`.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from detinfer.dtypes import resolve_dtype
from detinfer.engine.config import EngineConfig
from detinfer.engine.device_step import LaunchedStep, SampledIds, launch_step
from detinfer.engine.logits_processors import prepare_processors
from detinfer.engine.model_runner import ModelRunner
from detinfer.engine.outputs import EngineStats, RequestOutput
from detinfer.engine.request_state import RequestState
from detinfer.engine.sampling_params import SamplingParams
from detinfer.engine.scheduler import ScheduledBatch, ScheduledSequence, Scheduler
from detinfer.engine.sequence import Sequence
from detinfer.models import fp8
from detinfer.models.config import ModelConfig
from detinfer.models.hub import resolve_model_path
from detinfer.models.loader import load_model, load_tokenizer
from detinfer.models.transformer import Transformer
from detinfer.models.weight_sources import CheckpointWeights, build_full_model
from detinfer.ops import Ops


def on_device(device: torch.device):
    """`device` as the current GPU while the engine launches kernels: Triton launches on the current device's
    context and stream, so an engine on cuda:1 in a process whose current GPU is cuda:0 (a sampler beside its
    trainer) must switch to its own (torch's ops switch by themselves). A no-op on CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for but CUDA is not available")
    return device


def out_of_memory_message(config: EngineConfig, device: torch.device, error: BaseException) -> str:
    """What to lower when the model and its KV cache do not fit at start-up."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (f"out of memory on {device} while loading the model or allocating its KV cache ({first}). Lower "
            f"--gpu-memory-utilization (now {config.gpu_memory_utilization}), --max-model-len (now "
            f"{config.max_model_len or 'the model maximum'}), --max-num-seqs (now {config.max_num_seqs}) or "
            f"--num-kv-blocks (now {config.num_kv_blocks or 'auto'}), or pick a smaller --dtype")


class LLMEngine:
    """See the module docstring. Not thread-safe: one caller drives add_request / abort_request / step."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None,
                 device: torch.device | str | None = None, *, attention_backend: str = "auto"):
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        device = resolve_device(device)
        model_dir = resolve_model_path(model_dir)  # a directory, or a hub id -> its cached snapshot
        model_config = ModelConfig.from_dir(model_dir)
        dtype = resolve_dtype(config.dtype, model_config.dtype, device)
        try:
            if config.tensor_parallel_size > 1 or config.quantization != "auto":
                # every rank reads only its own slices (no full copy anywhere); FP8 models are built here too
                self._setup_sharded(CheckpointWeights(str(model_dir), dtype), model_config, config, device,
                                    load_tokenizer(model_dir), attention_backend)
            else:
                model, model_config = load_model(model_dir, dtype, device, config.mode, attention=attention_backend)
                self._setup(model, model_config, config, load_tokenizer(model_dir))
        except (torch.OutOfMemoryError, MemoryError) as e:
            raise RuntimeError(out_of_memory_message(config, device, e)) from e
        except RuntimeError as e:
            if "can't allocate memory" not in str(e):  # the CPU allocator's out-of-memory message
                raise
            raise RuntimeError(out_of_memory_message(config, device, e)) from e

    @classmethod
    def from_model(cls, model: Transformer, model_config: ModelConfig, config: EngineConfig | None = None,
                   tokenizer=None, *, attention_backend: str = "auto") -> LLMEngine:
        """An engine over an already built model (benchmarks, tests). Without a tokenizer, prompts must be
        token ids, outputs have empty text, and stop strings are refused. The model keeps its numerics
        backend (`model.ops`, whose mode must be the config's); attention_backend other than "auto"
        switches its attention choice (`model.set_ops`)."""
        if attention_backend != "auto":
            model.set_ops(model.ops.replace(attention=attention_backend))
        engine = cls.__new__(cls)
        engine._setup(model, model_config, EngineConfig() if config is None else config, tokenizer)
        return engine

    @classmethod
    def from_weights(cls, weights, model_config: ModelConfig, config: EngineConfig | None = None,
                     device: torch.device | str | None = None, tokenizer=None, *,
                     attention_backend: str = "auto") -> LLMEngine:
        """An engine over `weights` (a models.weight_sources value, e.g. `RandomWeights(seed, dtype)` for a
        random preset): at TP=1 the whole model is built from it; under tensor parallelism every rank builds
        only its own shard from it. Tokenizer: as for `from_model`."""
        engine = cls.__new__(cls)
        engine._setup_sharded(weights, model_config, EngineConfig() if config is None else config,
                              resolve_device(device), tokenizer, attention_backend)
        return engine

    def _setup_sharded(self, weights, model_config, config, device, tokenizer, attention_backend) -> None:
        model_config = fp8.with_quantization(model_config, config.quantization)
        if device.type == "cuda" and device.index is None:  # rank 0's GPU, as a loaded model's tensors say it
            device = torch.device("cuda", torch.cuda.current_device())
        ops = Ops(config.mode, device, weights.dtype, head_dim=model_config.head_dim, attention=attention_backend)
        if config.tensor_parallel_size > 1:
            self._setup(None, model_config, config, tokenizer, weights=weights, ops=ops)
        else:
            self._setup(build_full_model(weights, model_config, ops), model_config, config, tokenizer)

    def _setup(self, model, model_config, config, tokenizer, *, weights=None, ops=None) -> None:
        if config.quantization != "auto" and model_config.quantization != config.quantization:
            raise ValueError(f"quantization {config.quantization!r} was asked for but the model was built "
                             f"with quantization {model_config.quantization!r}")
        config = config.resolved(model_config.max_position_embeddings)
        self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
        if config.tensor_parallel_size > 1 or config.tp_invariant_reduction:
            from detinfer.engine.tp_runner import make_runner  # rank 0 of a TP group (docs/tensor-parallel.md)

            with on_device(torch.device(ops.device) if model is None else model.embed_tokens.device):
                self.runner = make_runner(model, model_config, config, config.num_kv_blocks, weights=weights,
                                          ops=ops)
        else:
            with on_device(model.embed_tokens.device):
                self.runner = ModelRunner(model, model_config, config, config.num_kv_blocks)
        self.ops = self.runner.ops  # the model's numerics backend (logprobs use its log_softmax)
        eos = model_config.eos_token_ids
        if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
            eos = (tokenizer.eos_token_id,)
        self.scheduler = Scheduler(config, num_kv_blocks=self.runner.num_kv_blocks, eos_token_ids=eos,
                                   vocab_size=model_config.vocab_size)
        self._requests: dict[str, RequestState] = {}
        self._grammars = None  # GrammarMasks, made by the first structured request (llguidance is optional)
        self._aborted: list[str] = []  # aborted requests whose final output is still owed
        self._inflight: list[LaunchedStep] = []  # launched, not read back yet (async scheduling)
        self._counters = dict(num_steps=0, prompt_tokens=0, generation_tokens=0, num_preemptions=0,
                              num_finished_requests=0, last_step_tokens=0)
        self._last_step_seconds = 0.0

    def close(self) -> None:
        """Release what outlives the object by itself: a tensor-parallel engine's worker processes."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    # -- requests ------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None) -> None:
        """Queue a request. Raises ValueError (TypeError for wrong types) when it can never run."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams or None, got {type(params).__name__}")
        prompt_text, ids = self._prompt_ids(request_id, prompt)
        vocab = self.model_config.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                raise ValueError(f"request {request_id!r}: {name}={k} exceeds the vocabulary size {vocab}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"request {request_id!r}: stop strings need a tokenizer; this engine has none "
                             "(use stop_token_ids)")
        try:
            params = prepare_processors(params, self.tokenizer, self.model_config.vocab_size)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None
        if params.structured_outputs is not None:
            self._grammar_masks().check(params.structured_outputs)  # compiled (and cached) before queueing
        seqs = self.scheduler.add_request(request_id, ids, params)  # the prompt's checks, seeds
        if params.structured_outputs is not None:
            self._grammars.add([s.seq_id for s in seqs], params.structured_outputs)
        ids = seqs[0].prompt_token_ids
        detoks = [None if self.tokenizer is None else
                  self.tokenizer.incremental_detokenizer(ids, stop=params.stop,
                                                         skip_special_tokens=params.skip_special_tokens,
                                                         include_stop_str=params.include_stop_str_in_output,
                                                         min_tokens=params.min_tokens) for _ in seqs]
        self._requests[request_id] = RequestState(request_id, prompt_text, tuple(ids), params, seqs, detoks,
                                                  [0.0] * len(seqs))

    def _grammar_masks(self):
        if self._grammars is None:
            from detinfer.engine.grammar import GrammarMasks  # imports llguidance, an optional dependency

            self._grammars = GrammarMasks(self.tokenizer, self.model_config.vocab_size,
                                          self.scheduler.eos_token_ids)
        return self._grammars

    def _prompt_ids(self, request_id: str, prompt) -> tuple[str | None, list[int] | object]:
        """(text, token ids) of a text prompt; token-id prompts pass through (the scheduler checks them)."""
        if isinstance(prompt, str):
            if not prompt:  # checked as text: the tokenizer may turn "" into a BOS token
                raise ValueError(f"request {request_id!r}: the prompt is empty")
            if self.tokenizer is None:
                raise ValueError(f"request {request_id!r}: text prompts need a tokenizer; pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        return None, prompt

    def abort_request(self, request_id: str) -> None:
        """Stop a request now, freeing its KV blocks; its final output (finish_reason "abort") comes with
        the next step(). Unknown or finished requests are ignored."""
        req = self._requests.get(request_id)
        if req is None or request_id in self._aborted:
            return
        self._finish_text(self.scheduler.abort(request_id))
        self._aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        # A step still in flight matters only for sequences the scheduler still holds: once all of them
        # are finished, its results would be discarded, so it need not be read back.
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix KV block, e.g. after the weights were updated in place (the cached K/V
        belong to the old weights). Only an idle engine can do this; returns how many blocks were dropped."""
        if self.has_unfinished_requests():
            raise RuntimeError(f"reset_prefix_cache: the engine has {self.get_num_unfinished_requests()} "
                               "unfinished requests whose KV blocks hold the old weights' keys and values; "
                               "finish or abort them first")
        return self.scheduler.block_manager.reset_prefix_cache()

    def release_kv_cache(self) -> None:
        """Hand the KV pool's memory back while idle (engine built with releasable_kv_cache=True): the prefix
        cache is dropped (its blocks' contents go with the memory) and no step runs until
        `restore_kv_cache()`."""
        self.reset_prefix_cache()  # refuses while requests are unfinished
        with on_device(self.runner.device):
            self.runner.release_kv_cache()

    def restore_kv_cache(self) -> None:
        """Memory for the KV pool again (same addresses; empty cache). Nothing to do if it was not released."""
        if self.runner.kv_released:
            with on_device(self.runner.device):
                self.runner.restore_kv_cache()

    # -- one step ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that progressed (cumulative outputs).

        Schedule, launch, resolve (read back and process). With async_scheduling the step resolved is the
        previous one, after this one was launched, so the host's work runs while the device computes (see
        the module docstring)."""
        if self.runner.kv_released:
            raise RuntimeError("the engine's KV cache is released (release_kv_cache()); call restore_kv_cache() "
                               "before running requests")
        with on_device(self.runner.device):
            return self._step()

    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        outputs = [self._output(self._requests[rid]) for rid in self._aborted]
        self._aborted.clear()
        previous, self._inflight = self._inflight, []
        touched: list[str] = []
        if _needs_history(previous):  # the next step's sampling needs these ids on the host: no overlap
            touched, previous = self._resolve_or_abort(previous), []
        batch = self.scheduler.schedule()
        self._counters["num_preemptions"] += len(batch.preempted)
        if not batch.is_empty:
            self._inflight = self._launch(batch, previous)
        touched += self._resolve_or_abort(previous)
        if not self.config.async_scheduling:
            inflight, self._inflight = self._inflight, []
            touched += self._resolve_or_abort(inflight)
        for rid in dict.fromkeys(touched):
            req = self._requests.get(rid)
            # final_only: no output (and no copy of the growing token list) until the request finishes
            if req is not None and (req.params.output_kind != "final_only" or req.finished):
                outputs.append(self._output(req))
        self._last_step_seconds = time.perf_counter() - start
        return outputs

    def _launch(self, batch: ScheduledBatch, previous: list[LaunchedStep]) -> list[LaunchedStep]:
        """Launch `batch` (its pending inputs come from `previous`, not read yet) and record it as computed."""
        pending = SampledIds.join([p.sampled for p in previous])
        try:
            try:
                launched = [self._launch_step(batch, pending)]
            except Exception as exc:
                launched = self._isolate_failure(batch, exc, pending)
        except BaseException:
            # Interrupted (or the isolation itself failed). The scheduler already committed this batch,
            # so its requests cannot simply be retried: abort them (their blocks are freed and they end
            # with finish_reason "abort" at the next step) and let the caller see the error. Requests
            # not in the batch are untouched (the previous step stays to be read), so the engine stays usable.
            self._abort_requests_in([batch])
            self._inflight = previous
            raise
        c = self._counters
        c["num_steps"] += 1
        c["last_step_tokens"] = sum(part.batch.num_batched_tokens for part in launched)
        for part in launched:
            self.scheduler.advance(part.batch)
            c["prompt_tokens"] += sum(item.query_len for item in part.batch.scheduled if not item.is_decode)
        return launched

    def _isolate_failure(self, batch: ScheduledBatch, exc: Exception,
                         pending: SampledIds | None) -> list[LaunchedStep]:
        """A step failed (forward pass or sampling): find whose. Each request's share of the batch is run
        again on its own, read back at once; the requests whose share fails again are aborted with the
        error (their output carries it), the others' shares are kept. In deterministic mode every kernel
        and the sampler are batch-invariant, so the survivors get the same bits they would have got in the
        whole batch. Nothing of the failed attempt is kept: KV slots are rewritten by the rerun, and the
        scheduler and the prefix cache only record a step in advance()."""
        groups: dict[str, list[ScheduledSequence]] = {}
        for item in batch.scheduled:
            groups.setdefault(item.seq.request_id, []).append(item)
        if len(groups) == 1:
            failed = {next(iter(groups)): exc}
            kept = []
        else:
            failed, kept = {}, []
            for rid, part in groups.items():
                sub = ScheduledBatch(tuple(part), sum(item.query_len for item in part))
                try:
                    launched = self._launch_step(sub, pending)
                    launched.read()  # a failure on the device shows here, in this request's share
                    kept.append(launched)
                except Exception as e:
                    failed[rid] = e
        for rid, e in failed.items():
            self._requests[rid].error = f"{type(e).__name__}: {e}"
            self.abort_request(rid)
        return kept

    def _resolve_or_abort(self, launched: list[LaunchedStep]) -> list[str]:
        """`_resolve`; if it is interrupted (Ctrl-C while waiting for the device, or an error while
        processing), the tokens of those steps are lost: their requests are aborted (finish_reason "abort"
        at the next step, blocks freed) and the error is raised. The steps were already taken off
        `_inflight`, so no later step waits for them, and every other request goes on unchanged."""
        try:
            return self._resolve(launched)
        except BaseException:
            self._abort_requests_in([part.batch for part in launched])
            raise

    def _abort_requests_in(self, batches: list[ScheduledBatch]) -> None:
        for rid in dict.fromkeys(item.seq.request_id for batch in batches for item in batch.scheduled):
            self.abort_request(rid)

    def _launch_step(self, batch: ScheduledBatch, pending: SampledIds | None) -> LaunchedStep:
        mask = self._grammars.mask_logits if self._grammars else None
        return launch_step(self.runner, batch, pending, self.scheduler.eos_token_ids, mask)

    def _resolve(self, launched: list[LaunchedStep]) -> list[str]:
        """Read launched steps back and process them: grammars, logprobs, then the scheduler's finishes
        (which ask `RequestState.text_stop` for stop strings). Returns the ids of the requests that progressed."""
        touched: list[str] = []
        for part in launched:
            tokens, entries = part.read()
            complete: set[int] = set()  # sequences whose grammar this step's token completed
            if self._grammars:  # before anything is recorded: a refused token ends its request alone, unrecorded
                done, refused = self._grammars.consume_step(part.batch, tokens)
                complete = {item.seq.seq_id for item, c in zip(part.batch.scheduled, done) if c}
                for rid, message in refused:
                    self._requests[rid].error = message
                    self.abort_request(rid)
            for dest, entry in entries:
                seq = dest.seq
                if seq.is_finished:
                    continue  # aborted, or finished by an earlier token: this step's results are discarded
                if dest.is_prompt:
                    seq.prompt_logprobs.append(entry)
                else:
                    seq.output_logprobs.append(entry)
                    self._requests[seq.request_id].cumulative_logprobs[seq.sample_index] += entry.logprob
            live = [item.seq.request_id for item in part.batch.scheduled if item.sample and not item.seq.is_finished]
            finished = self.scheduler.resolve(
                part.batch, tokens,
                lambda seq, token, done=complete: self._requests[seq.request_id].text_stop(seq, token, done))
            self._finish_text(finished)
            self._counters["generation_tokens"] += len(live)
            touched += live + [seq.request_id for seq in finished]
        return touched

    def _finish_text(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._requests[seq.request_id].finish_text(seq)

    def _output(self, req: RequestState) -> RequestOutput:
        """`req`'s output; a finished request leaves the table (and its grammars) with it."""
        out = req.output()
        if out.finished:
            del self._requests[req.request_id]
            for seq in req.seqs:
                if self._grammars is not None:
                    self._grammars.release(seq.seq_id)
            self._counters["num_finished_requests"] += 1
        return out

    # -- monitoring ----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.scheduler.block_manager
        c = self._counters
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=bm.num_blocks - bm.num_free_blocks, kv_blocks_cached=bm.num_cached_free_blocks,
            kv_blocks_total=bm.num_blocks, num_steps=c["num_steps"], prompt_tokens=c["prompt_tokens"],
            generation_tokens=c["generation_tokens"], prefix_cache_query_tokens=bm.prefix_query_tokens,
            prefix_cache_hit_tokens=bm.prefix_hit_tokens, num_preemptions=c["num_preemptions"],
            num_finished_requests=c["num_finished_requests"], last_step_seconds=self._last_step_seconds,
            last_step_tokens=c["last_step_tokens"])


def _needs_history(launched: list[LaunchedStep]) -> bool:
    """Whether sampling a next token of a sequence these launched steps sampled for needs its earlier tokens'
    ids on the host: the sampler's (penalties, bad words, a token_mask: `SamplingParams.needs_history`) or
    its grammar's matcher. Then those steps are read back before the next one is scheduled."""
    return any((item.seq.params.needs_history or item.seq.params.structured_outputs is not None)
               and not item.seq.is_finished for part in launched for item in part.batch.scheduled if item.sample)
