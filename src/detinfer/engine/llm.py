"""LLM: the offline API. Give it prompts, get completions back in input order.

    llm = LLM("path/to/model", mode="deterministic", max_num_seqs=64)  # or a hub id: LLM("Qwen/Qwen3-0.6B")
    outs = llm.generate(["Hello", "Once upon a time"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)

Each call queues every prompt, steps the engine until all of them finish, and returns their final
`RequestOutput`s. In deterministic mode a prompt's completion is the same whether it is generated alone
or in a batch of any size, so batching many prompts in one call costs nothing in reproducibility.

`LLM(..., engine_process=True)` runs the engine in its own process (`engine.core_client`), as `detinfer serve`
does by default; the results are bit-identical. The default is in-process: a `generate()` caller waits for
the engine anyway, so a second process only adds a start-up (a second CUDA context and model load) and the
spawn rules (a script must guard its entry point with `if __name__ == "__main__":`); in-process also keeps
debuggers and profilers working and lets `TrainableModel` and `detinfer rl` share the engine's weights. Call
`close()` (or use `with`) to stop the engine process early; it is stopped at exit otherwise.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from detinfer.engine.config import EngineConfig
from detinfer.engine.drive import drive
from detinfer.engine.llm_engine import LLMEngine
from detinfer.engine.outputs import RequestOutput
from detinfer.engine.sampling_params import SamplingParams


def _is_token_list(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in x)


PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids")


def _unpack_prompt(index: int, prompt: Any) -> Any:
    """A vLLM prompt dict -> its text or token ids; anything else passes through (checked later)."""
    if not isinstance(prompt, Mapping):
        return prompt
    unknown = sorted(str(k) for k in prompt if k not in PROMPT_DICT_KEYS)
    if unknown:
        raise ValueError(f"prompt {index}: unsupported key(s) {', '.join(map(repr, unknown))} in a prompt dict; "
                         f"give exactly one of {PROMPT_DICT_KEYS}")
    if len(prompt) != 1:
        raise ValueError(f"prompt {index}: a prompt dict needs exactly one of {PROMPT_DICT_KEYS}, got "
                         f"{sorted(prompt) or 'none'}")
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise TypeError(f"prompt {index}: \"prompt\" must be a str, got {type(prompt['prompt']).__name__}")
        return prompt["prompt"]
    ids = prompt["prompt_token_ids"]
    if not _is_token_list(ids):
        raise TypeError(f"prompt {index}: \"prompt_token_ids\" must be a non-empty list of ints, got {ids!r:.80}")
    return list(ids)


class LLM:
    """`LLM(model, **engine_config_fields)`: loads the model and builds an `LLMEngine`. `model` is a HF-format
    directory or a Hugging Face hub id (see detinfer.models.hub.resolve_model_path).

    Keyword arguments are `EngineConfig` fields (mode, max_num_seqs, max_num_batched_tokens, block_size,
    num_kv_blocks, max_model_len, dtype, enforce_eager, ...), plus `device` (default: cuda if available) and
    `engine_process` (default False: see the module docstring).
    """

    def __init__(self, model: str, *, device=None, engine_process: bool = False, **engine_kwargs: Any):
        try:
            config = EngineConfig(**engine_kwargs)
        except TypeError as e:
            raise TypeError(f"LLM: {e} (keyword arguments must be EngineConfig fields)") from None
        if not isinstance(engine_process, bool):
            raise TypeError(f"LLM: engine_process must be True or False, got {engine_process!r}")
        if engine_process:
            from detinfer.engine.core_client import EngineCoreClient

            self.engine = EngineCoreClient(model, config, device=device)
        else:
            self.engine = LLMEngine(model, config, device=device)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine process (engine_process=True) or a tensor-parallel engine's workers (idempotent)."""
        self.engine.close()

    def release_kv_cache(self) -> None:
        """Hand the KV pool's memory back while idle (LLM(..., releasable_kv_cache=True)), e.g. while a
        colocated trainer needs the GPU; `restore_kv_cache()` before the next generate. The prefix cache is
        dropped. Errors: unfinished requests, a pool built without the option, an engine in its own process."""
        self._in_process("release_kv_cache").release_kv_cache()

    def restore_kv_cache(self) -> None:
        self._in_process("restore_kv_cache").restore_kv_cache()

    def _in_process(self, what: str):
        if not isinstance(self.engine, LLMEngine):
            raise RuntimeError(f"{what}: not available for an engine in its own process (engine_process=True)")
        return self.engine

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The tokenizer the engine encodes prompts and decodes outputs with (vLLM's `LLM.get_tokenizer`), or
        None for an engine built without one.

        It is a `detinfer.models.tokenizer.Tokenizer`: `encode(text, add_special_tokens=True) -> list[int]`,
        `decode(ids, skip_special_tokens=True) -> str`, `apply_chat_template(messages, ...)`, `eos_token_id`,
        `vocab_size`, ... Its `.backend` is the Hugging Face `tokenizers.Tokenizer` built from the model's
        tokenizer.json (the fast tokenizer inside transformers' PreTrainedTokenizerFast); transformers'
        Python tokenizer class itself is not loaded.
        """
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]] | Sequence[int] | Mapping
                 | Sequence[Mapping],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete each prompt; one RequestOutput per prompt, in order.

        A prompt is a string, a list of token ids, or (vLLM's prompt dicts) {"prompt": str} or
        {"prompt_token_ids": [int, ...]}; a list may mix them. sampling_params: one SamplingParams for every
        prompt, a list with one per prompt, or None for the defaults (SamplingParams()).
        """
        if isinstance(prompts, (str, Mapping)) or _is_token_list(prompts):
            prompts = [prompts]
        if isinstance(prompts, bytes) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a str, a prompt dict, a list of token ids or a list of these, "
                            f"got {type(prompts).__name__}")
        prompts = [_unpack_prompt(i, p) for i, p in enumerate(prompts)]
        if not prompts:
            return []
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts; pass one, "
                                 "or one per prompt")
        return self._run(prompts, params, use_tqdm)

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, **template_kwargs: Any) -> list[RequestOutput]:
        """Generate replies to one conversation ([{"role": ..., "content": ...}, ...]) or a list of them,
        rendered with the model's chat template (the template adds the special tokens)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template")
        if isinstance(messages, Sequence) and messages and isinstance(messages[0], Mapping):
            conversations = [messages]
        else:
            conversations = list(messages)
        if not conversations:
            return []
        prompts = [self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                                      tokenize=True, **template_kwargs)
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, prompts: list, params: list, use_tqdm: bool) -> list[RequestOutput]:
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str) and not _is_token_list(prompt):
                raise TypeError(f"prompt {i} must be a non-empty str or a non-empty list of "
                                f"token ids, got {prompt!r:.80}")
        # Only final outputs are returned, so only final outputs are asked for (as vLLM's LLM does): no
        # per-step copies of growing outputs on the host, and a "delta" request still returns all its text.
        params = [p if p.output_kind == "final_only" else dataclasses.replace(p, output_kind="final_only")
                  for p in params]
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req", dynamic_ncols=True)

        def count(out: RequestOutput, _step: int) -> None:
            if out.finished and bar is not None:
                bar.update(1)

        try:
            results = drive(self.engine, [(0, rid, prompt, p) for rid, prompt, p in zip(ids, prompts, params,
                                                                                         strict=True)],
                            on_output=count)
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]
