"""kernels_cu/sampling.cu against sampler/reference.py (B rows, V vocabulary, N top logprobs).

The kernel draws argmax_{kept} p_i / E_i with E_i = -log U_i from Philox-4x32-10 (key = seed, counter =
(i // 4, step, 0, 0), word i % 4, U = ((w >> 9) + 0.5) * 2^-23).  `kernel_noise` below rebuilds that
noise in NumPy (checked against Random123's published known-answer vectors), so each sampled token has
one exact expected value: argmax of the reference's kept, renormalised probabilities (`_probs`) over
that noise.  That checks the kept set of top-k / top-p / min-p, the draw and the RNG in one comparison.
Rows whose best two scores log p - log E differ by less than 1e-4 are float-ambiguous: there we only
require a token the reference keeps (p > 0).  top_p and min_p are snapped to midpoints between
consecutive reference cumulative masses / probability ratios so the cut is not decided by rounding.
Logprobs: log-softmax of the penalised, untempered logits, within 1e-5 (float32 logZ vs float64).
Kernel variants (a row over a cluster of 1..8 CTAs, 256..1024 threads, x cached in shared memory or
reread) must give the same ids and top ids and logprobs within a few float32 ulps of logZ."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from helpers.gpu import poison
from kda_rt.sampler.params import SamplingParams
from kda_rt.sampler.reference import _probs, apply_penalties, draw_noise, philox4x32_10, top_logprobs

gpu = pytest.mark.gpu


# ---------------------------------------------------------------------------------------------
# NumPy model of the kernel's noise

def expected_token(x: np.ndarray, params: SamplingParams, seed: int, step: int) -> tuple[int, np.ndarray, bool]:
    """(token, reference probs, unambiguous) for penalised logits x [V]."""
    if params.greedy:
        p = np.zeros(x.shape[0])
        p[np.argmax(x)] = 1.0
        return int(np.argmax(x)), p, True
    p = _probs(x, params)
    with np.errstate(divide="ignore"):
        score = np.where(p > 0, np.log(p) - np.log(draw_noise(seed, step, x.shape[0])), -np.inf)
    top2 = np.partition(score, -2)[-2:]
    return int(np.argmax(score)), p, bool(top2[1] - top2[0] > 1e-4)


def snap_top_p(x, params: SamplingParams, target: float) -> float:
    """A top_p near `target` halfway between two consecutive reference cumulative masses."""
    q = np.sort(_probs(x, replace(params, top_p=1.0)))[::-1]  # after top_k and min_p, as top_p sees them
    cum = np.cumsum(q)
    j = int(np.searchsorted(cum, target))
    while j > 0 and (j >= len(q) or q[j] < 1e-4):
        j -= 1
    return float(np.float32(((cum[j - 1] if j else 0.0) + cum[j]) / 2))


def snap_min_p(x, params: SamplingParams, target: float) -> float:
    """A min_p near `target` halfway between two consecutive reference ratios p / max p."""
    p = _probs(x, replace(params, min_p=0.0, top_p=1.0))  # min_p's ratios p / max p, before top_p
    r = np.sort(p[p > 0] / p.max())[::-1]
    i = int(np.searchsorted(-r, -target))  # first ratio below target
    while i > 1 and (i >= len(r) or (r[i - 1] - r[i]) / r[i - 1] < 1e-3):
        i -= 1
    return float(np.float32((r[i - 1] + r[i]) / 2)) if 0 < i < len(r) else float(np.float32(target))


def make_params(kind: str, x: np.ndarray, rng) -> SamplingParams:
    if kind == "mixed":
        kind = rng.choice(["greedy", "temperature", "top_k", "top_p", "min_p", "combined"])
    t = float(np.float32(rng.uniform(0.5, 1.5)))
    if kind == "greedy":
        return SamplingParams(temperature=0.0)
    if kind == "temperature":
        return SamplingParams(temperature=t)
    if kind in ("top_k", "top_k_ties"):
        return SamplingParams(temperature=t, top_k=int(rng.integers(1, 60)))
    params = SamplingParams(temperature=t, top_k=int(rng.integers(20, 200)) if kind == "combined" else 0)
    # min_p first: top_p's cumulative masses are over what top_k and min_p keep (vLLM's order), so its snap
    # needs min_p set
    if kind in ("min_p", "combined"):
        params = replace(params, min_p=snap_min_p(x, params, rng.uniform(0.02, 0.4)))
    if kind in ("top_p", "combined"):
        params = replace(params, top_p=snap_top_p(x, params, rng.uniform(0.3, 0.95)))
    return params


def make_inputs(B: int, V: int, kind: str, seed: int):
    rng = np.random.default_rng(seed)
    scale = 2.0 if V < 20000 else 3.0
    x = (rng.normal(size=(B, V)) * scale).astype(np.float32)
    if kind == "top_k_ties":
        x = np.round(x * 2) / 2  # many equal logits: top-k keeps every token tied with the k-th
    params = [make_params(kind, x[b], rng) for b in range(B)]
    seeds = [int(s) for s in rng.integers(0, 2**64, size=B, dtype=np.uint64)]
    steps = [int(s) for s in rng.integers(0, 5000, size=B)]
    return x, params, seeds, steps


def run_sample(x, params, seeds, steps, *, penalties=None, num_logprobs=0, stream=None, **variant):
    """Upload, launch with poisoned outputs, return (ids, logprobs, top_ids, top_logprobs) as NumPy."""
    import cupy

    from kda_rt.sampler.sampling import sample

    B = x.shape[0]
    dev = {name: cupy.asarray(np.array(vals, dtype=dtype)) for name, vals, dtype in (
        ("temperature", [p.temperature for p in params], np.float32), ("top_k", [p.top_k for p in params], np.int32),
        ("top_p", [p.top_p for p in params], np.float32), ("min_p", [p.min_p for p in params], np.float32),
        ("seeds", seeds, np.uint64), ("steps", steps, np.int32))}
    ids, lp = cupy.full((B,), -7, dtype=np.int32), cupy.empty((B,), dtype=np.float32)
    top_ids, top_lp = cupy.full((B, num_logprobs), -7, dtype=np.int32), cupy.empty((B, num_logprobs), np.float32)
    poison(lp)
    poison(top_lp)
    out = sample(cupy.asarray(x), **dev, penalties=penalties, out_ids=ids, out_logprobs=lp, num_logprobs=num_logprobs,
                 out_top_ids=top_ids if num_logprobs else None, out_top_logprobs=top_lp if num_logprobs else None,
                 stream=stream, **variant)
    assert out is ids
    return tuple(cupy.asnumpy(a) for a in (ids, lp, top_ids, top_lp))


def check_tokens(x, params, seeds, steps, ids, *, min_exact: float = 0.9):
    """Every token is kept by the reference; unambiguous rows match the expected token exactly."""
    exact = 0
    for b in range(x.shape[0]):
        want, p, clear = expected_token(x[b], params[b], seeds[b], steps[b])
        assert 0 <= ids[b] < x.shape[1] and p[ids[b]] > 0, f"row {b}: token {ids[b]} outside the kept set ({params[b]})"
        if clear:
            assert ids[b] == want, f"row {b}: got {ids[b]}, expected {want} ({params[b]}, seed {seeds[b]}, step {steps[b]})"
            exact += 1
    assert exact >= min_exact * x.shape[0], f"only {exact}/{x.shape[0]} rows were unambiguous"


def check_logprobs(x, ids, lp, top_ids=None, top_lp=None):
    for b in range(x.shape[0]):
        ref = top_logprobs(x[b], int(ids[b]), 0 if top_ids is None else top_ids.shape[1])
        assert abs(lp[b] - ref[int(ids[b])]) <= 1e-5, f"row {b}: logprob {lp[b]} vs {ref[int(ids[b])]}"
        if top_ids is not None:
            want = np.argsort(-x[b].astype(np.float64), kind="stable")[: top_ids.shape[1]]
            assert np.array_equal(top_ids[b], want), f"row {b}: top ids {top_ids[b]} vs {want}"
            assert np.all(np.abs(top_lp[b] - [ref[int(t)] for t in want]) <= 1e-5), f"row {b}: top logprobs"


# ---------------------------------------------------------------------------------------------
# tests

def test_philox_known_answers():
    """Random123's published Philox-4x32-10 known-answer vectors (CPU only: validates the model)."""
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, want in cases:
        assert tuple(int(w) for w in philox4x32_10(*ctr, *key)) == want


