"""FSDP2 data parallelism (`detinfer.train.fsdp.FSDPTrainer`) over 2 (and 3) gloo processes, CPU, deterministic
mode.

Per case (the dense `tiny` Qwen3 preset in fp32 and in bf16 from fp32 master shards, `tiny-llama` in fp32,
`tiny-qwen3-moe` in fp32: a MoE layer and a dense one), one 2-rank job (`_fsdp_job`) scores each rank's own
micro-batch, backpropagates, repeats with activation checkpointing and with the gathered weights kept,
and runs the same 3 AdamW steps twice; the parent process computes the one-process references (with
master weights and push_weights for bf16). Asserted bitwise (torch.equal):
  * FSDP logprobs == one-process trainer logprobs == the sampler's (engine's) logprobs;
  * the reduced gradients == one process accumulating the same micro-batches in rank order (the fixed
    rank-order reduce-scatter); the gradient of the whole batch in one backward differs only by rounding;
  * activation checkpointing under FSDP == without; keeping the gathered weights from the forward to the
    backward (reshard_after_forward=False) == gathering them again;
  * two identical 3-step runs == each other == the one-process run, and the weights fingerprint is the
    same on both ranks;
  * at 3 ranks, the fixed-order reduce-scatter == the rank-order sum, and FSDP gradients == one-process
    accumulation;
and bad input gets clear errors. A 2-GPU NCCL version (marked gpu) mirrors the bitwise checks.
"""

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from detinfer.engine import LLM, SamplingParams
from detinfer.models.config import ModelConfig
from detinfer.models.families import preset_hf_config
from detinfer.models.loader import load_model
from detinfer.models.testing import write_tiny_checkpoint
from detinfer.models.transformer import Transformer
from detinfer.ops import Ops
from detinfer.rl.metrics import weights_fingerprint
from detinfer.train import TrainableModel
from detinfer.train import fsdp as fsdp_module
from detinfer.train.fsdp import FixedOrderReduceScatter, FSDPTrainer, local_sequences
from detinfer.train.optim import adamw
from detinfer.train.testing import pack, run_ranks

WORLD = 2
STEPS = 3
LR = 1e-2  # large enough that every step moves the weights
PRESETS = {"tiny": "Qwen3ForCausalLM", "tiny-llama": "LlamaForCausalLM", "tiny-qwen3-moe": "Qwen3MoeForCausalLM"}
CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "tie_word_embeddings")
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers")


def _loss(lp: torch.Tensor) -> torch.Tensor:
    # a weighted sum, so the gradient is not the same for every token
    return -(lp * torch.linspace(0.5, 1.5, lp.shape[0], device=lp.device)).sum()


def _load(ckpt: str, checkpointing: bool = False, device: str = "cpu") -> TrainableModel:
    model, _ = load_model(ckpt, None, device, "deterministic")  # the checkpoint's dtype
    return TrainableModel(model, activation_checkpointing=checkpointing)


def _backward(trainer, seqs):
    ids, cu = pack(seqs)
    lp = trainer.score(ids, cu)
    _loss(lp).backward()
    return lp.detach()


def _steps(trainer, params, micro_batches):
    """STEPS AdamW steps; each step backpropagates the micro-batches given (one per rank, or all of them
    in rank order in one process)."""
    # single-tensor AdamW on every device: elementwise torch ops, the same bits on shards and full tensors
    # (fused AdamW on DTensor shards does not give fused AdamW's bits on the full tensors: measured on CPU)
    opt = adamw(params, lr=LR, fused=False, foreach=False)
    for _ in range(STEPS):
        opt.zero_grad()
        for seqs in micro_batches:
            _backward(trainer, seqs)
        opt.step()
        if isinstance(trainer, TrainableModel):
            trainer.push_weights()  # one process, 16-bit model: the fp32 masters into the weights it computes with


