"""moe_bucket's optional experts-touched counter (the bench's decode bytes floor): after each call
stats[0] has grown by the number of distinct expert ids the call saw and stats[1] by one.  Exact
integer checks on random and skewed routings (ids drawn here, so the expected counts are known)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("wide", [None, True])  # the one-block kernel / moe_bucket_plan (by N, then forced)
@pytest.mark.parametrize("T,E,A,skew", [(1, 256, 8, False), (32, 256, 8, False), (300, 64, 6, True),
                                         (2048, 256, 8, False)])
def test_bucket_counts_touched_experts(T, E, A, skew, wide):
    import cupy

    from kda_rt.cuda.ops.moe_align import MoEPlan, max_tiles, moe_bucket

    rng = np.random.default_rng(T * 7 + E)
    stats = cupy.asarray(np.array([5, 2], np.int32))  # nonzero start: the kernel adds, never overwrites
    expect = np.array([5, 2], np.int64)
    for call in range(3):
        pool = rng.choice(E, size=max(A, E // 8), replace=False) if skew else np.arange(E)
        ids = np.stack([rng.choice(pool, size=A, replace=False) for _ in range(T)]).astype(np.int32)
        N, BT = T * A, 8
        tiles = max_tiles(N, E, BT)
        plan = MoEPlan(*(cupy.full(n, -7, np.int32) for n in (E + 1, N, N, tiles, tiles, 1)), BT)
        moe_bucket(cupy.asarray(ids), E, plan, stats=stats, wide=wide)
        expect += (np.unique(ids).size, 1)
        assert stats.get().tolist() == expect.tolist(), f"call {call}"
        assert int(plan.num_tiles.get()[0]) == sum(-(-c // BT) for c in np.bincount(ids.ravel(), minlength=E))