@gpu
@pytest.mark.parametrize("V", [1003, 32000, 163840], ids=lambda v: f"V{v}")
@pytest.mark.parametrize("kind", ["greedy", "temperature", "top_k", "top_k_ties", "top_p", "min_p", "combined", "mixed"])
def test_sample_matches_reference(kind, V):
    x, params, seeds, steps = make_inputs(48 if V < 100000 else 12, V, kind, seed=V + len(kind))
    ids, lp, top_ids, top_lp = run_sample(x, params, seeds, steps, num_logprobs=5)
    check_tokens(x, params, seeds, steps, ids)
    check_logprobs(x, ids, lp, top_ids, top_lp)


@gpu
def test_distribution_chi_square():
    """20000 seeds on one small row: counts over the top-k set against n * p.  With 7 degrees of
    freedom, chi2 < 35 fails by chance with probability ~1e-5; tokens outside top-k never appear."""
    n, V = 20000, 16
    rng = np.random.default_rng(11)
    x = np.tile(rng.normal(size=V).astype(np.float32), (n, 1))
    params = [SamplingParams(temperature=1.0, top_k=8)] * n
    ids, *_ = run_sample(x, params, [int(s) for s in rng.integers(0, 2**62, size=n)], [3] * n)
    p = _probs(x[0], params[0])
    obs = np.bincount(ids, minlength=V)
    assert np.all(obs[p == 0] == 0)
    exp = n * p[p > 0]
    chi2 = float(np.sum((obs[p > 0] - exp) ** 2 / exp))
    assert chi2 < 35.0, f"chi2 {chi2:.1f} over 7 dof; observed {obs}, expected {np.round(n * p)}"


