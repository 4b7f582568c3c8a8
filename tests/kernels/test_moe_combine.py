"""kernels_cu/moe_align.cu moe_combine against a float64 NumPy gather-sum on random inputs.

    out[t] = bf16( shared[t] + Σ_k w[t, k] · y[pair_pos[t·A + k]] )     (y bf16, fp32 sum in k order)

shared: none, a separate [T, D] fp32 input, or row pair_pos[t·(A+1) + A] of y (shared expert in the
stacks).  Check: |out - ref| ≤ 2^-8·|ref| + 1e-6 (one bf16 rounding of an fp32 sum).
Letters: T tokens, A active experts, N pairs, D hidden."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.gpu import assert_close, bf16_round, poison, to_gpu_bf16, to_np

pytestmark = pytest.mark.gpu

CASES = {"T1-D2304-A8-in_y": (1, 2304, 8, "in_y"), "T33-D2304-A8-sep": (33, 2304, 8, "separate"),
         "T300-D2304-A8-none": (300, 2304, 8, "none"), "T7-D132-A16-in_y": (7, 132, 16, "in_y"),
         "T1000-D2304-A8-in_y": (1000, 2304, 8, "in_y")}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_combine(name):
    import cupy

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_align import moe_combine

    T, D, A, mode = CASES[name]
    rng = np.random.default_rng(len(name) + T)
    pairs = A + 1 if mode == "in_y" else A
    N = T * pairs
    y = bf16_round(rng.normal(size=(N, D)))  # the grouped GEMM's bf16 expert rows
    pos = rng.permutation(N).astype(np.int32)
    w = rng.uniform(0.05, 1.0, size=(T, A)).astype(np.float32)
    shared = rng.normal(size=(T, D)).astype(np.float32) if mode == "separate" else None
    ref = np.einsum("tk,tkd->td", w.astype(np.float64), y.astype(np.float64)[pos.reshape(T, pairs)[:, :A]])
    if mode == "in_y":
        ref += y.astype(np.float64)[pos.reshape(T, pairs)[:, A]]
    elif shared is not None:
        ref += shared
    out = cupy.empty((T, D), dtype=BF16)
    poison(out)
    moe_combine(to_gpu_bf16(y), cupy.asarray(pos), cupy.asarray(w), None if shared is None else cupy.asarray(shared),
                shared_in_y=mode == "in_y", out=out)
    assert_close(to_np(out), ref, atol=1e-6, rtol=2.0**-8, name=name)


if __name__ == "__main__":
    for case in CASES:
        test_moe_combine(case)
    print("ok")
