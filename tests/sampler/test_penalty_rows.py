"""sampler/penalties.PenaltyRows (the CUDA runner's per-sequence token counts, KDA_RT_GPU_SAMPLING_EXTRAS) on NumPy arrays:
its rows hold exactly each sequence's output counts and prompt marks through new sequences, sampled tokens added
after each launch, rows sampled on the host in between, eviction and growth; and the penalty the sampling kernel
computes from such rows (sampling.cu `penalise`, emulated here in float32 as written there) is bit for bit the
reference's `apply_penalties` with all three penalties on."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.penalties import add_sampled as _add
from helpers.penalties import penalise
from kda_rt.sampler.batch import SamplingBatch
from kda_rt.sampler.params import SamplingParams
from kda_rt.sampler.penalties import PenaltyRows
from kda_rt.sampler.reference import apply_penalties

V = 97


def test_kernel_penalty_is_the_reference_bit_for_bit():
    rng = np.random.default_rng(3)
    for trial in range(20):
        p = SamplingParams(repetition_penalty=float(rng.uniform(0.5, 2.0)), presence_penalty=float(rng.uniform(-1, 1)),
                           frequency_penalty=float(rng.uniform(-1, 1)))
        x = (rng.standard_normal(V) * rng.uniform(0.1, 30)).astype(np.float32)
        prompt = rng.integers(0, V, rng.integers(1, 40)).tolist()
        out = rng.integers(0, V, rng.integers(0, 40)).tolist()
        counts = np.bincount(np.asarray(out, dtype=np.int64), minlength=V)
        mark = np.zeros(V, np.uint8)
        mark[prompt] = 1
        want = apply_penalties(x, p, prompt, out)
        got = penalise(x, p, counts, mark)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), trial


class _Seq:
    def __init__(self, key, prompt, params):
        self.key, self.prompt, self.params, self.out = key, prompt, params, []


def _batch(seqs, host=()):
    rows = [(s.params, 0, s.prompt, s.out) for s in seqs]
    b = SamplingBatch.build(rows, [0], device_extras=True, keys=[s.key for s in seqs])
    if host:  # rows the host samples this step (a ban, a bias: needs_host_sampling), whatever their penalties
        b.host_rows[list(host)] = True
    return b


def _check(pool, seqs):
    for s in seqs:
        row = pool.entries[s.key][0]
        assert row > 0
        assert np.array_equal(pool.counts[row], np.bincount(np.asarray(s.out, dtype=np.int64), minlength=V)), s.key
        assert np.array_equal(np.flatnonzero(pool.prompt[row]), np.unique(s.prompt)), s.key
    assert not pool.counts[0].any() and not pool.prompt[0].any()


def test_rows_follow_the_sequences():
    """Sequences come and go over 40 launches (some steps sample a row on the host): after every launch each
    sequence's row holds its outputs' counts (the device added the sampled token) and its prompt's marks."""
    rng = np.random.default_rng(5)
    pen = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3)
    pool = PenaltyRows(V, np, _add, first_capacity=2)
    live, plain, next_key = [], _Seq(999, [1], SamplingParams()), 0
    for _ in range(40):
        while len(live) < 5 and rng.random() < 0.6:
            live.append(_Seq(next_key, rng.integers(0, V, rng.integers(1, 30)).tolist(), pen))
            next_key += 1
        if not live:
            continue
        seqs = [s for s in live if rng.random() < 0.8] or live[:1]
        host = [i for i in range(len(seqs)) if rng.random() < 0.1]
        batch = _batch([*seqs, plain], host)
        ids = rng.integers(0, V, len(seqs) + 1).astype(np.int32)
        prepared = pool.prepare(batch)
        if prepared is None:  # every penalised row on the host this step
            assert len(host) == len(seqs)
        else:
            rows, update, _ = prepared
            assert rows[-1] == 0 and update[-1] == -1  # the unpenalised row reads the zero row, is never counted
            for i in host:
                assert rows[i] == 0 and update[i] == -1
            pool.after_sample(batch, ids, update)
        for s, t in zip(seqs, ids, strict=False):
            s.out.append(int(t))
        _check(pool, [s for i, s in enumerate(seqs) if i not in host])
        live = [s for s in live if rng.random() > 0.15]  # finished: never seen again
    assert pool.capacity >= 4  # grew from 2


