"""The trainer's logprobs equal the sampler's, bit for bit (deterministic mode, CPU).

The engine samples sequences inside mixed batches (greedy and seeded rows, chunked prefill, a shared
prefix served from the prefix cache, two engine configurations); then `TrainableModel.score` recomputes
every prompt and output logprob of those sequences in several training packings (all packed, reversed
with a filler sequence, one by one, a padded [B, T] batch, only the reported positions in row chunks).
Every value must be `torch.equal` to what the
engine returned. Also: two backward passes give bitwise identical gradients.
"""

import pytest
import torch

from detinfer.engine import LLM, SamplingParams
from detinfer.train import TrainableModel

MODELS = ["stories260k", "llama-bias-tied", "qwen3-mqa"]
ENGINES = {  # two engine configurations: different token budgets (chunking), block sizes, batch widths
    "budget16": dict(max_num_batched_tokens=16, max_num_seqs=3, block_size=8),
    # a KV pool of 32 blocks of 2 tokens (one max_model_len sequence) for 6 sequences: preemption
    "budget64": dict(max_num_batched_tokens=64, max_num_seqs=8, block_size=2, num_kv_blocks=32, max_model_len=64),
}


def _prompts(vocab: int):
    shared = [1, 17, 29, 41, 53, 65, 77, 89, 101, 113]  # a shared prefix (prefix cache hits)
    prompts = [shared + [7, 8], shared + [9], [1, 44, 55], [1] + [(13 * i + 5) % vocab for i in range(19)],
               [1, 8], shared + [3, 4, 5, 6]]
    # Requests asking for prompt logprobs skip the prefix cache; the seeded ones without them hit it.
    params = [SamplingParams(max_tokens=6, temperature=0, logprobs=1, prompt_logprobs=1),
              SamplingParams(max_tokens=5, temperature=0.9, seed=5, logprobs=0),
              SamplingParams(max_tokens=4, temperature=1.0, top_k=20, seed=11, logprobs=2, prompt_logprobs=0)]
    return prompts, [params[i % 3] for i in range(len(prompts))]


def _expected(outs):
    """Per sequence: (tokens, the engine's logprob of token i+1 given tokens 0..i for the positions it
    reported, the first such position): prompt logprobs when asked for, then the output logprobs."""
    result = []
    for o in outs:
        seq = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        prompt = [e.logprob for e in o.prompt_logprobs[1:]] if o.prompt_logprobs is not None else []
        skip = 0 if o.prompt_logprobs is not None else len(o.prompt_token_ids) - 1
        result.append((seq, torch.tensor(prompt + [e.logprob for e in o.outputs[0].logprobs]), skip))
    return result


def _rows(lp, cu, skips):
    return [lp[a + k:b - 1].detach() for a, b, k in zip(cu[:-1], cu[1:], skips)]


def _sample(model_dir, engine_kwargs):
    llm = LLM(str(model_dir), device="cpu", mode="deterministic", **{"max_model_len": 128, **engine_kwargs})
    prompts, params = _prompts(llm.engine.model_config.vocab_size)
    outs = llm.generate(prompts, params, use_tqdm=False)
    if engine_kwargs.get("num_kv_blocks"):
        assert llm.engine.stats().num_preemptions > 0
    seqs, expected, skips = zip(*_expected(outs))
    return llm, list(seqs), (list(expected), list(skips))


def _packed(seqs):
    ids = torch.tensor([t for s in seqs for t in s])
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    return ids, cu


@pytest.fixture(scope="module", params=MODELS)
def sampled(request, model_dirs):
    # The second engine configuration only for stories260k (pure-torch attention, fast on CPU): the
    # Triton-interpreter models would double the test time for a property the engine's tests cover.
    names = list(ENGINES) if request.param == "stories260k" else ["budget16"]
    runs = {name: _sample(model_dirs[request.param], ENGINES[name]) for name in names}
    return request.param, runs


def _check(lp_rows, expected):
    for i, (got, want) in enumerate(zip(lp_rows, expected, strict=True)):
        assert got.shape == want.shape, (i, got.shape, want.shape)
        assert torch.equal(got, want), (i, (got - want).abs().max().item())


