"""kernels_cu/moe_route_small.cu (logits + top-k + bucketing in one launch, T <= 8) against the separate
kernels (moe_route's logits and warp select, moe_align's moe_bucket) and against the float64 reference
route, on fresh random routers without near-ties (helpers/moe_router.py), outputs poisoned first.

Checks: ids equal in order to the separate kernels' and equal as sets to the reference; weights within
1e-6 relative of the separate kernels' (the same fp32 arithmetic; bitwise expected) and 1e-5 of the
float64 reference; the plan equal where it is deterministic (expert_off, num_tiles, tile_expert,
tile_row) and a valid permutation inside each bin where atomics order it (sorted_pair, pair_pos); the
ticket back at 0 after every call; a CUDA graph of the call replayed on new x matches eager calls; the
experts-touched counter as moe_bucket's."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.gpu import to_gpu_bf16
from helpers.moe_router import make_cfg, make_router

pytestmark = pytest.mark.gpu

CASES = [  # (T, E, D, A, shared_slot, cfg kwargs)
    (1, 256, 2304, 8, True, {}),
    (3, 256, 2304, 8, True, dict(biased=True)),
    (8, 256, 2304, 8, False, dict(renormalize=False, scaling=1.0)),
    (5, 16, 64, 4, True, {}),
    (8, 384, 512, 16, True, {}),
]


def _plan(T, E, A, shared):
    import cupy

    from kda_rt.cuda.ops.moe_align import MoEPlan, max_tiles

    bins, N = (E + 1, T * (A + 1)) if shared else (E, T * A)
    tiles = max_tiles(N, bins, 16)
    arr = lambda n: cupy.full(n, -5, dtype=np.int32)  # noqa: E731  (poisoned)
    return MoEPlan(arr(bins + 1), arr(N), arr(N), arr(tiles), arr(tiles), arr(1), 16), N, bins


def _run_small(xg, wg, bg, cfg, shared, ticket, stats=None):
    import cupy

    from kda_rt.cuda.ops.moe_route_small import moe_route_small

    T, A, E = xg.shape[0], cfg.top_k, wg.shape[0]
    plan, N, bins = _plan(T, E, A, shared)
    ids, w = cupy.full((T, A), -3, np.int32), cupy.full((T, A), np.nan, np.float32)
    logits = cupy.full((T, 3 * E), np.nan, np.float32)
    moe_route_small(xg, wg, bg, plan, top_k=A, renormalize=cfg.renormalize, scaling=cfg.routed_scaling_factor,
                    biased_weights=cfg.biased_weights, logits=logits, out_ids=ids, out_w=w, ticket=ticket,
                    shared_slot=shared, stats=stats)
    return ids, w, plan


@pytest.mark.parametrize(("T", "E", "D", "A", "shared", "kw"), CASES)
def test_fused_route_matches_separate_kernels(T, E, D, A, shared, kw):
    import cupy

    from kda_rt.cuda.ops.moe_align import moe_bucket
    from kda_rt.cuda.ops.moe_route import moe_route
    from kda_rt.reference.moe import route

    cfg = make_cfg(E, A=A, **kw)
    x, w_router, bias = make_router(T, D, cfg, seed=T * 7 + E + A)
    xg, wg, bg = to_gpu_bf16(x), cupy.asarray(w_router.astype(np.float32)), cupy.asarray(bias.astype(np.float32))
    ticket = cupy.zeros(1, np.int32)
    stats_small, stats_sep = cupy.zeros(2, np.int32), cupy.zeros(2, np.int32)
    ids, w, plan = _run_small(xg, wg, bg, cfg, shared, ticket, stats_small)
    assert int(ticket.get()[0]) == 0, "the last block must leave the ticket at 0"

    ids2, w2 = moe_route(xg, wg, bg, top_k=A, num_groups=1, topk_group=1, renormalize=cfg.renormalize,
                         scaling=cfg.routed_scaling_factor, biased_weights=cfg.biased_weights, select="warp")
    plan2, N, bins = _plan(T, E, A, shared)
    moe_bucket(ids2, E, plan2, stats=stats_sep, shared_slot=shared)
    np.testing.assert_array_equal(ids.get(), ids2.get())
    np.testing.assert_allclose(w.get(), w2.get(), rtol=1e-6, atol=0)
    ids_ref, w_ref = route(x, w_router, bias, cfg)
    assert all(set(a) == set(b) for a, b in zip(ids.get(), ids_ref, strict=True))
    order = np.argsort(ids.get(), -1)
    w_s = np.take_along_axis(w.get().astype(np.float64), order, -1)
    w_ref_s = np.take_along_axis(w_ref, np.argsort(ids_ref, -1), -1)
    assert np.max(np.abs(w_s - w_ref_s) / np.abs(w_ref_s)) <= 1e-5
    for name in ("expert_off", "num_tiles"):
        np.testing.assert_array_equal(getattr(plan, name).get(), getattr(plan2, name).get(), err_msg=name)
    n_tiles = int(plan.num_tiles.get()[0])
    for name in ("tile_expert", "tile_row"):
        np.testing.assert_array_equal(getattr(plan, name).get()[:n_tiles], getattr(plan2, name).get()[:n_tiles])
    sp, pp, off = plan.sorted_pair.get(), plan.pair_pos.get(), plan.expert_off.get()
    assert sorted(sp.tolist()) == list(range(N)) and np.array_equal(sp[pp], np.arange(N))
    pairs = A + 1 if shared else A
    flat = ids.get()
    for p in range(N):  # each pair's row lies in its expert's bin
        t, k = divmod(p, pairs)
        e = E if (shared and k == A) else flat[t, k]
        assert off[e] <= pp[p] < off[e + 1]
    np.testing.assert_array_equal(stats_small.get(), stats_sep.get())


def test_fused_route_in_a_graph_replays_on_new_inputs():
    """Captured once, replayed with new x (and twice in a row): the ticket stays consistent and every
    replay equals an eager call on the same x."""
    import cupy

    from kda_rt.cuda.ops.moe_route_small import moe_route_small

    T, E, D, A = 4, 256, 2304, 8
    cfg = make_cfg(E, A=A)
    x, w_router, bias = make_router(T, D, cfg, seed=11)
    wg, bg = cupy.asarray(w_router.astype(np.float32)), cupy.asarray(bias.astype(np.float32))
    stream = cupy.cuda.Stream(non_blocking=True)
    xg = to_gpu_bf16(x)
    plan, _, _ = _plan(T, E, A, True)
    ids, w = cupy.zeros((T, A), np.int32), cupy.zeros((T, A), np.float32)
    logits, ticket = cupy.zeros((T, E), np.float32), cupy.zeros(1, np.int32)
    cupy.cuda.Device().synchronize()

    def call():
        moe_route_small(xg, wg, bg, plan, top_k=A, renormalize=True, scaling=2.446, biased_weights=False,
                        logits=logits, out_ids=ids, out_w=w, ticket=ticket, shared_slot=True, stream=stream)

    with stream:
        call()  # compile outside the capture
        stream.synchronize()
        stream.begin_capture()
        call()
        graph = stream.end_capture()
    for seed in (21, 22, 23):
        x2, _, _ = make_router(T, D, cfg, seed=seed)
        xg[...] = to_gpu_bf16(x2)
        cupy.cuda.Device().synchronize()
        graph.launch(stream)
        graph.launch(stream)  # twice: the ticket must be back at 0 after each
        stream.synchronize()
        got = (ids.get().copy(), w.get().copy())
        ids_e, w_e, _ = _run_small(xg, wg, bg, cfg, True, cupy.zeros(1, np.int32))
        np.testing.assert_array_equal(got[0], ids_e.get())
        np.testing.assert_array_equal(got[1], w_e.get())
        assert int(ticket.get()[0]) == 0
