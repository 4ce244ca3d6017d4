"""The engine requests behind one HTTP request.

`Generation` groups them (one per prompt, each with the request's n samples), merges their streams and
aborts them together; `ChoiceTracker` turns cumulative outputs into the deltas a stream sends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from detinfer.server.async_engine import AsyncEngine, ClientDisconnected


class ChoiceTracker:
    """Per-choice progress of a streamed request: what was already sent, to emit only the new part."""

    def __init__(self, n: int):
        self.n = n
        self.text_sent: dict[int, int] = {}
        self.tokens_sent: dict[int, int] = {}
        self.ids_sent: dict[int, int] = {}  # tokens already carried by a yielded delta (return_token_ids)
        self.finished: dict[int, str] = {}

    def deltas(self, prompt_index: int, out: Any):
        """(choice index, new text, new logprob entries or None, finish_reason newly reached or None, token
        ids not carried by an earlier delta). A token whose text is still held back (an incomplete UTF-8
        character, a possible stop string) yields no delta of its own; its id rides with the next one, and
        the final delta always comes, so the ids of all deltas concatenate to the choice's token ids."""
        for o in out.outputs:
            c = prompt_index * self.n + o.index
            if c in self.finished:
                continue
            t0, k0 = self.text_sent.get(c, 0), self.tokens_sent.get(c, 0)
            text, new_lp = o.text[t0:], (o.logprobs[k0:] if o.logprobs is not None else None)
            self.text_sent[c], self.tokens_sent[c] = len(o.text), len(o.token_ids)
            if o.finish_reason is not None:
                self.finished[c] = o.finish_reason
            if text or new_lp or o.finish_reason is not None:
                ids = list(o.token_ids[self.ids_sent.get(c, 0):])
                self.ids_sent[c] = len(o.token_ids)
                yield c, text, new_lp, o.finish_reason, ids


class Generation:
    """The engine requests behind one HTTP request: one per prompt, each with the request's n samples.
    Whatever way its user exits, `abort()` (idempotent) must run: it frees whatever is still running."""

    def __init__(self, engine: AsyncEngine, request_id: str, prompts: list[list[int]], params: Any):
        self.engine, self.request_id, self.prompts, self.params = engine, request_id, prompts, params
        self.streams: list = []
        self.latest: list[Any] = [None] * len(prompts)

    async def start(self) -> None:
        """Add every prompt's request at once (AsyncEngine.add_requests: all or none, its errors)."""
        self.streams = await self.engine.add_requests(
            [(f"{self.request_id}-{i}", ids, self.params) for i, ids in enumerate(self.prompts)])

    def abort(self) -> None:
        for s in self.streams:
            if not s.finished:
                self.engine.abort(s.request_id)

    async def updates(self) -> AsyncIterator[tuple[int, Any]]:
        """(prompt index, latest RequestOutput) as they come, until every prompt's request finished."""
        pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(self.streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    try:
                        out = task.result()
                    except StopAsyncIteration:
                        continue
                    self.latest[i] = out
                    yield i, out
                    if not out.finished:
                        pending[asyncio.ensure_future(anext(self.streams[i]))] = i
        finally:
            for task in pending:
                task.cancel()

    async def run_to_end(self, client_gone: Callable[[], Awaitable[Any]]) -> list[Any]:
        """Every prompt's final output. If `client_gone()` completes first, aborts everything and raises
        ClientDisconnected; RequestAborted / EngineUnavailableError from the streams propagate."""

        async def consume():
            async for _ in self.updates():
                pass

        work, watch = asyncio.ensure_future(consume()), asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # nobody is left to answer; the finally below aborts the requests
                raise ClientDisconnected(self.request_id)
            work.result()
            return self.latest
        finally:
            work.cancel()
            watch.cancel()
            self.abort()

    def token_counts(self) -> tuple[int, int]:
        """(prompt tokens, completion tokens) so far, over every prompt and sample."""
        completion = sum(len(o.token_ids) for out in self.latest if out is not None for o in out.outputs)
        return sum(len(p) for p in self.prompts), completion
