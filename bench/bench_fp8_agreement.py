"""How close FP8 (a checkpoint quantized at load, `--quantization fp8`) stays to the 16-bit model: greedy
completions of the bf16 model, then the FP8 model scoring those same tokens (teacher forcing).

    PYTHONPATH=src python bench/bench_fp8_agreement.py MODEL_DIR [--prompts 64] [--max-tokens 64] [--json F]

Reports, over every generated position of every prompt:
  top-1 agreement   fraction of positions where the FP8 model's most likely next token (given the bf16
                    model's prefix) is the token the bf16 model chose
  logprob error     |logprob_fp8 - logprob_bf16| of the chosen token: mean, p99, max
and, running each model freely: the fraction of completions that are identical and the mean length of
the common prefix. Both engines deterministic mode, bf16 activations; prompts are built-in (no download).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

TOPICS = ["the ocean", "a small village", "how computers work", "the history of bread", "a friendly robot",
          "why the sky is blue", "learning to ride a bike", "the moon landing", "a rainy afternoon",
          "the rules of chess", "photosynthesis", "a trip to the mountains", "the first airplane",
          "how bees make honey", "a lost kitten", "the water cycle"]
FORMS = ["Write a short story about {}.", "Explain {} to a child.", "Give three facts about {}.",
         "Describe {} in one paragraph."]


def prompts(n: int) -> list[str]:
    return [FORMS[i % len(FORMS)].format(TOPICS[(i // len(FORMS)) % len(TOPICS)]) + ("" if i < 64 else f" ({i})")
            for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from detinfer import LLM, SamplingParams

    texts = prompts(args.prompts)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=0, ignore_eos=True)
    common = dict(device=args.device, dtype="bfloat16", max_model_len=512)
    with LLM(args.model, **common) as ref_llm:
        ref = ref_llm.generate(texts, greedy)
    with LLM(args.model, quantization="fp8", **common) as fp8_llm:
        free = fp8_llm.generate(texts, greedy)
        forced = fp8_llm.generate([{"prompt_token_ids": list(r.prompt_token_ids) + list(r.outputs[0].token_ids)}
                                   for r in ref], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    errors, agree = [], 0
    for r, f in zip(ref, forced):
        gen = r.outputs[0]
        scored = f.prompt_logprobs[len(r.prompt_token_ids):]
        for tok, lp_ref, lp in zip(gen.token_ids, gen.logprobs, scored):
            assert lp.token_id == tok
            errors.append(abs(lp.logprob - lp_ref.logprob))
            agree += lp.rank == 1
    prefix, same = [], 0
    for r, f in zip(ref, free):
        a, b = r.outputs[0].token_ids, f.outputs[0].token_ids
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(k)
        same += a == b
    errors.sort()
    res = {"positions": len(errors), "top1_agreement": agree / len(errors),
           "logprob_err_mean": statistics.fmean(errors),
           "logprob_err_p99": errors[int(0.99 * (len(errors) - 1))], "logprob_err_max": errors[-1],
           "identical_completions": same / len(ref), "mean_common_prefix": statistics.fmean(prefix),
           "max_tokens": args.max_tokens, "prompts": len(ref)}
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
