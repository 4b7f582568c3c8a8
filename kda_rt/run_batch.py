"""`python -m kda_rt.run_batch -i requests.jsonl -o results.jsonl`: an OpenAI batch file run offline (see
`kda_rt.server.run_batch`)."""

from __future__ import annotations

from kda_rt.server.run_batch import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
