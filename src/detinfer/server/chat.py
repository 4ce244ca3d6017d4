"""POST /v1/chat/completions: the messages go through the model's chat template into one engine request
with the request's `n` samples."""

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
from detinfer.server.sampling import chat_logprobs_count, sampling_params


async def chat_completions(request: Request):
    state, req = await read_request(request, P.ChatCompletionRequest)
    logprobs = chat_logprobs_count(req, state.limits)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, state.limits, max_tokens=max_tokens, logprobs=logprobs,
                             vocab_size=state.model.vocab_size)
    headers = ignored_fields_headers(req)
    ids = await state.prompts.chat(req.template_messages(), req.add_generation_prompt)
    ids = state.prompts.check_prompt(ids, max_tokens, "messages")
    gen = await start_generation(state, [ids], params, "chatcmpl")  # from here on, every exit must abort it
    created = int(time.time())

    if req.stream:
        return _stream(state, req, gen, created, logprobs, headers)
    (out,) = await run_to_end(gen, request)
    fmt = state.formatter
    choices = [R.ChatChoice(index=o.index, message=R.AssistantMessage(content=o.text),
                            logprobs=fmt.chat_logprobs(o.logprobs) if logprobs is not None else None,
                            finish_reason=o.finish_reason,
                            token_ids=list(o.token_ids) if req.return_token_ids else None) for o in out.outputs]
    count_finishes(state, [c.finish_reason for c in choices])
    prompt_lp = fmt.prompt_logprobs(out.prompt_logprobs or ()) if req.prompt_logprobs is not None else None
    return json_response(R.ChatCompletionResponse(id=gen.request_id, created=created, model=state.model.name,
                                                  system_fingerprint=state.model.fingerprint, choices=choices,
                                                  usage=usage(gen), prompt_logprobs=prompt_lp,
                                                  prompt_token_ids=list(ids) if req.return_token_ids else None),
                         headers)


def _stream(state, req: P.ChatCompletionRequest, gen: Generation, created: int, logprobs: int | None,
            headers: dict[str, str]):
    started: set[int] = set()

    def chunk(choices, usage_: R.Usage | None = None) -> R.ChatCompletionChunk:
        return R.ChatCompletionChunk(id=gen.request_id, created=created, model=state.model.name,
                                     system_fingerprint=state.model.fingerprint, choices=choices, usage=usage_)

    def emit(i: int, out: Any, c: int, text: str, entries: Any, finish: str | None, new_ids: list[int]):
        new_ids = new_ids if req.return_token_ids else None
        if c not in started:  # OpenAI opens each choice with the role
            first = not started
            started.add(c)
            opening = chunk([R.ChatChunkChoice(index=c, delta=R.DeltaMessage(role="assistant", content=""))])
            if first and req.return_token_ids:  # the templated prompt's ids, once per response
                opening.prompt_token_ids = list(gen.prompts[0])
            if first and req.prompt_logprobs is not None:  # once per response, with the first chunk
                opening.prompt_logprobs = state.formatter.prompt_logprobs(out.prompt_logprobs or ())
            yield opening
        lp = state.formatter.chat_logprobs(entries) if entries and logprobs is not None else None
        if text or lp:
            yield chunk([R.ChatChunkChoice(index=c, delta=R.DeltaMessage(content=text), logprobs=lp,
                                           token_ids=new_ids)])
            new_ids = [] if new_ids is not None else None
        if finish is not None:
            yield chunk([R.ChatChunkChoice(index=c, delta=R.DeltaMessage(), finish_reason=finish,
                                           token_ids=new_ids)])

    def aborted(c: int) -> R.ChatCompletionChunk:
        return chunk([R.ChatChunkChoice(index=c, delta=R.DeltaMessage(), finish_reason="abort")])

    return stream_response(gen, req, emit, aborted, lambda u: chunk([], u), headers)