def test_a_row_is_reused_only_after_two_launches_away():
    """A key seen in the launch before may still have a token of that launch to count (its pending token): its row
    is kept and the arrays grow; keys unseen for longer give their rows, least recently seen first."""
    pen = SamplingParams(presence_penalty=0.5)
    pool = PenaltyRows(V, np, _add, first_capacity=2)
    a, b, c, d, e = (_Seq(k, [k + 2], pen) for k in (1, 2, 3, 4, 5))
    for seqs in ([a, b], [c], [d, e, c]):
        batch = _batch(seqs)
        rows, update, _ = pool.prepare(batch)
        if seqs[0] is c:  # a and b seen one launch ago: growth, c in the first new row
            assert pool.capacity == 4 and rows.tolist() == [3]
        if seqs[0] is d:  # d the last free row; a and b unseen for two launches: the lower key, a, gives e its row
            assert rows.tolist() == [4, 1, 3] and 1 not in pool.entries and 2 in pool.entries
        pool.after_sample(batch, np.full(len(seqs), 5, np.int32), update)
        for s in seqs:
            s.out.append(5)
    _check(pool, [b, c, d, e])


def test_pending_token_the_device_did_not_count_is_refused():
    """A row whose step counts a token neither the device counted nor the host holds (not something the engine
    makes) is an error, not silently wrong counts."""
    pen = SamplingParams(frequency_penalty=0.5)
    pool = PenaltyRows(V, np, _add)
    rows = [(pen, 0, [1, 2], [7], 1)]
    with pytest.raises(RuntimeError, match="samples output token 2 but the host holds 1"):
        pool.prepare(SamplingBatch.build(rows, [0], device_extras=True, keys=[5]))
    with pytest.raises(ValueError, match="needs its sequence key"):
        pool.prepare(SamplingBatch.build([(pen, 0, [1], [])], [0], device_extras=True))


def test_no_pool_without_device_penalty_rows():
    pool = PenaltyRows(V, np, _add)
    assert pool.prepare(_batch([_Seq(1, [2], SamplingParams())])) is None
    host = SamplingBatch.build([(SamplingParams(repetition_penalty=1.5), 0, [1], [])], [0], keys=[3])
    assert host.host_rows[0] and pool.prepare(host) is None and pool.counts is None


def test_no_memory_to_grow_samples_the_new_row_on_the_host():
    """When the arrays cannot grow (the GPU's memory is spent), a new sequence's row becomes a host row for that launch
    (its history holds every output), the rows that have counts stay on the device, and later launches try again."""

    class TightNumpy:  # np whose zeros fail past the first growth
        def __init__(self):
            self.allocs = 0

        def zeros(self, shape, dtype):
            self.allocs += 1
            if shape[0] > 3:
                raise MemoryError("out of memory")
            return np.zeros(shape, dtype)

        def __getattr__(self, name):
            return getattr(np, name)

    pen = SamplingParams(frequency_penalty=0.5)
    pool = PenaltyRows(V, TightNumpy(), _add, first_capacity=2)
    a, b, c = _Seq(1, [3], pen), _Seq(2, [4], pen), _Seq(3, [5], pen)
    batch = _batch([a, b, c])
    rows, update, _ = pool.prepare(batch)
    assert rows.tolist() == [1, 2, 0] and update.tolist() == [1, 2, -1]
    assert batch.host_rows.tolist() == [False, False, True] and 3 not in pool.entries
    pool.after_sample(batch, np.array([7, 8, 9], np.int32), update)
    a.out.append(7)
    b.out.append(8)
    _check(pool, [a, b])
    assert pool.counts[:, 9].sum() == 0  # the host row's token is not counted on the device


def test_device_masks_are_the_host_samplers_bans():
    """SamplingBatch.device_masks: grammar mask, this step's bans (min_tokens' stop ids and EOS, bad_words' last
    tokens) and allowed_token_ids as one bitmask; applied as -inf it gives the host sampler's token and logprobs."""
    from kda_rt.sampler.batch import StepOutput
    from kda_rt.sampler.reference import allowed_tokens, sample_row, sample_rows, top_logprobs

    rng = np.random.default_rng(12)
    grammar = rng.integers(-2**31, 2**31, (V + 31) // 32, dtype=np.int64).astype(np.int32)
    plain = SamplingParams(temperature=0.0, logprobs=3)
    p_min = SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[3, 150], logprobs=3)  # (150: past V)
    p_allowed = SamplingParams(temperature=0.8, allowed_token_ids=[1, 5, 7, 60, 96, 500], logprobs=2)
    p_bad = SamplingParams(temperature=0.0, min_tokens=2, logprobs=1)
    p_bad.bad_words_token_ids = ((4, 9), (11,))
    rows = [(plain, 1, [1], [2]), (p_min, 2, [1], [2, 3]), (p_allowed, 3, [1], []), (p_bad, 4, [1], [7, 4]),
            (p_allowed, 5, [2], [])]
    batch = SamplingBatch.build(rows, [0, 96], [None, None, None, None, grammar], device_extras=True)
    masks = batch.device_masks(V)
    assert masks[0] is None and not batch.host_rows.any()
    x = rng.standard_normal((len(rows), V)).astype(np.float32)
    x[:, [0, 3, 9, 11, 96]] += 6.0  # the banned tokens would win otherwise
    want = StepOutput.empty(len(rows))
    sample_rows(x, batch, range(len(rows)), want)
    for i, (p, seed, _, out) in enumerate(rows):
        xi = x[i] if masks[i] is None else np.where(allowed_tokens(masks[i], V), x[i], -np.inf).astype(np.float32)
        token = sample_row(xi, p, seed, len(out))
        assert token == want.token_ids[i], i
        assert top_logprobs(xi, token, p.logprobs) == want.logprobs[i], i
    assert want.token_ids[1] not in (0, 3, 96) and want.token_ids[3] not in (0, 9, 11, 96)  # bans held