@gpu
@pytest.mark.parametrize("V", [1003, 163840], ids=lambda v: f"V{v}")
def test_same_seed_same_token_whatever_the_batch(V):
    """Also across kernel variants: at V = 163840, B = 1 and 16 run 1024-thread CTAs, B = 40 512."""
    rng = np.random.default_rng(5)
    row = (rng.normal(size=V) * 0.3).astype(np.float32)  # flat: many tokens are likely
    mine = SamplingParams(temperature=1.0, top_p=0.95)
    tokens = set()
    for B, pos, num_logprobs in [(1, 0, 0), (16, 5, 3), (40, 39, 0)]:
        x, params, seeds, steps = make_inputs(B, V, "mixed", seed=B)
        x[pos], params[pos], seeds[pos], steps[pos] = row, mine, 1234567, 42
        ids, *_ = run_sample(x, params, seeds, steps, num_logprobs=num_logprobs)
        tokens.add(int(ids[pos]))
    assert len(tokens) == 1, f"same (seed, step, logits) gave tokens {tokens} in different batches"


@gpu
def test_steps_and_seeds_change_the_draw():
    rng = np.random.default_rng(6)
    V, B = 1003, 64
    x = np.tile((rng.normal(size=V) * 0.1).astype(np.float32), (B, 1))
    params = [SamplingParams(temperature=1.0)] * B
    by_step, *_ = run_sample(x, params, [99] * B, list(range(B)))
    by_seed, *_ = run_sample(x, params, list(range(B)), [0] * B)
    assert len(set(by_step.tolist())) >= 48 and len(set(by_seed.tolist())) >= 48, (by_step, by_seed)
    check_tokens(x, params, [99] * B, list(range(B)), by_step)


