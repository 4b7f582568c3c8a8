"""`python -m kda_rt.serve --model DIR`: the OpenAI-compatible server (see `kda_rt.server`)."""

from __future__ import annotations

from kda_rt.server import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
