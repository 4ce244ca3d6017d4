"""Programmatic dependent launch (kernels/_pdl.py): where it is on, what the decode matmuls prefetch, and (GPU)
that PDL launches give the same bits as plain ones, eagerly and chained inside a CUDA graph, op by op
and through the engine."""

import gc

import pytest
import torch

from detinfer.kernels import _pdl
from detinfer.kernels import matmul as mm


@pytest.fixture
def pdl_switch():
    """Restores the process-wide switch (and drops launches cached under the other setting's keys)."""
    before = _pdl.enabled()
    yield _pdl.set_enabled
    _pdl.set_enabled(before)
    mm.clear_config_cache()


def test_off_the_gpu_nothing_uses_pdl(pdl_switch):
    pdl_switch(True)
    assert not _pdl.use_pdl(torch.device("cpu"))
    assert _pdl.launch_options(False) == {}
    assert _pdl.launch_options(True) == {"launch_pdl": True}


@pytest.mark.parametrize("elem", [2, 4])
def test_prefetch_is_for_decode_class_weights_under_pdl(elem):
    line = 128 // elem
    on = dict(PREFETCH_K=mm.PREFETCH_COLS, LINE_K=line)
    off = dict(PREFETCH_K=0, LINE_K=1)
    assert mm._prefetch(True, 1, 4096, 1, elem) == on
    assert mm._prefetch(True, mm.PREFETCH_MAX_M, 12288, 1, elem) == on
    assert mm._prefetch(False, 1, 4096, 1, elem) == off  # no PDL: the kernel starts after its predecessor
    assert mm._prefetch(True, mm.PREFETCH_MAX_M + 1, 4096, 1, elem) == off  # not a decode-class launch
    assert mm._prefetch(True, 1, 4096, 4096, elem) == off  # K is not the unit-stride dim (not a weight)
    assert mm._prefetch(True, 1, mm.PREFETCH_COLS - 1, 1, elem) == off  # shorter than the prefetch


def test_switch_off_at_runtime(pdl_switch):
    pdl_switch(False)
    assert not _pdl.enabled()
    if torch.cuda.is_available():
        assert not _pdl.use_pdl(torch.device("cuda"))


# ----------------------------------------------------------------------------------------------- GPU
def _needs_pdl_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (marker gpu)")
    if torch.cuda.get_device_capability()[0] < 9 or not _pdl._TRITON_OK:
        pytest.skip("PDL needs compute capability >= 9.0 and a Triton with gdc intrinsics")


def _decode_chain(x, res, norm_w, w_qkv, w_o, w_gate_up, w_down):
    """A decode layer's op sequence (norm, qkv, o, norm, fused gate_up + SiLU*mul, down), each reading the
    previous output, so every boundary is a real dependency."""
    from detinfer.kernels.linear_silu_mul import linear_silu_mul
    from detinfer.kernels.rmsnorm import rms_norm

    h, res = rms_norm(x, norm_w, 1e-6, residual=res)
    a = mm.linear(h, w_qkv)[:, : w_o.shape[1]]
    o = mm.linear(a.contiguous(), w_o)
    h, res = rms_norm(o, norm_w, 1e-6, residual=res)
    return mm.linear(linear_silu_mul(h, w_gate_up), w_down), res


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_gpu_pdl_chain_bits_eager_and_graph(pdl_switch, m):
    _needs_pdl_gpu()
    g = torch.Generator(device="cuda").manual_seed(m)
    d, inner = 1024, 2816

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

    x, res = rand(m, d), rand(m, d)
    ws = (rand(d) + 1, rand(d + 512, d, scale=d ** -0.5), rand(d, d, scale=d ** -0.5),
          rand(2 * inner, d, scale=d ** -0.5), rand(d, inner, scale=inner ** -0.5))
    pdl_switch(False)
    mm.clear_config_cache()
    ref = [t.clone() for t in _decode_chain(x, res, *ws)]
    pdl_switch(True)
    mm.clear_config_cache()
    eager = _decode_chain(x, res, *ws)
    assert all(torch.equal(a, b) for a, b in zip(eager, ref))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _decode_chain(x, res, *ws)  # warm (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decode_chain(x, res, *ws)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, ref))


@pytest.mark.gpu
def test_gpu_engine_same_bits_with_and_without_pdl(pdl_switch, tmp_path):
    _needs_pdl_gpu()
    from detinfer.engine import EngineConfig, LLMEngine, SamplingParams
    from detinfer.engine.testing import drive
    from detinfer.models.testing import write_tiny_checkpoint

    model_dir = write_tiny_checkpoint(tmp_path / "qwen3", "Qwen3ForCausalLM", seed=5, vocab_size=2048,
                                      hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                                      max_position_embeddings=1024, dtype="bfloat16")
    requests = [(i % 4, f"r{i}", [(7 * i + 13 * j) % 2000 + 3 for j in range(5 + 37 * i)],
                 SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, ignore_eos=True)) for i in range(10)]

    def signature(out):
        return tuple((c.token_ids, tuple((e.token_id, float(e.logprob).hex()) for e in c.logprobs or ()))
                     for c in out.outputs)

    results = {}
    for on in (False, True):
        pdl_switch(on)
        mm.clear_config_cache()
        gc.collect()
        torch.cuda.empty_cache()
        engine = LLMEngine(model_dir, EngineConfig(max_num_batched_tokens=512, max_num_seqs=16, block_size=16,
                                                   num_kv_blocks=512, dtype="bfloat16"), device="cuda")
        assert engine.runner.use_graphs
        results[on] = drive(engine, requests, max_steps=5000, signature_of=signature)
        del engine
    assert results[True] == results[False]