def test_score_equals_engine_logprobs_in_every_packing(sampled):
    name, runs = sampled
    llm, seqs, (expected, skips) = runs["budget16"]
    trainer = TrainableModel(llm)
    ids, cu = _packed(seqs)
    with torch.no_grad():
        lp = trainer.score(ids, cu)
    _check(_rows(lp, cu, skips), expected)
    assert torch.equal(lp[[b - 1 for b in cu[1:]]], torch.zeros(len(seqs)))  # no next token: 0
    # reversed order, with a filler sequence in front
    filler = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    ids2, cu2 = _packed([filler] + seqs[::-1])
    lp2 = trainer.score(ids2, torch.tensor(cu2, dtype=torch.int32))  # with autograd this time
    _check(_rows(lp2, cu2, [0] + skips[::-1])[1:][::-1], expected)
    # one sequence per call
    _check([trainer.score(torch.tensor(s)).detach()[k:-1] for s, k in zip(seqs[:2], skips)], expected[:2])
    # a padded [B, T] batch
    width = max(map(len, seqs)) + 3
    padded = torch.zeros((len(seqs), width), dtype=torch.int64)
    for i, s in enumerate(seqs):
        padded[i, :len(s)] = torch.tensor(s)
    lp3 = trainer.score(padded, lengths=[len(s) for s in seqs]).detach()
    _check([lp3[i, k:len(s) - 1] for i, (s, k) in enumerate(zip(seqs, skips))], expected)
    # only the reported positions (the RL loop's completion tokens), in chunks of 64 rows, with autograd
    chunked = TrainableModel(llm, logprob_chunk_rows=64)
    positions = [i for a, b, k in zip(cu[:-1], cu[1:], skips) for i in range(a + k, b - 1)]
    lp4 = chunked.score(ids, cu, positions=positions)
    assert lp4.shape == (len(positions),) and lp4.requires_grad
    _check(lp4.detach().split([len(e) for e in expected]), expected)
    mask = torch.zeros_like(padded, dtype=torch.bool)  # the padded batch, masked to the same positions
    for i, (s, k) in enumerate(zip(seqs, skips)):
        mask[i, k:len(s) - 1] = True
    lp5 = chunked.score(padded, lengths=[len(s) for s in seqs], mask=mask).detach()
    _check([lp5[i, k:len(s) - 1] for i, (s, k) in enumerate(zip(seqs, skips))], expected)
    assert torch.equal(lp5[~mask], torch.zeros(int((~mask).sum())))
    if "budget64" not in runs:
        return
    # the same prompts sampled under another engine configuration (with preemption)
    llm_b, seqs_b, (expected_b, skips_b) = runs["budget64"]
    ids_b, cu_b = _packed(seqs_b)
    _check(_rows(TrainableModel(llm_b).score(ids_b, cu_b), cu_b, skips_b), expected_b)


def test_two_backward_passes_are_bitwise_equal(sampled):
    name, runs = sampled
    llm, seqs, _ = runs["budget16"]
    seqs = seqs[:3]
    trainer = TrainableModel(llm)
    ids, cu = _packed(seqs)
    weights = torch.linspace(-1, 1, ids.shape[0])
    grads = []
    for _ in range(2):
        trainer.zero_grad()
        (trainer.score(ids, cu) * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in trainer.named_parameters()})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 5
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n
        assert torch.isfinite(grads[0][n]).all(), n
    assert any(g.abs().sum() > 0 for g in grads[0].values())


def test_rl_loop_trainer_still_matches_sampler_after_updates(model_dirs):
    """sample -> score -> step -> push_weights -> sample again: the new samples' logprobs equal the
    trainer's under the new weights. push_weights drops the engine's prefix cache (KV of the old weights);
    without that, requests hitting the cache report stale logprobs (checked last)."""
    llm = LLM(str(model_dirs["stories260k"]), device="cpu", mode="deterministic", max_model_len=128,
              **ENGINES["budget16"])
    trainer = TrainableModel(llm)
    opt = torch.optim.SGD(trainer.parameters(), lr=0.05)
    prompts, params = _prompts(512)
    llm.generate(prompts, params, use_tqdm=False)  # warm the prefix cache

    def sample_and_score():
        hits = llm.engine.stats().prefix_cache_hit_tokens
        seqs, expected, skips = zip(*_expected(llm.generate(prompts, params, use_tqdm=False)))
        ids, cu = _packed(seqs)
        lp = trainer.score(ids, cu)
        return lp, _rows(lp, cu, skips), list(expected), llm.engine.stats().prefix_cache_hit_tokens - hits
    for step in range(2):
        lp, rows, expected, hits = sample_and_score()
        _check(rows, expected)
        assert hits > 0 if step == 0 else hits >= 0
        opt.zero_grad()
        (-lp.sum()).backward()
        opt.step()  # fp32: updates the engine's tensors in place
        if step == 0:
            trainer.push_weights()
    # negative control: weights changed (step 1) but the prefix cache was not dropped
    _, rows, expected, hits = sample_and_score()
    assert hits > 0
    assert any(not torch.equal(r, e) for r, e in zip(rows, expected))
