"""kernels_cu/skinny_gemm.cu (ops/skinny_gemm.py): y = x · Wᵀ for up to 8 rows (skinny_gemm, and on sm_90+
skinny_gemm_staged where a CTA's weight rows fit in shared memory) and for 9 to 32 rows on sm_90+
(skinny_gemm_ws: a producer warp streams the weights and x through a ring in shared memory, and skinny_gemm_cl:
x in shared memory, both with K split over a thread-block cluster), on fresh random inputs against
float64 NumPy, every output element checked, outputs poisoned first.

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
WIDE_SHAPES = [  # (M, K, N): batch-9 to batch-32 decode projections (skinny_gemm_cl), and edge shapes
    (32, 4096, 2304),  # o_proj: 64 features per CTA, K over clusters of 4
    (16, 4096, 2304),  # two n-tiles
    (9, 2304, 288),    # f_a | g_a | b: 32 features per CTA, clusters of 6, the fewest rows
    (32, 2304, 288),
    (24, 2304, 768),   # the split router's logits (fp32 out in the model), a partial last n-tile
    (17, 4096, 1024),  # a ragged row count
    (31, 512, 64),     # one feature block: one cluster
    (20, 1024, 4096),  # the widest output it takes
    (20, 4096, 4096),  # 16 ring steps a CTA in skinny_gemm_ws (the ring wraps past its second round)
]


def _reference(x, w):
    return x @ w.T, np.abs(x) @ np.abs(w).T


@pytest.mark.parametrize("M, K, N", SHAPES, ids=str)
@pytest.mark.parametrize("out_dtype", ["bf16", "f32"])
@pytest.mark.parametrize("staged", ["1", "2", "0"])
def test_skinny_gemm_matches_numpy(M, K, N, out_dtype, staged, monkeypatch):
    import cupy

    monkeypatch.setenv("KDA_RT_SKINNY_STAGED", staged)
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


@pytest.mark.parametrize("M, K, N", WIDE_SHAPES, ids=str)
@pytest.mark.parametrize("out_dtype", ["bf16", "f32"])
@pytest.mark.parametrize("form", ["ws", "cl"])
def test_skinny_gemm_wide_matches_numpy(M, K, N, out_dtype, form, monkeypatch):
    """Both forms of the 9-32-row kernel: skinny_gemm_ws (the producer warp's ring; KDA_RT_SKINNY_WS=1, where its k
    slices are whole 128-wide steps) and skinny_gemm_cl (KDA_RT_SKINNY_WS=0, or a slice that is not: (31, 512, 64)),
    the form that ran checked."""
    _check_wide(M, K, N, out_dtype, form, monkeypatch)


def _check_wide(M, K, N, out_dtype, form, monkeypatch):
    import cupy

    import kda_rt.cuda.ops.skinny_gemm as sk
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.compile import clusters_supported
    from kda_rt.cuda.ops.skinny_gemm import fits, skinny_gemm, wide_plan

    if not clusters_supported():
        pytest.skip("skinny_gemm_cl needs thread-block clusters (sm_90+)")
    monkeypatch.setenv("KDA_RT_SKINNY_WS", "1" if form == "ws" else "0")
    monkeypatch.delenv("KDA_RT_SKINNY_WS_MIN_K", raising=False)
    plan = wide_plan(M, N, K)
    assert plan is not None
    want = "skinny_gemm_ws" if form == "ws" and (K // plan[1]) % 128 == 0 else "skinny_gemm_cl"
    ran = []
    for name in ("_ws_kernel", "_wide_kernel"):
        real = getattr(sk, name)
        monkeypatch.setattr(sk, name, lambda *a, _real=real, _name=name: ran.append(_name) or _real(*a))
    rng = np.random.default_rng(M * 7919 + K + N + 1)
    x, w = bf16_round(rng.normal(size=(M, K))), bf16_round(rng.normal(size=(N, K)) / np.sqrt(K))
    xg, wg = to_gpu_bf16(x), to_gpu_bf16(w)
    out = cupy.empty((M, N), dtype=BF16 if out_dtype == "bf16" else np.float32)
    ref, mag = _reference(x, w)
    bound = 1e-5 * mag + (2.0**-8 * np.abs(ref) if out_dtype == "bf16" else 0.0)
    runs = []
    for _ in range(2):  # twice: the same values (the cluster reduction adds in a fixed order)
        poison(out)
        assert fits(xg, wg, out, accumulate=False)
        skinny_gemm(xg, wg, out)
        got = to_np(out)
        bad = ~(np.abs(got - ref) <= bound)
        assert not bad.any(), f"{int(bad.sum())} of {got.size} elements off, max err {np.nanmax(np.abs(got - ref)):.3e}"
        runs.append(got)
    assert np.array_equal(runs[0], runs[1]), "not deterministic"
    assert ran == [{"skinny_gemm_ws": "_ws_kernel", "skinny_gemm_cl": "_wide_kernel"}[want]] * 2, (want, ran)


STAGED_SHAPES = [  # (M, K, N) that skinny_gemm_staged takes on an H200 (132 SMs)
    (1, 4096, 2304),   # o_proj: 17 or 18 rows a CTA (two m-tiles, the second ragged)
    (8, 4096, 2304),
    (4, 2304, 288),    # 2 or 3 rows a CTA
    (6, 256, 16),      # fewer features than SMs: one row a CTA
    (2, 2048, 4096),   # 31 or 32 rows a CTA: two full m-tiles
]


@pytest.mark.parametrize("M, K, N", STAGED_SHAPES, ids=str)
def test_skinny_gemm_staged_equals_the_streaming_kernel(M, K, N, monkeypatch):
    """skinny_gemm_staged takes each warp's k slice in the streaming kernel's chunk order and sums the warps in
    the same order: the same bits, and both within the NumPy bound."""
    import cupy

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.compile import clusters_supported, sm_count
    from kda_rt.cuda.ops.skinny_gemm import skinny_gemm, staged_plan

    if not clusters_supported():
        pytest.skip("skinny_gemm_staged runs on sm_90+ only")
    assert staged_plan(N, K, sm_count(cupy.cuda.Device().id)) is not None
    rng = np.random.default_rng(M * 31 + K + N)
    x, w = bf16_round(rng.normal(size=(M, K))), bf16_round(rng.normal(size=(N, K)) / np.sqrt(K))
    xg, wg = to_gpu_bf16(x), to_gpu_bf16(w)
    got = {}
    for staged in ("1", "2", "0"):  # cp.async pieces, bulk copies, the streaming kernel
        monkeypatch.setenv("KDA_RT_SKINNY_STAGED", staged)
        out = cupy.empty((M, N), dtype=BF16)
        poison(out)
        skinny_gemm(xg, wg, out)
        got[staged] = to_np(out)
    ref, mag = _reference(x, w)
    bad = ~(np.abs(got["1"] - ref) <= 1e-5 * mag + 2.0**-8 * np.abs(ref))
    assert not bad.any(), f"{int(bad.sum())} of {ref.size} elements off"
    assert np.array_equal(got["1"], got["0"]), "staged and streaming kernels differ"
    assert np.array_equal(got["2"], got["0"]), "staged (bulk copies) and streaming kernels differ"


@pytest.mark.parametrize("M", [6, 24])
def test_skinny_gemm_strided_rows_and_the_linear_switch(M, monkeypatch):
    """x and out as column slices of wider buffers (as the fused projections pass them), through
    gemm.linear, against the cuBLAS path of the same call (KDA_RT_SKINNY=0) and NumPy; 24 rows run
    skinny_gemm_ws on sm_90+ (x's tensor map with rows K + 64 elements apart)."""
    import cupy

    from kda_rt.cuda.gemm import linear
    from kda_rt.cuda.ops.check import BF16

    rng = np.random.default_rng(11 + M)
    K, N = 2304, 576
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


@pytest.mark.parametrize("M, K, N, accumulate", [(33, 2304, 288, False), (1, 2304, 12288, False), (4, 128, 4096, False),
                                                 (4, 2304, 8, False), (4, 2304, 288, True), (16, 2304, 12288, False),
                                                 (16, 2304, 48, False), (16, 96, 64, False), (16, 9216, 2304, False)],
                         ids=str)
def test_skinny_gemm_refuses_what_it_cannot_run(M, K, N, accumulate):
    """More than 32 rows, more than 4096 outputs (q|k|v, lm_head: cuBLAS streams those as fast), K not a
    multiple of 256 with up to 8 rows (the f_b / g_b rank-128 projections) or not a multiple of a warp's
    32-wide chunks with more, K above 4096 with more than 8 rows (the dense down: cuBLAS was faster), N not a
    multiple of 16 (of 32 with more than 8 rows), and accumulate=True stay on cuBLAS."""
    import cupy

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.skinny_gemm import fits

    x, w = cupy.zeros((M, K), dtype=BF16), cupy.zeros((N, K), dtype=BF16)
    assert not fits(x, w, cupy.zeros((M, N), dtype=BF16), accumulate)
