"""kernels_cu/rmsnorm.cu against NumPy: y = bf16(bf16(h·rsqrt(mean(h²)+eps))·w), h = x (+ residual).

Tolerance: the kernel and the reference round at the same points, so the only differences are
fp32 summation order in mean(h²) -> at most 1 bf16 ulp of y: rtol 8e-3 (2^-7), atol 1e-6."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.gpu import assert_close, bf16_round, poison, to_gpu_bf16, to_np

pytestmark = pytest.mark.gpu


def reference(x, w, eps, residual=None):
    h = bf16_round(x + residual) if residual is not None else x
    inv = 1.0 / np.sqrt(np.mean(h.astype(np.float32) ** 2, axis=-1, keepdims=True) + eps)
    return bf16_round(bf16_round(h * inv) * w), h


@pytest.mark.parametrize("T, D", [(1, 2304), (37, 2304), (5, 128), (3, 512)], ids=lambda v: str(v))
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "residual"])
def test_rmsnorm(T, D, fused):
    from kda_rt.cuda.ops.rmsnorm import rmsnorm

    rng = np.random.default_rng(T * D + fused)
    x = bf16_round(rng.normal(size=(T, D)) * 3)
    w = bf16_round(1 + 0.1 * rng.normal(size=D))
    r = bf16_round(rng.normal(size=(T, D))) if fused else None
    ref, h = reference(x, w, 1e-5, r)
    xg, wg = to_gpu_bf16(x), to_gpu_bf16(w)
    rg = to_gpu_bf16(r) if fused else None
    out = to_gpu_bf16(np.zeros((T, D)))
    poison(out)
    rmsnorm(xg, wg, 1e-5, residual=rg, out=out)
    assert_close(to_np(out), ref, atol=1e-6, rtol=8e-3, name="y")
    if fused:
        assert np.array_equal(to_np(rg), h), "residual must become bf16(x + residual) exactly"


@pytest.mark.parametrize("T, D", [(37, 2304), (300, 128), (4, 512)], ids=lambda v: str(v))
def test_rmsnorm_e4m3_out(T, D):
    """e4m3_out (rmsnorm.cu E4M3_OUT, the MoE's FP8 prefill sources): y as without it, bit for bit, and its rows'
    codes and scales exactly the host quantizer's of that y (loader/quant.quantize_rows, which the GEMMs' own
    quantizer also matches); a row of zeros takes scale 1 and zero codes; a row whose input holds an inf gets a NaN
    scale and the other rows their own codes.  Codes and scales poisoned first."""
    import cupy

    from kda_rt.cuda.ops.compile import arch_number, device_arch
    from kda_rt.cuda.ops.rmsnorm import rmsnorm
    from kda_rt.loader.quant import quantize_rows

    if arch_number(device_arch()) < 89:
        pytest.skip("e4m3 codes need sm_89 or newer")
    rng = np.random.default_rng(T + D)
    x = bf16_round(rng.normal(size=(T, D)) * 3 * 2.0 ** rng.integers(-8, 8, size=(T, 1)))
    x[1] = 0.0  # a row of zeros (its residual too, below)
    w = bf16_round(1 + 0.1 * rng.normal(size=D))
    r = bf16_round(rng.normal(size=(T, D)))
    r[1] = 0.0
    plain = to_gpu_bf16(np.zeros((T, D)))
    rmsnorm(to_gpu_bf16(x), to_gpu_bf16(w), 1e-5, residual=to_gpu_bf16(r), out=plain)
    out = to_gpu_bf16(np.zeros((T, D)))
    poison(out)
    q = cupy.full((T, D), 0x7F, dtype=np.uint8)
    s = cupy.full(T, np.nan, dtype=np.float32)
    rmsnorm(to_gpu_bf16(x), to_gpu_bf16(w), 1e-5, residual=to_gpu_bf16(r), out=out, e4m3_out=(q, s))
    y = to_np(out)
    assert np.array_equal(y, to_np(plain)), "y moved with e4m3_out"
    qh, sh = quantize_rows(y, "y", reciprocal=True)  # (the activations' rule)
    assert np.array_equal(cupy.asnumpy(q), qh.view(np.uint8)), "codes differ from quantize_rows of y"
    assert np.array_equal(cupy.asnumpy(s).view(np.uint32), sh.view(np.uint32)), "scales differ"
    assert sh[1] == 1.0 and not cupy.asnumpy(q)[1].any(), "a zero row: scale 1, zero codes"
    x_bad = x.copy()
    x_bad[2, D // 3] = np.inf
    s[:] = np.nan
    rmsnorm(to_gpu_bf16(x_bad), to_gpu_bf16(w), 1e-5, residual=to_gpu_bf16(r), out=out, e4m3_out=(q, s))
    s_np = cupy.asnumpy(s)
    keep = np.arange(T) != 2
    assert np.isnan(s_np[2]), "a row with a non-finite value must get a NaN scale"
    assert np.array_equal(s_np[keep].view(np.uint32), sh[keep].view(np.uint32)), "the other rows' scales moved"
    assert np.array_equal(cupy.asnumpy(q)[keep], qh.view(np.uint8)[keep]), "the other rows' codes moved"
