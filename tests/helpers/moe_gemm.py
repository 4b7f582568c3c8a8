"""The grouped expert GEMMs' shared test pieces (tests/kernels/test_moe_gemm_tc.py and the other MoE tests, the MoE
benches in tests/gpu/): routings, plans, NumPy reference rows, tolerances, e4m3 expert stacks.  (Kept out of the test
files: `kernels.<test module>` is not importable where a distribution named `kernels` is installed, as transformers
5.25 installs one.)"""

from __future__ import annotations

import numpy as np

from helpers.gpu import bf16_round, rms_rel, to_np

__all__ = ["TILES", "Dequantized", "check", "check_drift", "drift", "e4m3_stack", "h_bound", "make_ids", "make_plan",
           "reference_rows", "silu"]


def make_ids(T, E, A, skewed, rng) -> np.ndarray:
    """[T, A] int32, distinct per token.  Uniform: A random experts per token.  Skewed: every token
    routes to expert 0 (T rows), experts E-1 and E-2 get one row each, the rest random."""
    if not skewed:
        return np.argsort(rng.random((T, E)), axis=1)[:, :A].astype(np.int32)
    ids = np.empty((T, A), np.int32)
    ids[:, 0] = 0
    ids[:, 1:] = 1 + np.argsort(rng.random((T, E - 3)), axis=1)[:, :A - 1]
    ids[0, -1] = E - 1
    ids[T // 2, -1] = E - 2 if T > 1 else ids[T // 2, -1]
    return ids


def make_plan(ids, E, tile_rows):
    import cupy

    from kda_rt.cuda.ops.moe_align import MoEPlan, max_tiles, moe_bucket

    T, A = ids.shape
    N, tiles = T * A, max_tiles(T * A, E, tile_rows)
    z = lambda n: cupy.full(n, -1, dtype=np.int32)  # noqa: E731
    plan = MoEPlan(z(E + 1), z(N), z(N), z(tiles), z(tiles), z(1), tile_rows)
    return moe_bucket(cupy.asarray(ids), E, plan)


def silu(v):
    return v / (1.0 + np.exp(-v))


def reference_rows(e, plan_np, x, w13, w2, h_gpu, A):
    """(h_ref, y_ref) for the rows of expert e, float64 products rounded to bf16 where the kernels round;
    y_ref from the kernel's own h (exact bf16 input)."""
    off, sorted_pair = plan_np
    rows = np.arange(off[e], off[e + 1])
    inter = w13.shape[1] // 2
    w13e, w2e = to_np(w13[e]), to_np(w2[e])
    xr = x[sorted_pair[rows] // A]
    g, u = bf16_round(xr @ w13e[:inter].T), bf16_round(xr @ w13e[inter:].T)
    h_ref = bf16_round(bf16_round(silu(g)) * u)
    y_ref = bf16_round(h_gpu[rows] @ w2e.T)
    return rows, h_ref, y_ref


def check(got, ref, name, *, rms_tol, rtol, atol_rms):
    err = rms_rel(got, ref)
    scale = np.sqrt(np.mean(ref**2))
    bad = np.abs(got - ref) > rtol * np.abs(ref) + atol_rms * scale
    assert err <= rms_tol and not bad.any(), (f"{name}: rms rel {err:.3e}, {int(bad.sum())} elements out of "
                                              f"tolerance, max abs err {np.max(np.abs(got - ref)):.3e}")


TILES = [  # candidate tiles (bm, bn, bk, stages, warps_m, warps_n, min_blocks), timed by tests/gpu/bench_moe_gemm.py
    (128, 256, 64, 3, 2, 4, 1),
    (128, 256, 64, 4, 2, 4, 1),
    (128, 256, 32, 4, 2, 4, 1),
    (128, 128, 64, 3, 2, 2, 2),
    (64, 256, 64, 3, 2, 4, 1),
    (64, 256, 64, 4, 2, 4, 1),
    (64, 256, 32, 4, 2, 4, 2),
    (64, 128, 64, 4, 2, 2, 2),
    (64, 128, 64, 3, 2, 2, 2),
    (16, 128, 64, 4, 1, 4, 2),  # decode tiles: one m16 row tile, weights streamed through 4-6 stages
    (16, 64, 64, 4, 1, 2, 4),
    (16, 128, 64, 6, 1, 4, 2),
    (16, 64, 64, 6, 1, 2, 3),  # batches of up to 8 tokens
]


class Dequantized:
    """w[e] -> float64 [NOUT, K]: an e4m3 expert stack dequantized one expert at a time (for reference_rows)."""

    def __init__(self, q, scale):
        self.q, self.scale, self.shape = q, scale, q.shape

    def __getitem__(self, e):
        import cupy
        import ml_dtypes

        q = cupy.asnumpy(self.q[e]).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        return q * cupy.asnumpy(self.scale[e]).astype(np.float64)[:, None]


def e4m3_stack(crng, rng, E, nout, k, subnormal=False, expert_spread=True):
    """(q uint8 [E, nout, k], scale fp32 [E, nout]) on the GPU: codes uniform over the finite ones (or over zero and
    the subnormals), row scales around 1 / (44 sqrt(k)) (the codes' RMS is ~44) times 2^-6 .. 2^4 by expert (without
    `expert_spread`: every expert at the same level, so that each adds about as much to a block's output)."""
    import cupy

    q = cupy.empty((E, nout, k), dtype=np.uint8)
    for e in range(E):  # (one expert at a time: the int32 draws of a 48B stack would be 10 GB)
        mag = crng.integers(0, 8 if subnormal else 127, size=(nout, k), dtype=np.int32)  # 0x7F is NaN: never
        q[e] = (mag | (crng.integers(0, 2, size=(nout, k), dtype=np.int32) << 7)).astype(np.uint8)
    base = 1.0 / (44.0 * np.sqrt(k)) * (2.0**9 if subnormal else 1.0)  # (subnormal codes are ~2^-9..2^-6)
    scale = base * np.exp(rng.normal(0, 0.5, size=(E, nout)))
    if expert_spread:
        scale = scale * 2.0 ** rng.integers(-6, 5, size=(E, 1))
    return q, cupy.asarray(scale.astype(np.float32))


def drift(k: int) -> float:
    """Twice the e4m3 tensor cores' worst drift on a K-long sum, as a fraction of |x| @ |w| (test_moe_gemm_wg_w8a8)."""
    return 2 * (k / 32) * 2.0**-14


def h_bound(xr, w13e):
    """Per-element bound on h = SiLU(g) u from the products' drift on g and u (each |x| @ |w| times drift(K),
    carried through SiLU, whose slope is at most 1.1) and one bf16 ulp (2^-7) for each rounding: g's carried
    through SiLU (|SiLU'(g) g u|), u's, SiLU's and h's (|h| each)."""
    inter = w13e.shape[0] // 2
    g, u = xr @ w13e[:inter].T, xr @ w13e[inter:].T
    dg = drift(xr.shape[1]) * (np.abs(xr) @ np.abs(w13e[:inter]).T)
    du = drift(xr.shape[1]) * (np.abs(xr) @ np.abs(w13e[inter:]).T)
    sig = 1 / (1 + np.exp(-g))
    slope = sig * (1 + g * (1 - sig))
    rounding = 2.0**-7 * (np.abs(slope * g * u) + 3 * np.abs(silu(g) * u))
    return 1.1 * dg * (np.abs(u) + du) + np.abs(silu(g)) * du + rounding + 1e-30


def check_drift(got, ref, bound, name):
    bad = ~(np.abs(got - ref) <= bound)
    err = rms_rel(got, ref)
    assert err <= 8e-3 and not bad.any(), (f"{name}: rms rel {err:.3e}, {int(bad.sum())} elements past the drift "
                                           f"bound, worst |err| / bound {np.max(np.abs(got - ref) / bound):.2f}")
