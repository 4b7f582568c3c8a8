"""`python -m kda_rt.generate`: generate text from a Kimi Linear checkpoint.

With no `--model`, runs the bundled tiny demo checkpoint (random weights: the text is noise, the
point is that the whole pipeline runs).  Prints the text, then tokens/s on stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from kda_rt.cli import model_dir_problem
from kda_rt.engine.config import EngineConfig

__all__ = ["main", "build_parser"]

DEFAULT_PROMPT = "The quick brown fox"


def _token_ids(text: str) -> list[int]:
    """`--prompt-token-ids 1,2,3` -> [1, 2, 3]; an empty list or item is an error, not a dropped id."""
    if not text.strip():
        raise argparse.ArgumentTypeError("no token ids given (comma-separated integers >= 0, e.g. 1,2,3)")
    items = [item.strip() for item in text.split(",")]
    for item in items:
        if not (item.isascii() and item.isdigit()):  # no sign, no empty item
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r} is not a token id "
                                             "(comma-separated integers >= 0, e.g. 1,2,3)")
    return [int(item) for item in items]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kda_rt.generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: the bundled tiny demo checkpoint)")
    ap.add_argument("--prompt", default=None, help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    ap.add_argument("--prompt-token-ids", type=_token_ids, default=None,
                    help="comma-separated prompt token ids instead of --prompt (checkpoints without tokenizer files)")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    ap.add_argument("--system", default=None, help="system message for --chat")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--report", action="store_true",
                    help="print each op with the kernel it used and the launches per decode step")
    ap.add_argument("-v", "--verbose", action="store_true")
    EngineConfig.add_cli_args(ap, exclude=("seed",), max_num_seqs=1)  # --seed above is the request's
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.prompt_token_ids is not None and (args.chat or args.prompt is not None):
        ap.error(f"--prompt-token-ids does not go with {'--chat' if args.chat else '--prompt'} "
                 "(the ids are the whole prompt)")
    if args.system is not None and not args.chat:
        ap.error("--system needs --chat")
    if (problem := model_dir_problem(args.model)) is not None:
        ap.error(problem)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from kda_rt import LLM, SamplingParams
    from kda_rt.demo import demo_path

    prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
    model = args.model
    if model is None:
        model = str(demo_path())
        print(f"[kda_rt] no --model given: using the bundled demo checkpoint at {model} "
              "(random weights, so the text is meaningless)", file=sys.stderr)
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                seed=args.seed, max_tokens=args.max_tokens)
        t0 = time.perf_counter()
        settings = EngineConfig.from_cli_args(args, exclude=("seed",))
        llm = LLM(model, report=args.report, **settings.to_dict())
        t_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system is not None else [])
            messages.append({"role": "user", "content": prompt})
            out = llm.chat(messages, params)[0]
        elif args.prompt_token_ids is not None:
            out = llm.generate({"prompt_token_ids": args.prompt_token_ids}, params)[0]
        elif llm.get_tokenizer() is None:
            raise ValueError(f"{model} has no tokenizer files: pass --prompt-token-ids 1,2,3")
        else:
            out = llm.generate(prompt, params)[0]
        dt = time.perf_counter() - t0
    except (ValueError, FileNotFoundError, RuntimeError, MemoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    comp = out.outputs[0]
    if args.report:
        print(llm.report, file=sys.stderr)
    print(comp.text if llm.get_tokenizer() is not None else f"token ids: {comp.token_ids}")
    n = len(comp.token_ids)
    print(f"[kda_rt] backend={llm.backend} load {t_load:.2f}s | prompt {len(out.prompt_token_ids)} tokens, "
          f"generated {n} tokens in {dt:.2f}s ({n / dt:.1f} tok/s), finish_reason={comp.finish_reason}", file=sys.stderr)
    if comp.finish_reason == "error":  # (was: exit 0, a script could not tell; e.g. non-finite weights' logits)
        print(f"error: the request failed: {comp.stop_reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