@gpu
def test_penalties_flip_the_greedy_pick():
    """Each row's raw argmax is penalised below the runner-up: repetition on a prompt token (positive
    and negative logits), frequency and presence on output tokens.  counts / prompt_mask are built
    with update_counts / mark_prompt_tokens."""
    import cupy

    from kda_rt.sampler.sampling import mark_prompt_tokens, update_counts

    rng = np.random.default_rng(8)
    B, V = 4, 4099
    x = rng.normal(size=(B, V)).astype(np.float32)
    top, second = 10, 20
    x[:, top], x[:, second] = x.max(axis=1) + 1.0, x.max(axis=1) + 0.6
    x[1] = -np.abs(x[1]) - 1.0  # all-negative row: repetition multiplies
    x[1, top], x[1, second] = -0.5, -0.7
    prompts = [[top, 3, 7], [top, 5], [1, 2], [2]]
    outputs = [[4, 4], [], [top, top, top, 9], [top, 11, 11]]
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5), SamplingParams(temperature=0.0, repetition_penalty=1.8),
              SamplingParams(temperature=0.0, frequency_penalty=0.5), SamplingParams(temperature=0.0, presence_penalty=1.5)]
    counts, prompt_mask = cupy.zeros((B, V), dtype=np.int32), cupy.zeros((B, V), dtype=np.uint8)
    for b, prompt in enumerate(prompts):
        mark_prompt_tokens(prompt_mask, b, cupy.asarray(np.array(prompt, dtype=np.int32)))
    for step in range(max(map(len, outputs))):
        update_counts(counts, cupy.asarray(np.array([o[step] if step < len(o) else -1 for o in outputs], np.int32)))
    for b in range(B):
        assert np.array_equal(cupy.asnumpy(counts[b]), np.bincount(outputs[b], minlength=V)), f"counts row {b}"
        assert np.array_equal(np.flatnonzero(cupy.asnumpy(prompt_mask[b])), sorted(set(prompts[b]))), f"mask row {b}"
    pen = (counts, prompt_mask, *(cupy.asarray(np.array([getattr(p, f) for p in params], np.float32))
                                  for f in ("repetition_penalty", "presence_penalty", "frequency_penalty")))
    xp = np.stack([apply_penalties(x[b], params[b], prompts[b], outputs[b]) for b in range(B)])
    assert all(np.argmax(xp[b]) != np.argmax(x[b]) for b in range(B)), "test logits do not flip the pick"
    ids, lp, top_ids, top_lp = run_sample(x, params, [1] * B, [0] * B, penalties=pen, num_logprobs=4)
    assert np.array_equal(ids, np.argmax(xp, axis=1)), (ids, np.argmax(xp, axis=1))
    check_logprobs(xp, ids, lp, top_ids, top_lp)
    sampled = [replace(p, temperature=0.8) for p in params]
    ids, lp, *_ = run_sample(x, sampled, [7, 8, 9, 10], [3, 3, 3, 3], penalties=pen)
    check_tokens(xp, sampled, [7, 8, 9, 10], [3] * 4, ids, min_exact=0.75)
    check_logprobs(xp, ids, lp)
    # the runner's form (sampler/penalties.py): rows of a larger pool, found through a row map; update_counts by
    # the same map skips rows mapped to -1
    perm = np.array([5, 2, 6, 1], np.int32)
    pool_counts, pool_prompt = cupy.zeros((B + 3, V), dtype=np.int32), cupy.zeros((B + 3, V), dtype=np.uint8)
    pool_counts[cupy.asarray(perm)], pool_prompt[cupy.asarray(perm)] = counts, prompt_mask
    mapped = (pool_counts, pool_prompt, *pen[2:], cupy.asarray(perm))
    counts_before = pool_counts.copy()  # (for the bias case below: update_counts changes pool_counts)
    ids2, lp2, top_ids2, top_lp2 = run_sample(x, params, [1] * B, [0] * B, penalties=mapped, num_logprobs=4)
    assert np.array_equal(ids2, np.argmax(xp, axis=1)) and np.array_equal(lp2, run_sample(
        x, params, [1] * B, [0] * B, penalties=pen, num_logprobs=4)[1])
    update_counts(pool_counts, cupy.asarray(np.array([3, 4, 5, 6], np.int32)),
                  rows=cupy.asarray(np.array([5, -1, 6, 1], np.int32)))
    after = cupy.asnumpy(pool_counts)
    for b, (r, t) in enumerate(zip(perm.tolist(), [3, 4, 5, 6], strict=True)):
        want = np.bincount(outputs[b], minlength=V)
        want[t] += b != 1
        assert np.array_equal(after[r], want), f"row {b}"
    assert not after[[0, 3, 4]].any()
    # HAS_BIAS: each row's logit_bias from a [R, V] array through the same map, added before the penalties, as vLLM
    # adds it: also on `top`, which every row's penalties touch (its logprob among the top 4 tells the order apart)
    bias = np.zeros((B + 3, V), np.float32)
    for b, r in enumerate(perm.tolist()):
        bias[r, [second, 30 + b, top]] = [3.0, -0.25, 2.0]
    xb = np.stack([apply_penalties(x[b] + bias[r], params[b], prompts[b], outputs[b])
                   for b, r in enumerate(perm.tolist())])
    biased = (counts_before, *mapped[1:], cupy.asarray(bias))
    ids3, lp3, top_ids3, top_lp3 = run_sample(x, params, [1] * B, [0] * B, penalties=biased, num_logprobs=4)
    assert np.array_equal(ids3, np.argmax(xb, axis=1)) and (ids3 == second).all()
    check_logprobs(xb, ids3, lp3, top_ids3, top_lp3)


