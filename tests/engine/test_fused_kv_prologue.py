"""The engine's attention prologue stores each layer's K/V in its own launch (`PagedAttention.prologue`):
with every kernel on (the dense kernels under the interpreter switch, the attention kernels at head_dim 64),
a prefill step, a mixed step with padding rows (slot -1) and decode steps give the same logits and the same
KV-pool bytes, bitwise, as the unfused path (the prologue kernel, then write_kv), in both modes, with and
without Qwen3's qk-norm (kernels/test_rope_qk_kv_write.py covers the kernel's cases in detail)."""

import pytest
import torch

from detinfer.cache.layout import StepLayout
from detinfer.engine import EngineConfig
from detinfer.engine.cuda_graphs import pad_layout
from detinfer.engine.model_runner import ModelRunner
from detinfer.engine.paged_attention import PagedAttention
from detinfer.kernels import rope_qk
from detinfer.models import load_model
from detinfer.models.testing import write_tiny_checkpoint
from detinfer.ops import Ops

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
BLOCK = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(arch):
        if arch not in made:
            # head_dim 64 (the attention kernels' size) and GQA (4 query heads on 2 KV heads) are what the
            # prologue sees; the hidden and MLP widths only size the matmuls both paths share (in the
            # interpreter each 32-wide K block of a deterministic-mode matmul costs time), so they are small.
            made[arch] = write_tiny_checkpoint(tmp_path_factory.mktemp("kv_prologue") / arch, arch, seed=5,
                                               hidden_size=32, intermediate_size=32, num_attention_heads=4,
                                               num_key_value_heads=2, head_dim=64, num_hidden_layers=1)
        return made[arch]
    return get


def runner_for(model_dir, mode):
    model, config = load_model(model_dir, dtype=torch.float32, mode=mode)
    model.set_ops(Ops(mode, "cpu", torch.float32, head_dim=config.head_dim, cpu_triton=True))
    cfg = EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, block_size=BLOCK, max_model_len=64,
                       dtype="float32", mode=mode)
    runner = ModelRunner(model, config, cfg, num_kv_blocks=24)
    for pools in runner.kv_cache:  # a slot nobody wrote stays NaN: a stray or missing write shows
        for pool in pools:
            pool.fill_(float("nan"))
    assert runner.backend == "kernel" and not runner.use_graphs
    return runner


def steps(vocab):
    """Prefill of two sequences, one mixed step (a chunk of a third + a decode) padded to 16 tokens, decodes."""
    g = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    yield StepLayout.build(tables[:2], [0, 0], [9, 5], BLOCK, token_ids=[ids(9), ids(5)], num_logits=[1, 5])
    mixed = StepLayout.build(tables, [9, 5, 0], [1, 1, 7], BLOCK, token_ids=[ids(1), ids(1), ids(7)],
                             num_logits=[1, 1, 0])
    yield mixed, 16
    for done in (0, 1):
        yield StepLayout.build(tables[:2], [10 + done, 6 + done], [1, 1], BLOCK, token_ids=[ids(1), ids(1)],
                               num_logits=[1, 1])


def run_steps(runner, vocab):
    logits = []
    for step in steps(vocab):
        if isinstance(step, tuple):  # padded as a graph would pad it: rows with slot -1
            layout, tokens = step
            shape = runner.graph_shape(layout)
            assert shape is not None and shape.tokens == tokens
            padded = pad_layout(layout, shape)
            assert -1 in padded.slots
            logits.append(runner._run_eager(padded)[:len(layout.logit_rows)])
        else:
            logits.append(runner._run_eager(step))
    return logits


# Deterministic mode (its matmul kernels in the interpreter: the slow case) on the qk-norm model only.
@pytest.mark.parametrize("arch, mode", [("Qwen3ForCausalLM", "deterministic"), ("Qwen3ForCausalLM", "fast"),
                                        ("LlamaForCausalLM", "fast")])
def test_runner_fused_prologue_equals_the_unfused_path(checkpoints, arch, mode, monkeypatch):
    model_dir = checkpoints(arch)
    fused_calls = []
    real = rope_qk.qk_norm_rope_write_kv
    monkeypatch.setattr(rope_qk, "qk_norm_rope_write_kv", lambda *a, **kw: fused_calls.append(1) or real(*a, **kw))
    fused = runner_for(model_dir, mode)
    assert (fused.model.layers[0].self_attn.q_norm is not None) == arch.startswith("Qwen3")
    fused_logits = run_steps(fused, fused.model_config.vocab_size)
    assert len(fused_calls) == 4 * fused.model_config.num_hidden_layers  # every layer of every step
    fused_calls.clear()
    with monkeypatch.context() as m:
        m.setattr(PagedAttention, "prologue", None)  # the model then calls ops.qk_norm_rope + attn(...)
        plain = runner_for(model_dir, mode)
        plain_logits = run_steps(plain, plain.model_config.vocab_size)
    assert not fused_calls
    for a, b in zip(fused_logits, plain_logits, strict=True):
        assert torch.equal(a, b), f"{mode}: the fused prologue changed the logits"
    for (fk, fv), (pk, pv) in zip(fused.kv_cache, plain.kv_cache, strict=True):
        for got, want in ((fk, pk), (fv, pv)):
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"{mode}: KV pools differ"
    assert int((~fused.kv_cache[0][0][..., 0, 0].isnan()).sum()) == 9 + 5 + 9 + 2 * 2  # tokens written
