"""NumPy reference sampler: filters keep exactly the right tokens, draws follow the
distribution, and a seeded draw depends only on (seed, step)."""

from __future__ import annotations

import numpy as np
import pytest

from kda_rt import SamplingParams
from kda_rt.sampler.reference import _probs, apply_penalties, draw_noise, sample_row, top_logprobs


def make_logits(seed: int = 0, vocab: int = 50) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=vocab).astype(np.float32) * 3


def test_greedy_is_argmax():
    x = make_logits()
    assert sample_row(x, SamplingParams(temperature=0), seed=1, step=0) == int(np.argmax(x))


def test_top_k_top_p_min_p_supports():
    x = make_logits(1)
    order = np.argsort(-x)
    p = _probs(x, SamplingParams(top_k=5))
    assert set(np.flatnonzero(p)) == set(order[:5].tolist())
    full = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    p = _probs(x, SamplingParams(top_p=0.5))
    cum = np.cumsum(full[order])
    need = int(np.searchsorted(cum, 0.5)) + 1  # smallest prefix reaching 0.5
    assert set(np.flatnonzero(p)) == set(order[:need].tolist())
    p = _probs(x, SamplingParams(min_p=0.1))
    assert set(np.flatnonzero(p)) == set(np.flatnonzero(full >= 0.1 * full.max()).tolist())
    assert abs(p.sum() - 1) < 1e-12


def test_min_p_applies_before_top_p():
    """vLLM's v1 sampler order: min_p drops tokens below min_p x the top probability first, and top_p's cumulative
    mass is then over the renormalised rest.  p = (0.4, 0.3, 0.2, 0.1), min_p 0.3 (drops 0.1 < 0.12), top_p 0.75:
    the rest renormalised is (4, 3, 2) / 9, whose prefix reaches 0.75 at two tokens (7 / 9); top_p first would keep
    three (0.4 + 0.3 < 0.75 <= 0.9) and min_p would then drop none of them."""
    x = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    p = _probs(x, SamplingParams(top_p=0.75, min_p=0.3))
    assert set(np.flatnonzero(p)) == {0, 1}
    assert np.allclose(p[:2], [4 / 7, 3 / 7], rtol=1e-12)
    assert set(np.flatnonzero(_probs(x, SamplingParams(top_p=0.75)))) == {0, 1, 2}  # top_p alone: three


def test_draws_follow_distribution():
    x = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float32))
    params = SamplingParams(temperature=1.0)
    counts = np.bincount([sample_row(x, params, seed=7, step=s) for s in range(4000)], minlength=3) / 4000
    # 4000 draws: standard error <= 0.008, so 0.03 is a > 3.5 sigma bound
    assert np.allclose(counts, [0.5, 0.3, 0.2], atol=0.03), counts


def test_seeded_noise_depends_only_on_seed_and_step():
    a, b = draw_noise(123, 5, 100), draw_noise(123, 5, 100)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, draw_noise(123, 6, 100)) and not np.array_equal(a, draw_noise(124, 5, 100))


def test_penalties():
    x = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    out = apply_penalties(x, SamplingParams(repetition_penalty=2.0), prompt_ids=[0], output_ids=[1])
    assert np.allclose(out, [1.0, -4.0, 1.0, 0.5])
    out = apply_penalties(x, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [3], [2, 2, 0])
    assert np.allclose(out, [2.0 - 0.75, -2.0, 1.0 - 1.0, 0.5])


@pytest.mark.parametrize("num", [0, 3])
def test_top_logprobs(num):
    """The sampled token and the `num` most likely ones (which ones, not only how many: a list of the least likely
    passed before), each at its float64 log-softmax (1e-12: the same float64 sums, other order)."""
    x = make_logits(2)
    lp = top_logprobs(x, 7, num)
    ref = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum())
    assert set(lp) == {7} | set(np.argsort(-ref)[:num].tolist())
    assert all(abs(v - ref[t]) < 1e-12 for t, v in lp.items())


def test_logit_bias_applies_before_repetition_penalty():
    """vLLM's v1 sampler adds logit_bias before the penalties (bias is one of its non-argmax-invariant logits
    processors, run before apply_all_penalties), so a repetition penalty acts on the biased logit's sign.  Token 1
    (logit 1.0, in the prompt) with bias -3 and repetition 2: vLLM (1 - 3) * 2 = -4 < token 0's -3.5, so token 0 is
    the greedy pick; the bias after the penalty gives 1 / 2 - 3 = -2.5, and token 1."""
    from kda_rt.sampler.batch import SamplingBatch, StepOutput
    from kda_rt.sampler.reference import sample_rows

    x = np.array([-3.5, 1.0, -10.0, -10.0], np.float32)
    p = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={1: -3.0}, logprobs=0)
    batch = SamplingBatch.build([(p, 0, [1], [])], eos_token_ids=[])
    out = StepOutput.empty(1)
    sample_rows(x[None], batch, [0], out)
    assert out.token_ids[0] == 0
    z = np.array([-3.5, -4.0, -10.0, -10.0])
    assert out.logprobs[0][0] == pytest.approx(z[0] - np.log(np.exp(z).sum()))


@pytest.mark.parametrize("ignore_eos", [False, True], ids=["eos", "ignore_eos"])
def test_min_tokens_bans_eos_even_under_ignore_eos(ignore_eos):
    """vLLM's min_tokens processor bans `_all_stop_token_ids`: the stop ids and every EOS id, which the engine adds
    whatever `ignore_eos` says (SamplingParams.update_from_generation_config); `ignore_eos` only keeps EOS from
    ending the request.  (Was: under ignore_eos, EOS could be sampled before min_tokens.)"""
    from kda_rt.sampler.batch import SamplingBatch

    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5], ignore_eos=ignore_eos)
    rows = [(p, 0, [1], [7, 8]), (p, 0, [1], [7, 8, 9])]  # 2 outputs: still under min_tokens; 3: reached
    batch = SamplingBatch.build(rows, eos_token_ids=[11, 2])
    assert sorted(batch.banned[0]) == [2, 5, 11]
    assert batch.banned[1] == ()