@gpu
def test_top_logprobs_with_ties():
    """Integer logits: many ties, so the top-N search resolves index bits (lower index first)."""
    rng = np.random.default_rng(9)
    x = rng.integers(-4, 4, size=(8, 1003)).astype(np.float32)
    params = [SamplingParams(temperature=0.0)] * 8
    ids, lp, top_ids, top_lp = run_sample(x, params, [0] * 8, [0] * 8, num_logprobs=20)
    assert np.array_equal(ids, np.argmax(x, axis=1))
    check_logprobs(x, ids, lp, top_ids, top_lp)


@gpu
def test_full_vocab_row():
    V = 163840
    x, params, seeds, steps = make_inputs(3, V, "combined", seed=10)
    params[0] = SamplingParams(temperature=0.0)
    ids, lp, top_ids, top_lp = run_sample(x, params, seeds, steps, num_logprobs=8)
    check_tokens(x, params, seeds, steps, ids, min_exact=0.66)
    check_logprobs(x, ids, lp, top_ids, top_lp)


@gpu
@pytest.mark.parametrize("V", [1003, 163840], ids=lambda v: f"V{v}")
def test_cuda_graph_capture_and_replay(V):
    """sample + update_counts captured once on a stream, replayed with new logits and steps (the
    cluster kernel at V = 163840 keeps no state between launches)."""
    import cupy

    from kda_rt.sampler.sampling import sample, update_counts

    B = 8
    x, params, seeds, steps = make_inputs(B, V, "mixed", seed=12)
    dev = [cupy.asarray(np.array(v, dtype=d)) for v, d in (
        ([p.temperature for p in params], np.float32), ([p.top_k for p in params], np.int32),
        ([p.top_p for p in params], np.float32), ([p.min_p for p in params], np.float32),
        (seeds, np.uint64), (steps, np.int32))]
    xg, ids, lp = cupy.asarray(x), cupy.empty((B,), np.int32), cupy.empty((B,), np.float32)
    counts = cupy.zeros((B, V), np.int32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        sample(xg, *dev, out_ids=ids, out_logprobs=lp, stream=stream)  # compile + load outside capture
        update_counts(counts, ids, stream=stream)
        stream.synchronize()
        counts[...] = 0
        stream.begin_capture()
        sample(xg, *dev, out_ids=ids, out_logprobs=lp, stream=stream)
        update_counts(counts, ids, stream=stream)
        graph = stream.end_capture()
    for replay in range(2):
        x2 = (np.random.default_rng(100 + replay).normal(size=(B, V)) * 2).astype(np.float32)
        steps2 = [s + replay + 1 for s in steps]
        xg[...] = cupy.asarray(x2)
        dev[5][...] = cupy.asarray(np.array(steps2, np.int32))
        ids.fill(-7)
        poison(lp)
        cupy.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        got = cupy.asnumpy(ids)
        check_tokens(x2, params, seeds, steps2, got, min_exact=0.75)
        check_logprobs(x2, got, cupy.asnumpy(lp))
    assert int(counts.sum()) == 2 * B


def _variant_outputs(x, params, seeds, steps, variants, **kw):
    """run_sample under each kernel variant; ids and top ids must agree exactly, logprobs within 4e-6
    (a few float32 ulps of logZ ~ 16: the variants merge the log-sum-exp partials in different orders)."""
    runs = [run_sample(x, params, seeds, steps, **kw, **v) for v in variants]
    ids, lp, top_ids, top_lp = runs[0]
    for v, (ids2, lp2, top_ids2, top_lp2) in zip(variants[1:], runs[1:], strict=True):
        assert np.array_equal(ids, ids2), f"{v}: ids {ids2} vs {ids}"
        assert np.array_equal(top_ids, top_ids2), f"{v}: top ids differ"
        assert np.max(np.abs(lp - lp2), initial=0.0) <= 4e-6, f"{v}: logprobs differ by {np.max(np.abs(lp - lp2))}"
        assert np.max(np.abs(top_lp - top_lp2), initial=0.0) <= 4e-6, f"{v}: top logprobs differ"
    return runs[0]


VARIANTS = [{}, {"cluster": 8, "threads": 512}, {"cluster": 8, "threads": 1024}, {"cluster": 4, "threads": 256},
            {"cluster": 1, "threads": 1024}]  # the last two: 160 KB / 640 KB slices, x reread from global


@gpu
@pytest.mark.parametrize("kind", ["mixed", "top_k_ties", "temperature"])
def test_variants_agree(kind):
    """Every kernel variant gives the same tokens, the reference's where unambiguous (V = 163840)."""
    V = 163840
    x, params, seeds, steps = make_inputs(12, V, kind, seed=21 + len(kind))
    ids, lp, top_ids, top_lp = _variant_outputs(x, params, seeds, steps, VARIANTS, num_logprobs=8)
    check_tokens(x, params, seeds, steps, ids, min_exact=0.75)
    check_logprobs(x, ids, lp, top_ids, top_lp)


@gpu
def test_crowded_bins():
    """Integer logits in [-4, 4) at V = 163840: ~20000 tokens share each value, so every coarse bin of
    the searches holds more than the per-CTA candidate list (LIST_CAP) and the fine passes rescan the
    slice; top-k keeps every token tied with the k-th, top logprobs resolve index bits."""
    V, B = 163840, 8
    rng = np.random.default_rng(22)
    x = rng.integers(-4, 4, size=(B, V)).astype(np.float32)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              *(SamplingParams(temperature=float(np.float32(rng.uniform(0.5, 1.5))), top_k=int(k))
                for k in rng.integers(1, 40000, size=B - 2))]
    seeds = [int(v) for v in rng.integers(0, 2**63, size=B)]
    steps = [int(v) for v in rng.integers(0, 5000, size=B)]
    ids, lp, top_ids, top_lp = _variant_outputs(x, params, seeds, steps, VARIANTS[:3], num_logprobs=20)
    check_tokens(x, params, seeds, steps, ids, min_exact=0.75)
    check_logprobs(x, ids, lp, top_ids, top_lp)


