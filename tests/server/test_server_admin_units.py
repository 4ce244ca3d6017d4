"""engine/admin.py without a server: the hold-until-idle queue (property-based), weight loading from every
accepted layout (directory, HF-named file, detinfer-named subset), validation that names the tensor and leaves
the weights untouched, and the weights fingerprint."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from detinfer.engine import EngineConfig, LLMEngine, SamplingParams
from detinfer.engine.admin import HeldCommands, run_admin, weights_sha256
from detinfer.engine.drive import drive
from detinfer.models.testing import write_tiny_checkpoint

CONFIG = EngineConfig(max_num_batched_tokens=32, max_num_seqs=4, block_size=4, num_kv_blocks=48)
TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
            max_position_embeddings=64)


# -- HeldCommands ----------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3)), max_size=30))
def test_held_commands_keep_order_and_run_admin_only_when_idle(script):
    """Commands ("a" admin / "r" request) arrive in order; a request keeps the engine busy for `work` release
    rounds. Applied order == arrival order, and every admin command is applied while the engine is idle."""
    held = HeldCommands(lambda c: c[0] == "a")
    busy = [0]  # release rounds the engine stays busy
    applied, idle_at_admin = [], []

    def apply(c):
        applied.append(c)
        if c[0] == "a":
            idle_at_admin.append(busy[0] == 0)
        else:
            busy[0] += c[2]

    for i, (is_admin, work) in enumerate(script):
        c = ("a" if is_admin else "r", i, work)
        if not held.offer(c):
            apply(c)
        held.release(lambda: busy[0] == 0, apply)
        busy[0] = max(0, busy[0] - 1)  # one engine step
    while held:
        held.release(lambda: busy[0] == 0, apply)
        busy[0] = max(0, busy[0] - 1)
    assert [c[1] for c in applied] == list(range(len(script)))
    assert all(idle_at_admin)


# -- weight loading --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("admin_units")
    return (write_tiny_checkpoint(base / "a", "LlamaForCausalLM", seed=1, **TINY),
            write_tiny_checkpoint(base / "b", "LlamaForCausalLM", seed=2, **TINY))


def _sample(engine, prompt="hello world"):
    out = drive(engine, [(0, "r", prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True,
                                                         logprobs=1))])["r"]
    return out.outputs[0].token_ids, [e.logprob for e in out.outputs[0].logprobs]


def test_load_directory_equals_fresh_engine_and_changes_fingerprint(dirs):
    a, b = dirs
    engine, fresh_b = LLMEngine(a, CONFIG, device="cpu"), LLMEngine(b, CONFIG, device="cpu")
    before = run_admin(engine, "weights_fingerprint")["weights_sha256"]
    _sample(engine)  # fills the prefix cache
    result = run_admin(engine, "load_weights", str(b))
    assert result["weights_sha256"] != before
    assert result["weights_sha256"] == weights_sha256(fresh_b.runner.model)
    assert result["prefix_cache_blocks_dropped"] > 0
    assert _sample(engine) == _sample(fresh_b)  # bitwise: tokens and float logprobs


def test_load_hf_named_file_and_detinfer_named_subset(dirs, tmp_path):
    a, b = dirs
    engine, fresh_b = LLMEngine(a, CONFIG, device="cpu"), LLMEngine(b, CONFIG, device="cpu")
    run_admin(engine, "load_weights", str(b / "model.safetensors"))  # HF names, one file
    assert weights_sha256(engine.runner.model) == weights_sha256(fresh_b.runner.model)
    # a subset under detinfer's names: only that tensor changes
    name, p = next(iter(engine.runner.model.named_parameters()))
    new = p.detach().clone() + 0.5
    save_file({name: new.contiguous()}, tmp_path / "one.safetensors")
    result = run_admin(engine, "load_weights", str(tmp_path / "one.safetensors"))
    assert result["tensors_loaded"] == 1
    assert torch.equal(dict(engine.runner.model.named_parameters())[name], new)


@pytest.mark.parametrize("case", ["shape", "name", "dtype", "nan", "missing"])
def test_bad_weights_name_the_tensor_and_change_nothing(dirs, tmp_path, case):
    a, _ = dirs
    engine = LLMEngine(a, CONFIG, device="cpu")
    before = weights_sha256(engine.runner.model)
    name, p = next(iter(engine.runner.model.named_parameters()))
    good = next(n for n, _ in list(engine.runner.model.named_parameters())[1:])
    tensors = {good: dict(engine.runner.model.named_parameters())[good].detach().clone() + 1.0}  # valid, first
    if case == "shape":
        tensors[name] = torch.zeros(p.shape[0] + 1, *p.shape[1:])
    elif case == "name":
        tensors["layers.99.nonexistent.weight"] = torch.zeros(2)
    elif case == "dtype":
        tensors[name] = torch.zeros(p.shape, dtype=torch.int32)
    elif case == "nan":
        tensors[name] = torch.full(p.shape, float("nan"))
    path = tmp_path / "bad.safetensors"
    if case != "missing":
        save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    with pytest.raises(ValueError) as e:
        run_admin(engine, "load_weights", str(path))
    expected = {"shape": name, "name": "layers.99.nonexistent.weight", "dtype": name, "nan": name,
                "missing": "no such file"}[case]
    assert expected in str(e.value)
    assert weights_sha256(engine.runner.model) == before  # atomic: the valid tensor was not copied either


def test_admin_refuses_a_busy_engine_and_unknown_ops(dirs):
    engine = LLMEngine(dirs[0], CONFIG, device="cpu")
    with pytest.raises(ValueError, match="unknown admin operation"):
        run_admin(engine, "nope")
    engine.add_request("r", "hi", SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="unfinished"):
        run_admin(engine, "reset_prefix_cache")


# -- the engine core: admin held until idle, aborts of held adds, over both transports ----------------------
class _QueueTransport:
    """EngineCore on a thread, commands through a queue (the server's --no-engine-process mode)."""

    def __init__(self, engine):
        import queue

        from detinfer.engine.core import EngineCore, take_from

        self.commands, self.events = queue.SimpleQueue(), queue.SimpleQueue()
        self.core = EngineCore(engine, take_from(self.commands), self.events.put)

    def send(self, command):
        self.commands.put(command)

    def recv(self):
        return self.events.get(timeout=60)

    def output(self, out):
        return out

    def run(self):
        self.core.run()


class _SocketTransport:
    """EngineCore behind core_wire's framing (the engine process's loop, here on a thread): deltas out."""

    def __init__(self, engine):
        import socket

        from detinfer.engine import core_wire as wire

        self.wire, self.engine = wire, engine
        self.ours, self.theirs = socket.socketpair()
        self.assembler = wire.OutputAssembler()

    def send(self, command):
        self.wire.send(self.ours, self.wire.encode_prompts(command))

    def recv(self):
        return self.wire.recv(self.ours)

    def output(self, delta):
        return self.assembler.apply(delta)

    def run(self):
        from detinfer.engine.core_process import serve_core

        serve_core(self.engine, self.theirs)


@pytest.mark.parametrize("transport", [_QueueTransport, _SocketTransport])
def test_core_holds_admin_until_idle_and_aborts_reach_held_adds(dirs, transport):
    """An admin operation sent while A runs is answered only after A's final output; B, added behind it and
    aborted before its add was applied, ends with finish_reason "abort" and no token (it must not run to
    max_tokens after the operation); C, refused as a group for C1's empty prompt, leaves nothing running.
    The same with the core on a thread and behind the process wire format."""
    import threading

    from detinfer.engine.core import Abort, Added, AddRequests, Admin, Reply, Shutdown, StepDone

    engine = LLMEngine(dirs[0], CONFIG, device="cpu")
    t = transport(engine)
    long = SamplingParams(max_tokens=30, ignore_eos=True)
    t.send(AddRequests(0, (("A", [1, 2, 3, 4, 5], long),)))
    t.send(Admin(1, "reset_prefix_cache"))
    t.send(AddRequests(2, (("B", [5, 4, 3], long),)))
    t.send(Abort(("B",)))
    t.send(AddRequests(3, (("C0", [1, 2], long), ("C1", [], long))))
    loop = threading.Thread(target=t.run, daemon=True)
    loop.start()  # all are queued before the loop reads any: A is running when the admin op arrives
    events, finals, added = [], {}, {}
    while len(finals) < 2 or "reply" not in events or len(added) < 3:
        event = t.recv()
        if isinstance(event, StepDone):
            for item in event.outputs:
                out = t.output(item)
                if out.request_id == "C0":  # rolled back: it only reports its abort (the front end drops it)
                    assert out.finished and out.outputs[0].finish_reason == "abort" and not out.outputs[0].token_ids
                    continue
                assert out.request_id in ("A", "B")
                if out.finished:
                    finals[out.request_id] = out
                    events.append(f"final {out.request_id}")
        elif isinstance(event, Reply):
            events.append("reply")
            assert event.error is None and event.token == 1, event
        elif isinstance(event, Added):
            added[event.token] = event.error
    t.send(Shutdown())
    loop.join(30)
    assert not loop.is_alive()
    assert events.index("final A") < events.index("reply")
    assert finals["A"].outputs[0].finish_reason == "length" and len(finals["A"].outputs[0].token_ids) == 30
    assert finals["B"].outputs[0].finish_reason == "abort" and finals["B"].outputs[0].token_ids == ()
    assert added[0] is None and added[2] is None and added[3][0] == "ValueError"
    assert not engine.has_unfinished_requests()


@pytest.mark.gpu
def test_gpu_load_weights_under_cuda_graphs_equals_a_fresh_engine(tmp_path):
    """bf16 on CUDA with CUDA graphs captured over the old weights: the in-place load keeps the graphs valid,
    so sampling after the load equals, bit for bit, an engine started on the new checkpoint."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    shape = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                 dtype="bfloat16")
    a = write_tiny_checkpoint(tmp_path / "a", "Qwen3ForCausalLM", seed=1, **shape)
    b = write_tiny_checkpoint(tmp_path / "b", "Qwen3ForCausalLM", seed=2, **shape)
    cfg = EngineConfig(max_num_batched_tokens=256, max_num_seqs=8, block_size=16, num_kv_blocks=128,
                       dtype="bfloat16")
    engine = LLMEngine(a, cfg, device="cuda")
    _sample(engine)  # graphs captured and replayed on the old weights
    run_admin(engine, "load_weights", str(b))
    got = _sample(engine)
    del engine
    fresh = LLMEngine(b, cfg, device="cuda")
    assert got == _sample(fresh)