def _fsdp_job(rank: int, ckpt: str, seqs: list) -> dict:
    """One rank of the 2-process run: see the module doc."""
    out = {}
    sharded = FSDPTrainer(_load(ckpt))
    mine = local_sequences(seqs)
    out["lp"] = _backward(sharded, mine)
    out["grads"] = sharded.full_grads()
    ids, cu = pack(mine)
    with torch.no_grad():  # only the odd positions: logits for those rows only (the RL path)
        out["lp_odd"] = sharded.score(ids, cu, positions=list(range(1, cu[-1], 2)))
    checkpointed = FSDPTrainer(_load(ckpt, checkpointing=True))
    out["lp_checkpointed"] = _backward(checkpointed, mine)
    out["grads_checkpointed"] = checkpointed.full_grads()
    kept = FSDPTrainer(_load(ckpt), reshard_after_forward=False)  # no second gather for the backward
    out["lp_kept"] = _backward(kept, mine)
    out["grads_kept"] = kept.full_grads()
    for run in ("run_a", "run_b"):
        sharded = FSDPTrainer(_load(ckpt))
        _steps(sharded, sharded.parameters(), [mine])
        out[run] = sharded.full_state_dict()
        out[run + "_fingerprint"] = weights_fingerprint(out[run].items())
    out.update(_masters_made_before_wrapping(ckpt, mine))
    out["errors"] = _bad_group_errors(rank, ckpt, seqs)
    return out


def _masters_made_before_wrapping(ckpt: str, mine: list) -> dict:
    """A trainer used before it is wrapped already holds its fp32 masters (another path into the module):
    the same run's weights. A fresh one's 16-bit tensors leave memory as FSDP shards each unit's masters."""
    used = _load(ckpt)
    list(used.parameters())  # makes the masters of a 16-bit model
    sharded = FSDPTrainer(used)
    _steps(sharded, sharded.parameters(), [mine])
    fresh = _load(ckpt)
    refs = [weakref.ref(p) for p in fresh.model.parameters() if p.dtype != torch.float32]
    full_fp32_at_each_shard = []  # unsharded fp32 elements in the model each time a unit is sharded

    def recording_fully_shard(unit, **kwargs):
        full_fp32_at_each_shard.append(sum(p.numel() for p in fresh.model.parameters()
                                           if p.dtype == torch.float32 and not isinstance(p, DTensor)))
        return real_fully_shard(unit, **kwargs)

    real_fully_shard, fsdp_module.fully_shard = fsdp_module.fully_shard, recording_fully_shard
    try:
        FSDPTrainer(fresh)
    finally:
        fsdp_module.fully_shard = real_fully_shard
    gc.collect()
    return {"run_masters_made_first": sharded.full_state_dict(), "sixteen_bit_tensors": len(refs),
            "sixteen_bit_alive": sum(r() is not None for r in refs),
            "most_full_fp32": max(full_fp32_at_each_shard),
            "largest_unit": _largest_unit_elements(fresh.model)}


def _largest_unit_elements(model) -> int:
    """Elements of FSDP's largest unit: a decoder layer, or the root (all the rest)."""
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    return max(*layers, sum(p.numel() for p in model.parameters()) - sum(layers))


def _bad_group_errors(rank: int, ckpt: str, seqs: list) -> dict:
    errors = {}
    try:
        local_sequences(seqs[:3])
    except ValueError as e:
        errors["uneven"] = str(e)
    rank0_only = dist.new_group([0])  # every rank must call new_group; rank 1 is not in it
    if rank == 1:
        try:
            FSDPTrainer(_load(ckpt), rank0_only)
        except ValueError as e:
            errors["not_member"] = str(e)
    trainer = _load(ckpt)
    FSDPTrainer(trainer)
    try:
        FSDPTrainer(trainer)
    except ValueError as e:
        errors["twice"] = str(e)
    return errors


