"""kernels_cu/moe_align.cu moe_bucket: the plan it writes, checked exactly against counts made here on
random and skewed routings, with and without the shared expert as the last bin (shared_slot), by the one-block
kernel and by the three launches over many blocks (moe_bucket_count / _plan / _scatter) that large steps
take; the invariants are in tests/helpers/moe_plan.py.

Every output is poisoned (-7) first, so an entry left unwritten fails.  (Run on the H200 on 2026-11-30
against a variant of the kernel that placed the shared pairs without atomics, since reverted; the
invariants checked here hold for both.)"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.moe_plan import assert_plan

pytestmark = pytest.mark.gpu

CASES = [(1, 256, 8, 16, False), (7, 256, 8, 16, False), (300, 64, 6, 64, True), (2048, 256, 8, 128, False),
         (8192, 256, 8, 128, False), (3, 16, 4, 16, True), (1000, 256, 8, 64, True), (16384, 256, 8, 128, False),
         (16384, 256, 8, 128, True), (4099, 256, 8, 128, True)]


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("shared_slot", [False, True])
@pytest.mark.parametrize("T,E,A,BT,skew", CASES)
def test_moe_bucket_plan(T, E, A, BT, skew, shared_slot, wide):
    import cupy

    from kda_rt.cuda.ops.moe_align import MoEPlan, max_tiles, moe_bucket

    rng = np.random.default_rng(T * 31 + E + A + int(shared_slot))
    pool = rng.choice(E, size=max(A, E // 8), replace=False) if skew else np.arange(E)
    ids = np.stack([rng.choice(pool, size=A, replace=False) for _ in range(T)]).astype(np.int32)
    pairs = A + 1 if shared_slot else A
    bins, N = E + int(shared_slot), T * pairs
    tiles = max_tiles(N, bins, BT)
    plan = MoEPlan(*(cupy.full(n, -7, np.int32) for n in (bins + 1, N, N, tiles, tiles, 1)), BT)
    sync = cupy.full(5, 0x5A5A5A5A, dtype=np.int32)  # either path must zero it
    moe_bucket(cupy.asarray(ids), E, plan, shared_slot=shared_slot, sync=sync, wide=wide)
    assert_plan(plan, ids, E, shared_slot)
    assert not sync.any()


def test_moe_bucket_scratch_refused():
    import cupy

    from kda_rt.cuda.ops.moe_align import MoEPlan, bucket_scratch_words, max_tiles, moe_bucket

    T, E, A, BT = 4096, 256, 8, 128
    N = T * A
    assert bucket_scratch_words(N, E) > 0 and bucket_scratch_words(8, E) == 0
    tiles = max_tiles(N, E, BT)
    plan = MoEPlan(*(cupy.full(n, -7, np.int32) for n in (E + 1, N, N, tiles, tiles, 1)), BT)
    ids = cupy.zeros((T, A), np.int32)
    with pytest.raises(ValueError, match=r"moe_bucket: scratch has 10 int32 words, needs \d+ \(bucket_scratch_words\)"):
        moe_bucket(ids, E, plan, scratch=cupy.zeros(10, np.int32))


# (T, E, A, BT, shared_slot, live): none live, a few, all but the last token, more than T (clamped: every token)
LIVE_CASES = [(300, 64, 6, 64, True, 0), (300, 64, 6, 64, True, 123), (1000, 256, 8, 64, True, 1),
              (1000, 256, 8, 64, True, 999), (4099, 256, 8, 128, True, 2000), (2048, 256, 8, 128, False, 2053)]


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("T,E,A,BT,shared_slot,live", LIVE_CASES)
def test_moe_bucket_live_count(T, E, A, BT, shared_slot, live, wide):
    """moe_bucket(live=) (KDA_RT_SKIP_PAD, default on: moe_align.cu LIVE_PAIRS): only the first min(live, T) tokens'
    pairs are planned, by either path (the three launches with blocks cut by the live pairs and blocks past them
    empty): the plan is exactly the one of those tokens alone (assert_plan on the live slice), and the rows past
    them are never written (still -7)."""
    import cupy

    from kda_rt.cuda.ops.moe_align import MoEPlan, max_tiles, moe_bucket

    rng = np.random.default_rng(T * 17 + live + int(wide))
    ids = np.stack([rng.choice(E, size=A, replace=False) for _ in range(T)]).astype(np.int32)
    pairs = A + 1 if shared_slot else A
    bins, N = E + int(shared_slot), T * pairs
    tiles = max_tiles(N, bins, BT)
    plan = MoEPlan(*(cupy.full(n, -7, np.int32) for n in (bins + 1, N, N, tiles, tiles, 1)), BT)
    moe_bucket(cupy.asarray(ids), E, plan, shared_slot=shared_slot, wide=wide,
               live=cupy.asarray([live], dtype=np.int32))
    L = min(live, T) * pairs
    assert_plan(plan._replace(sorted_pair=plan.sorted_pair[:L], pair_pos=plan.pair_pos[:L]), ids[:min(live, T)], E,
                shared_slot)
    assert bool(cupy.all(plan.sorted_pair[L:] == -7)) and bool(cupy.all(plan.pair_pos[L:] == -7)), \
        "rows past the live pairs written"