def test_bias_rows():
    """A logit_bias makes a device row too (no penalty needed): the bias array comes with the first biased row and
    holds each row's biases (ids past V left out), 0 elsewhere; a reused row is cleared; growth keeps the biases."""
    pool = PenaltyRows(V, np, _add, first_capacity=2)
    plain_pen = _Seq(1, [3], SamplingParams(frequency_penalty=0.5))
    batch = _batch([plain_pen])
    assert pool.prepare(batch)[2] is False and pool.bias is None
    pool.after_sample(batch, np.array([5], np.int32), np.array([1], np.int32))
    plain_pen.out.append(5)
    biased = _Seq(2, [4], SamplingParams(logit_bias={7: 2.5, 9: -1.0, 500: 3.0}))
    batch = _batch([plain_pen, biased])
    rows, update, use_bias = pool.prepare(batch)
    assert use_bias and rows[1] > 0 and update.tolist() == rows.tolist()
    want = np.zeros(V, np.float32)
    want[[7, 9]] = [2.5, -1.0]
    assert np.array_equal(pool.bias[rows[1]], want) and not pool.bias[rows[0]].any()
    pool.after_sample(batch, np.array([6, 8], np.int32), update)
    for s, t in ((plain_pen, 6), (biased, 8)):
        s.out.append(t)
    more = [_Seq(k, [k], SamplingParams(presence_penalty=0.3)) for k in (10, 11, 12)]
    batch = _batch([plain_pen, biased, *more])  # growth: 2 -> 4 -> 8 rows
    rows, update, use_bias = pool.prepare(batch)
    assert pool.capacity == 8 and use_bias and np.array_equal(pool.bias[rows[1]], want)
    assert not pool.bias[rows[2:]].any()
    _check(pool, [plain_pen, biased])


def test_no_memory_for_the_bias_array_or_any_row():
    """Out of memory for the bias array (its first allocation) or for the arrays themselves: the rows that needed them
    are host rows for that launch, `prepare` gives None when no device row is left, and a later launch tries again."""

    class Tight:  # np whose zeros fail while `full` is set
        full = False

        def zeros(self, shape, dtype):
            if self.full:
                raise MemoryError("out of memory")
            return np.zeros(shape, dtype)

        def __getattr__(self, name):
            return getattr(np, name)

    xp = Tight()
    pool = PenaltyRows(V, xp, _add, first_capacity=2)
    xp.full = True
    batch = _batch([_Seq(1, [3], SamplingParams(frequency_penalty=0.5))])
    assert pool.prepare(batch) is None and batch.host_rows.tolist() == [True] and pool.counts is None
    xp.full = False
    pen, biased = _Seq(2, [3], SamplingParams(frequency_penalty=0.5)), _Seq(3, [4], SamplingParams(logit_bias={5: 1.0}))
    batch = _batch([pen])
    rows, update, _ = pool.prepare(batch)
    pool.after_sample(batch, np.array([6], np.int32), update)
    pen.out.append(6)
    xp.full = True
    batch = _batch([pen, biased])
    rows, update, use_bias = pool.prepare(batch)
    assert batch.host_rows.tolist() == [False, True] and rows[1] == 0 and not use_bias and pool.bias is None
    pool.after_sample(batch, np.array([7, 8], np.int32), update)
    pen.out.append(7)
    xp.full = False
    batch = _batch([pen, biased])
    rows, update, use_bias = pool.prepare(batch)
    assert not batch.host_rows.any() and use_bias and pool.bias[rows[1], 5] == 1.0
    _check(pool, [pen])
