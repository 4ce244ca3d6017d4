"""A tensor-parallel sampler and a one-process trainer agree bit for bit: with tp_invariant_reduction the
TP=2 engine's row-parallel sums are TP=1's chunk tree, and a `TrainableModel` on a TP=1 engine with the flag
runs that tree in its forward (`DifferentiableOps.linear_tree`). CPU, gloo, 2 processes; dense and MoE."""

import pytest
import torch

from detinfer.engine import EngineConfig, LLMEngine, SamplingParams
from detinfer.engine.drive import drive
from detinfer.models.testing import write_tiny_checkpoint
from detinfer.train import TrainableModel

CKPTS = {
    "llama": ("LlamaForCausalLM", dict(vocab_size=322, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=8, attention_bias=True, mlp_bias=True)),
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(vocab_size=322, hidden_size=32, intermediate_size=64,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                              extra={"num_experts": 4, "num_experts_per_tok": 2,
                                                     "moe_intermediate_size": 16})),
}
ENGINE = dict(max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_kv_blocks=64, max_model_len=64,
              tp_invariant_reduction=True)


def _generate(engine, prompts, params):
    done = drive(engine, [(0, str(i), p, params) for i, p in enumerate(prompts)])
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("name", list(CKPTS))
def test_trainer_on_tp1_with_the_flag_scores_a_tp2_samplers_tokens_bitwise(tmp_path, name):
    arch, kw = CKPTS[name]
    model_dir = write_tiny_checkpoint(tmp_path / name, arch, seed=3, **kw)
    prompts = [[1, 5, 9, 13, 17], [1, 22, 7], [1, 40, 41, 42, 43, 44, 45]]
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=4, logprobs=0, ignore_eos=True)
    sampler = LLMEngine(model_dir, EngineConfig(tensor_parallel_size=2, **ENGINE), device="cpu")
    try:
        outs = _generate(sampler, prompts, params)
    finally:
        sampler.close()
    trainer = TrainableModel(LLMEngine(model_dir, EngineConfig(**ENGINE), device="cpu"))
    seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    lp = trainer.score(torch.tensor([t for s in seqs for t in s]), cu)
    for o, a, b in zip(outs, cu[:-1], cu[1:]):
        n = len(o.prompt_token_ids)
        assert torch.equal(lp[a + n - 1:b - 1].detach(), torch.tensor([e.logprob for e in o.outputs[0].logprobs]))
    (-lp.sum()).backward()  # the chunk-tree layers train: their weights get gradients
    grads = [p.grad for n_, p in trainer.named_parameters() if n_.endswith(("o_proj.weight", "down_proj.weight"))]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_a_tensor_parallel_engine_is_refused_with_the_way_out(tmp_path):
    arch, kw = CKPTS["llama"]
    model_dir = write_tiny_checkpoint(tmp_path / "llama", arch, seed=3, **kw)
    engine = LLMEngine(model_dir, EngineConfig(tensor_parallel_size=2, **ENGINE), device="cpu")
    try:
        with pytest.raises(ValueError, match="tensor_parallel_size=1.*tp_invariant_reduction=True"):
            TrainableModel(engine)
    finally:
        engine.close()
