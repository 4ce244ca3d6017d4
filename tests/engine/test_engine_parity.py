"""Engine vs references: greedy tokens equal a plain greedy loop over the model with the reference
attention (logprobs close), the kernel and pure-torch attention backends agree, and the real stories260k
checkpoint reproduces the 40 greedy token ids recorded in its SOURCE.md, in both modes."""


import pytest
import torch

from detinfer.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from detinfer.models import ReferenceAttention, load_model
from detinfer.models.testing import write_tiny_checkpoint

PROMPT = [5, 77, 140, 9, 260, 31, 18, 200, 45, 99, 13, 250, 7, 64, 121, 33, 280, 17, 42]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_parity")
    common = dict(hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=64)
    return {"llama": write_tiny_checkpoint(root / "llama", "LlamaForCausalLM", seed=5, **common),
            "qwen3": write_tiny_checkpoint(root / "qwen3", "Qwen3ForCausalLM", seed=6, tie_word_embeddings=True,
                                           **common)}


def reference_greedy(model_dir, mode, prompt, n):
    """Prefill the whole prompt, then decode one token at a time, attention by ReferenceAttention."""
    model, cfg = load_model(model_dir, torch.float32, "cpu", mode)
    attn = ReferenceAttention(cfg.num_hidden_layers, cfg.softmax_scale)
    tokens, logprobs, feed = [], [], list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            positions = attn.begin(["s"], [len(feed)])
            hidden = model(torch.tensor(feed), positions, attn)
            logits = model.compute_logits(hidden[-1:])[0].double()
            tok = int(torch.argmax(logits))
            tokens.append(tok)
            logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
            feed = [tok]
    return tokens, logprobs


@pytest.mark.parametrize("mode", ["deterministic", "fast"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_matches_reference_loop(checkpoints, arch, mode):
    ref_tokens, ref_lps = reference_greedy(checkpoints[arch], mode, PROMPT, NEW_TOKENS)
    # Chunked prefill (budget 8) next to another request: the engine path, not a trivial one.
    engine = LLMEngine(checkpoints[arch], EngineConfig(mode=mode, max_num_batched_tokens=8, max_num_seqs=4,
                                                       block_size=4, num_kv_blocks=64), device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
    engine.add_request("target", PROMPT, params)
    engine.add_request("other", PROMPT[:7] + [3, 4], params)
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    out = final["target"].outputs[0]
    assert list(out.token_ids) == ref_tokens
    got = [e.logprob for e in out.logprobs]
    assert got == pytest.approx(ref_lps, abs=2e-4, rel=0)
    assert out.cumulative_logprob == pytest.approx(sum(ref_lps), abs=1e-3)


def test_kernel_and_ref_attention_backends_agree(checkpoints):
    results = {}
    for backend in ("kernel", "ref"):
        engine = LLMEngine(checkpoints["llama"], EngineConfig(max_num_batched_tokens=16, max_num_seqs=4,
                                                              block_size=4, num_kv_blocks=64),
                           device="cpu", attention_backend=backend)
        assert engine.runner.backend == backend
        engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=6, logprobs=0,
                                                       prompt_logprobs=0, ignore_eos=True))
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    results[backend] = o
    kern, ref = results["kernel"], results["ref"]
    assert kern.outputs[0].token_ids == ref.outputs[0].token_ids
    assert [e.logprob for e in kern.outputs[0].logprobs] == pytest.approx(
        [e.logprob for e in ref.outputs[0].logprobs], abs=1e-4)
    assert [e.logprob for e in kern.prompt_logprobs[1:]] == pytest.approx(
        [e.logprob for e in ref.prompt_logprobs[1:]], abs=1e-4)


def test_unsupported_kernel_backend_is_refused(checkpoints, tmp_path):
    odd = write_tiny_checkpoint(tmp_path / "hd16", "LlamaForCausalLM")  # head_dim 16: no kernel for it
    with pytest.raises(ValueError, match="head_dim 16"):
        LLMEngine(odd, EngineConfig(num_kv_blocks=16), device="cpu", attention_backend="kernel")
    with pytest.raises(ValueError, match="attention_backend"):
        LLMEngine(checkpoints["llama"], EngineConfig(num_kv_blocks=16), device="cpu", attention_backend="x")


@pytest.mark.parametrize("mode", ["deterministic", "fast"])
def test_stories260k_once_upon_a_time(stories_dir, stories_expected, mode):
    llm = LLM(str(stories_dir), mode=mode, max_num_batched_tokens=64, max_num_seqs=4)
    # Alongside two other prompts, so the 40 ids come from a shared batch.
    outs = llm.generate(["Once upon a time", "The little dog", "Once upon a time"],
                        SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    first, third = outs[0], outs[2]
    assert list(first.prompt_token_ids) == stories_expected["prompt_ids"]
    assert list(first.outputs[0].token_ids[:40]) == stories_expected["new_ids"]
    assert first.prompt + first.outputs[0].text == stories_expected["text"]
    assert third.outputs[0].token_ids == first.outputs[0].token_ids
