"""`drive(engine, requests)`: the one loop that runs an engine's requests to completion, for every offline
caller (`LLM.generate`, `detinfer generate`, `detinfer repro`, the test helpers). The server steps its engine
from its own thread instead (server/async_engine.py): its requests come from clients, not from a plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from detinfer.engine.outputs import RequestOutput

# (arrival step, request id, prompt (ids or text), SamplingParams)
Arrival = tuple[int, str, Any, Any]


def drive(engine, requests: Iterable[Arrival], *, max_steps: int | None = None,
          on_output: Callable[[RequestOutput, int], None] | None = None,
          after_step: Callable[[int], None] | None = None,
          add: Callable[[str, Any, Any], None] | None = None) -> dict[str, RequestOutput]:
    """Add each request at its arrival step (ties in the given order) and step until the engine has nothing
    left; -> {request id: final output} of every request that finished. While the engine is idle the step
    counter jumps to the next arrival (an idle step does nothing). `on_output(out, step)` sees every output,
    `after_step(step)` runs after each step, `add(rid, prompt, params)` replaces `engine.add_request`; an
    engine with `add_requests` (the engine process) gets a step's arrivals in one call, all or none.

    On any exception (a refused request, a hook's, Ctrl-C) the unfinished requests it added are aborted and
    the engine stepped until idle, so none keeps its KV blocks. A request finishing twice or never, or more
    than `max_steps` steps, is a RuntimeError."""
    pending = sorted(requests, key=lambda r: r[0])
    batch_add = add is None and hasattr(engine, "add_requests")
    add = add or engine.add_request
    unfinished: set[str] = set()
    finals: dict[str, RequestOutput] = {}
    step, i = 0, 0
    try:
        while i < len(pending) or engine.has_unfinished_requests():
            if not engine.has_unfinished_requests() and pending[i][0] > step:
                step = pending[i][0]
            due = []
            while i < len(pending) and pending[i][0] <= step:
                due.append(pending[i][1:])
                i += 1
            unfinished.update(rid for rid, _, _ in due)  # before adding: aborting an unknown id is a no-op
            if batch_add and due:
                engine.add_requests(due)
            else:
                for request in due:
                    add(*request)
            for out in engine.step():
                if out.finished:
                    if out.request_id in finals:
                        raise RuntimeError(f"request {out.request_id} finished twice")
                    finals[out.request_id] = out
                    unfinished.discard(out.request_id)
                if on_output is not None:
                    on_output(out, step)
            if after_step is not None:
                after_step(step)
            step += 1
            if max_steps is not None and step >= max_steps:
                raise RuntimeError(f"the engine did not finish its requests in {max_steps} steps")
        if unfinished:
            raise RuntimeError(f"the engine stopped with requests unfinished: {sorted(unfinished)}")
    except BaseException:
        for rid in unfinished:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
        raise
    return finals
