"""kernels_cu/moe_gemv.cu's gemv_dense (a one-row projection as a GEMV over every warp, its first weight rows loaded
before the programmatic-launch wait) against NumPy float64 on fresh random bf16 inputs:

    y[n] = bf16(x · W[n]ᵀ)      x [1, K], W [N, K] bf16, fp32 sums

Tolerance: the kernel rounds its fp32 sum once to bf16 and the fp32 sum of K products
is off by at most K 2^-24 Σ|x_k w_k| (<= 2^-12 Σ|x_k w_k| up to K = 4096); half an ulp is <= 2^-8 |y|:
|y - ref| <= 2^-8 |ref| + 2^-12 Σ|x w|.
A wrong row or a stale x is off by ~Σ|x w| / sqrt(K), 30-90x that bound at these widths.  Outputs are poisoned
(NaN) first, and written through a column slice of a wider poisoned buffer (as the fused projections pass them):
every element outside the view must stay NaN."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from helpers.gpu import bf16_round, poison, to_gpu_bf16, to_np

pytestmark = pytest.mark.gpu

SHAPES = {  # name: (N, K)
    "qkv-fgb": (12576, 2304),  # the 48B KDA layer's q|k|v|f_a|g_a|b
    "mla-q-kva": (6720, 2304),  # its MLA layers' q|kv_a
    "odd-N-K520": (1001, 520),  # 65 pieces a row (lanes hold 3 or 2), the last unit one row
    "N3-K72": (3, 72),  # fewer units than warps (most warps idle), 9 pieces a row
    "K2560": (4096, 2560),  # MAX_K
}


def _check(got, x, w, what):
    ref, mag = (x @ w.T)[0], (np.abs(x) @ np.abs(w).T)[0]
    bad = ~(np.abs(got - ref) <= 2.0**-8 * np.abs(ref) + 2.0**-12 * mag)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.size} outputs off, first at {np.flatnonzero(bad)[:5]}"


@pytest.mark.parametrize("pre", ["0", "1", "2"])
@pytest.mark.parametrize("config", ["default", "w4-b3"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_gemv_dense_matches_numpy(name, config, pre, monkeypatch):
    """Every variant of the pre-wait loads (KDA_RT_DENSE_GEMV_PRE: 0, 1 or 2 units a warp)."""
    import cupy

    monkeypatch.setenv("KDA_RT_DENSE_GEMV_PRE", pre)

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.gemv import DEFAULT, gemv_dense

    N, K = SHAPES[name]
    cfg = DEFAULT if config == "default" else DEFAULT._replace(warps=4, blocks_per_sm=3)
    rng = np.random.default_rng(zlib.crc32(f"{name}/{config}".encode()))
    x, w = bf16_round(rng.normal(size=(1, K))), bf16_round(rng.normal(size=(N, K)) / np.sqrt(K))
    wide = cupy.empty((1, N + 24), dtype=BF16)
    poison(wide)
    gemv_dense(to_gpu_bf16(x), to_gpu_bf16(w), wide[:, 8:8 + N], cfg=cfg)
    got = to_np(wide)
    assert np.isnan(got[:, :8]).all() and np.isnan(got[:, 8 + N:]).all(), "wrote outside the view"
    assert np.isfinite(got[:, 8:8 + N]).all(), "outputs left unwritten"
    _check(got[:, 8:8 + N], x, w, f"{name}/{config}")


def test_linear_takes_the_gemv_where_it_fits(monkeypatch):
    """gemm.linear sends one row of 4-256 MB of weights with bf16 out to gemv_dense (KDA_RT_DENSE_GEMV=1, the
    default) and to cuBLAS with =0, both within the bound above; two rows, fp32 out or accumulate stay on cuBLAS
    / skinny_gemm (the GEMV is not called); with KDA_RT_DENSE_GEMV_MAX_T=4 2-4 rows take it too."""
    import cupy

    import kda_rt.cuda.ops.gemv as gemv
    from kda_rt.cuda.gemm import linear
    from kda_rt.cuda.ops.check import BF16

    monkeypatch.delenv("KDA_RT_DENSE_GEMV_MAX_T", raising=False)  # (one row by default)
    calls = []
    real = gemv.gemv_dense
    monkeypatch.setattr(gemv, "gemv_dense", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    rng = np.random.default_rng(5)
    N, K = 12576, 2304
    x, w = bf16_round(rng.normal(size=(2, K))), bf16_round(rng.normal(size=(N, K)) / np.sqrt(K))
    xg, wg = to_gpu_bf16(x), to_gpu_bf16(w)
    for flag in ("1", "0"):
        monkeypatch.setenv("KDA_RT_DENSE_GEMV", flag)
        calls.clear()
        out = cupy.empty((1, N), dtype=BF16)
        poison(out)
        linear(xg[:1], wg, out=out)
        assert len(calls) == (flag == "1"), (flag, calls)
        _check(to_np(out), x[:1], w, f"linear, KDA_RT_DENSE_GEMV={flag}")
    monkeypatch.setenv("KDA_RT_DENSE_GEMV", "1")
    calls.clear()
    linear(xg, wg)  # two rows
    linear(xg[:1], wg, out_dtype=np.float32)  # fp32 out
    out = linear(xg[:1], wg)
    linear(xg[:1], wg, out=out, accumulate=True)
    linear(xg[:1, :K // 4], wg[:8, :K // 4].copy())  # 36 KB of weights
    assert len(calls) == 1, calls  # only the plain one-row call
    # KDA_RT_DENSE_GEMV_MAX_T=4 (prepared): 2-4 rows take the GEMV too (within the bound, each row as its one-row
    # launch), 5 rows cuBLAS
    monkeypatch.setenv("KDA_RT_DENSE_GEMV_MAX_T", "4")
    x5 = bf16_round(rng.normal(size=(5, K)))
    x5g = to_gpu_bf16(x5)
    for rows in (2, 4, 5):
        calls.clear()
        out = cupy.empty((rows, N), dtype=BF16)
        poison(out)
        linear(x5g[:rows], wg, out=out)
        assert len(calls) == (rows <= 4), (rows, calls)
        got = to_np(out)
        for m in range(rows):
            _check(got[m:m + 1], x5[m:m + 1], w, f"linear, {rows} rows, row {m}")


@pytest.mark.parametrize("pre", ["1", "2"])
def test_gemv_dense_in_a_pdl_graph_reads_its_input_after_the_wait(pre, monkeypatch):
    """A captured graph with programmatic dependent launch: rmsnorm (which lets the next launch go right after its
    own wait) writes x, gemv_dense reads it.  The GEMV loads weights before its wait, so a read of x before it
    would see the previous replay's x; five replays on new inputs each must all match NumPy."""
    import cupy

    from kda_rt.cuda.ops import pdl
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.gemv import gemv_dense
    from kda_rt.cuda.ops.rmsnorm import rmsnorm

    monkeypatch.setenv("KDA_RT_DENSE_GEMV_PRE", pre)
    rng = np.random.default_rng(9)
    N, K, eps = 12576, 2304, 1e-6
    w = bf16_round(rng.normal(size=(N, K)) / np.sqrt(K))
    wg, ones = to_gpu_bf16(w), cupy.ones(K, dtype=BF16)
    src, x, y = cupy.empty((1, K), dtype=BF16), cupy.empty((1, K), dtype=BF16), cupy.empty((1, N), dtype=BF16)
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        rmsnorm(src, ones, eps, out=x)
        gemv_dense(x, wg, y)
        stream.synchronize()
        with pdl.capturing() as on:  # the launches carry the programmatic attribute only inside this block
            if not on:
                pytest.skip("no programmatic dependent launch here (compute capability < 9.0 or KDA_RT_PDL=0)")
            stream.begin_capture()
            rmsnorm(src, ones, eps, out=x)
            gemv_dense(x, wg, y)
            graph = stream.end_capture()
        for i in range(5):
            s = rng.normal(size=(1, K)) * (i + 1)
            src[...] = to_gpu_bf16(s)
            poison(y)
            stream.synchronize()
            graph.launch(stream)
            stream.synchronize()
            xn = to_np(x)  # the kernel's own normalised row (its rounding is rmsnorm's test's business)
            assert np.allclose(xn, s / np.sqrt(np.mean(s**2) + eps), rtol=2e-2, atol=1e-2), f"replay {i}: rmsnorm"
            _check(to_np(y), xn, w, f"replay {i}")


