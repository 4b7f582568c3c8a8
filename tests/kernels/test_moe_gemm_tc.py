"""kernels_cu/moe_gemm_tc.cu (prefill grouped GEMM) against NumPy float64 on random bf16 inputs, over
the expert-sorted rows of moe_bucket (kernels_cu/moe_align.cu):

    gate/up:  h[r] = bf16( bf16(SiLU(bf16(x[tok(r)] · W1_eᵀ))) · bf16(x[tok(r)] · W3_eᵀ) )   [N, I] bf16
    down:     y[r] = bf16( h[r] · W2_eᵀ )                                                      [N, D] bf16

Tolerances.  The reference rounds where the kernel rounds, so the two differ only where a tiny
fp32-vs-float64 difference (fp32 accumulation error ~2^-24 · sqrt(K) ≈ 2e-6 relative) flips a bf16
rounding (rare; each flip is one bf16 ulp, 2^-8..2^-7 relative).  down (one rounding, on the kernel's
own bf16 h): RMS ≤ 1e-3 and |out - ref| ≤ 2^-7 · |ref| + 1e-4 · RMS(ref).  gate/up (roundings of g,
u, SiLU(g) and h): RMS ≤ 1e-3 and |out - ref| ≤ 3e-2 · |ref| + 1e-3 · RMS(ref) (three flips at once).
The E=256 cases check all rows against the decode kernel (moe_gemm.cu, tested on its own) and a
sample of experts (the busiest, the emptiest, random ones) against NumPy, to keep the host work
small; every output row is poisoned with NaN first, so a row left unwritten fails.  e4m3 weights (WFMT = 1 in
moe_gemm_tc.cu and moe_gemm_wg.cu) run the same checks against NumPy on the dequantized weights (below).
Letters: T tokens, A active experts per token, E experts, N = T·A rows, D hidden, I expert width."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from helpers.gpu import bf16_round, poison, rand_bf16, rms_rel, to_np
from helpers.moe_gemm import (
    TILES,
    Dequantized,
    check,
    check_drift,
    drift,
    e4m3_stack,
    h_bound,
    make_ids,
    make_plan,
    reference_rows,
)

pytestmark = pytest.mark.gpu


def run_tc(x, w13, w2, ids, E, bm, tile=None, gemm=None):
    """Plan with BM-row tiles, then both GEMMs (moe_gemm_tc, or `gemm`) into NaN-poisoned outputs;
    returns (plan, h, y)."""
    import cupy

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_gemm_tc import moe_gemm_tc

    gemm = gemm or moe_gemm_tc
    T, A = ids.shape
    N, inter, D = T * A, w13.shape[1] // 2, w2.shape[1]
    plan = make_plan(ids, E, bm)
    h, y = cupy.empty((N, inter), dtype=BF16), cupy.empty((N, D), dtype=BF16)
    poison(h)
    poison(y)
    gemm(x, w13, plan, top_k=A, fuse_silu=True, out=h, tile=tile)
    gemm(h, w2, plan, top_k=A, fuse_silu=False, out=y, tile=tile)
    return plan, h, y


def check_experts(experts, plan, x_np, w13, w2, h, y, A, label):
    import cupy

    off, sp = cupy.asnumpy(plan.expert_off), cupy.asnumpy(plan.sorted_pair)
    h_np, y_np = to_np(h), to_np(y)
    assert np.all(np.isfinite(h_np)) and np.all(np.isfinite(y_np)), f"{label}: rows left unwritten (NaN)"
    for e in experts:
        if off[e + 1] == off[e]:
            continue
        rows, h_ref, y_ref = reference_rows(e, (off, sp), x_np, w13, w2, h_np, A)
        check(h_np[rows], h_ref, f"{label} h expert {e}", rms_tol=1e-3, rtol=3e-2, atol_rms=1e-3)
        check(y_np[rows], y_ref, f"{label} y expert {e}", rms_tol=1e-3, rtol=2.0**-7, atol_rms=1e-4)


def skip_without_e4m3() -> None:
    """e4m3 weights need sm_89 or newer (the launchers refuse them below)."""
    from kda_rt.cuda.ops.compile import arch_number, device_arch

    if arch_number(device_arch()) < 89:
        pytest.skip("e4m3 weights need sm_89 or newer")


def sample_experts(ids, E, rng, extra=()) -> list[int]:
    """The experts to check against NumPy: every touched one when E <= 16, else the busiest, the emptiest, up to 4
    random touched ones and `extra` (the NumPy products of all 256 would dominate the test's time)."""
    counts = np.bincount(ids.ravel(), minlength=E)
    touched = np.flatnonzero(counts)
    if E <= 16:
        return [int(e) for e in touched]
    picks = {int(touched[np.argmax(counts[touched])]), int(touched[np.argmin(counts[touched])]),
             *map(int, rng.choice(touched, min(4, touched.size), replace=False)), *extra}
    return sorted(picks)


SMALL = {  # name: (T, D, I, E, A, bm) -- odd T, tiny E; D384-I192 takes the BN = 128 tiles
    **{f"T{T}-D256-I128-E8-bm{bm}": (T, 256, 128, 8, 2, bm) for T in (1, 3, 5, 9, 17) for bm in (64, 128)},
    "T17-D384-I192-E4-bm64": (17, 384, 192, 4, 3, 64),
    "T300-D384-I192-E4-bm128": (300, 384, 192, 4, 3, 128),
    "T200-D256-I128-E8-skewed-bm64": (200, 256, 128, 8, 4, 64),
    "T17-D256-I128-E8-bm16": (17, 256, 128, 8, 2, 16),  # the 16-row decode tile, one launch a GEMM
}


@pytest.mark.parametrize("weights", ["bf16", "e4m3"])
@pytest.mark.parametrize("name", list(SMALL))
def test_moe_gemm_tc_small(name, weights):
    """Every expert against NumPy; e4m3: the weights as e4m3 codes with a scale a row (moe_gemm_tc.cu WFMT = 1, the
    launcher's e4m3 tile), the reference on the dequantized weights."""
    import cupy

    from helpers.gpu import to_gpu_bf16
    from kda_rt.cuda.ops.moe_gemm_tc import moe_gemm_tc

    if weights == "e4m3":
        skip_without_e4m3()
    T, D, inter, E, A, bm = SMALL[name]
    rng = np.random.default_rng(zlib.crc32(name.encode() if weights == "bf16" else f"e4m3-tc/{name}".encode()))
    crng = cupy.random.default_rng(int(rng.integers(1 << 30)))
    x_np = bf16_round(rng.normal(size=(T, D)))
    x = to_gpu_bf16(x_np)
    gemm = None
    if weights == "bf16":
        w13, w2 = rand_bf16(crng, (E, 2 * inter, D), 1 / np.sqrt(D)), rand_bf16(crng, (E, D, inter), 1 / np.sqrt(inter))
        ref13, ref2 = w13, w2
    else:
        (w13, s13), (w2, s2) = e4m3_stack(crng, rng, E, 2 * inter, D), e4m3_stack(crng, rng, E, D, inter)
        ref13, ref2 = Dequantized(w13, s13), Dequantized(w2, s2)

        def gemm(src, weight, plan, *, top_k, fuse_silu, out, tile=None):
            return moe_gemm_tc(src, weight, plan, top_k=top_k, fuse_silu=fuse_silu, out=out,
                               scale=s13 if fuse_silu else s2)
    ids = make_ids(T, E, A, "skewed" in name, rng)
    plan, h, y = run_tc(x, w13, w2, ids, E, bm, gemm=gemm)
    check_experts(range(E), plan, x_np, ref13, ref2, h, y, A, f"{name}/{weights}")


@pytest.fixture(scope="module")
def big_weights():
    """Kimi-Linear-48B expert stacks: E=256, D=2304, I=1024 (3.6 GB), drawn once per module."""
    import cupy

    rng = cupy.random.default_rng(7)
    E, D, inter = 256, 2304, 1024
    return rand_bf16(rng, (E, 2 * inter, D), 1 / np.sqrt(D)), rand_bf16(rng, (E, D, inter), 1 / np.sqrt(inter))


BIG = {  # name: (T, skewed, bm)
    "T2048-bm64": (2048, False, 64),
    "T2048-bm128": (2048, False, 128),
    "T8192-bm128": (8192, False, 128),
    "T8192-bm64": (8192, False, 64),
    "T2048-skewed-bm64": (2048, True, 64),
    "T2048-skewed-bm128": (2048, True, 128),
    # decode steps with 16-row tiles (the weights stream; most rows of a tile are empty)
    "T1-bm16": (1, False, 16),
    "T8-bm16": (8, False, 16),
    "T32-bm16": (32, False, 16),
    "T128-skewed-bm16": (128, True, 16),
}


@pytest.mark.parametrize("name", list(BIG))
def test_moe_gemm_tc_real_shape(name, big_weights):
    T, skewed, bm = BIG[name]
    check_real_shape(name, big_weights, T, skewed, bm, None)


@pytest.mark.parametrize("tile", TILES, ids=lambda t: "tile-" + "-".join(map(str, t)))
def test_moe_gemm_tc_tiles(tile, big_weights):
    """Every candidate tile on a 2048-token step with skewed routing (full, ragged and 1-row tiles)."""
    from kda_rt.cuda.ops.moe_gemm_tc import TileConfig

    check_real_shape(f"T2048-skewed-{tile}", big_weights, 2048, True, tile[0], TileConfig(*tile))


def check_real_shape(name, big_weights, T, skewed, bm, tile, gemm=None):
    import cupy

    from helpers.gpu import to_gpu_bf16
    from kda_rt.cuda.ops.moe_gemm import moe_gemm, tile_rows_for

    w13, w2 = big_weights
    E, A, D = 256, 8, 2304
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    x_np = bf16_round(rng.normal(size=(T, D)))
    x = to_gpu_bf16(x_np)
    ids = make_ids(T, E, A, skewed, rng)
    plan, h, y = run_tc(x, w13, w2, ids, E, bm, tile, gemm)

    # every row against the decode kernel (rows are matched through pair_pos: the order of rows
    # inside an expert depends on moe_bucket's atomics)
    plan_old = make_plan(ids, E, tile_rows_for(T * A, E))
    h_old = cupy.empty_like(h)
    moe_gemm(x, w13, plan_old, top_k=A, fuse_silu=True, out=h_old)
    h_in_old = cupy.empty_like(h)
    h_in_old[plan_old.pair_pos] = h[plan.pair_pos]
    y_old = cupy.empty_like(y)
    moe_gemm(h_in_old, w2, plan_old, top_k=A, fuse_silu=False, out=y_old)
    err_h = rms_rel(to_np(h[plan.pair_pos]), to_np(h_old[plan_old.pair_pos]))
    err_y = rms_rel(to_np(y[plan.pair_pos]), to_np(y_old[plan_old.pair_pos]))
    print(f"\n{name}: vs decode kernel: h rms rel {err_h:.2e}, y rms rel {err_y:.2e}", end="")
    assert err_h <= 1e-3 and err_y <= 1e-3, f"{name}: h {err_h:.3e}, y {err_y:.3e} against moe_gemm"

    check_experts(sample_experts(ids, E, rng, extra=(E - 1, E - 2) if skewed else ()), plan, x_np, w13, w2, h, y, A,
                  name)


# kernels_cu/moe_gemm_wg.cu (wgmma, sm_90a): same checks, 128-row tiles, both BN, the two pipeline
# depths and both epilogues (staged through shared memory, or "direct" stores of the accumulators); T=1 and T=300 give tiles of 1 and
# ragged rows (a warpgroup with no rows), skewed routing a 2048-row expert.
WG = {  # name: (T, skewed, (bn, stages))
    "T1": (1, False, (256, 4)),
    "T300": (300, False, (256, 4)),
    "T2048-skewed": (2048, True, (256, 4)),
    "T8192": (8192, False, (256, 4)),
    "T2048-skewed-bn128": (2048, True, (128, 4)),
    "T2048-bn128-s3": (2048, False, (128, 3)),
    "T1-direct": (1, False, (256, 4, False)),
    "T300-direct": (300, False, (256, 4, False)),
    "T2048-skewed-direct": (2048, True, (256, 4, False)),
    "T2048-bn128-s3-direct": (2048, False, (128, 3, False)),
}


@pytest.mark.parametrize("name", list(WG))
def test_moe_gemm_wg(name, big_weights):
    from kda_rt.cuda.ops.compile import device_arch
    from kda_rt.cuda.ops.moe_gemm_wg import WgTile, moe_gemm_wg

    if device_arch() != "sm_90a":
        pytest.skip("moe_gemm_wg.cu needs sm_90a (wgmma)")
    T, skewed, tile = WG[name]
    check_real_shape(f"wg-{name}", big_weights, T, skewed, 128, WgTile(*tile), moe_gemm_wg)


@pytest.mark.parametrize("name", ["T300", "T2048-skewed", "T8192", "T2048-bn128-s3-direct"])
def test_moe_gemm_wg_half_skip(name, big_weights, monkeypatch):
    """KDA_RT_MOE_HALF_SKIP=1 (a warpgroup whose 64 rows all lie past its tile's end skips its wgmma) against =0 on
    one plan: h and y bit for bit, on plans that have tiles of 64 rows or fewer (where the skip acts; T300 has only
    those) and tiles of 65-127 rows (where it must not).  The switch is checked to reach the kernel build.  The
    NumPy checks of the default (skipping) kernel are test_moe_gemm_wg's."""
    import cupy

    import kda_rt.cuda.ops.moe_gemm_wg as wg_ops
    from helpers.gpu import to_gpu_bf16
    from kda_rt.cuda.ops.compile import device_arch
    from kda_rt.cuda.ops.moe_gemm_wg import WgTile, moe_gemm_wg

    if device_arch() != "sm_90a":
        pytest.skip("moe_gemm_wg.cu needs sm_90a (wgmma)")
    T, skewed, tile = WG[name]
    w13, w2 = big_weights
    E, A, D = 256, 8, 2304
    rng = np.random.default_rng(zlib.crc32(name.encode()) + 1)
    x = to_gpu_bf16(bf16_round(rng.normal(size=(T, D))))
    ids = make_ids(T, E, A, skewed, rng)
    counts = np.bincount(ids.ravel(), minlength=E)
    assert np.any((counts % 128 > 0) & (counts % 128 <= 64)), "no tile of 64 rows or fewer: nothing to skip"
    plan = make_plan(ids, E, 128)
    built = []
    real_get = wg_ops.get_kernel
    monkeypatch.setattr(wg_ops, "get_kernel", lambda *a, **kw: built.append(kw.get("HALF_SKIP")) or real_get(*a, **kw))
    outs = {}
    for v in ("0", "1"):
        monkeypatch.setenv("KDA_RT_MOE_HALF_SKIP", v)
        built.clear()
        h, y = (cupy.empty((T * A, n), dtype=x.dtype) for n in (w13.shape[1] // 2, D))
        poison(h)
        poison(y)
        moe_gemm_wg(x, w13, plan, top_k=A, fuse_silu=True, out=h, tile=WgTile(*tile))
        moe_gemm_wg(h, w2, plan, top_k=A, fuse_silu=False, out=y, tile=WgTile(*tile))
        assert built and set(built) == {int(v)}, (v, built)
        outs[v] = (cupy.asnumpy(h.view(np.uint16)), cupy.asnumpy(y.view(np.uint16)))
    for a, b, what in zip(outs["1"], outs["0"], ("h", "y"), strict=True):
        assert np.array_equal(a, b), f"{name}: {what} with the skip differs from the kernel without it"


@pytest.mark.parametrize("name", ["T1", "T300", "T2048-skewed", "T8192", "T2048-bn128-s3-direct", "w8a8-T300",
                                  "w8a8-T2048-skewed", "w8a8-T2048-bn128-s3-direct", "w8a8-T40-D512-I384-E16"])
def test_moe_gemm_wg_b_tma(name, big_weights, big_e4m3, monkeypatch):
    """KDA_RT_MOE_B_TMA=1 (the weight rows of each stage by two tensor-map copies, moe_gemm_wg.cu B_TMA), and with it
    KDA_RT_MOE_A_TMA=1 (the down GEMM's source rows by one more), and KDA_RT_MOE_WS=1 (the persistent,
    warp-specialized form: a producer warpgroup, mbarrier-released stages, one CTA an SM walking many items at T8192,
    most CTAs with none at T1, K of fewer steps than stages at E16), and with it KDA_RT_MOE_MC=1 (clusters of two CTAs
    on an expert's two tiles, the weight rows multicast; pairs across two experts and a last tile alone in its pair
    on the odd plans) against the cp.async kernel on one plan: h and y bit
    for bit (the same values land in the same swizzled places, summed in the same order), with bf16 weights and with e4m3 weights and sources
    (w8a8-*), both tile widths, both epilogues, a 1-token plan, a skewed one and 3-step K (E16); the down GEMM's source
    (h, or its codes) is the first rows of a larger buffer whose other rows are NaN, as a workspace's are (A_TMA's map
    covers the whole allocation: rows past N must never reach an output); the switches are checked to reach the kernel
    builds (A_TMA on the down GEMM only), outputs and every SM's shared memory poisoned first.  The NumPy checks of the default kernel
    are test_moe_gemm_wg's and test_moe_gemm_wg_w8a8's."""
    import cupy

    import kda_rt.cuda.ops.moe_gemm_wg as wg_ops
    from helpers.gpu import poison_shared_memory, to_gpu_bf16
    from kda_rt.cuda.ops.moe_gemm_wg import WgTile, moe_gemm_wg
    from kda_rt.cuda.ops.quant import quantize_activations_e4m3

    w8a8 = name.startswith("w8a8-")
    if w8a8:
        T, D, inter, E, A, skewed, tile = W8A8[name[5:]]
    else:
        (T, skewed, tile), D, inter, E, A = WG[name], 2304, 1024, 256, 8
    rng = np.random.default_rng(zlib.crc32(f"b_tma/{name}".encode()))
    if w8a8 and E == 256:
        q13, s13, q2, s2 = big_e4m3
    elif w8a8:
        crng = cupy.random.default_rng(int(rng.integers(1 << 30)))
        q13, s13 = e4m3_stack(crng, rng, E, 2 * inter, D)
        q2, s2 = e4m3_stack(crng, rng, E, D, inter)
    x = to_gpu_bf16(bf16_round(rng.normal(size=(T, D))))
    plan = make_plan(make_ids(T, E, A, skewed, rng), E, 128)
    built = []
    real_get = wg_ops.get_kernel
    monkeypatch.setattr(wg_ops, "get_kernel", lambda *a, **kw: built.append(
        (kw.get("FUSE_SILU"), kw.get("B_TMA", 0), kw.get("A_TMA", 0), kw.get("WS", 0), kw.get("MC", 0)))
        or real_get(*a, **kw))

    def gemm(src, fuse_silu, out):
        if not w8a8:
            return moe_gemm_wg(src, big_weights[0] if fuse_silu else big_weights[1], plan, top_k=A,
                               fuse_silu=fuse_silu, out=out, tile=WgTile(*tile))
        q = cupy.full((src.shape[0] + 256, src.shape[1]), 0x7F, dtype=np.uint8)[:src.shape[0]]  # NaN codes past N
        sc = cupy.empty(src.shape[0], dtype=np.float32)
        quantize_activations_e4m3(src, out=q, scale_out=sc)
        return moe_gemm_wg(q, q13 if fuse_silu else q2, plan, top_k=A, fuse_silu=fuse_silu, out=out,
                           tile=WgTile(*tile), scale=s13 if fuse_silu else s2, src_scale=sc)

    outs = {}
    for v in ("0", "1", "a", "ws", "mc"):  # cp.async, B_TMA, B_TMA + A_TMA, WS (its own B_TMA and A_TMA), WS + MC
        monkeypatch.setenv("KDA_RT_MOE_B_TMA", "1" if v in ("1", "a") else "0")
        monkeypatch.setenv("KDA_RT_MOE_A_TMA", "1" if v == "a" else "0")
        monkeypatch.setenv("KDA_RT_MOE_WS", "1" if v in ("ws", "mc") else "0")
        monkeypatch.setenv("KDA_RT_MOE_MC", "1" if v == "mc" else "0")
        built.clear()
        h_buf, y = cupy.empty((T * A + 256, inter), dtype=x.dtype), cupy.empty((T * A, D), dtype=x.dtype)
        poison(h_buf)  # (rows past N stay NaN)
        poison(y)
        h = h_buf[:T * A]
        poison_shared_memory()  # no run may pass on the stages the one before left
        gemm(x, True, h)
        gemm(h, False, y)
        a_down, ws, mc = int(v in ("a", "ws", "mc")), int(v in ("ws", "mc")), int(v == "mc")  # (h's allocation
        # holds a 128-row box: >= 256 rows)
        assert sorted(set(built)) == [(0, int(v != "0"), a_down, ws, mc), (1, int(v != "0"), 0, ws, mc)], (v, built)
        outs[v] = (cupy.asnumpy(h.view(np.uint16)), cupy.asnumpy(y.view(np.uint16)))
    for v in ("1", "a", "ws", "mc"):
        for a, b, what in zip(outs[v], outs["0"], ("h", "y"), strict=True):
            assert np.array_equal(a, b), f"{name} ({v}): {what} differs from the cp.async kernel's"


# moe_decode_fused (both decode GEMMs in one launch, items claimed from a counter, each down item waiting for
# its tile's gate/up items): bit for bit the two launches of moe_gemm_tc on the same plan (same tiles, same
# accumulation order), and a sample of experts against NumPy.  ctas = 1 runs every item on one CTA (all
# gate/up items, then the down items, no wait can block); 3 and 7 leave many items per CTA with down items
# waiting on tiles another CTA is still computing; None is the launcher's grid (all CTAs resident).
FUSED = {  # name: (T, D, I, E, A, skewed, ctas)
    "T1-E256": (1, 2304, 1024, 256, 8, False, None),
    "T1-E256-ctas1": (1, 2304, 1024, 256, 8, False, 1),
    "T8-E256": (8, 2304, 1024, 256, 8, False, None),
    "T9-E256-ctas7": (9, 2304, 1024, 256, 8, False, 7),
    "T32-E256": (32, 2304, 1024, 256, 8, False, None),
    "T32-E256-ctas3": (32, 2304, 1024, 256, 8, False, 3),
    "T128-E256-skewed": (128, 2304, 1024, 256, 8, True, None),  # expert 0: 8 tiles of 16 rows
    "T5-D512-I384-E16": (5, 512, 384, 16, 4, False, None),
    "T40-D512-I384-E16-skewed-ctas2": (40, 512, 384, 16, 4, True, 2),
}


def fused_plan(ids, E):
    """The 16-row plan of `ids` [T, A] for moe_decode_fused and its counters, built by moe_bucket into poisoned arrays
    (the counters too: moe_bucket must zero them)."""
    import cupy

    from kda_rt.cuda.ops.moe_align import MoEPlan, max_tiles, moe_bucket
    from kda_rt.cuda.ops.moe_gemm_tc import sync_words

    N, tiles = ids.size, max_tiles(ids.size, E, 16)
    z = lambda n: cupy.full(n, -1, dtype=np.int32)  # noqa: E731
    plan = MoEPlan(z(E + 1), z(N), z(N), z(tiles), z(tiles), z(1), 16)
    sync = cupy.full(sync_words(N, E), 0x5A5A5A5A, dtype=np.int32)
    moe_bucket(cupy.asarray(ids), E, plan, sync=sync)
    return plan, sync


DECODE_FORMS = {"plain": "0", "ws": "1"}


def use_decode_ws(form, monkeypatch):
    """moe_decode_fused's form for a test: "plain" (KDA_RT_MOE_DECODE_WS = 0) or "ws" (the producer warp's tensor-map
    copies, = 1, the default on sm_90+; a tile without 128-byte k steps runs "plain")."""
    from kda_rt.cuda.ops.moe_gemm_tc import decode_ws

    monkeypatch.setenv("KDA_RT_MOE_DECODE_WS", DECODE_FORMS[form])
    if form != "plain" and not decode_ws():
        pytest.skip("the producer-warp form needs sm_90+")


@pytest.mark.parametrize("form", list(DECODE_FORMS))
@pytest.mark.parametrize("name", list(FUSED))
def test_moe_decode_fused(name, form, big_weights, monkeypatch):
    """ws: the producer-warp form (tensor-map copies into mbarrier-guarded stages), the same bits as plain."""
    import cupy

    from helpers.gpu import to_gpu_bf16
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_gemm_tc import decode_ws, fused_decode_tile, moe_decode_fused, moe_gemm_tc

    use_decode_ws(form, monkeypatch)

    T, D, inter, E, A, skewed, ctas = FUSED[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if E == 256:
        w13, w2 = big_weights
    else:
        crng = cupy.random.default_rng(int(rng.integers(1 << 30)))
        w13 = rand_bf16(crng, (E, 2 * inter, D), 1 / np.sqrt(D))
        w2 = rand_bf16(crng, (E, D, inter), 1 / np.sqrt(inter))
    tile = fused_decode_tile(T, D, inter)
    assert tile is not None and tile.bm == 16, f"{name}: no fused decode tile"
    assert decode_ws(tile) == (form == "ws"), f"{name}: the {form} form does not run on {tile}"
    x_np = bf16_round(rng.normal(size=(T, D)))
    x = to_gpu_bf16(x_np)
    ids = make_ids(T, E, A, skewed, rng)
    N = T * A
    plan, sync = fused_plan(ids, E)
    h, y = cupy.empty((N, inter), dtype=BF16), cupy.empty((N, D), dtype=BF16)
    poison(h)
    poison(y)
    moe_decode_fused(x, w13, w2, plan, top_k=A, h=h, out=y, sync=sync, ctas=ctas)
    h2, y2 = cupy.empty_like(h), cupy.empty_like(y)
    poison(h2)
    poison(y2)
    moe_gemm_tc(x, w13, plan, top_k=A, fuse_silu=True, out=h2, tile=tile)
    moe_gemm_tc(h2, w2, plan, top_k=A, fuse_silu=False, out=y2, tile=tile)
    bits = lambda a: cupy.asnumpy(a).view(np.uint16)  # noqa: E731
    assert np.array_equal(bits(h), bits(h2)), f"{name}: h differs from the two-launch path"
    assert np.array_equal(bits(y), bits(y2)), f"{name}: y differs from the two-launch path"
    check_experts(sample_experts(ids, E, rng), plan, x_np, w13, w2, h, y, A, name)
    # the counters end at: items claimed = every item + one failed claim per CTA; each tile counted its
    # gate/up items
    ntiles = int(plan.num_tiles[0])
    counters = cupy.asnumpy(sync)
    gu = inter // (tile.bn // 2)
    assert np.all(counters[1:1 + ntiles] == gu), f"{name}: tile counters {counters[1:1 + ntiles]}, expected {gu}"



# e4m3 weights (moe_gemm_tc.cu WFMT = 1): uint8 bits with one fp32 scale a weight row.  The references run on the
# dequantized weights (exact in float64), so the bf16 tolerances above hold (the scale adds one fp32 rounding to each
# sum).  The codes are drawn uniformly over every finite e4m3 code, so all 254 of them occur; the "subnormal" cases
# hold only zeros and the 14 subnormal codes (a conversion that flushed them would leave those outputs 0), and the
# experts' scales lie 2^-6 .. 2^4 apart (a scale read from the wrong expert or row fails by far).


FUSED_E4M3 = {  # name: (T, D, I, E, A, skewed, ctas, subnormal)
    "T32-E256": (32, 2304, 1024, 256, 8, False, None, False),
    "T8-E256": (8, 2304, 1024, 256, 8, False, None, False),  # a small batch (the same e4m3 tile: fused_e4m3_tile)
    "T9-E256-ctas7": (9, 2304, 1024, 256, 8, False, 7, False),
    "T40-D512-I384-E16-skewed-ctas2": (40, 512, 384, 16, 4, True, 2, False),
    "T5-D512-I384-E16-subnormal": (5, 512, 384, 16, 4, False, None, True),
    "T8-D512-I320-E16": (8, 512, 320, 16, 4, False, None, False),  # I % 128 != 0: fused_e4m3_tile falls back
}


@pytest.mark.parametrize("form", list(DECODE_FORMS))
@pytest.mark.parametrize("convert", [0, 1], ids=["bits", "cvt"])
@pytest.mark.parametrize("name", list(FUSED_E4M3))
def test_moe_decode_fused_e4m3(name, convert, form, monkeypatch):
    """moe_decode_fused with e4m3 w13 and w2: bit for bit the two e4m3 moe_gemm_tc launches on the same plan and tile,
    and every touched expert (E = 16) or a sample (E = 256) against NumPy on the dequantized weights; both
    conversions of the codes (E4M3_CONVERT)."""
    import cupy

    from helpers.gpu import to_gpu_bf16
    from kda_rt.cuda.ops import moe_gemm_tc as mod
    from kda_rt.cuda.ops.check import BF16

    skip_without_e4m3()
    use_decode_ws(form, monkeypatch)
    monkeypatch.setattr(mod, "E4M3_CONVERT", convert)
    T, D, inter, E, A, skewed, ctas, subnormal = FUSED_E4M3[name]
    rng = np.random.default_rng(zlib.crc32(f"e4m3/{name}".encode()))
    crng = cupy.random.default_rng(int(rng.integers(1 << 30)))
    q13, s13 = e4m3_stack(crng, rng, E, 2 * inter, D, subnormal)
    q2, s2 = e4m3_stack(crng, rng, E, D, inter, subnormal)
    tile = mod.fused_e4m3_tile(mod.fused_decode_tile(T, D, inter), [(2 * inter, D, True), (D, inter, False)])
    assert tile is not None and tile.bm == 16, f"{name}: no e4m3 decode tile"
    # (the I % 128 != 0 case's fallback tile has 64-byte k steps: the plain form either way)
    assert mod.decode_ws(tile, True) == (form == "ws" and name != "T8-D512-I320-E16"), f"{name}: {form} on {tile}"
    x_np = bf16_round(rng.normal(size=(T, D)))
    x = to_gpu_bf16(x_np)
    ids = make_ids(T, E, A, skewed, rng)
    N = T * A
    plan, sync = fused_plan(ids, E)
    h, y, h2, y2 = (cupy.empty((N, n), dtype=BF16) for n in (inter, D, inter, D))
    for a in (h, y, h2, y2):
        poison(a)
    mod.moe_decode_fused(x, q13, q2, plan, top_k=A, h=h, out=y, sync=sync, ctas=ctas, scale13=s13, scale2=s2)
    mod.moe_gemm_tc(x, q13, plan, top_k=A, fuse_silu=True, out=h2, tile=tile, scale=s13)
    mod.moe_gemm_tc(h2, q2, plan, top_k=A, fuse_silu=False, out=y2, tile=tile, scale=s2)
    bits = lambda a: cupy.asnumpy(a).view(np.uint16)  # noqa: E731
    assert np.array_equal(bits(h), bits(h2)), f"{name}: h differs from the two-launch path"
    assert np.array_equal(bits(y), bits(y2)), f"{name}: y differs from the two-launch path"
    if subnormal:  # the outputs are not all zero (a conversion that flushed the subnormal codes would give zeros)
        assert float(cupy.abs(h.astype(np.float32)).max()) > 0, f"{name}: h is all zero"
    check_experts(sample_experts(ids, E, rng), plan, x_np, Dequantized(q13, s13), Dequantized(q2, s2), h, y, A,
                  f"{name}/{convert}")


@pytest.fixture(scope="module")
def big_e4m3():
    """Kimi-Linear-48B expert stacks in e4m3 (E=256, D=2304, I=1024: 1.8 GB of codes) with their row scales (only on
    sm_90a, the wgmma kernel's arch: drawn lazily by the tests that need them)."""
    import cupy

    from kda_rt.cuda.ops.compile import device_arch

    if device_arch() != "sm_90a":
        pytest.skip("moe_gemm_wg.cu needs sm_90a (wgmma)")

    rng = np.random.default_rng(11)
    crng = cupy.random.default_rng(11)
    return (*e4m3_stack(crng, rng, 256, 2048, 2304), *e4m3_stack(crng, rng, 256, 2304, 1024))


WG_E4M3 = {  # name: (T, D, I, E, A, skewed, tile, convert, subnormal); E = 256: the big_e4m3 stacks
    "T1-direct": (1, 2304, 1024, 256, 8, False, (256, 4, False), 1, False),
    "T300": (300, 2304, 1024, 256, 8, False, (256, 4), 1, False),
    "T2048-skewed": (2048, 2304, 1024, 256, 8, True, (256, 4), 1, False),
    "T2048-skewed-bits": (2048, 2304, 1024, 256, 8, True, (256, 4), 0, False),
    "T8192": (8192, 2304, 1024, 256, 8, False, (256, 4), 1, False),
    "T2048-bn128-s3-direct": (2048, 2304, 1024, 256, 8, False, (128, 3, False), 1, False),
    "T40-D512-I384-E16-subnormal": (40, 512, 384, 16, 4, False, (256, 4), 1, True),
    "T40-D512-I384-E16-subnormal-bits": (40, 512, 384, 16, 4, False, (256, 4), 0, True),
}


@pytest.mark.parametrize("name", list(WG_E4M3))
def test_moe_gemm_wg_e4m3(name, big_e4m3, monkeypatch):
    """moe_gemm_wg with e4m3 weights (moe_gemm_wg.cu WFMT = 1: each step's codes widened to bf16 in shared memory)
    against NumPy on the dequantized weights: every expert (E = 16) or the busiest, the emptiest and random ones;
    tiles and epilogues as test_moe_gemm_wg, both conversions."""
    import cupy

    from helpers.gpu import to_gpu_bf16
    from kda_rt.cuda.ops import moe_gemm_tc as mod
    from kda_rt.cuda.ops.compile import device_arch
    from kda_rt.cuda.ops.moe_gemm_wg import WgTile, moe_gemm_wg

    if device_arch() != "sm_90a":
        pytest.skip("moe_gemm_wg.cu needs sm_90a (wgmma)")
    T, D, inter, E, A, skewed, tile, convert, subnormal = WG_E4M3[name]
    monkeypatch.setattr(mod, "E4M3_CONVERT", convert)
    rng = np.random.default_rng(zlib.crc32(f"wg-e4m3/{name}".encode()))
    if E == 256:
        q13, s13, q2, s2 = big_e4m3
    else:
        crng = cupy.random.default_rng(int(rng.integers(1 << 30)))
        q13, s13 = e4m3_stack(crng, rng, E, 2 * inter, D, subnormal)
        q2, s2 = e4m3_stack(crng, rng, E, D, inter, subnormal)
    x_np = bf16_round(rng.normal(size=(T, D)))
    ids = make_ids(T, E, A, skewed, rng)

    def gemm(src, weight, plan, *, top_k, fuse_silu, out, tile=None):
        return moe_gemm_wg(src, weight, plan, top_k=top_k, fuse_silu=fuse_silu, out=out, tile=tile,
                           scale=s13 if fuse_silu else s2)

    plan, h, y = run_tc(to_gpu_bf16(x_np), q13, q2, ids, E, 128, WgTile(*tile), gemm)
    if subnormal:
        assert float(cupy.abs(h.astype(np.float32)).max()) > 0, f"{name}: h is all zero"
    check_experts(sample_experts(ids, E, rng), plan, x_np, Dequantized(q13, s13), Dequantized(q2, s2), h, y, A, name)

W8A8 = {  # name: (T, D, I, E, A, skewed, tile); E = 256: the big_e4m3 stacks
    "T300": (300, 2304, 1024, 256, 8, False, (256, 4)),
    "T2048-skewed": (2048, 2304, 1024, 256, 8, True, (256, 4)),
    "T8192": (8192, 2304, 1024, 256, 8, False, (256, 4)),
    "T2048-bn128-s3-direct": (2048, 2304, 1024, 256, 8, False, (128, 3, False)),
    "T2048-direct": (2048, 2304, 1024, 256, 8, False, (256, 4, False)),  # the launcher's gate/up epilogue
    "T40-D512-I384-E16": (40, 512, 384, 16, 4, False, (256, 4)),  # K = 384: 3 k steps of 128 codes
}


@pytest.mark.parametrize("name", list(W8A8))
def test_moe_gemm_wg_w8a8(name, big_e4m3):
    """moe_gemm_wg with e4m3 sources and weights (moe_gemm_wg.cu WFMT = 2: wgmma e4m3 x e4m3): each GEMM's bf16
    source quantized a row at a time (quantize_activations_e4m3), checked against NumPy float64 on the dequantized
    sources and weights.  Hopper's e4m3 tensor cores keep ~14 bits of their partial sums (DeepSeek-V3 report,
    section 3.3.2), so a sum of K products can drift by up to (K / 32) 2^-14 of the size its partial sums reach,
    which |x| @ |w| bounds (4.4e-3 of it at K = 2304).  Each element's bound is that drift, twice, plus one bf16
    ulp (2^-7 relative) for each rounding the kernel and the reference may take apart (g, u, SiLU and h, or y:
    two roundings of slightly different values can land one ulp apart): an element whose products cancel has a small result but partial
    sums as large as the others' (the first runs, 2026-12-02: RMS 4.07e-3 on h at T300; one element of T2048-skewed
    4.7e-2 off, inside a relative bound of its own size; with half-ulp rounding terms T40-D512-I384-E16's y
    had 10 elements up to 1.28x past).  The per-element bound is loose where |x| @ |w| is large against the
    result (for random data about 2.4x |h| at the median): a wrong source row or expert puts ~40% of the elements
    past it, but a wrong scale shows only in the RMS over each expert's rows, <= 8e-3, which a scale off by more
    than ~1% fails.  Outputs poisoned first (run_tc)."""
    import cupy
    import ml_dtypes

    from helpers.gpu import to_gpu_bf16
    from kda_rt.cuda.ops.compile import device_arch
    from kda_rt.cuda.ops.moe_gemm_wg import WgTile, moe_gemm_wg
    from kda_rt.cuda.ops.quant import quantize_activations_e4m3

    if device_arch() != "sm_90a":
        pytest.skip("moe_gemm_wg.cu needs sm_90a (wgmma)")
    T, D, inter, E, A, skewed, tile = W8A8[name]
    rng = np.random.default_rng(zlib.crc32(f"w8a8/{name}".encode()))
    if E == 256:
        q13, s13, q2, s2 = big_e4m3
    else:
        crng = cupy.random.default_rng(int(rng.integers(1 << 30)))
        q13, s13 = e4m3_stack(crng, rng, E, 2 * inter, D)
        q2, s2 = e4m3_stack(crng, rng, E, D, inter)
    x_np = bf16_round(rng.normal(size=(T, D)))
    ids = make_ids(T, E, A, skewed, rng)
    sources = {}  # fuse_silu -> the dequantized source rows the kernel multiplied (float64)

    def gemm(src, weight, plan, *, top_k, fuse_silu, out, tile=None):
        q = cupy.full(src.shape, 0x7F, dtype=np.uint8)
        s = cupy.full(src.shape[0], np.nan, dtype=np.float32)
        quantize_activations_e4m3(src, out=q, scale_out=s)
        codes = cupy.asnumpy(q).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        sources[fuse_silu] = codes * cupy.asnumpy(s).astype(np.float64)[:, None]
        return moe_gemm_wg(q, weight, plan, top_k=top_k, fuse_silu=fuse_silu, out=out, tile=tile,
                           scale=s13 if fuse_silu else s2, src_scale=s)

    plan, h, y = run_tc(to_gpu_bf16(x_np), q13, q2, ids, E, 128, WgTile(*tile), gemm)
    off, sp = cupy.asnumpy(plan.expert_off), cupy.asnumpy(plan.sorted_pair)
    h_np, y_np = to_np(h), to_np(y)
    assert np.all(np.isfinite(h_np)) and np.all(np.isfinite(y_np)), f"{name}: rows left unwritten (NaN)"
    w13, w2 = Dequantized(q13, s13), Dequantized(q2, s2)
    for e in sample_experts(ids, E, rng):
        if off[e + 1] == off[e]:
            continue
        rows, h_ref, _ = reference_rows(e, (off, sp), sources[True], w13, w2, h_np, A)
        _, _, y_ref = reference_rows(e, (off, sp), sources[True], w13, w2, sources[False], A)
        check_drift(h_np[rows], h_ref, h_bound(sources[True][sp[rows] // A], w13[e]), f"w8a8 {name} h expert {e}")
        y_mag = np.abs(sources[False][rows]) @ np.abs(w2[e]).T
        check_drift(y_np[rows], y_ref, drift(inter) * y_mag + 2.0**-7 * np.abs(y_ref), f"w8a8 {name} y expert {e}")


def test_w8a8_refusals():
    """e4m3 sources refused by name: without e4m3 weights, a bf16 source with a source scale, a source scale of the
    wrong length, K not a multiple of 128."""
    import cupy

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_gemm_wg import moe_gemm_wg

    T, D, inter, E, A = 3, 256, 128, 4, 2
    rng = np.random.default_rng(6)
    crng = cupy.random.default_rng(6)
    q13, s13 = e4m3_stack(crng, rng, E, 2 * inter, D)
    plan = make_plan(make_ids(T, E, A, False, rng), E, 128)
    h = cupy.empty((T * A, inter), dtype=BF16)
    xq, xs = cupy.zeros((T, D), np.uint8), cupy.ones(T, np.float32)
    with pytest.raises(ValueError, match="need e4m3 weights"):
        moe_gemm_wg(xq, cupy.zeros((E, 2 * inter, D), BF16), plan, top_k=A, fuse_silu=True, out=h, src_scale=xs)
    with pytest.raises(TypeError, match="src must have dtype uint8"):
        moe_gemm_wg(cupy.zeros((T, D), BF16), q13, plan, top_k=A, fuse_silu=True, out=h, scale=s13, src_scale=xs)
    with pytest.raises(ValueError, match="src_scale must have shape"):
        moe_gemm_wg(xq, q13, plan, top_k=A, fuse_silu=True, out=h, scale=s13, src_scale=xs[:2])
    q13b, s13b = e4m3_stack(crng, rng, E, 2 * inter, 192)
    with pytest.raises(ValueError, match="K % 128 == 0"):
        moe_gemm_wg(cupy.zeros((T, 192), np.uint8), q13b, plan, top_k=A, fuse_silu=True, out=h, scale=s13b,
                    src_scale=xs)


def test_e4m3_grouped_gemm_refusals():
    """e4m3 calls refused by name: a scale without e4m3 weights, e4m3 weights without scales, one of the two fused
    scales, a scale of the wrong shape."""
    import cupy

    from helpers.gpu import to_gpu_bf16
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_gemm_tc import moe_decode_fused, moe_gemm_tc

    T, D, inter, E, A = 3, 256, 128, 4, 2
    rng = np.random.default_rng(5)
    crng = cupy.random.default_rng(5)
    q13, s13 = e4m3_stack(crng, rng, E, 2 * inter, D)
    q2, s2 = e4m3_stack(crng, rng, E, D, inter)
    x = to_gpu_bf16(rng.normal(size=(T, D)))
    plan = make_plan(make_ids(T, E, A, False, rng), E, 16)
    h, y = cupy.empty((T * A, inter), dtype=BF16), cupy.empty((T * A, D), dtype=BF16)
    w13_bf16 = cupy.zeros((E, 2 * inter, D), dtype=BF16)
    with pytest.raises(TypeError, match=r"weight must have dtype uint8 \(e4m3 bits, with scales\), got bfloat16"):
        moe_gemm_tc(x, w13_bf16, plan, top_k=A, fuse_silu=True, out=h, scale=s13)
    with pytest.raises(TypeError, match=r"weight must have dtype bfloat16 \(or uint8 e4m3 bits with scales\)"):
        moe_gemm_tc(x, q13, plan, top_k=A, fuse_silu=True, out=h)
    with pytest.raises(ValueError, match="scale"):
        moe_gemm_tc(x, q13, plan, top_k=A, fuse_silu=True, out=h, scale=s13[:, :-1])
    with pytest.raises(ValueError, match="need both scale13 and scale2"):
        moe_decode_fused(x, q13, q2, plan, top_k=A, h=h, out=y, sync=cupy.zeros(64, np.int32), scale13=s13)

if __name__ == "__main__":
    for n in SMALL:
        test_moe_gemm_tc_small(n)
        print(n, "ok")
