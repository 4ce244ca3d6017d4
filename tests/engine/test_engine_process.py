"""The engine core in its own process (`LLM(engine_process=True)`, `engine.core_*`): bit-identical outputs to the
in-process engine, the same errors, start-up failures with their own message, a killed core raises instead of
hanging, and close() leaves no process behind. One core process serves the module (spawning one costs seconds)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from detinfer.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from detinfer.engine.core import EngineCoreError
from detinfer.engine.core_wire import OutputAssembler, OutputEncoder, decode_prompt, encode_prompt
from detinfer.engine.testing import CoreStepGate
from detinfer.models.testing import write_tiny_checkpoint

# Small steps (chunked prefill, several steps per request) so deltas cross many messages.
KW = dict(max_num_batched_tokens=24, max_num_seqs=4, block_size=4, num_kv_blocks=96)
PROMPTS = ["once upon a time", "the quick brown fox jumps over the lazy dog and then", [3, 17, 42, 9, 200, 11],
           "a", "batch invariance means one row never depends on the others"]


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, prompt_logprobs=2, ignore_eos=True),
            SamplingParams(max_tokens=16, temperature=0.9, seed=7, n=2, logprobs=0, ignore_eos=True),
            SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
            SamplingParams(max_tokens=20, temperature=1.0, seed=5, stop=["e", "the"], logprobs=1),
            SamplingParams(max_tokens=14, temperature=0.0, stop_token_ids=[5], repetition_penalty=1.2)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("engine_process") / "llama", "LlamaForCausalLM", seed=3)


@pytest.fixture(scope="module")
def proc_llm(model_dir):
    with LLM(str(model_dir), device="cpu", engine_process=True, **KW) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(model_dir):
    return LLM(str(model_dir), device="cpu", **KW).generate(PROMPTS, _params(), use_tqdm=False)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state


def test_outputs_are_bit_identical_to_the_in_process_engine(proc_llm, reference):
    got = proc_llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert got == reference  # text, token ids, every logprob (floats compared exactly), finish/stop reasons
    assert any(o.stop_reason in ("e", "the") for o in got[3].outputs)  # the stop-string path was exercised
    assert got[0].prompt_logprobs[0] is None and len(got[0].prompt_logprobs) == len(got[0].prompt_token_ids)
    again = proc_llm.generate(PROMPTS, _params(), use_tqdm=False)  # after a prefix-cache warm run, too
    assert [r.outputs for r in again] == [r.outputs for r in reference]


def test_wire_round_trip_rebuilds_every_cumulative_output(model_dir):
    """Every output of every step, encoded as a delta and reassembled, equals the engine's own."""
    engine = LLMEngine(model_dir, EngineConfig(**KW), device="cpu")
    for i, (prompt, params) in enumerate(zip(PROMPTS, _params(), strict=True)):
        engine.add_request(str(i), decode_prompt(encode_prompt(prompt)), params)
    engine.abort_request("4")
    enc, asm, seen = OutputEncoder(), OutputAssembler(), 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert asm.apply(enc.encode(out)) == out
            seen += 1
    assert seen > len(PROMPTS) and not enc._sent and not asm._reqs  # finished requests leave no state
    assert encode_prompt([1, 2 ** 40]) == [1, 2 ** 40]  # not int32: passed as is, the engine refuses it


def test_refused_requests_raise_the_same_errors_and_add_nothing(proc_llm, reference):
    with pytest.raises(ValueError, match="token id 100000 at position 1 is outside the vocabulary"):
        proc_llm.generate([PROMPTS[0], [1, 100000]], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        proc_llm.generate("", use_tqdm=False)
    assert not proc_llm.engine.has_unfinished_requests()
    assert proc_llm.generate(PROMPTS[:1], _params()[:1], use_tqdm=False)[0].outputs == reference[0].outputs
    assert isinstance(proc_llm.engine.reset_prefix_cache(), int)
    from detinfer.train import TrainableModel

    with pytest.raises(TypeError, match="engine_process=False"):  # it needs the weights in this process
        TrainableModel(proc_llm)
    assert proc_llm.engine.stats()["num_finished_requests"] >= len(PROMPTS)


def test_start_up_errors_keep_their_type_and_message(tmp_path):
    bad = write_tiny_checkpoint(tmp_path / "bad", "LlamaForCausalLM")
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(Exception) as in_process:
        LLMEngine(bad, EngineConfig(**KW), device="cpu")
    with pytest.raises(Exception) as in_core:
        LLM(str(bad), device="cpu", engine_process=True, **KW)
    assert type(in_core.value) is type(in_process.value)
    assert str(in_core.value) == str(in_process.value)


def test_killed_core_raises_instead_of_hanging_and_close_leaves_nothing(model_dir, tmp_path, monkeypatch):
    # The core is held after its first step (the first tokens exist, no request can have finished), killed
    # there: no race between a kill timer and generation speed.
    gate = CoreStepGate(tmp_path / "gate")
    gate.hold_after(1)
    for key, value in gate.env.items():
        monkeypatch.setenv(key, value)  # the spawned core inherits it
    llm = LLM(str(model_dir), device="cpu", engine_process=True, **KW)
    pid = llm.engine.core.pid
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    def kill_once_held():
        gate.wait_held(steps=1, unfinished=4)
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_once_held)
    killer.start()
    with pytest.raises(EngineCoreError, match="killed by signal SIGKILL"):
        llm.generate(["once upon a time"] * 4, params, use_tqdm=False)
    killer.join()
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(EngineCoreError):
        llm.generate("again", use_tqdm=False)
    llm.close()
    assert not _alive(pid)


def test_a_cancelled_start_up_kills_the_half_started_core(model_dir):
    import multiprocessing

    from detinfer.engine.core_process import CoreSpec, start_core

    before = {p.pid for p in multiprocessing.active_children()}  # the module's own core may be running
    cancel = threading.Event()
    cancel.set()  # already cancelled when the core is spawned: it cannot have loaded the model, on any machine
    with pytest.raises(EngineCoreError, match="start-up cancelled"):
        start_core(CoreSpec(str(model_dir), EngineConfig(**KW), "cpu"), cancel=cancel)
    assert {p.pid for p in multiprocessing.active_children()} <= before, "the half-started core is still running"


def test_close_stops_the_core_process(proc_llm):
    """Runs last in this module: it closes the module's engine process."""
    pid = proc_llm.engine.core.pid
    assert _alive(pid)
    proc_llm.close()
    proc_llm.close()  # idempotent
    assert not _alive(pid)


@pytest.mark.gpu
def test_engine_process_on_the_gpu_is_bit_identical(model_dir):
    """On CUDA (bf16, CUDA graphs): the core process's outputs equal the in-process engine's, bit for bit."""
    kw = dict(KW, dtype="bfloat16")
    reference = LLM(str(model_dir), device="cuda", **kw).generate(PROMPTS, _params(), use_tqdm=False)
    with LLM(str(model_dir), device="cuda", engine_process=True, **kw) as llm:
        assert llm.engine.core.info["device"].startswith("cuda")
        assert llm.generate(PROMPTS, _params(), use_tqdm=False) == reference