def _sample(ckpt: str, dtype: str, device: str = "cpu"):
    """Sequences the engine sampled in one batch, with the logprobs it reported for their outputs."""
    llm = LLM(ckpt, device=device, dtype=dtype, mode="deterministic", max_model_len=64,
              max_num_batched_tokens=16, max_num_seqs=4, block_size=8)
    prompts = [[1, 17, 29, 41], [1, 44, 55], [1, 8, 9, 10, 11, 12], [1, 90]]
    params = [SamplingParams(max_tokens=5, temperature=1.0, seed=i, logprobs=0) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    reported = [torch.tensor([e.logprob for e in o.outputs[0].logprobs]) for o in outs]
    return seqs, reported, [len(o.prompt_token_ids) for o in outs]


def _checkpoint(tmp_path_factory, preset: str, dtype: str = "float32") -> str:
    cfg = preset_hf_config(preset)
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp(preset), PRESETS[preset], seed=3, dtype=dtype,
                                     extra={k: cfg[k] for k in MOE_KEYS if k in cfg},
                                     **{k: cfg[k] for k in CONFIG_KEYS if k in cfg}))


# (preset, checkpoint dtype): bf16 computes with 16-bit weights gathered from fp32 master shards
CASES = {"tiny": ("tiny", "float32"), "tiny-llama": ("tiny-llama", "float32"), "tiny-bf16": ("tiny", "bfloat16"),
         "tiny-qwen3-moe": ("tiny-qwen3-moe", "float32")}  # experts sharded like any parameter (dim 0)


@pytest.fixture(scope="module", params=sorted(CASES))
def fsdp_run(request, tmp_path_factory):
    preset, dtype = CASES[request.param]
    ckpt = _checkpoint(tmp_path_factory, preset, dtype)
    seqs, reported, prompt_lens = _sample(ckpt, dtype)
    ranks = run_ranks(_fsdp_job, WORLD, (ckpt, seqs), timeout_s=600)
    return dict(ckpt=ckpt, dtype=dtype, seqs=seqs, reported=reported, prompt_lens=prompt_lens, ranks=ranks)


def _micro_batches(seqs):
    per = len(seqs) // WORLD
    return [seqs[r * per:(r + 1) * per] for r in range(WORLD)]


def test_fsdp_logprobs_equal_one_process_and_the_sampler(fsdp_run):
    trainer = _load(fsdp_run["ckpt"])
    ids, cu = pack(fsdp_run["seqs"])
    with torch.no_grad():
        whole = trainer.score(ids, cu)
    for j, (a, b) in enumerate(zip(cu[:-1], cu[1:])):  # one process == the sampler
        start = a + fsdp_run["prompt_lens"][j] - 1
        assert torch.equal(whole[start:b - 1], fsdp_run["reported"][j]), f"sequence {j}"
    for r, seqs in enumerate(_micro_batches(fsdp_run["seqs"])):  # FSDP rank r == one process
        first, last = cu[r * len(seqs)], cu[(r + 1) * len(seqs)]
        assert torch.equal(fsdp_run["ranks"][r]["lp"], whole[first:last]), f"rank {r}"
        assert torch.equal(fsdp_run["ranks"][r]["lp_odd"], whole[first:last][1::2]), f"rank {r}"


def test_fsdp_gradients_equal_one_process_accumulation_in_rank_order(fsdp_run):
    trainer = _load(fsdp_run["ckpt"])
    for seqs in _micro_batches(fsdp_run["seqs"]):
        _backward(trainer, seqs)
    accumulated = {n: p.grad.clone() for n, p in trainer.named_parameters()}
    for r, result in enumerate(fsdp_run["ranks"]):
        assert result["grads"].keys() == accumulated.keys()
        for name, grad in accumulated.items():
            assert torch.equal(result["grads"][name], grad), f"rank {r}: {name}"
    # one backward over the whole batch reduces all tokens in one accumulator: equal up to rounding only
    # (checked for fp32 models: with 16-bit activations the embedding's gradient differs by more than fp32
    # rounding, ~5e-2 on the tiny bf16 model, the other tensors' by ~1e-6)
    if fsdp_run["dtype"] != "float32":
        return
    trainer.zero_grad()
    ids, cu = pack(fsdp_run["seqs"])
    lp = trainer.score(ids, cu)
    loss = sum(_loss(lp[cu[r * 2]:cu[r * 2 + 2]]) for r in range(WORLD))
    loss.backward()
    for name, p in trainer.named_parameters():
        torch.testing.assert_close(fsdp_run["ranks"][0]["grads"][name], p.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["checkpointed", "kept"])