def test_gemv_dense_refuses_what_it_cannot_run():
    import cupy

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.gemv import MAX_K, gemv_dense

    x, w = cupy.zeros((1, 64), dtype=BF16), cupy.zeros((16, 64), dtype=BF16)
    with pytest.raises(ValueError, match="x must have 1 to 4 rows"):
        gemv_dense(cupy.zeros((5, 64), dtype=BF16), w, cupy.empty((5, 16), dtype=BF16))
    with pytest.raises(ValueError, match="x must have 1 to 4 rows"):
        gemv_dense(cupy.zeros((0, 64), dtype=BF16), w, cupy.empty((0, 16), dtype=BF16))
    with pytest.raises(ValueError, match="out must have shape"):
        gemv_dense(cupy.zeros((2, 64), dtype=BF16), w, cupy.empty((1, 16), dtype=BF16))
    with pytest.raises(ValueError, match="16-byte aligned"):  # rows 68 elements apart
        gemv_dense(cupy.zeros((2, 68), dtype=BF16)[:, :64], w, cupy.empty((2, 16), dtype=BF16))
    with pytest.raises(ValueError, match="K % 8"):
        gemv_dense(cupy.zeros((1, 60), dtype=BF16), cupy.zeros((16, 60), dtype=BF16), cupy.empty((1, 16), dtype=BF16))
    with pytest.raises(ValueError, match="K % 8"):
        big = MAX_K + 8
        gemv_dense(cupy.zeros((1, big), dtype=BF16), cupy.zeros((16, big), dtype=BF16), cupy.empty((1, 16), dtype=BF16))
    with pytest.raises(ValueError, match="contiguous"):
        gemv_dense(x, w, cupy.empty((1, 32), dtype=BF16)[:, ::2])
    with pytest.raises((ValueError, TypeError)):
        gemv_dense(x, w, cupy.empty((1, 16), dtype=np.float32))



