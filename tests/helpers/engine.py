"""Engine-test helpers: an LLM on a checkpoint directory, greedy params, random prompts, and the
no-leak check (the `tiny_dir` fixture lives in tests/engine/conftest.py)."""

from __future__ import annotations

import random
from pathlib import Path

from kda_rt import LLM, SamplingParams

__all__ = ["greedy", "make_llm", "mixed_prompts", "assert_no_leaks"]


def make_llm(model_dir: Path | str, **kw) -> LLM:
    """float64 so that batching, chunking and recompute cannot flip a greedy argmax by rounding."""
    kw.setdefault("dtype", "float64")
    kw.setdefault("backend", "numpy")
    return LLM(str(model_dir), **kw)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def mixed_prompts(count: int, seed: int = 0, lo: int = 1, hi: int = 40, vocab: int = 512) -> list[list[int]]:
    """`count` prompts of token ids with lengths spread over [lo, hi]."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def assert_no_leaks(llm: LLM) -> None:
    """Nothing running or waiting, and every slot and page back in its pool."""
    s = llm.stats()
    assert s["running"] == 0 and s["waiting"] == 0, s
    assert s["slots_used"] == 0 and s["pages_used"] == 0, s
