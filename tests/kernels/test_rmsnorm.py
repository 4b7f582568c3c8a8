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
