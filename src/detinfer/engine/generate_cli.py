"""`detinfer generate`: complete one prompt with the offline engine and print the completion.

    detinfer generate --model DIR --prompt "Once upon a time" --max-tokens 40 --temperature 0
    detinfer generate DIR --prompt "Hi!" --chat --mode fast        (DIR or --model DIR: the same)

The completion streams to stdout as it is generated; loading and timing lines go to stderr.

Every EngineConfig field is a flag too (--max-model-len, --dtype, --enforce-eager, ...). --seed seeds the
request's sampling stream, so a sampled completion can be replayed exactly.
"""

from __future__ import annotations

import argparse
import sys
import time

from detinfer.cli_util import Parser, add_model_argument, model_path, progress
from detinfer.engine.config import EngineConfig, add_dataclass_args, from_args
from detinfer.engine.drive import drive


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="detinfer generate", description=__doc__.split("\n\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(parser, "HF-format model directory or Hugging Face hub id")
    parser.add_argument("--prompt", required=True, help="prompt text (the user message with --chat)")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1, off)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0, off)")
    # Raw text by default, as vLLM's generate and /v1/completions take it; `detinfer repro` has the same default.
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=False,
                        help="send the prompt as one user message through the model's chat template; "
                             "--no-chat (the default) sends it as raw text")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--show-ids", action="store_true", help="also print the generated token ids")
    parser.add_argument("--quiet", action="store_true", help="no loading/progress lines on stderr")
    add_dataclass_args(parser, EngineConfig)  # --mode, --seed, --max-model-len, ...
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    model = model_path(parser, args)
    if model is None:
        parser.error("give the model directory (MODEL_DIR or --model DIR)")
    from detinfer.engine.llm_engine import LLMEngine
    from detinfer.engine.sampling_params import SamplingParams

    show = not args.quiet
    try:
        config = from_args(EngineConfig, args)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
        started = time.perf_counter()
        progress(f"loading {model} ({config.mode} mode) ...", show)
        engine = LLMEngine(model, config, device=args.device)
        progress(f"loaded in {time.perf_counter() - started:.1f} s; generating up to {args.max_tokens} tokens",
                 show)
        prompt = args.prompt
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True)
        engine.add_request("cli", prompt, params)  # refused here (e.g. a prompt too long): exit 2
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"detinfer generate: error: {e}", file=sys.stderr)
        return 2
    printed, started = 0, time.perf_counter()

    def stream(out, _step: int) -> None:  # print the completion as it grows
        nonlocal printed
        text = out.outputs[0].text
        if show and len(text) > printed:
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)

    final = drive(engine, [], on_output=stream)["cli"]
    completion = final.outputs[0]
    print(completion.text[printed:] if show else completion.text)
    if args.show_ids:
        print(f"token ids: {list(completion.token_ids)}")
    elapsed = time.perf_counter() - started
    print(f"[{len(completion.token_ids)} tokens in {elapsed:.1f} s, finish_reason={completion.finish_reason}, "
          f"mode={config.mode}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
