"""kernels_cu/moe_route.cu against kda_rt.reference.moe.route in float64 on the same bf16 x / fp32 router.

    logits = x · W_routerᵀ (fp32),  s = sigmoid,  sel = s + bias (selection only), group-limited top-A,
    w = s[ids] (sel[ids] when biased) / (Σ + 1e-20) if renormalize, × scaling

From SPLIT_MIN_T tokens the launcher computes the logits as one bf16 GEMM on the router split in three
exact bf16 parts (`split_router`); the cases of >= SPLIT_MIN_T = 32 tokens run that path, the others the fp32 kernel.
Checks: ids equal as sets per token (inputs are redrawn until every top-A / top-group boundary
has a gap > 2e-5 in sel, far above the ~1e-6 fp32 logit error, so no selection can flip);
weights |w - w_ref| ≤ 1e-5·|w_ref| (fp32 dot over D = 2304 has relative error ~1e-6).
Letters: T tokens, D hidden, E experts, G groups, A active experts."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from helpers.gpu import poison, to_gpu_bf16, to_np
from helpers.moe_router import make_cfg, make_router

pytestmark = pytest.mark.gpu



CASES = {
    "T1-E256": (1, 256, dict()),
    "T2-E256": (2, 256, dict()),
    "T3-E256-biased": (3, 256, dict(biased=True)),
    "T7-E256-norenorm": (7, 256, dict(renormalize=False)),
    "T64-E64-G8k3": (64, 64, dict(G=8, topk_group=3)),
    "T300-E256-G8k4": (300, 256, dict(G=8, topk_group=4)),
    "T300-E16-G16k8": (300, 16, dict(G=16, topk_group=8)),  # one expert per group
    "T64-E256-biased": (64, 256, dict(biased=True)),
    "T7-E16-A4-scale1": (7, 16, dict(A=4, scaling=1.0, renormalize=False)),
    "T1000-E256": (1000, 256, dict()),
    "T400-E256-biased": (400, 256, dict(biased=True)),  # (more tokens: near-ties become likely, make_router gives up)
}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_route(name):
    import cupy

    from kda_rt.cuda.ops.moe_route import moe_route, split_router
    from kda_rt.reference.moe import route

    T, E, kw = CASES[name]
    D = 2304
    cfg = make_cfg(E, **kw)
    x, w_router, bias = make_router(T, D, cfg, seed=zlib.crc32(name.encode()))
    ids_ref, w_ref = route(x, w_router, bias, cfg)
    A = cfg.top_k
    out_ids = cupy.full((T, A), -1, dtype=np.int32)
    out_w = cupy.full((T, A), np.nan, dtype=np.float32)
    moe_route(to_gpu_bf16(x), cupy.asarray(w_router.astype(np.float32)), cupy.asarray(bias.astype(np.float32)),
              top_k=A, num_groups=cfg.num_expert_group, topk_group=cfg.topk_group, renormalize=cfg.renormalize,
              scaling=cfg.routed_scaling_factor, biased_weights=cfg.biased_weights, out_ids=out_ids, out_w=out_w,
              router_split=split_router(cupy.asarray(w_router.astype(np.float32))))
    ids, w = cupy.asnumpy(out_ids), to_np(out_w)
    order, order_ref = np.argsort(ids, axis=-1), np.argsort(ids_ref, axis=-1)
    ids_s, ids_ref_s = np.take_along_axis(ids, order, -1), np.take_along_axis(ids_ref, order_ref, -1)
    bad = np.nonzero((ids_s != ids_ref_s).any(-1))[0]
    assert bad.size == 0, f"{bad.size} tokens select other experts, e.g. token {bad[0]}: {ids_s[bad[0]]} vs {ids_ref_s[bad[0]]}"
    w_s, w_ref_s = np.take_along_axis(w, order, -1), np.take_along_axis(w_ref, order_ref, -1)
    rel = np.abs(w_s - w_ref_s) / np.abs(w_ref_s)
    assert np.all(np.isfinite(w_s)) and rel.max() <= 1e-5, f"weights: max rel err {rel.max():.3e}"
    if kw.get("G", 1) == 1:  # the bias must matter: selections without it differ somewhere
        ids_nobias, _ = route(x, w_router, 0 * bias, cfg)
        assert any(set(a) != set(b) for a, b in zip(ids_nobias, ids_ref, strict=True)) or T < 7


def test_moe_route_nan_row_keeps_ids_valid():
    """A NaN input row must not break the ranks: its ids are 0..A-1 (NaN ranks as -inf, ties by
    index), so the bucketing that follows never sees an id outside [0, E); other rows unaffected."""
    import cupy

    from kda_rt.cuda.ops.moe_route import moe_route
    from kda_rt.reference.moe import route

    cfg = make_cfg(64)
    x, w_router, bias = make_router(4, 256, cfg, seed=3)
    xg = to_gpu_bf16(x)
    xg[2] = np.nan
    ids, w = moe_route(xg, cupy.asarray(w_router.astype(np.float32)), cupy.asarray(bias.astype(np.float32)),
                       top_k=8, num_groups=1, topk_group=1, renormalize=True, scaling=1.0)
    ids = cupy.asnumpy(ids)
    assert sorted(ids[2]) == list(range(8))
    ids_ref, _ = route(x, w_router, bias, cfg)
    for t in (0, 1, 3):
        assert set(ids[t]) == set(ids_ref[t])


def _tied_router(T: int, E: int, A: int):
    """x [T, 256] bf16 (row 3 NaN when T > 3), router [E, 256] and bias [E] fp32 on the GPU, every 5th pair of
    experts (rows 5i and 5i + 1, router and bias) tied exactly."""
    import cupy

    rng = np.random.default_rng(T * 1000 + E + A)
    D = 256
    w_router = rng.standard_normal((E, D)).astype(np.float32) * 0.05
    w_router[1::5] = w_router[0::5][: w_router[1::5].shape[0]]
    bias = (rng.standard_normal(E) * 0.05).astype(np.float32)
    bias[1::5] = bias[0::5][: bias[1::5].shape[0]]
    x = to_gpu_bf16(rng.standard_normal((T, D)).astype(np.float32))
    if T > 3:
        x[3] = np.nan
    return x, cupy.asarray(w_router), cupy.asarray(bias)


def _assert_a_tie_was_taken(ids: np.ndarray, min_tokens: int) -> None:
    """With min_tokens or more tokens and A > 1, some token took both experts of a tied pair in a row (the
    lower index first), so the tie-break was exercised; the NaN row 3 picks 0..A-1 by index alone."""
    T, A = ids.shape
    finite = np.delete(ids, 3, axis=0) if T > 3 else ids
    tied = (finite[:, :-1] // 5 == finite[:, 1:] // 5) & (finite[:, :-1] % 5 == 0) & (finite[:, 1:] % 5 == 1)
    assert tied.any() or T < min_tokens or A == 1, "no exact tie was selected: the tie-break went untested"


@pytest.mark.parametrize(("T", "E", "A", "biased", "renorm"), [
    (1, 256, 8, False, True), (7, 16, 4, False, False), (9, 64, 8, True, True), (33, 256, 8, False, True),
    (300, 384, 16, False, True), (8192, 256, 8, False, True), (100, 256, 1, True, False)])
def test_moe_route_select_warp_equals_rank(T, E, A, biased, renorm):
    """The warp-per-token select against the rank-counting one on the same inputs: ids in the same
    order and weights bit for bit, with exact score ties (duplicated router rows and biases: ties go to
    the lower index), a NaN row, T not a multiple of the 8 tokens per block, E not a multiple of 32, and
    both logits paths (T >= 32 takes the split router).  Outputs poisoned first."""
    import cupy

    from kda_rt.cuda.ops.moe_route import moe_route, split_router

    x, wg, bg = _tied_router(T, E, A)
    outs = []
    for select in ("rank", "warp"):
        ids = cupy.full((T, A), -7, dtype=np.int32)
        w = cupy.full((T, A), np.inf, dtype=np.float32)
        moe_route(x, wg, bg, top_k=A, num_groups=1, topk_group=1, renormalize=renorm, scaling=2.5,
                  biased_weights=biased, out_ids=ids, out_w=w, router_split=split_router(wg), select=select)
        outs.append((cupy.asnumpy(ids), cupy.asnumpy(w)))
    (ids_r, w_r), (ids_w, w_w) = outs
    assert ids_r.min() >= 0 and ids_r.max() < E
    np.testing.assert_array_equal(ids_w, ids_r)
    np.testing.assert_array_equal(w_w.view(np.uint32), w_r.view(np.uint32))  # NaN rows included, bitwise
    _assert_a_tie_was_taken(ids_r, min_tokens=33)


FUSED_CASES = {
    "T1-E256": (1, 256, False, dict()),
    "T1-E256-shared": (1, 256, True, dict()),
    "T2-E256-shared-biased": (2, 256, True, dict(biased=True)),
    "T3-E64-norenorm": (3, 64, False, dict(renormalize=False)),
    "T8-E256-shared": (8, 256, True, dict()),
    "T17-E256-shared": (17, 256, True, dict()),  # more tokens than the last block's 16 warps
    "T32-E256-shared": (32, 256, True, dict()),
    "T64-E256": (64, 256, False, dict()),
    "T64-E256-shared": (64, 256, True, dict()),
    "T5-E16-A4-shared": (5, 16, True, dict(A=4, scaling=1.0)),
    "T9-E504-A16-shared": (9, 504, True, dict(A=16)),  # 505 bins of the 512-thread bucketing block
}


@pytest.mark.parametrize("name", list(FUSED_CASES))
def test_moe_route_fused(name):
    """moe_route_fused (logits, select and bucketing in one launch) against float64 NumPy: logits within
    1e-5 of Σ|x·w| (fp32 sums of D = 2304 products: ~5e-7 relative), ids as sets per token and weights to
    1e-5 relative (inputs without near-ties, as test_moe_route), the plan exactly (tests/helpers/moe_plan.py),
    stats (+touched routed experts, +1) and the zeroed sync words.  Three launches on one workspace with new
    inputs each (the done counter is left 0 by the kernel; the first call finds it poisoned and the launcher
    zeroes it); every output poisoned before each launch."""
    import cupy

    from helpers.moe_plan import assert_plan
    from kda_rt.cuda.ops.moe_align import MoEPlan, max_tiles
    from kda_rt.cuda.ops.moe_route import moe_route_fused
    from kda_rt.reference.moe import route

    T, E, shared, kw = FUSED_CASES[name]
    D, BT = 2304, 16
    cfg = make_cfg(E, **kw)
    A = cfg.top_k
    pairs, bins = A + int(shared), E + int(shared)
    N, tiles = T * pairs, max_tiles(T * pairs, bins, BT)
    plan = MoEPlan(*(cupy.empty(n, np.int32) for n in (bins + 1, N, N, tiles, tiles, 1)), BT)
    ids, w = cupy.empty((T, A), np.int32), cupy.empty((T, A), np.float32)
    logits, sync, stats = cupy.empty((T, 3 * E), np.float32), cupy.empty(1 + tiles, np.int32), cupy.zeros(2, np.int32)
    done = cupy.full(64, 5, np.int32)
    touched = 0
    for call in range(3):
        x, w_router, bias = make_router(T, D, cfg, seed=zlib.crc32(name.encode()) + call)
        for arr in (*plan[:6], ids, sync):
            arr.fill(-7)
        w.fill(np.nan)
        logits.fill(np.nan)
        moe_route_fused(to_gpu_bf16(x), cupy.asarray(w_router.astype(np.float32)),
                        cupy.asarray(bias.astype(np.float32)), plan, top_k=A, renormalize=cfg.renormalize,
                        scaling=cfg.routed_scaling_factor, biased_weights=cfg.biased_weights, out_ids=ids, out_w=w,
                        logits=logits, done=done, stats=stats, shared_slot=shared, sync=sync)
        ref = x @ w_router.T
        bound = 1e-5 * (np.abs(x) @ np.abs(w_router).T)
        got = cupy.asnumpy(logits.reshape(-1)[: T * E].reshape(T, E))  # its first T·E floats, [T, E]
        assert np.all(np.abs(got - ref) <= bound), f"call {call}: logits off by {np.max(np.abs(got - ref) / bound):.2f} bounds"
        ids_ref, w_ref = route(x, w_router, bias, cfg)
        got_ids, got_w = cupy.asnumpy(ids), cupy.asnumpy(w)
        order, order_ref = np.argsort(got_ids, -1), np.argsort(ids_ref, -1)
        np.testing.assert_array_equal(np.take_along_axis(got_ids, order, -1), np.take_along_axis(ids_ref, order_ref, -1))
        w_s, w_ref_s = np.take_along_axis(got_w, order, -1), np.take_along_axis(w_ref, order_ref, -1)
        rel = np.abs(w_s - w_ref_s) / np.abs(w_ref_s)
        assert np.all(np.isfinite(w_s)) and rel.max() <= 1e-5, f"call {call}: weights max rel err {rel.max():.3e}"
        assert_plan(plan, got_ids, E, shared)
        assert not cupy.any(sync), "sync words not zeroed"
        assert int(done[0]) == 0, "the kernel left its counter set"
        touched += len(np.unique(got_ids))
        assert stats.get().tolist() == [touched, call + 1]


@pytest.mark.parametrize(("T", "E", "A", "shared", "biased"), [
    (1, 256, 8, True, False), (5, 64, 8, False, True), (17, 256, 8, True, False), (64, 256, 16, True, False),
    (40, 96, 1, False, False)])
def test_moe_route_fused_select_equals_rank(T, E, A, shared, biased):
    """moe_route_fused's select (warp_route_token: sorted lanes, redux.sync rounds) against the rank-counting
    select kernel run on the logits the fused kernel wrote: ids in the same order and weights bit for bit,
    with exact score ties (every 5th router row and bias duplicated: ties go to the lower index) and a NaN
    row (its ids 0..A-1, so the bucketing still sees valid ids).  Outputs poisoned first."""
    import cupy

    from helpers.moe_plan import assert_plan
    from kda_rt.cuda.ops.check import f32, i32
    from kda_rt.cuda.ops.compile import get_kernel
    from kda_rt.cuda.ops.moe_align import MoEPlan, max_tiles
    from kda_rt.cuda.ops.moe_route import MAX_TOP_K, moe_route_fused

    x, wg, bg = _tied_router(T, E, A)
    pairs, bins = A + int(shared), E + int(shared)
    tiles = max_tiles(T * pairs, bins, 16)
    plan = MoEPlan(*(cupy.full(n, -7, np.int32) for n in (bins + 1, T * pairs, T * pairs, tiles, tiles, 1)), 16)
    ids, w = cupy.full((T, A), -7, np.int32), cupy.full((T, A), np.inf, np.float32)
    logits = cupy.full((T, E), np.nan, np.float32)
    moe_route_fused(x, wg, bg, plan, top_k=A, renormalize=True, scaling=2.5, biased_weights=biased, out_ids=ids,
                    out_w=w, logits=logits, done=cupy.zeros(1, np.int32), shared_slot=shared)
    ids_r, w_r = cupy.full((T, A), -7, np.int32), cupy.full((T, A), np.inf, np.float32)
    threads = max(128, -(-E // 32) * 32)
    rank = get_kernel("moe_route.cu", "moe_route_select", E=E, THREADS=threads, MAX_TOP_K=MAX_TOP_K, PARTS=1)
    rank((T,), (threads,), (logits, bg, ids_r, w_r, i32(T), i32(A), i32(1), i32(1), i32(1), i32(int(biased)),
                            f32(2.5)))
    got_ids, ref_ids = cupy.asnumpy(ids), cupy.asnumpy(ids_r)
    np.testing.assert_array_equal(got_ids, ref_ids)
    np.testing.assert_array_equal(cupy.asnumpy(w).view(np.uint32), cupy.asnumpy(w_r).view(np.uint32))
    _assert_a_tie_was_taken(got_ids, min_tokens=17)
    assert_plan(plan, got_ids, E, shared)


@pytest.mark.parametrize(("T", "E", "shared"), [(1, 256, True), (2, 256, True), (3, 256, True), (8, 256, True),
                                                (16, 256, False), (5, 64, False)])
def test_moe_route_fused_norm_before(T, E, shared):
    """moe_route_fused with NormBefore (ROUTE_NORM: the residual add and RMSNorm before the block in the
    routing kernel): h_out bit-identical to rmsnorm.cu's updated residual (same roundings), a_out within one
    bf16 ulp of rmsnorm.cu's output (only the order of the fp32 sum of squares differs) on <= 1% of the
    entries, residual left unchanged; and the ids, weights, logits and plan bit-identical to moe_route_fused
    routing the kernel's own a_out without the norm (the same staged values; the plan's row order inside a bin
    follows shared-memory atomics, so sorted_pair / pair_pos are checked by assert_plan).  1, 2, 4 and 8 rows a
    block; T = 16 has two token groups.  Outputs poisoned first."""
    import cupy

    from helpers.moe_plan import assert_plan
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_align import MoEPlan, max_tiles
    from kda_rt.cuda.ops.moe_route import NormBefore, moe_route_fused
    from kda_rt.cuda.ops.rmsnorm import rmsnorm

    D, A, eps = 2304, 8, 1e-6
    rng = np.random.default_rng(1000 * T + E)
    cfg = make_cfg(E)
    _, w_router, bias = make_router(T, D, cfg, seed=T + E)
    wg, bg = cupy.asarray(w_router.astype(np.float32)), cupy.asarray(bias.astype(np.float32))
    delta = to_gpu_bf16(rng.normal(size=(T, D)) * 0.7)
    residual = rng.normal(size=(T, D)) * 4.0
    norm_w = to_gpu_bf16(rng.uniform(0.5, 1.5, size=D))
    res_ref = to_gpu_bf16(residual)
    a_ref = rmsnorm(delta, norm_w, eps, residual=res_ref)

    pairs, bins = A + int(shared), E + int(shared)
    tiles = max_tiles(T * pairs, bins, 16)

    def route(x, norm_before=None):
        plan = MoEPlan(*(cupy.full(n, -7, np.int32) for n in (bins + 1, T * pairs, T * pairs, tiles, tiles, 1)), 16)
        ids, w = cupy.full((T, A), -7, np.int32), cupy.full((T, A), np.nan, np.float32)
        logits = cupy.full((T, E), np.nan, np.float32)
        moe_route_fused(x, wg, bg, plan, top_k=A, renormalize=True, scaling=2.5, out_ids=ids, out_w=w, logits=logits,
                        done=cupy.zeros(1, np.int32), shared_slot=shared, norm_before=norm_before)
        return [cupy.asnumpy(a).view(np.uint32) for a in (ids, w, logits, *plan[:6])]

    res = to_gpu_bf16(residual)
    h, a = cupy.empty((T, D), BF16), cupy.empty((T, D), BF16)
    poison(h)
    poison(a)
    got = route(delta, NormBefore(res, norm_w, eps, h, a))
    np.testing.assert_array_equal(to_np(res), to_np(to_gpu_bf16(residual)))  # left as it was
    np.testing.assert_array_equal(to_np(h), to_np(res_ref))
    got_a, want_a = to_np(a), to_np(a_ref)
    assert np.all(np.isfinite(got_a))
    assert np.all(np.abs(got_a - want_a) <= np.abs(want_a) * 2.0**-7 + 1e-30), "more than one bf16 ulp from rmsnorm"
    assert np.mean(got_a != want_a) <= 0.01, f"{np.mean(got_a != want_a):.3%} of the entries differ from rmsnorm"
    names = ("ids", "w", "logits", "expert_off", "sorted_pair", "pair_pos", "tile_expert", "tile_row", "num_tiles")
    for name, g, r in zip(names, got, route(a), strict=True):
        if name not in ("sorted_pair", "pair_pos"):
            np.testing.assert_array_equal(g, r, err_msg=name)
    plan = MoEPlan(*(cupy.asarray(p.view(np.int32)) for p in got[3:]), 16)
    assert_plan(plan, got[0].view(np.int32), E, shared)


def test_moe_route_refuses_x_off_a_16_byte_boundary():
    """The kernels stage x by 16-byte copies (D % 8 == 0): a view starting 8 bytes into its buffer is refused
    by both launchers, with the reason, before anything runs."""
    import cupy

    from kda_rt.cuda.ops.moe_align import MoEPlan, max_tiles
    from kda_rt.cuda.ops.moe_route import moe_route, moe_route_fused

    T, D, E, A = 2, 2304, 64, 8
    cfg = make_cfg(E)
    x, w_router, bias = make_router(T, D, cfg, seed=3)
    buf = cupy.zeros(T * D + 4, dtype=to_gpu_bf16(x).dtype)
    xs = buf[4:].reshape(T, D)
    xs[...] = to_gpu_bf16(x)
    wg, bg = cupy.asarray(w_router.astype(np.float32)), cupy.asarray(bias.astype(np.float32))
    with pytest.raises(ValueError, match="16-byte boundary"):
        moe_route(xs, wg, bg, top_k=A, num_groups=1, topk_group=1, renormalize=True, scaling=1.0)
    tiles = max_tiles(T * A, E, 16)
    plan = MoEPlan(*(cupy.zeros(n, np.int32) for n in (E + 1, T * A, T * A, tiles, tiles, 1)), 16)
    with pytest.raises(ValueError, match="16-byte boundary"):
        moe_route_fused(xs, wg, bg, plan, top_k=A, renormalize=True, scaling=1.0, out_ids=cupy.empty((T, A), np.int32),
                        out_w=cupy.empty((T, A), np.float32), logits=cupy.empty((T, E), np.float32),
                        done=cupy.zeros(1, np.int32))


if __name__ == "__main__":
    for case in CASES:
        test_moe_route(case)
    test_moe_route_nan_row_keeps_ids_valid()
    print("ok")