E4M3_SHAPES = {  # name: (N, K), K % 16 == 0 (16 e4m3 weights a 16-byte piece)
    "qkv-fgb": (12576, 2304),  # 144 pieces a row: lanes hold 5 or 4
    "mla-q-kva": (6720, 2304),
    "odd-N-K528": (1001, 528),  # 33 pieces a row (lane 0 holds two), the last unit one row
    "N3-K80": (3, 80),  # fewer units than warps, 5 pieces a row
    "K2560": (4096, 2560),  # MAX_K
    "o_proj-K4096": (2304, 4096),  # the 48B shape's o_proj (KDA_RT_FP8_DECODE_GEMV): 256 pieces, 8 a lane
    "K5120": (1024, 5120),  # MAX_K_E4M3: 320 pieces, 10 a lane (as bf16's MAX_K)
}


@pytest.mark.parametrize("pre", ["0", "1"])
@pytest.mark.parametrize("name", list(E4M3_SHAPES))
def test_gemv_dense_e4m3_matches_numpy(name, pre, monkeypatch):
    """e4m3 weights with a scale a row (moe_gemv.cu WFMT = 1, loader/quant.quantize_rows) against float64 NumPy of
    x · (float(q) · scale)ᵀ: the same bound as the bf16 kernel's (the e4m3 -> fp32 conversion is exact and the
    scale adds one fp32 rounding to the sum).  Rows of very different magnitudes (scales from 2^-12 to 2^6) and a
    row of zeros (scale 1), so a scale applied to the wrong row or not at all is off by orders of magnitude; a
    swapped e4m3 pair within a word is off by ~Σ|x w| / sqrt(K), far above the bound.  Outputs poisoned first,
    written through a column slice of a wider buffer."""
    import cupy

    monkeypatch.setenv("KDA_RT_DENSE_GEMV_PRE", pre)

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.gemv import gemv_dense
    from kda_rt.loader.quant import dequantize_rows, quantize_rows

    N, K = E4M3_SHAPES[name]
    rng = np.random.default_rng(zlib.crc32(f"e4m3/{name}".encode()))
    x = bf16_round(rng.normal(size=(1, K)))
    w = rng.normal(size=(N, K)) / np.sqrt(K) * 2.0 ** rng.integers(-12, 7, size=(N, 1))
    w[N // 2] = 0.0
    q, scale = quantize_rows(w, "w")
    assert scale[N // 2] == 1.0
    wq = dequantize_rows(q, scale).astype(np.float64)
    wide = cupy.empty((1, N + 24), dtype=BF16)
    poison(wide)
    gemv_dense(to_gpu_bf16(x), cupy.asarray(q.view(np.uint8)), wide[:, 8:8 + N], scale=cupy.asarray(scale))
    got = to_np(wide)
    assert np.isnan(got[:, :8]).all() and np.isnan(got[:, 8 + N:]).all(), "wrote outside the view"
    assert np.isfinite(got[:, 8:8 + N]).all(), "outputs left unwritten"
    assert (got[0, 8 + N // 2] == 0.0), "the zero row's output is not 0"
    _check(got[:, 8:8 + N], x, wq, f"e4m3/{name}")


def test_gemv_dense_e4m3_refusals():
    """Bad e4m3 calls are refused by name: bf16 weights with a scale, K not a multiple of 16, a scale of the wrong
    length or dtype, K past MAX_K_E4M3."""
    import cupy

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.gemv import MAX_K_E4M3, gemv_dense

    x, out = cupy.ones((1, 64), BF16), cupy.empty((1, 4), BF16)
    with pytest.raises(TypeError, match="weight must have dtype uint8"):
        gemv_dense(x, cupy.ones((4, 64), BF16), out, scale=cupy.ones(4, np.float32))
    with pytest.raises(ValueError, match="K % 16 == 0"):
        gemv_dense(cupy.ones((1, 72), BF16), cupy.ones((4, 72), np.uint8), out, scale=cupy.ones(4, np.float32))
    with pytest.raises(ValueError, match="scale must have shape"):
        gemv_dense(x, cupy.ones((4, 64), np.uint8), out, scale=cupy.ones(5, np.float32))
    with pytest.raises(TypeError, match="scale must have dtype float32"):
        gemv_dense(x, cupy.ones((4, 64), np.uint8), out, scale=cupy.ones(4, np.float16))
    big = MAX_K_E4M3 + 16  # (a multiple of 16: refused for its width alone)
    with pytest.raises(ValueError, match=f"K <= {MAX_K_E4M3}"):
        gemv_dense(cupy.ones((1, big), BF16), cupy.ones((4, big), np.uint8), out, scale=cupy.ones(4, np.float32))


MULTI_SHAPES = {  # name: (N, K, e4m3)
    "qkv-fgb-e4m3": (12576, 2304, True),
    "o_proj-K4096-e4m3": (2304, 4096, True),
    "K5120-e4m3": (1024, 5120, True),  # MAX_K_E4M3: the 4-row build's 242 registers
    "odd-N-K528-e4m3": (1001, 528, True),
    "mla-q-kva-bf16": (6720, 2304, False),
    "K2560-bf16": (4096, 2560, False),
    "N3-K72-bf16": (3, 72, False),
}


@pytest.mark.parametrize("pre", ["0", "1", "2"])
@pytest.mark.parametrize("rows", [2, 3, 4])
@pytest.mark.parametrize("name", list(MULTI_SHAPES))
def test_gemv_dense_several_rows(name, rows, pre, monkeypatch):
    """x of 2-4 rows in one launch (moe_gemv.cu MROWS; the fp8 decode GEMVs of up to 4 sequences,
    KDA_RT_FP8_DECODE_GEMV_MAX_T): every row within the one-row bound of float64 NumPy and bit for bit what a one-row
    launch gives for that row (the same FMA order, so a sequence's outputs do not depend on the rows beside it).
    x's rows are a column slice of a wider buffer (rows 64 elements further apart) and out's rows too; rows of very
    different magnitudes (x rows scaled by 2^-6 .. 2^6, so a row's sums landing in another row's output are off by
    orders of magnitude); outputs poisoned first, every element outside the views must stay NaN.  Every
    KDA_RT_DENSE_GEMV_PRE (2, two row buffers, spills with several rows: those builds take 1)."""
    import cupy

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.gemv import gemv_dense
    from kda_rt.loader.quant import dequantize_rows, quantize_rows

    monkeypatch.setenv("KDA_RT_DENSE_GEMV_PRE", pre)
    N, K, e4m3 = MULTI_SHAPES[name]
    rng = np.random.default_rng(zlib.crc32(f"rows/{name}/{rows}".encode()))
    x = bf16_round(rng.normal(size=(rows, K)) * 2.0 ** rng.integers(-6, 7, size=(rows, 1)))
    if e4m3:
        w = rng.normal(size=(N, K)) / np.sqrt(K) * 2.0 ** rng.integers(-12, 7, size=(N, 1))
        q, scale = quantize_rows(w, "w")
        wv, wg, kw = dequantize_rows(q, scale).astype(np.float64), cupy.asarray(q.view(np.uint8)), {
            "scale": cupy.asarray(scale)}
    else:
        wv = bf16_round(rng.normal(size=(N, K)) / np.sqrt(K))
        wg, kw = to_gpu_bf16(wv), {}
    xs = cupy.zeros((rows, K + 64), dtype=BF16)
    xs[:, 32:32 + K] = to_gpu_bf16(x)
    wide = cupy.empty((rows, N + 24), dtype=BF16)
    poison(wide)
    gemv_dense(xs[:, 32:32 + K], wg, wide[:, 8:8 + N], **kw)
    got = to_np(wide)
    assert np.isnan(got[:, :8]).all() and np.isnan(got[:, 8 + N:]).all(), "wrote outside the view"
    assert np.isfinite(got[:, 8:8 + N]).all(), "outputs left unwritten"
    for m in range(rows):
        _check(got[m:m + 1, 8:8 + N], x[m:m + 1], wv, f"{name} row {m}")
        one = cupy.empty((1, N), dtype=BF16)
        poison(one)
        gemv_dense(xs[m:m + 1, 32:32 + K], wg, one, **kw)
        assert cupy.array_equal(one.view(np.uint16), wide[m:m + 1, 8:8 + N].view(np.uint16)), (
            f"{name}: row {m} of the {rows}-row launch differs from its one-row launch")
