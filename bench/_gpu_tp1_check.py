import sys
sys.path.insert(0, "tests/distributed")
import torch
import test_tensor_parallel as t
from detinfer.models.testing import write_tiny_checkpoint
if __name__ == "__main__":
    d = write_tiny_checkpoint("/tmp/tpg/qwen3", "Qwen3ForCausalLM", seed=13, vocab_size=2048, hidden_size=512,
                              intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                              num_key_value_heads=2, head_dim=128, max_position_embeddings=1024, dtype="bfloat16")
    res = {}
    for name, kw in {"graphs": {}, "eager": {"enforce_eager": True}}.items():
        e = t.engine_at(d, 1, device="cuda", max_num_batched_tokens=64, max_num_seqs=8, tp_invariant_reduction=True, **kw)
        b = t.run(e, t.REQUESTS)
        a = {rid: t.run(e, [(0, rid, p, params)])[rid] for _, rid, p, params in t.REQUESTS}
        res[name] = (b, a, t.forward_logits(e).cpu())
        print(name, "alone==batched", a == b, "runner", type(e.runner).__name__, e.runner.use_graphs)
    print("graphs==eager", res["graphs"][0] == res["eager"][0], torch.equal(res["graphs"][2], res["eager"][2]))
    e = t.engine_at(d, 1, device="cuda", max_num_batched_tokens=64, max_num_seqs=8)
    b = t.run(e, t.REQUESTS)
    print("flag changes bits vs plain:", b != res["graphs"][0])
