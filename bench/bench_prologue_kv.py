"""The attention prologue with and without the KV write folded in, on the GPU (Qwen3-8B shapes, bf16).

    PYTHONPATH=src python bench/bench_prologue_kv.py [--tokens 1,8,64,2048] [--layers 36]

Per token count: one CUDA graph of `--layers` layers, each layer's own q/k/v (views into a fused QKV
output) and KV pools (block_size 16, shuffled slots), running either `qk_norm_rope` then `write_kv` (two
launches per layer: the unfused path) or `qk_norm_rope_write_kv` (one). Prints us per layer (median of the
replays) and checks that both leave the same q and pool bits.
"""

from __future__ import annotations

import argparse

import torch

from bench_attention import graph_ms
from detinfer.kernels.kv_write import write_kv
from detinfer.kernels.rope_qk import qk_norm_rope, qk_norm_rope_write_kv

HQ, HKV, D, BS = 32, 8, 128, 16


def make_layer(t: int, g: torch.Generator):
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, generator=g).to(torch.bfloat16).cuda()
    q = qkv[:, :HQ * D].view(t, HQ, D)
    k = qkv[:, HQ * D:(HQ + HKV) * D].view(t, HKV, D)
    v = qkv[:, (HQ + HKV) * D:].view(t, HKV, D)
    blocks = -(-t // BS) + 1
    slots = torch.randperm(blocks * BS, generator=g)[:t].cuda()
    pools = [torch.zeros(blocks, BS, HKV, D, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    return dict(q=q, k=k, v=v, slots=slots, pools=pools,
                positions=torch.randint(0, 4096, (t,), generator=g).cuda(),
                w=[(1 + 0.1 * torch.randn(D, generator=g)).to(torch.bfloat16).cuda() for _ in range(2)])


def time_tokens(t: int, num_layers: int, inv: torch.Tensor) -> tuple[float, float, bool]:
    """(unfused ms per layer, fused ms per layer, whether both left the same q and pool bits)."""
    g = torch.Generator().manual_seed(t)
    layers = [make_layer(t, g) for _ in range(num_layers)]
    outs = {}

    def unfused(i):
        c = layers[i]
        q, k = qk_norm_rope(c["positions"], c["q"], c["k"], inv, *c["w"], 1e-6)
        write_kv(k, c["v"], c["pools"][0], c["pools"][1], c["slots"], validate=False)
        outs[("unfused", i)] = q

    def fused(i):
        c = layers[i]
        outs[("fused", i)] = qk_norm_rope_write_kv(c["positions"], c["q"], c["k"], c["v"], inv, *c["w"], 1e-6,
                                                   c["pools"][2], c["pools"][3], c["slots"], validate=False)[0]

    ms_unfused, ms_fused = graph_ms(unfused, num_layers), graph_ms(fused, num_layers)
    torch.cuda.synchronize()
    same = all(torch.equal(outs[("unfused", i)], outs[("fused", i)])
               and torch.equal(c["pools"][0], c["pools"][2]) and torch.equal(c["pools"][1], c["pools"][3])
               for i, c in enumerate(layers))
    return ms_unfused, ms_fused, same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,8,64,2048")
    ap.add_argument("--layers", type=int, default=36)
    args = ap.parse_args()
    inv = (1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))).cuda()
    print("| tokens | unfused us/layer | fused us/layer | same bits |")
    print("| --- | --- | --- | --- |")
    for t in (int(x) for x in args.tokens.split(",")):
        ms_unfused, ms_fused, same = time_tokens(t, args.layers, inv)
        print(f"| {t} | {ms_unfused * 1e3:.2f} | {ms_fused * 1e3:.2f} | {same} |")


if __name__ == "__main__":
    main()
