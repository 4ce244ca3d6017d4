"""`detinfer generate`: complete one prompt with the offline engine and print the completion.

    detinfer generate --model DIR --prompt "Once upon a time" --max-tokens 40 --temperature 0
    detinfer generate --model DIR --prompt "Hi!" --chat --mode fast

Every EngineConfig field is a flag too (--max-model-len, --dtype, --enforce-eager, ...). --seed seeds the
request's sampling stream, so a sampled completion can be replayed exactly.
"""

from __future__ import annotations

import argparse
import sys

from detinfer.engine.config import EngineConfig, add_dataclass_args, from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="detinfer generate", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF-format model directory or Hugging Face hub id")
    parser.add_argument("--prompt", required=True, help="prompt text (the user message with --chat)")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1, off)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0, off)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt with the model's chat template")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--show-ids", action="store_true", help="also print the generated token ids")
    add_dataclass_args(parser, EngineConfig)  # --mode, --seed, --max-model-len, ...
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from detinfer.engine.llm_engine import LLMEngine
    from detinfer.engine.sampling_params import SamplingParams

    try:
        config = from_args(EngineConfig, args)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
        engine = LLMEngine(args.model, config, device=args.device)
        prompt = args.prompt
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True)
        engine.add_request("cli", prompt, params)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"detinfer generate: error: {e}", file=sys.stderr)
        return 2
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    completion = final.outputs[0]
    print(completion.text)
    if args.show_ids:
        print(f"token ids: {list(completion.token_ids)}")
    print(f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}, mode={config.mode}]",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