@gpu
@pytest.mark.parametrize("B", [32, 256])
def test_large_batch_greedy_and_top_p(B):
    """B * 8 CTAs: 512-thread CTAs, several waves of clusters; greedy rows exact, top-p rows checked."""
    V = 163840
    kind = "greedy" if B == 256 else "top_p"
    x, params, seeds, steps = make_inputs(B, V, kind, seed=B)
    ids, lp, *_ = run_sample(x, params, seeds, steps)
    if kind == "greedy":
        assert np.array_equal(ids, np.argmax(x, axis=1))
        m = x.astype(np.float64).max(axis=1)
        logz = m + np.log(np.exp(x - m[:, None]).sum(axis=1))
        want = x[np.arange(B), ids] - logz
        assert np.max(np.abs(lp - want)) <= 1e-5, f"logprobs off by {np.max(np.abs(lp - want))}"
    else:
        check_tokens(x, params, seeds, steps, ids)
        check_logprobs(x, ids, lp)


@gpu
@pytest.mark.parametrize("V", [1003, 163840], ids=lambda v: f"V{v}")
def test_grammar_mask_and_flags(V):
    """HAS_MASK: disallowed tokens are -inf before everything (as sampler/reference.py applies the mask),
    so tokens and logprobs equal the reference on the masked logits; out_flags: 1 for a row with a NaN
    logit, 2 for a row whose mask allows nothing, 0 otherwise (an all-ones mask is no constraint)."""
    import cupy

    from kda_rt.sampler.reference import allowed_tokens
    from kda_rt.sampler.sampling import sample

    B, words = 8, (V + 31) // 32
    x, params, seeds, steps = make_inputs(B, V, "mixed", seed=V)
    rng = np.random.default_rng(V + 1)
    masks = rng.integers(-2**31, 2**31, size=(B, words), dtype=np.int64).astype(np.int32)
    masks &= rng.integers(-2**31, 2**31, size=(B, words), dtype=np.int64).astype(np.int32)  # ~1/4 allowed
    masks[1] = -1  # unconstrained
    masks[2] = 0
    masks[2, 3] = 1 << 5  # exactly one token (101) allowed
    masks[6] = 0  # nothing allowed -> flag 2
    x[7, V // 2] = np.nan  # -> flag 1
    dev = {name: cupy.asarray(np.array(vals, dtype=dtype)) for name, vals, dtype in (
        ("temperature", [p.temperature for p in params], np.float32), ("top_k", [p.top_k for p in params], np.int32),
        ("top_p", [p.top_p for p in params], np.float32), ("min_p", [p.min_p for p in params], np.float32),
        ("seeds", seeds, np.uint64), ("steps", steps, np.int32))}
    ids, lp, flags = cupy.full((B,), -7, np.int32), cupy.empty((B,), np.float32), cupy.full((B,), -7, np.int32)
    top_ids, top_lp = cupy.full((B, 4), -7, np.int32), cupy.empty((B, 4), np.float32)
    poison(lp)
    poison(top_lp)
    sample(cupy.asarray(x), **dev, allowed=cupy.asarray(masks), out_ids=ids, out_logprobs=lp, num_logprobs=4,
           out_top_ids=top_ids, out_top_logprobs=top_lp, out_flags=flags)
    ids, lp, flags, top_ids, top_lp = (cupy.asnumpy(a) for a in (ids, lp, flags, top_ids, top_lp))
    assert flags.tolist() == [0, 0, 0, 0, 0, 0, 2, 1]
    good = list(range(6))
    xm = np.stack([np.where(allowed_tokens(masks[b], V), x[b], -np.inf).astype(np.float32) for b in good])
    assert ids[2] == 101
    check_tokens(xm, [params[b] for b in good], [seeds[b] for b in good], [steps[b] for b in good], ids[good],
                 min_exact=0.8)
    for b in good:
        assert (masks[b, ids[b] // 32] >> (ids[b] % 32)) & 1, f"row {b}: token {ids[b]} is not allowed"
    allowed_rows = [b for b in good if b != 2]  # row 2 has one allowed token: fewer than 4 top logprobs exist
    check_logprobs(xm[allowed_rows], ids[allowed_rows], lp[allowed_rows], top_ids[allowed_rows], top_lp[allowed_rows])



@gpu
def test_penalty_overflow_is_flagged():
    """A finite logit that a penalty takes past float32 (x / 0.01 at 1e37, the reference's "non-finite logits after
    penalties" error) flags the row 3 (a non-finite raw logit: 1); the other rows sample as before."""
    import cupy

    from kda_rt.sampler.sampling import sample

    B, V = 3, 1003
    rng = np.random.default_rng(4)
    x = rng.normal(size=(B, V)).astype(np.float32)
    x[1, 17] = 1e37  # in the prompt of row 1: divided by its repetition penalty 0.01
    x[2, 17] = 1e37  # row 2 has no penalty: a large but finite logit
    counts, prompt = cupy.zeros((B, V), np.int32), cupy.zeros((B, V), np.uint8)
    prompt[:, 17] = 1
    pen = (counts, prompt, cupy.asarray(np.array([1.0, 0.01, 1.0], np.float32)),
           cupy.zeros((B,), np.float32), cupy.zeros((B,), np.float32))
    dev = dict(temperature=cupy.zeros((B,), np.float32), top_k=cupy.zeros((B,), np.int32),
               top_p=cupy.ones((B,), np.float32), min_p=cupy.zeros((B,), np.float32),
               seeds=cupy.zeros((B,), np.uint64), steps=cupy.zeros((B,), np.int32))
    flags = cupy.full((B,), -7, np.int32)
    ids = sample(cupy.asarray(x), **dev, penalties=pen, out_flags=flags)
    assert cupy.asnumpy(flags).tolist() == [0, 3, 0]
    x[0, 3] = np.inf  # a raw inf in a penalised batch: 1, whatever the penalties
    flags[:] = -7
    ids = sample(cupy.asarray(x), **dev, penalties=pen, out_flags=flags)
    assert cupy.asnumpy(flags).tolist() == [1, 3, 0]
    assert cupy.asnumpy(ids)[[0, 2]].tolist() == [int(np.argmax(x[0])), 17]


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v"]))
