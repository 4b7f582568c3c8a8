"""ops/dense_w8a8 (the dense prefill projections of fp8 models on e4m3 products): the weights' e4m3 copies against
the host quantizer, and the GEMM against NumPy float64 on the dequantized sources and weights, into NaN-poisoned
outputs, on fresh random inputs.

Bounds (as tests/kernels/test_moe_gemm_tc.py's w8a8 cases, whose helpers these are): Hopper's e4m3 tensor cores keep
~14 bits of their partial sums, so each element may drift by drift(K) of |x| @ |w| (twice the worst case), plus one
bf16 ulp (2^-7 relative) for each rounding the kernel and the reference may take apart; and the RMS over all
elements <= 8e-3 (a wrong scale, row or column fails it)."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.gpu import bf16_round, to_np

pytestmark = pytest.mark.gpu

CASES = {  # name: (T, K, NOUT, fuse_silu)
    "T300-K256-N384": (300, 256, 384, False),  # NOUT padded to 512: the padding's columns unread
    "T1030-K384-N512": (1030, 384, 512, False),  # a partial last tile, 3 k steps
    "T257-K256-silu-2x200": (257, 256, 400, True),  # gate|up, each half padded 200 -> 256
    "T64-K128-N256": (64, 128, 256, False),  # one k step (the demo model's hidden size)
}


def _skip_unless_hopper():
    from kda_rt.cuda.ops.compile import device_arch

    if device_arch() != "sm_90a":
        pytest.skip("the e4m3 x e4m3 GEMM runs on wgmma (sm_90a)")


def _dequant(codes, scale):
    import cupy
    import ml_dtypes

    q = cupy.asnumpy(codes).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return q * cupy.asnumpy(scale).astype(np.float64)[..., None]


@pytest.mark.parametrize("fuse_silu", [False, True])
def test_quantize_dense_matches_host_rows(fuse_silu):
    """The e4m3 copy holds the host quantizer's codes and scales row for row (loader/quant.quantize_rows), and zero
    codes with zero scales on the padding (each half of gate|up padded on its own)."""
    import cupy

    from helpers.gpu import to_gpu_bf16
    from kda_rt.cuda.ops.dense_w8a8 import quantize_dense
    from kda_rt.loader.quant import quantize_rows

    _skip_unless_hopper()
    rng = np.random.default_rng(11)
    nout, K = (400, 256) if fuse_silu else (300, 384)
    w_np = bf16_round(rng.normal(size=(nout, K)) * np.exp(rng.normal(0, 2, size=(nout, 1))))
    q = quantize_dense(to_gpu_bf16(w_np), "w", fuse_silu=fuse_silu)
    codes, scale = cupy.asnumpy(q.codes[0]), cupy.asnumpy(q.scale[0])
    want_q, want_s = quantize_rows(w_np.astype(np.float32), "w")
    want_q = want_q.view(np.uint8)  # (e4m3 values -> their codes)
    if fuse_silu:
        half, ph = nout // 2, codes.shape[0] // 2
        assert ph % 256 == 0 and q.nout == nout
        rows = np.r_[0:half, ph:ph + half]
        pad = np.r_[half:ph, ph + half:2 * ph]
    else:
        assert codes.shape[0] % 256 == 0 and q.nout == nout
        rows, pad = np.arange(nout), np.arange(nout, codes.shape[0])
    np.testing.assert_array_equal(codes[rows], want_q)
    np.testing.assert_array_equal(scale[rows], want_s)
    assert not codes[pad].any() and not scale[pad].any(), "padding rows not zero"


@pytest.mark.parametrize("name", list(CASES))
def test_dense_w8a8_against_numpy(name):
    """dense_w8a8 with x quantized inside (quantized=False) and with codes made before (quantized=True, as the norm
    hands them over): the same output bit for bit, within the drift bound of float64 products of the dequantized
    sources and weights (SiLU · up: tests/helpers/moe_gemm.h_bound).  Outputs poisoned first; the identity
    plans of other sizes run in between (their cache)."""
    import cupy

    from helpers.gpu import to_gpu_bf16
    from helpers.moe_gemm import check_drift, drift, h_bound
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.dense_w8a8 import dense_w8a8, quantize_dense
    from kda_rt.cuda.ops.quant import quantize_activations_e4m3
    from kda_rt.reference.layers import silu

    _skip_unless_hopper()
    T, K, nout, fuse = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    x_np = bf16_round(rng.normal(size=(T, K)) * np.exp(rng.normal(0, 1, size=(T, 1))))
    w_np = bf16_round(rng.normal(size=(nout, K)) * K**-0.5)
    x = to_gpu_bf16(x_np)
    w8 = quantize_dense(to_gpu_bf16(w_np), "w", fuse_silu=fuse)
    padded = w8.codes.shape[1] // (2 if fuse else 1)
    width = nout // 2 if fuse else nout
    outs = []
    for quantized in (False, True):
        out = cupy.full((T, padded), np.nan, dtype=BF16)
        q = cupy.full((T, K), 0x7F, dtype=np.uint8)
        s = cupy.full(T, np.nan, dtype=np.float32)
        if quantized:
            quantize_activations_e4m3(x, out=q, scale_out=s)
            dense_w8a8(None, w8, out=out, codes=(q, s), quantized=True)
        else:
            dense_w8a8(x, w8, out=out, codes=(q, s))
            dense_w8a8(x[: T // 2 + 1], w8, out=cupy.empty((T // 2 + 1, padded), BF16),  # another size's plan
                       codes=(q[: T // 2 + 1], s[: T // 2 + 1]))
        outs.append((to_np(out), _dequant(q, s)))
    (got, xr), (again, _) = outs
    np.testing.assert_array_equal(got[:, :width], again[:, :width])
    got = got[:, :width]
    assert np.all(np.isfinite(got)), f"{name}: output columns left unwritten (NaN)"
    wr = _dequant(w8.codes[0], w8.scale[0])
    if fuse:
        ph = w8.codes.shape[1] // 2
        w13 = np.concatenate([wr[:width], wr[ph:ph + width]])
        g, u = bf16_round(xr @ w13[:width].T), bf16_round(xr @ w13[width:].T)
        ref = bf16_round(bf16_round(silu(g)) * u)
        check_drift(got, ref, h_bound(xr, w13), name)
    else:
        wr = wr[:nout]
        ref = bf16_round(xr @ wr.T)
        check_drift(got, ref, drift(K) * (np.abs(xr) @ np.abs(wr).T) + 2.0**-7 * np.abs(ref) + 1e-30, name)
