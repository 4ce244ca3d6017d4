"""engine/drive.py: the one loop that runs an engine's requests to completion, on a fake engine whose
request i needs a given number of steps (so every case is exact and fast)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from detinfer.engine.drive import drive


class FakeEngine:
    """LLMEngine's driving interface: a request finishes after `params` steps; abort ends it next step."""

    def __init__(self, *, batch_add: bool = False):
        self.left: dict[str, int] = {}
        self.log: list[tuple[int, str]] = []  # (engine step, request id) of every add
        self.steps = 0
        if batch_add:
            self.add_requests = lambda reqs: [self.add_request(*r) for r in reqs]

    def add_request(self, rid, prompt, params):
        if prompt == "refused":
            raise ValueError(f"request {rid} refused")
        self.left[rid] = params
        self.log.append((self.steps, rid))

    def abort_request(self, rid):
        if rid in self.left:
            self.left[rid] = 0

    def has_unfinished_requests(self):
        return bool(self.left)

    def step(self):
        self.steps += 1
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            finished = self.left[rid] <= 0
            if finished:
                del self.left[rid]
            outs.append(SimpleNamespace(request_id=rid, finished=finished))
        return outs


def test_arrivals_at_their_step_and_idle_jumps():
    engine = FakeEngine()
    seen = []
    finals = drive(engine, [(5, "late", "p", 1), (0, "a", "p", 3), (1, "b", "p", 1)],
                   on_output=lambda out, step: seen.append((step, out.request_id, out.finished)))
    assert sorted(finals) == ["a", "b", "late"]
    # "late" arrives at drive step 5 although the engine went idle after 3 steps: the idle steps are skipped.
    assert engine.log == [(0, "a"), (1, "b"), (3, "late")]
    assert (5, "late", True) in seen and engine.steps == 4


def test_batch_add_for_an_engine_process():
    engine = FakeEngine(batch_add=True)
    calls = []
    add_requests = engine.add_requests
    engine.add_requests = lambda reqs: (calls.append([r[0] for r in reqs]), add_requests(reqs))
    drive(engine, [(0, "a", "p", 1), (0, "b", "p", 1)])
    assert calls == [["a", "b"]]


def test_a_refused_request_aborts_the_others_and_leaves_the_engine_idle():
    engine = FakeEngine()
    with pytest.raises(ValueError, match="request bad refused"):
        drive(engine, [(0, "a", "p", 100), (2, "bad", "refused", 1)])
    assert not engine.has_unfinished_requests() and engine.steps < 10


def test_max_steps_and_a_lost_request_raise():
    with pytest.raises(RuntimeError, match="did not finish its requests in 3 steps"):
        drive(FakeEngine(), [(0, "a", "p", 10)], max_steps=3)
    engine = FakeEngine()
    engine.step = lambda: engine.left.clear() or []  # forgets the request without a final output
    with pytest.raises(RuntimeError, match=r"stopped with requests unfinished: \['a'\]"):
        drive(engine, [(0, "a", "p", 1)])
