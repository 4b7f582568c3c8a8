"""kernels_cu/skinny_gemm.cu (ops/skinny_gemm.py): y = x · Wᵀ for up to 8 rows, on fresh random inputs
against float64 NumPy, every output element checked, outputs poisoned first.

Tolerances.  The inputs are bf16 (exact in fp32); the kernel accumulates in fp32 on the tensor cores in
its own order, so an element may differ from the float64 sum by a few fp32 roundings of the partial
sums: we allow 1e-5 · Σ_k |x_k w_k| (that bound is ~40x the typical fp32 error at K = 4096 and far below
any indexing mistake, which moves an element by O(Σ|x w|)).  bf16 outputs are then one rounding of that
sum: |got - ref| ≤ 2^-8 |ref| + the same bound (half an ulp of bf16 is 2^-9 relative, doubled for a sum
that lands next to a rounding boundary)."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.gpu import bf16_round, poison, to_gpu_bf16, to_np

pytestmark = pytest.mark.gpu

SHAPES = [  # (M, K, N): batch-1 to batch-8 decode projections of the 48B shape, and small edge shapes
    (1, 4096, 2304),   # KDA / MLA o_proj
    (1, 2304, 288),    # f_a | g_a | b: 9 k chunks per warp, one past the unroll
    (3, 2304, 288),    # a ragged row count
    (8, 9216, 2304),   # dense MLP down, a full n-tile
    (5, 256, 16),      # one CTA, one k chunk per warp
    (2, 768, 48),      # a chunk count (3 per warp) below the unroll
    (7, 8192, 4096),   # the widest output it takes, 4 unrolled groups per warp
]


def _reference(x, w):
    return x @ w.T, np.abs(x) @ np.abs(w).T


@pytest.mark.parametrize("M, K, N", SHAPES, ids=str)
@pytest.mark.parametrize("out_dtype", ["bf16", "f32"])
def test_skinny_gemm_matches_numpy(M, K, N, out_dtype):
    import cupy

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.skinny_gemm import fits, skinny_gemm

    rng = np.random.default_rng(M * 7919 + K + N)
    x, w = bf16_round(rng.normal(size=(M, K))), bf16_round(rng.normal(size=(N, K)) / np.sqrt(K))
    xg, wg = to_gpu_bf16(x), to_gpu_bf16(w)
    out = cupy.empty((M, N), dtype=BF16 if out_dtype == "bf16" else np.float32)
    poison(out)
    assert fits(xg, wg, out, accumulate=False)
    skinny_gemm(xg, wg, out)
    got = to_np(out)
    ref, mag = _reference(x, w)
    bound = 1e-5 * mag + (2.0**-8 * np.abs(ref) if out_dtype == "bf16" else 0.0)
    bad = ~(np.abs(got - ref) <= bound)  # NaN (an element left unwritten) counts as bad
    assert not bad.any(), f"{int(bad.sum())} of {got.size} elements off, max err {np.nanmax(np.abs(got - ref)):.3e}"


def test_skinny_gemm_strided_rows_and_the_linear_switch(monkeypatch):
    """x and out as column slices of wider buffers (as the fused projections pass them), through
    gemm.linear, against the cuBLAS path of the same call (KDA_RT_SKINNY=0) and NumPy."""
    import cupy

    from kda_rt.cuda.gemm import linear
    from kda_rt.cuda.ops.check import BF16

    rng = np.random.default_rng(11)
    M, K, N = 6, 2304, 576
    xw, w = bf16_round(rng.normal(size=(M, K + 64))), bf16_round(rng.normal(size=(N, K)) / np.sqrt(K))
    xg, wg = to_gpu_bf16(xw), to_gpu_bf16(w)
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("KDA_RT_SKINNY", flag)
        wide = cupy.empty((M, N + 32), dtype=BF16)
        poison(wide)
        linear(xg[:, 64:], wg, out=wide[:, 16:16 + N])
        outs[flag] = to_np(wide)
        assert np.isnan(outs[flag][:, :16]).all() and np.isnan(outs[flag][:, 16 + N:]).all(), "wrote outside the view"
    ref, mag = _reference(xw[:, 64:], w)
    for flag, got in outs.items():
        bad = ~(np.abs(got[:, 16:16 + N] - ref) <= 2.0**-8 * np.abs(ref) + 1e-5 * mag)
        assert not bad.any(), f"KDA_RT_SKINNY={flag}: {int(bad.sum())} elements off"
    # both paths round the fp32 sum once: at most one bf16 ulp apart where the sums straddle a rounding point
    diff = np.abs(outs["1"] - outs["0"])[:, 16:16 + N]
    assert (diff <= 2.0**-7 * np.abs(ref) + 1e-5 * mag).all()


@pytest.mark.parametrize("M, K, N, accumulate", [(9, 2304, 288, False), (1, 2304, 12288, False), (4, 128, 4096, False),
                                                 (4, 2304, 8, False), (4, 2304, 288, True)], ids=str)
def test_skinny_gemm_refuses_what_it_cannot_run(M, K, N, accumulate):
    """More than 8 rows, more than 4096 outputs (q|k|v, lm_head: cuBLAS streams those as fast), K not a
    multiple of 256 (the f_b / g_b rank-128 projections), N not a multiple of 16, and accumulate=True stay
    on cuBLAS."""
    import cupy

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.skinny_gemm import fits

    x, w = cupy.zeros((M, K), dtype=BF16), cupy.zeros((N, K), dtype=BF16)
    assert not fits(x, w, cupy.zeros((M, N), dtype=BF16), accumulate)