def test_activation_checkpointing_and_keeping_gathered_weights_change_no_bit(fsdp_run, variant):
    for result in fsdp_run["ranks"]:
        assert torch.equal(result["lp_" + variant], result["lp"])
        for name, grad in result["grads"].items():
            assert torch.equal(result["grads_" + variant][name], grad), name


def test_two_fsdp_runs_give_identical_weights_equal_to_one_process(fsdp_run):
    ranks = fsdp_run["ranks"]
    fingerprints = {r[key] for r in ranks for key in ("run_a_fingerprint", "run_b_fingerprint")}
    assert len(fingerprints) == 1, fingerprints  # both runs, both ranks
    trainer = _load(fsdp_run["ckpt"])
    initial = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    _steps(trainer, list(trainer.parameters()), _micro_batches(fsdp_run["seqs"]))
    for name, p in trainer.named_parameters():
        assert not torch.equal(p, initial[name]), name  # the steps moved every tensor
        for result in ranks:
            assert torch.equal(result["run_a"][name], result["run_b"][name]), name
            assert torch.equal(result["run_a"][name], p.detach()), name
    assert weights_fingerprint((n, p.detach()) for n, p in trainer.named_parameters()) in fingerprints


def test_masters_made_per_unit_free_the_16_bit_weights_and_change_no_bit(fsdp_run):
    """FSDPTrainer makes a fresh trainer's fp32 masters one unit at a time as it shards (the whole model's
    fp32 copy never exists at once); a trainer whose masters were made before wrapping gives the same run."""
    for result in fsdp_run["ranks"]:
        assert result["sixteen_bit_alive"] == 0
        if fsdp_run["dtype"] == "bfloat16":
            assert result["sixteen_bit_tensors"] > 0
            # at most one unit unsharded in fp32 at a time (a decoder layer or the root's embedding and
            # output layer), never the whole model
            assert 0 < result["most_full_fp32"] <= result["largest_unit"]
        for name, weight in result["run_a"].items():
            assert torch.equal(result["run_masters_made_first"][name], weight), name


def test_bad_groups_and_batches_are_rejected_with_clear_errors(fsdp_run):
    errors = fsdp_run["ranks"][1]["errors"]
    assert "3 sequences does not split over 2" in errors["uneven"]
    assert "not a member" in errors["not_member"]
    assert "already sharded" in errors["twice"]


def _three_rank_job(rank: int, ckpt: str, seqs: list) -> dict:
    """The fixed-order reduce-scatter on spread-out random values, and FSDP gradients, at 3 ranks (where the
    order of a sum of 3 values matters; gloo's own reduce-scatter does not add in rank order there)."""
    world, comm, sums = dist.get_world_size(), FixedOrderReduceScatter(), []
    for n in (1, 7, 1000):
        gen = torch.Generator().manual_seed(rank * 10 + n)
        values = torch.randn(world * n, generator=gen) * torch.logspace(-3, 3, world * n)  # spread exponents
        reduced = comm.allocate((n,), dtype=torch.float32, device=torch.device("cpu"))
        comm(reduced, values, dist.group.WORLD, dist.ReduceOp.SUM)
        sums.append((values, reduced))
    sharded = FSDPTrainer(_load(ckpt))
    _backward(sharded, local_sequences(seqs))
    return {"sums": sums, "grads": sharded.full_grads()}


