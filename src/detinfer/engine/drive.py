"""`drive(engine, requests)`: the one loop that runs an engine's requests to completion.

Every offline caller (`LLM.generate`, `detinfer generate`, `detinfer repro`, the engine and trainer test
helpers) adds its requests, each at its arrival step, and steps the engine until all of them have
finished, collecting their final outputs; they differ only in what they watch on the way (`on_output`,
`after_step`) and how a request is added (`add`). The server drives the engine from its own thread
(server/async_engine.py): requests arrive there from clients, not from a plan.
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
    """Add each request at its arrival step (ties in the given order), step until every one has finished
    and the engine has nothing left; -> {request id: final output} of every request that finished.

    The step counter jumps to the next arrival while the engine is idle (an idle step would do nothing),
    so an arrival step means "after this many steps of work". `on_output(out, step)` sees every output
    (final ones too), `after_step(step)` runs after every step; `add(rid, prompt, params)` replaces
    `engine.add_request` (to record or reword what the engine does at arrival). An engine with
    `add_requests` (the engine process) gets each step's arrivals in one call, all or none.

    Whatever goes wrong (a refused request, a hook's exception, Ctrl-C), the requests added and not yet
    finished are aborted and the engine is stepped until idle before the exception propagates, so no
    half-run request keeps its KV blocks. A request finishing twice, one the engine forgets, or more
    than `max_steps` steps, raise a RuntimeError."""
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
            if batch_add and due:
                engine.add_requests(due)
                unfinished.update(rid for rid, _, _ in due)
            for rid, prompt, params in [] if batch_add else due:
                add(rid, prompt, params)
                unfinished.add(rid)
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
