"""The reference sampler's shortcuts (top-p among the k largest, the Philox noise of the kept tokens only, top-N
logprobs without a full sort) give exactly what the plain forms give: the same kept set, the same token, the same
logprobs in the same order, on peaked and flat rows, rows of many ties, masked (-inf) tokens, every top_k / min_p /
top_p mix.  The plain forms are written out here as they were."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kda_rt.sampler.params import SamplingParams
from kda_rt.sampler.reference import _probs, _top_indices, draw_noise, draw_noise_at, sample_row


def plain_top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-p, kind="stable")
    cum = np.cumsum(p[order])
    cut = int(np.searchsorted(cum, top_p, side="left")) + 1
    keep = np.zeros_like(p, dtype=bool)
    keep[order[:cut]] = True
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def plain_sample(x: np.ndarray, params: SamplingParams, seed: int, step: int) -> int:
    p = plain_top_p(_probs(x, replace(params, top_p=1.0)), params.top_p) if params.top_p < 1.0 else _probs(x, params)
    return int(np.argmax(p / draw_noise(seed, step, x.shape[0])))


def rows(rng, vocab):
    yield "peaked", (rng.standard_normal(vocab) * 4).astype(np.float32)
    yield "flat", (rng.standard_normal(vocab) * 0.3).astype(np.float32)
    yield "ties", rng.integers(-3, 4, vocab).astype(np.float32)
    spiky = (rng.standard_normal(vocab) * 0.5).astype(np.float32)
    spiky[rng.integers(0, vocab, 40)] += 9.0
    yield "spiky", spiky
    masked = (rng.standard_normal(vocab) * 2).astype(np.float32)
    masked[rng.random(vocab) < 0.7] = -np.inf
    yield "masked", masked
    few_ties = np.round(rng.standard_normal(vocab) * 6).astype(np.float32)  # large tied groups near the top
    yield "rounded", few_ties


@pytest.mark.parametrize("vocab", [4099, 40000])
def test_shortcuts_equal_the_plain_forms(vocab):
    rng = np.random.default_rng(vocab)
    settings = [SamplingParams(temperature=t, top_p=tp, top_k=tk, min_p=mp) for t in (0.3, 1.0) for tp in (0.5, 0.9, 0.99)
                for tk in (0, 50, 3000) for mp in (0.0, 0.05)]
    for name, x in rows(rng, vocab):
        for i, params in enumerate(settings):
            p = _probs(x, params)
            want = plain_top_p(_probs(x, replace(params, top_p=1.0)), params.top_p)
            assert np.array_equal(p, want), (name, params)
            seed, step = 1000 + i, i % 7
            assert sample_row(x, params, seed, step) == plain_sample(x, params, seed, step), (name, params)
        for num in (1, 5, 20, vocab):
            assert np.array_equal(_top_indices(x, num), np.argsort(-x, kind="stable")[:num]), (name, num)


def test_noise_of_some_tokens_is_the_full_rows():
    full = draw_noise(123456789012345, 17, 1001)
    for tokens in (np.array([0, 1, 2, 3, 4, 999, 1000]), np.arange(0, 1001, 7), np.arange(1001)):
        assert np.array_equal(draw_noise_at(123456789012345, 17, tokens, 1001), full[tokens])
