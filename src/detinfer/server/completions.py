"""POST /v1/completions (legacy completions): one engine request per prompt, each with the request's `n`
samples; choice `i * n + j` is sample j of prompt i, as in OpenAI's API. Whatever way the handler exits
(finished, client gone, error) the engine requests still running are aborted, so no KV blocks outlive
their client."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request

from detinfer.server import protocol as P
from detinfer.server import responses as R
from detinfer.server.generation import Generation
from detinfer.server.handling import (
    count_finishes,
    ignored_fields_headers,
    json_response,
    read_request,
    run_to_end,
    start_generation,
    stream_response,
    usage,
)
from detinfer.server.logprobs import TextOffsets
from detinfer.server.sampling import completion_logprobs_count, sampling_params


async def prepare_prompts(state, req: P.CompletionRequest) -> list[list[int]]:
    """Token ids of every prompt, checked against the vocabulary and the context."""
    raw = P.normalize_prompt(req.prompt)
    texts = [p for p in raw if isinstance(p, str)]
    encoded = iter(await state.prompts.encode(texts, "prompt") if texts else [])
    return [state.prompts.check_prompt(next(encoded) if isinstance(p, str) else p, req.max_tokens, "prompt")
            for p in raw]


class _Choices:
    """Builds CompletionChoice objects, keeping each choice's text offsets across stream chunks."""

    def __init__(self, state, req: P.CompletionRequest, prompts: list[list[int]], prompt_text: list[str]):
        self.state, self.req, self.prompts, self.prompt_text = state, req, prompts, prompt_text
        self.n = req.n or 1
        self.offsets: dict[int, TextOffsets] = {}

    def choice(self, out: Any, i: int, o: Any, text: str, entries: Any, finish: str | None,
               ids: Any = None) -> R.CompletionChoice:
        c = i * self.n + o.index
        first = c not in self.offsets
        if first:
            self.offsets[c] = TextOffsets(self.state.model.tokenizer, start=len(self.prompt_text[i]),
                                          context_ids=self.prompts[i])
        lp = None
        if self.req.logprobs is not None:
            fmt = self.state.formatter
            lp = fmt.completion_logprobs(entries or (), self.offsets[c])
            if first and self.req.echo:  # the echoed prompt's logprobs come first
                # position 0 has no context: OpenAI lists its token with a null logprob
                head = [e if e is not None else t for e, t in zip(out.prompt_logprobs or (), self.prompts[i])]
                prompt_offsets = TextOffsets(self.state.model.tokenizer, skip_special_tokens=False)
                lp = _concat(fmt.completion_logprobs(head, prompt_offsets), lp)
        prompt_lp = None
        if first and self.req.prompt_logprobs is not None:
            prompt_lp = self.state.formatter.prompt_logprobs(out.prompt_logprobs or ())
        choice = R.CompletionChoice(index=c, text=text, logprobs=lp, finish_reason=finish, prompt_logprobs=prompt_lp)
        if self.req.return_token_ids:  # vLLM's shape: the prompt's ids with the choice's first chunk
            choice.token_ids = list(o.token_ids if ids is None else ids)
            choice.prompt_token_ids = list(self.prompts[i]) if first else None
        return choice


def _concat(a: R.CompletionLogprobs, b: R.CompletionLogprobs) -> R.CompletionLogprobs:
    return R.CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                                top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)


async def completions(request: Request):
    state, req = await read_request(request, P.CompletionRequest)
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise P.bad_request("best_of must equal n (every sample is returned)", param="best_of")
    logprobs = completion_logprobs_count(req, state.limits)
    echo = bool(req.echo)
    params = sampling_params(req, state.limits, max_tokens=req.max_tokens, logprobs=logprobs,
                             prompt_logprobs=logprobs if echo and logprobs is not None else None,
                             vocab_size=state.model.vocab_size)
    headers = ignored_fields_headers(req)
    prompts = await prepare_prompts(state, req)
    prompt_text = [await state.prompts.decode(p) if echo else "" for p in prompts]
    gen = await start_generation(state, prompts, params, "cmpl")  # from here on, every exit must abort it
    created = int(time.time())
    choices = _Choices(state, req, prompts, prompt_text)

    def resp(items, usage_=None) -> R.CompletionResponse:
        return R.CompletionResponse(id=gen.request_id, created=created, model=state.model.name,
                                    system_fingerprint=state.model.fingerprint, choices=items, usage=usage_)

    if req.stream:
        return _stream(req, gen, choices, resp, headers)
    latest = await run_to_end(gen, request)
    items = [choices.choice(out, i, o, prompt_text[i] + o.text, o.logprobs, o.finish_reason)
             for i, out in enumerate(latest) for o in out.outputs]
    count_finishes(state, [c.finish_reason for c in items])
    return json_response(resp(items, usage(gen)), headers)


def _stream(req: P.CompletionRequest, gen: Generation, choices: _Choices, resp, headers):
    def emit(i: int, out: Any, c: int, text: str, entries: Any, finish: str | None, ids: list[int]):
        o = out.outputs[c - i * choices.n]
        text = (choices.prompt_text[i] if c not in choices.offsets else "") + text
        yield resp([choices.choice(out, i, o, text, entries, finish, ids)])

    def aborted(c: int) -> R.CompletionResponse:
        return resp([R.CompletionChoice(index=c, text="", finish_reason="abort")])

    return stream_response(gen, req, emit, aborted, lambda u: resp([], u), headers)
