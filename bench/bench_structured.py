"""Structured output's cost per engine step: the same decode workload free and under a JSON schema.

A random Qwen3-shaped checkpoint (`write_tiny_checkpoint`) whose tokenizer is a byte-level BPE trained here
on Python's standard-library sources to --vocab tokens (a realistic vocabulary size for the grammar masks;
no download). --batch requests decode --max-tokens tokens each (greedy), once free and once with a JSON schema
whose strings are unbounded (so they run to max_tokens); per step it reports the wall time and the host time
spent building grammar masks (`GrammarMasks.mask_logits`, which computes the bitmasks with llguidance and
enqueues the masking).

    python bench/bench_structured.py                          # GPU if present: vocab 65536, batch 32
    python bench/bench_structured.py --device cpu --vocab 8192 --batch 4 --layers 1 --hidden 64
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from detinfer.engine import EngineConfig, LLMEngine, SamplingParams, StructuredOutputs  # noqa: E402
from detinfer.models.testing import SPECIAL_TOKENS, write_tiny_checkpoint  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}


def train_tokenizer(vocab: int, path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "**" / "*.py"), recursive=True))[:6000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((open(f, encoding="utf-8", errors="ignore").read() for f in files), trainer)
    tok.save(str(path))


def run(engine: LLMEngine, params: SamplingParams, batch: int) -> tuple[list[float], float]:
    """(wall seconds of each step once every request decodes, host seconds in mask_logits per step)."""
    for i in range(batch):
        engine.add_request(f"r{i}", f"Record {i} as JSON:", params)
    mask_s = [0.0]
    grammars = engine._grammars
    if grammars is not None:
        inner = grammars.mask_logits

        def timed(*args):
            t = time.perf_counter()
            try:
                return inner(*args)
            finally:
                mask_s[0] += time.perf_counter() - t

        grammars.mask_logits = timed
    steps = []
    engine.step()  # prefill
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    if grammars is not None:
        grammars.mask_logits = inner
    return steps, mask_s[0] / max(len(steps), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--out", default="/tmp/detinfer-bench-structured")
    args = ap.parse_args()
    out = Path(args.out)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    heads = max(args.hidden // 128, 1)
    write_tiny_checkpoint(out, "Qwen3ForCausalLM", vocab_size=args.vocab, hidden_size=args.hidden,
                          intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                          num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1),
                          head_dim=args.hidden // heads, max_position_embeddings=1024, dtype=dtype)
    t = time.perf_counter()
    train_tokenizer(args.vocab, out / "tokenizer.json")
    print(f"tokenizer: {args.vocab} tokens, trained in {time.perf_counter() - t:.1f} s", flush=True)
    cfg = EngineConfig(max_num_seqs=args.batch, max_num_batched_tokens=max(512, args.batch * 16), block_size=16,
                       num_kv_blocks=args.batch * 8 + 16, dtype=dtype)
    results = {}
    for name, so in (("free", None), ("json_schema", StructuredOutputs(json=SCHEMA))):
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, structured_outputs=so)
        for _ in range(2):  # the first pass warms up (graphs, the grammar's lexer states)
            engine = LLMEngine(out, cfg, device=args.device)
            steps, mask = run(engine, params, args.batch)
            engine.close()
        steps.sort()
        results[name] = {"step_ms_median": 1e3 * steps[len(steps) // 2], "mask_ms_per_step": 1e3 * mask,
                         "steps": len(steps)}
        print(name, json.dumps(results[name]), flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                      "vocab": args.vocab, "batch": args.batch, **results}))


if __name__ == "__main__":
    main()
