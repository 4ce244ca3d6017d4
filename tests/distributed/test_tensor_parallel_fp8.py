"""FP8 under tensor parallelism on CPU (gloo worker processes), asserted bitwise.

- With tp_invariant_reduction, TP=2 gives TP=1's bits for an FP8 model (row-parallel fp8 partials per fixed
  K chunk, each chunk whole 128-column scale blocks, added in the fixed tree); without it, TP=2 is
  batch-invariant (a request alone == among others).
- A random preset in FP8 draws, on each rank, exactly the slices of the TP=1 quantized weights (scales
  included), dense and MoE.
- Shapes whose row-parallel slices would cut a 128-column scale block are refused, naming the dim.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from detinfer.distributed import check_tp_config
from detinfer.engine import EngineConfig, LLMEngine, SamplingParams
from detinfer.engine.testing import drive
from detinfer.kernels.fp8_quant import FP8_DTYPE
from detinfer.models.config import ModelConfig
from detinfer.models.random_weights import random_state
from detinfer.models.sharding import shard_spec, take_shard
from detinfer.models.testing import tiny_config_dict, write_tiny_checkpoint

VOCAB = 322
# q size 4 x 128 = 512 and intermediate 512: 4 tp_invariant chunks of 128 columns, 2 per rank at TP=2
MODEL = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             head_dim=128, num_hidden_layers=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tp_fp8") / "llama", "LlamaForCausalLM", seed=9, **MODEL)


def _requests():
    rng = random.Random(3)
    out = []
    for i in range(4):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 20))]
        params = SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=4, logprobs=2, ignore_eos=True)
        out.append((i // 2, f"r{i}", prompt, params))
    return out


def _engine(model_dir, tp, **kw):
    cfg = dict(max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_kv_blocks=64, max_model_len=64,
               quantization="fp8")
    return LLMEngine(model_dir, EngineConfig(tensor_parallel_size=tp, **{**cfg, **kw}), device="cpu")


def _run(engine, requests):
    try:
        return drive(engine, requests, max_steps=400)
    finally:
        engine.close()


def test_tp2_equals_tp1_with_invariant_reduction(model_dir):
    reqs = _requests()
    one = _run(_engine(model_dir, 1, tp_invariant_reduction=True), reqs)
    two = _run(_engine(model_dir, 2, tp_invariant_reduction=True), reqs)
    assert all(sig.error is None and len(sig.completions[0].token_ids) == 4 for sig in one.values())
    assert one == two


def test_tp2_alone_equals_batched(model_dir):
    reqs = _requests()
    engine = _engine(model_dir, 2)
    try:
        batched = drive(engine, reqs, max_steps=400)
        for _, rid, prompt, params in reqs[:2]:
            alone = drive(engine, [(0, rid + "-alone", prompt, params)], max_steps=400)[rid + "-alone"]
            assert alone == batched[rid]
    finally:
        engine.close()


@pytest.mark.parametrize("arch,extra", [("LlamaForCausalLM", {}),
                                        ("Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                                                     moe_intermediate_size=64))])
def test_random_fp8_shards_are_slices_of_the_full_model(arch, extra):
    # hidden 200 and q/kv rows that end mid-block: a rank's row slice must still get the full tensor's scales
    cfg = tiny_config_dict(arch, vocab_size=VOCAB, hidden_size=200, intermediate_size=256, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, extra=extra)
    config = dataclasses.replace(ModelConfig.from_dict(cfg), quantization="fp8")
    full = random_state(config, seed=2, dtype=torch.bfloat16, device="cpu")
    for rank in range(2):
        shard = random_state(config, seed=2, dtype=torch.bfloat16, device="cpu", rank=rank, size=2)
        assert shard.keys() == full.keys()
        for name, t in full.items():
            want = take_shard(t, shard_spec(name, tuple(t.shape), config, rank, 2))
            got = shard[name]
            bits = (lambda v: v.view(torch.uint8)) if t.dtype == FP8_DTYPE else (lambda v: v)
            assert got.shape == want.shape and torch.equal(bits(got), bits(want)), (rank, name)


def test_row_parallel_slices_must_hold_whole_scale_blocks():
    cfg = dataclasses.replace(ModelConfig.from_dict(tiny_config_dict("LlamaForCausalLM", **{
        k: v for k, v in MODEL.items() if k != "num_hidden_layers"})), quantization="fp8")
    check_tp_config(cfg, 2)  # 512 / 2 and 512 / 4 chunks are whole blocks
    check_tp_config(cfg, 2, invariant=True)
    narrow = dataclasses.replace(cfg, intermediate_size=384)  # 384 / 2 = 192 columns per rank
    with pytest.raises(ValueError, match=r"intermediate_size=384 splits into 2 slices of 192"):
        check_tp_config(narrow, 2)
    small = dataclasses.replace(cfg, head_dim=64)  # q size 256: 4 invariant chunks of 64
    with pytest.raises(ValueError, match=r"q size=256 splits into 4 slices of 64"):
        check_tp_config(small, 1, invariant=True)
