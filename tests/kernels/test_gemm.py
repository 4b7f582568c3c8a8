"""kda_rt/cuda/gemm.py (cuBLAS via ctypes) against NumPy, and inside CUDA-graph capture.

Tolerance: bf16 inputs are exact in fp32; cuBLAS accumulates in fp32 (order differs from NumPy's
float64) and rounds the output to bf16 -> relative RMS error ~2^-9 = 2e-3; we allow 5e-3."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.gpu import bf16_round, poison, rms_rel, to_gpu_bf16, to_np

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("M, N, K", [(1, 4096, 2304), (33, 576, 2304), (300, 2304, 4096)], ids=str)
@pytest.mark.parametrize("out_dtype", ["bf16", "f32"])
def test_linear(M, N, K, out_dtype):
    import cupy

    from kda_rt.cuda.gemm import linear

    rng = np.random.default_rng(M + N)
    x, w = bf16_round(rng.normal(size=(M, K))), bf16_round(rng.normal(size=(N, K)) / np.sqrt(K))
    out = cupy.empty((M, N), dtype=to_gpu_bf16(x[:1, :1]).dtype if out_dtype == "bf16" else np.float32)
    poison(out)
    linear(to_gpu_bf16(x), to_gpu_bf16(w), out=out)
    err = rms_rel(to_np(out), x @ w.T)
    assert err < (5e-3 if out_dtype == "bf16" else 1e-5), err


def test_linear_in_cuda_graph():
    import cupy

    from kda_rt.cuda.gemm import linear

    rng = np.random.default_rng(7)
    x, w = bf16_round(rng.normal(size=(8, 256))), bf16_round(rng.normal(size=(128, 256)))
    xg, wg = to_gpu_bf16(x), to_gpu_bf16(w)
    out = cupy.empty((8, 128), dtype=np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        linear(xg, wg, out=out)  # warm up outside capture (handle, workspace)
        stream.begin_capture()
        linear(xg, wg, out=out)
        graph = stream.end_capture()
    poison(out)
    x2 = bf16_round(rng.normal(size=(8, 256)))
    xg[...] = to_gpu_bf16(x2)
    graph.launch(stream)
    stream.synchronize()
    assert rms_rel(to_np(out), x2 @ w.T) < 1e-5


def test_linear_row_strided_views():
    """x and out as column slices of wider buffers (fused projections)."""
    import cupy

    from kda_rt.cuda.gemm import linear

    rng = np.random.default_rng(3)
    big = bf16_round(rng.normal(size=(5, 300)))
    w = bf16_round(rng.normal(size=(64, 128)))
    xg = to_gpu_bf16(big)
    out = cupy.empty((5, 200), dtype=np.float32)
    poison(out)
    linear(xg[:, 100:228], to_gpu_bf16(w), out=out[:, 50:114])
    assert rms_rel(to_np(out[:, 50:114]), big[:, 100:228] @ w.T) < 1e-5