def test_three_ranks_sum_in_rank_order_equal_to_one_process_accumulation(tmp_path_factory):
    ckpt = _checkpoint(tmp_path_factory, "tiny")
    seqs = [[1, 5, 9, 33, 100, 7], [1, 44, 55], [1, 12, 300, 301], [4, 9, 9, 10], [1, 2, 3, 4, 5], [7, 70, 170]]
    ranks = run_ranks(_three_rank_job, 3, (ckpt, seqs), timeout_s=600)
    for r, result in enumerate(ranks):
        for i, (_, reduced) in enumerate(result["sums"]):
            blocks = [other["sums"][i][0].view(3, -1)[r] for other in ranks]
            assert torch.equal(reduced, (blocks[0] + blocks[1]) + blocks[2]), f"rank {r}, size {reduced.numel()}"
    trainer = _load(ckpt)
    for r in range(3):
        _backward(trainer, seqs[2 * r:2 * r + 2])
    for name, p in trainer.named_parameters():
        for r, result in enumerate(ranks):
            assert torch.equal(result["grads"][name], p.grad), f"rank {r}: {name}"


def test_bad_trainers_are_rejected_before_any_collective():
    assert not dist.is_initialized()
    with pytest.raises(TypeError, match="TrainableModel"):
        FSDPTrainer(torch.nn.Linear(2, 2))
    cfg = ModelConfig.from_dict(preset_hf_config("tiny"))
    bf16 = Transformer(cfg, Ops("deterministic", torch.device("cpu"), torch.bfloat16, head_dim=cfg.head_dim))
    with pytest.raises(ValueError, match="fp32 master"):  # 16-bit weights trained directly
        FSDPTrainer(TrainableModel(bf16.to(torch.bfloat16), master_weights=False))
    dense = Transformer(cfg, Ops("deterministic", torch.device("cpu"), torch.float32, head_dim=cfg.head_dim))
    with pytest.raises(RuntimeError, match="init_process_group"):
        FSDPTrainer(TrainableModel(dense))
    tp_engine = SimpleNamespace(runner=SimpleNamespace(model=dense), config=SimpleNamespace(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):  # a tensor-parallel engine's model
        FSDPTrainer(TrainableModel(SimpleNamespace(engine=tp_engine)))
    with pytest.raises(ValueError, match="sums only"):
        FixedOrderReduceScatter()(torch.zeros(1), torch.zeros(2), None, dist.ReduceOp.AVG)


def _fsdp_gpu_job(rank: int, ckpt: str, seqs: list) -> dict:
    """The CPU job's bitwise checks on cuda:rank over NCCL."""
    device = f"cuda:{rank}"
    mine = local_sequences(seqs)
    sharded = FSDPTrainer(_load(ckpt, device=device))
    out = {"lp": _backward(sharded, mine).cpu(),
           "grads": {n: g.cpu() for n, g in sharded.full_grads().items()}, "runs": []}
    for _ in range(2):
        sharded = FSDPTrainer(_load(ckpt, device=device))
        _steps(sharded, sharded.parameters(), [mine])
        out["runs"].append({n: t.cpu() for n, t in sharded.full_state_dict().items()})
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fsdp_on_two_gpus_over_nccl_is_bitwise_one_process(tmp_path_factory, dtype):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    ckpt = _checkpoint(tmp_path_factory, "tiny", dtype)
    seqs, reported, prompt_lens = _sample(ckpt, dtype, "cuda")
    ranks = run_ranks(_fsdp_gpu_job, WORLD, (ckpt, seqs), backend="nccl", timeout_s=600)
    trainer = _load(ckpt, device="cuda:0")
    lps = [_backward(trainer, mb).cpu() for mb in _micro_batches(seqs)]
    for r, result in enumerate(ranks):
        assert torch.equal(result["lp"], lps[r]), f"rank {r}"
        for name, p in trainer.named_parameters():
            assert torch.equal(result["grads"][name], p.grad.cpu()), f"rank {r}: {name}"
    for j, (lp, seq) in enumerate(zip(torch.cat(lps).split([len(s) for s in seqs]), seqs)):
        assert torch.equal(lp[prompt_lens[j] - 1:len(seq) - 1], reported[j].cpu()), f"sequence {j}"
    trainer = _load(ckpt, device="cuda:0")
    _steps(trainer, list(trainer.parameters()), _micro_batches(seqs))
    for name, p in trainer.named_parameters():
        for result in ranks:
            assert torch.equal(result["runs"][0][name], result["runs"][1][name]), name
            assert torch.equal(result["runs"][0][name], p.detach().cpu()), name
