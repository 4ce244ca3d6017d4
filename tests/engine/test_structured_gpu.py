"""Structured output on the GPU (bf16, Triton kernels, CUDA graphs): a structured request's tokens and
logprobs are bitwise the same alone as among other structured and free requests, at several token budgets,
with graphs on and off and overlapped scheduling on and off.

Skipped (shown as skipped) without CUDA. The model is a random bf16 Qwen3-shaped checkpoint whose vocab
(2048) is larger than its tokenizer's (320): ids past the tokenizer must never be allowed by a grammar.
"""

import gc
import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.engine import EngineConfig, LLMEngine, SamplingParams, StructuredOutputs
from detinfer.engine.testing import drive
from detinfer.models.testing import write_tiny_checkpoint

pytestmark = pytest.mark.gpu
pytest.importorskip("llguidance")
VOCAB = 2048
CONSTRAINTS = [
    StructuredOutputs(json_object=True),
    StructuredOutputs(json={"type": "object", "properties": {"n": {"type": "integer"}, "b": {"type": "boolean"}},
                            "required": ["n", "b"], "additionalProperties": False}),
    StructuredOutputs(regex=r"[a-z]{2,8}( [a-z]{2,8}){0,3}"),
    StructuredOutputs(choice=["yes", "no", "maybe"]),
    StructuredOutputs(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("structured_gpu") / "qwen3", "Qwen3ForCausalLM", seed=11,
                                 vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                                 max_position_embeddings=1024, dtype="bfloat16")


def make(model_dir, **kw):
    gc.collect()
    torch.cuda.empty_cache()
    cfg = dict(max_num_batched_tokens=512, max_num_seqs=16, block_size=16, num_kv_blocks=512, dtype="bfloat16")
    cfg.update(kw)
    return LLMEngine(model_dir, EngineConfig(**cfg), device="cuda")


def _requests(seed, n_other):
    rng = random.Random(seed)

    def params(i, logprobs=None):
        so = CONSTRAINTS[i % len(CONSTRAINTS)] if i % 3 else None
        if i % 2:
            return SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 40), logprobs=logprobs,
                                  structured_outputs=so)
        return SamplingParams(temperature=0.9, seed=i, max_tokens=rng.randint(4, 40), logprobs=logprobs,
                              structured_outputs=so)

    def prompt():
        return [rng.randrange(3, 320) for _ in range(rng.randint(1, 200))]

    target = (0, "target", prompt(), params(rng.choice([1, 2, 4, 5, 7, 8]), logprobs=4))
    others = [(rng.randint(0, 10), f"o{i}", prompt(), params(i)) for i in range(n_other)]
    return target, others


@settings(max_examples=6)
@given(seed=st.integers(0, 10_000), n_other=st.integers(1, 12))
def test_structured_request_alone_equals_batched_on_gpu(model_dir, seed, n_other):
    target, others = _requests(seed, n_other)
    alone = drive(make(model_dir), [target], max_steps=5000)["target"]
    for budget, eager, overlap in ((64, False, True), (512, True, False), (512, False, True)):
        engine = make(model_dir, max_num_batched_tokens=budget, enforce_eager=eager, async_scheduling=overlap)
        got = drive(engine, [target, *others], max_steps=5000)
        assert got["target"] == alone, (budget, eager, overlap)
        for _, rid, _, params in [target, *others]:
            (c,) = got[rid].completions
            assert all(t < 320 for t in c.token_ids if params.structured_outputs is not None)
            if params.structured_outputs is not None and params.structured_outputs.kind.startswith("json") \
                    and c.finish_reason == "stop":
                assert isinstance(json.loads(c.text), dict)
        del engine
