"""The expert-parallel MoE layer (distributed/layers.py `ExpertParallelMoE`) on its own, asserted bitwise.

Every rank runs in a thread of this process with a real gloo group (the same collectives the engine's
processes use, without a process start per case). Hypothesis draws the layer's shapes, the expert count E and
the rank count P (P | E), top-k, routing-heavy inputs with exact ties, and a slice of the batch:

- EP=P gives EP=1's bits: the one-device fused layer (`Ops.moe`), whatever P. This needs no
  `tp_invariant_reduction`: the layer's only cross-rank step is a data move (gather + pick the owner).
- A slice of the batch gives the full batch's rows (alone == batched) at every P.
- The Triton path (interpreter here, CUDA on a GPU): the per-rank slot outputs, gathered and combined, give
  the fused kernel's bits (sequentially, no threads: the interpreter is not thread-safe).
- Each rank holds exactly its E / P experts (resident bytes == its share), through the in-memory sharding.
- Fast mode (local combines + the library all-reduce) computes the layer (to fp32 rounding).
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.distributed.group import connect, master_store
from detinfer.distributed.layers import (
    ExpertParallelMoE,
    TPTransformer,
    build_local_model,
    pick_slot_owners,
    shard_state,
)
from detinfer.models.config import ModelConfig
from detinfer.models.sharding import expert_block
from detinfer.models.testing import tiny_config_dict
from detinfer.models.transformer import Transformer
from detinfer.ops import Ops

SIZES = (2, 4)
BASE = ModelConfig.from_dict(tiny_config_dict("Qwen3MoeForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                                              extra=dict(num_experts=8, num_experts_per_tok=2,
                                                         moe_intermediate_size=16, mlp_only_layers=[1])))


def in_threads(size: int, fn, timeout_s: float = 120.0) -> list:
    """fn(rank) on `size` threads at once -> [result of rank 0, 1, ...]; re-raises a rank's error."""
    results, errors = [None] * size, []

    def target(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - handed to the test below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    return results


@pytest.fixture(scope="module")
def groups():
    """size -> [rank 0's group, rank 1's, ...] (gloo, one store per size)."""
    out = {}
    for size in SIZES:
        store = master_store(size, timeout_s=60)
        out[size] = in_threads(size, lambda r, s=size, st_=store: connect(
            r, s, st_.port, torch.device("cpu"), timeout_s=60, store=st_ if r == 0 else None))
    return out


def layer_config(E, k, H, inter, renorm) -> ModelConfig:
    return dataclasses.replace(BASE, hidden_size=H, num_experts=E, num_experts_per_tok=k, moe_intermediate_size=inter,
                               norm_topk_prob=renorm)


@st.composite
def cases(draw):
    E = draw(st.sampled_from([2, 4, 8]))
    size = draw(st.sampled_from([s for s in SIZES if E % s == 0]))
    k = draw(st.integers(1, E))
    H, inter = draw(st.sampled_from([8, 24])), draw(st.sampled_from([4, 16]))
    T = draw(st.integers(1, 12))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    router = torch.randn(E, H, generator=g) / H ** 0.5
    a, b = draw(st.integers(0, E - 1)), draw(st.integers(0, E - 1))
    router[b] = router[a]  # experts a and b tie for every token (when a != b): the lower id must win everywhere
    w13 = torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter ** 0.5
    x = torch.randn(T, H, generator=g)
    for t in draw(st.lists(st.integers(0, T - 1), max_size=2)):
        x[t] = 0.0  # every expert ties
    if draw(st.booleans()):
        x[-1] *= 50  # a saturated router
    m = draw(st.integers(0, T - 1))
    n = draw(st.integers(m + 1, T))
    return layer_config(E, k, H, inter, draw(st.booleans())), size, (router, w13, w2), x, (m, n)


def ep_layer(config, group, size, weights) -> ExpertParallelMoE:
    """Rank `group.rank`'s layer, loaded through the in-memory sharding rule (`shard_state`'s)."""
    router, w13, w2 = weights
    with torch.device("meta"):
        layer = ExpertParallelMoE(config, group, size)
    block = expert_block(config, group.rank, size)
    layer.load_state_dict({"router": router, "gate_up_proj": w13[block.start:block.stop].clone(),
                           "down_proj": w2[block.start:block.stop].clone()}, strict=True, assign=True)
    return layer


@given(cases())
def test_ep_layer_gives_one_device_bits_and_slices_equal_the_batch(groups, case):
    config, size, weights, x, (m, n) = case
    ops = Ops("deterministic", "cpu", torch.float32)
    one_device = ops.moe(x, *weights, config.num_experts_per_tok, config.norm_topk_prob)

    def rank(r):
        layer = ep_layer(config, groups[size][r], size, weights)
        return layer(x, ops), layer(x[m:n].clone(), ops)

    for full, part in in_threads(size, rank):
        assert torch.equal(full, one_device)
        assert torch.equal(part, full[m:n])


@settings(max_examples=4)  # the interpreter runs ~1 s per expert GEMM launch
@given(cases())
def test_kernel_slot_outputs_gathered_give_the_fused_kernel_bits(case):
    config, size, (router, w13, w2), x, _ = case
    ops = Ops("deterministic", "cpu", torch.float32, cpu_triton=True)
    assert ops._kernel(x, router, w13, w2), "meant to run the Triton path (TRITON_INTERPRET=1 on a CPU)"
    k, renorm = config.num_experts_per_tok, config.norm_topk_prob
    weights, ids = ops.moe_route(x, router, k, renorm)
    per_rank = []
    for r in range(size):
        block = expert_block(config, r, size)
        per_rank.append(ops.moe_expert_outputs(x, ids, w13[block.start:block.stop], w2[block.start:block.stop],
                                               block.start, config.num_experts))
    y = pick_slot_owners(torch.stack(per_rank), ids, config.num_experts // size)
    assert torch.equal(ops.moe_combine(weights, y, x.dtype), ops.moe(x, router, w13, w2, k, renorm))


@pytest.mark.parametrize("size", SIZES)
def test_each_rank_holds_exactly_its_share_of_the_experts(size):
    """Through `shard_state` (the in-memory path) into `build_local_model`: expert bytes == total / P, and
    rank r's experts are experts [r E/P, (r+1) E/P) of the full model; the router stays whole."""
    ops = Ops("deterministic", "cpu", torch.float32)
    full = Transformer(BASE, ops)
    g = torch.Generator().manual_seed(3)
    for p in full.parameters():
        p.data = torch.randn(p.shape, generator=g)

    def expert_bytes(model):
        return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                   if name.endswith((".mlp.gate_up_proj", ".mlp.down_proj")))

    total = expert_bytes(full)
    for r in range(size):
        group = type("Group", (), {"rank": r, "size": size})()  # building reads only the rank
        local = build_local_model(BASE, size, ops, group, shard_state(full, BASE, r, size), torch.device("cpu"),
                                  invariant=False)
        assert isinstance(local, TPTransformer) and expert_bytes(local) * size == total
        moe = local.layers[0].mlp
        block = expert_block(BASE, r, size)
        assert isinstance(moe, ExpertParallelMoE) and moe.first_expert == block.start
        assert torch.equal(moe.gate_up_proj, full.layers[0].mlp.gate_up_proj[block.start:block.stop])
        assert torch.equal(moe.down_proj, full.layers[0].mlp.down_proj[block.start:block.stop])
        assert torch.equal(moe.router, full.layers[0].mlp.router)


@pytest.mark.parametrize("size", SIZES)
def test_fast_mode_local_combines_plus_all_reduce_match_the_stock_layer(groups, size):
    """Fast mode: each rank's combine over its own slots, added by the library all-reduce, is the layer
    (close to the one-device stock loop; the sum's order differs, so not bitwise)."""
    config = layer_config(8, 3, 24, 16, True)
    g = torch.Generator().manual_seed(9)
    weights = (torch.randn(8, 24, generator=g), torch.randn(8, 32, 24, generator=g) / 24 ** 0.5,
               torch.randn(8, 24, 16, generator=g) / 4)
    x = torch.randn(10, 24, generator=g)
    ops = Ops("fast", "cpu", torch.float32)
    expected = ops.moe(x, *weights, 3, True)
    outs = in_threads(size, lambda r: ep_layer(config, groups[size][r], size, weights)(x, ops))
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(out, outs[0])  # the all-reduce leaves every rank the same sum
