"""`kda-rt`: one console command over the three entry points, with vLLM's shape.

    kda-rt serve [MODEL] [server flags]     = python -m kda_rt.serve --model MODEL ...
    kda-rt generate [MODEL] [flags]         = python -m kda_rt.generate --model MODEL ...
    kda-rt bench [MODEL] [flags]            = python -m kda_rt.bench --model MODEL ...
    kda-rt run-batch -i IN -o OUT [flags]   = python -m kda_rt.run_batch -i IN -o OUT ... (vLLM's run-batch)

MODEL is positional as in `vllm serve MODEL` (right after the command); `--model MODEL` still works.  Without a model the
bundled demo checkpoint is used (serve, generate).
"""

from __future__ import annotations

import os
import sys

__all__ = ["main", "model_dir_problem"]

_COMMANDS = {
    "serve": ("kda_rt.server.__main__", "the OpenAI-compatible HTTP server"),
    "generate": ("kda_rt.generate", "generate text from a prompt and report tokens/s"),
    "bench": ("kda_rt.bench", "throughput and latency benchmark"),
    "run-batch": ("kda_rt.server.run_batch", "an OpenAI batch file (JSON lines) through the server's app, offline"),
}


def _usage() -> str:
    lines = ["usage: kda-rt {serve,generate,bench,run-batch} [MODEL] [flags]", ""]
    lines += [f"  {name:<9} {doc}" for name, (_, doc) in _COMMANDS.items()]
    lines += ["", "`kda-rt COMMAND --help` lists a command's flags."]
    return "\n".join(lines)


def model_dir_problem(path: str | None, name: str = "--model") -> str | None:
    """What is wrong with a checkpoint directory's path (`name`: the flag or parameter that gave it), checked before
    anything loads; None when nothing is (or no path).  `LLM(model)` and the CLIs' --model share it."""
    if path is None or os.path.isdir(path):
        return None
    if os.path.exists(path):
        return f"{name} {path!r} is a file, not a checkpoint directory"
    return f"{name} {path!r}: no such directory"


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from kda_rt import __version__

        print(__version__)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in _COMMANDS:
        print(f"kda-rt: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if rest and not rest[0].startswith("-"):  # positional MODEL
        given = [a for a in rest[1:] if a == "--model" or a.startswith("--model=")]
        if given:  # argparse would keep the last one silently: the positional would be ignored
            print(f"kda-rt {command}: the model is given twice (MODEL {rest[0]!r} and {given[0]}): give one",
                  file=sys.stderr)
            return 2
        rest = ["--model", rest[0], *rest[1:]]
    module = importlib.import_module(_COMMANDS[command][0])
    return module.main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
