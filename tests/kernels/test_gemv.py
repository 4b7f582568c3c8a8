"""kernels_cu/gemv.cu (one-row products as GEMVs spread over every warp) against NumPy float64 on fresh random
bf16 inputs:

    moe_gemv_gate_up, over the plan moe_bucket builds for one token:
        h[r] = bf16( bf16(SiLU(bf16(x · W1_eᵀ))) · bf16(x · W3_eᵀ) )      [N, I] bf16, e the expert of row r
    gemv_dense:  y = x · Wᵀ                                               [1, N] bf16 or fp32

Tolerances.  gate/up as test_moe_gemm_tc.py's (the reference rounds where the kernel rounds; an fp32-vs-float64
difference can flip one of the four bf16 roundings): RMS ≤ 1e-3 and |out - ref| ≤ 3e-2 · |ref| + 1e-3 · RMS(ref).
Dense bf16 out (one rounding): |out - ref| ≤ 2^-7 · |ref| + 1e-4 · RMS(ref).  Dense fp32 out: the error of an fp32
sum of K products, each lane summing K / 32 of them in order and the warp adding 32 partials, is below
~(K / 32 + 5) · 2^-24 · Σ|x_k w_k| (≈ 4.6e-6 of it at K = 2304): |out - ref| ≤ 1e-5 · Σ|x_k w_k|.
Every output is poisoned with NaN first, so an element left unwritten fails.  The launch configurations cover
the default, the unpipelined variant, and grids with more warps than units (warps with no work), and widths
that are not a multiple of 256 (lanes with no piece) or odd row counts (a last unit of one row)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from kernels.test_moe_gemm_tc import check, make_ids, make_plan, reference_rows

from helpers.gpu import bf16_round, poison, rand_bf16, to_np

pytestmark = pytest.mark.gpu

CASES = {  # name: (D, I, E, A)
    "D2304-I1024-E12-A9": (2304, 1024, 12, 9),  # the 48B shape's widths, 8 routed + the shared slot
    "D256-I128-E8-A2": (256, 128, 8, 2),
    "D72-I40-E5-A3": (72, 40, 5, 3),  # 9 pieces a row: lanes 9..31 hold none
    "D2312-I24-E4-A1": (2312, 24, 4, 1),  # 289 pieces: one lane holds a tenth; 24 features for 132 x 16 warps
}
CONFIGS = {"default": {}, "w8-b2": {"pipe": False, "blocks_per_sm": 2}, "w4-b3": {"warps": 4, "blocks_per_sm": 3},
           "w16-b4": {"warps": 16, "blocks_per_sm": 4, "pipe": False}}  # w16-b4: more CTAs than fit, one wave


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", list(CASES))
def test_moe_gemv_gate_up(name, config):
    import cupy

    from helpers.gpu import to_gpu_bf16
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.gemv import DEFAULT, moe_gemv_gate_up

    D, inter, E, A = CASES[name]
    rng = np.random.default_rng(zlib.crc32(f"{name}/{config}".encode()))
    crng = cupy.random.default_rng(int(rng.integers(1 << 30)))
    x_np = bf16_round(rng.normal(size=(1, D)))
    w13, w2 = rand_bf16(crng, (E, 2 * inter, D), 1 / np.sqrt(D)), rand_bf16(crng, (E, D, inter), 1 / np.sqrt(inter))
    ids = make_ids(1, E, A, False, rng)
    for bm in (8, 16):  # the plan's tile rows do not matter at one token (one row a tile)
        plan = make_plan(ids, E, bm)
        h = cupy.empty((A, inter), dtype=BF16)
        poison(h)
        moe_gemv_gate_up(to_gpu_bf16(x_np), w13, plan, out=h, cfg=DEFAULT._replace(**CONFIGS[config]))
        h_np = to_np(h)
        assert np.all(np.isfinite(h_np)), f"{name}/{config}: rows left unwritten (NaN)"
        off, sp = cupy.asnumpy(plan.expert_off), cupy.asnumpy(plan.sorted_pair)
        for e in np.unique(ids):
            rows, h_ref, _ = reference_rows(int(e), (off, sp), x_np, w13, w2, h_np, A)
            check(h_np[rows], h_ref, f"{name}/{config} bm{bm} h expert {e}", rms_tol=1e-3, rtol=3e-2, atol_rms=1e-3)


def test_moe_gemv_rejects_bad_inputs():
    import cupy

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.gemv import moe_gemv_gate_up

    E, D, inter, A = 4, 256, 64, 2
    plan = make_plan(np.array([[0, 2]], np.int32), E, 16)
    w13 = cupy.zeros((E, 2 * inter, D), dtype=BF16)
    h = cupy.empty((A, inter), dtype=BF16)
    with pytest.raises(ValueError, match="x must have shape"):
        moe_gemv_gate_up(cupy.zeros((2, D), dtype=BF16), w13, plan, out=h)
    with pytest.raises(ValueError, match="out must have shape"):
        moe_gemv_gate_up(cupy.zeros((1, D), dtype=BF16), w13, plan, out=cupy.empty((A, inter + 1), dtype=BF16))
    with pytest.raises(ValueError, match="multiple of 8"):
        moe_gemv_gate_up(cupy.zeros((1, 12), dtype=BF16), cupy.zeros((E, 2 * inter, 12), dtype=BF16), plan, out=h)


DENSE = {  # name: (N, K, fp32 out, x and out as row-strided views)
    "N12576-K2304-bf16": (12576, 2304, False, False),  # a KDA layer's q|k|v|f_a|g_a|b at the 48B shape
    "N6721-K2304-f32-strided": (6721, 2304, True, True),  # odd N: the last unit is one row
    "N5000-K72-bf16": (5000, 72, False, False),  # 9 pieces a row
    "N24-K2312-f32": (24, 2312, True, False),  # 12 units for 132 x 8 warps
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", list(DENSE))
def test_gemv_dense(name, config):
    import cupy

    from helpers.gpu import to_gpu_bf16
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.gemv import DEFAULT, gemv

    N, K, f32, strided = DENSE[name]
    rng = np.random.default_rng(zlib.crc32(f"{name}/{config}".encode()))
    crng = cupy.random.default_rng(int(rng.integers(1 << 30)))
    x_np = bf16_round(rng.normal(size=(1, K)))
    w = rand_bf16(crng, (N, K), 1 / np.sqrt(K))
    x = to_gpu_bf16(x_np)
    dtype = np.float32 if f32 else BF16
    out = cupy.empty((1, N + 16 if strided else N), dtype=dtype)
    if strided:  # column slices of wider rows, as the fused projections' views
        wide = cupy.zeros((1, K + 8), dtype=BF16)
        wide[:, 8:] = x
        x, out = wide[:, 8:], out[:, 16:]
    poison(out)
    gemv(x, w, out=out, cfg=DEFAULT._replace(**CONFIGS[config]))
    got, w_np = to_np(out).astype(np.float64), to_np(w).astype(np.float64)
    ref, mag = x_np @ w_np.T, np.abs(x_np) @ np.abs(w_np).T
    assert np.all(np.isfinite(got)), f"{name}/{config}: outputs left unwritten (NaN)"
    tol = 1e-5 * mag if f32 else 2.0**-7 * np.abs(ref) + 1e-4 * np.sqrt(np.mean(ref**2))
    bad = np.abs(got - ref) > tol
    assert not bad.any(), f"{name}/{config}: {int(bad.sum())} of {N} out of tolerance, max err {np.max(np.abs(got - ref)):.3e}"


def test_linear_takes_gemv_for_one_wide_row(monkeypatch):
    """gemm.linear sends one row with more than 4096 outputs to gemv (KDA_RT_GEMV=0: cuBLAS), the same values
    within the bf16 rounding of each; two rows or an accumulate still go to cuBLAS."""
    import cupy

    from helpers.gpu import to_gpu_bf16
    from kda_rt.cuda.gemm import linear
    from kda_rt.cuda.ops import gemv as gemv_mod
    from kda_rt.cuda.ops.check import BF16

    rng = np.random.default_rng(7)
    w = rand_bf16(cupy.random.default_rng(8), (4104, 256), 1 / 16)
    x = to_gpu_bf16(bf16_round(rng.normal(size=(2, 256))))
    calls, real = [], gemv_mod.gemv

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gemv_mod, "gemv", spy)
    one = linear(x[:1], w)
    assert calls == [1]
    two = linear(x, w)
    acc = cupy.zeros((1, 4104), dtype=np.float32)
    linear(x[:1], w, out=acc, accumulate=True)
    assert calls == [1]
    monkeypatch.setenv("KDA_RT_GEMV", "0")
    ref = linear(x[:1], w)
    assert calls == [1] and one.dtype == BF16
    a, b = to_np(one).astype(np.float64), to_np(ref).astype(np.float64)
    np.testing.assert_allclose(a, b, rtol=2.0**-6, atol=1e-3 * np.sqrt(np.mean(b**2)))
    np.testing.assert_allclose(to_np(two[:1]).astype(np.float64), b, rtol=2.0**-6, atol=1e-3 * np.sqrt(np.mean(b**2)))
    np.testing.assert_allclose(to_np(acc).astype(np.float64), b, rtol=2.0**-6, atol=1e-3 * np.sqrt(np.mean(b**2)))
