"""kernels_cu/moe_align.cu moe_combine against a float64 NumPy gather-sum on random inputs.

    out[t] = bf16( shared[t] + Σ_k w[t, k] · y[pair_pos[t·A + k]] )     (y bf16, fp32 sum in k order)

shared: none, a separate [T, D] fp32 input, or row pair_pos[t·(A+1) + A] of y (shared expert in the
stacks).  Check: |out - ref| ≤ 2^-8·|ref| + 1e-6 (one bf16 rounding of an fp32 sum).

moe_combine(norm=...) (moe_combine_norm: the combine, the residual add and the next RMSNorm in one launch)
against moe_combine followed by rmsnorm(residual=...) on the same inputs: the new residual stream bit for
bit (same roundings), the normalised output equal except where the fp32 mean of squares, summed in another
order, moves a value across a bf16 rounding boundary (≤ 1 bf16 ulp, on ≤ 1% of the entries).
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


NORM_CASES = {"T1-D2304-A8-in_y": (1, 2304, 8, "in_y"), "T32-D2304-A8-in_y": (32, 2304, 8, "in_y"),
              "T5-D2304-A8-sep": (5, 2304, 8, "separate"), "T300-D256-A6-none": (300, 256, 6, "none"),
              "T3-D4096-A8-in_y": (3, 4096, 8, "in_y"), "T9-D160-A16-in_y": (9, 160, 16, "in_y")}


@pytest.mark.parametrize("name", list(NORM_CASES))
def test_moe_combine_norm_equals_combine_then_rmsnorm(name):
    import cupy

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_align import NormAfter, moe_combine
    from kda_rt.cuda.ops.rmsnorm import rmsnorm

    T, D, A, mode = NORM_CASES[name]
    rng = np.random.default_rng(len(name) * 7 + T)
    pairs = A + 1 if mode == "in_y" else A
    N = T * pairs
    y = to_gpu_bf16(rng.normal(size=(N, D)) * 0.5)
    pos = cupy.asarray(rng.permutation(N).astype(np.int32))
    w = cupy.asarray(rng.uniform(0.05, 1.0, size=(T, A)).astype(np.float32))
    shared = cupy.asarray(rng.normal(size=(T, D)).astype(np.float32)) if mode == "separate" else None
    residual = rng.normal(size=(T, D)) * 3.0
    norm_w = to_gpu_bf16(rng.uniform(0.5, 1.5, size=D))
    eps = 1e-6
    # reference: the two-kernel path
    res_ref = to_gpu_bf16(residual)
    delta = moe_combine(y, pos, w, shared, shared_in_y=mode == "in_y")
    y_ref = rmsnorm(delta, norm_w, eps, residual=res_ref)
    # fused
    res = to_gpu_bf16(residual)
    out = cupy.empty((T, D), dtype=BF16)
    poison(out)
    moe_combine(y, pos, w, shared, shared_in_y=mode == "in_y", out=out, norm=NormAfter(res, norm_w, eps))
    np.testing.assert_array_equal(to_np(res), to_np(res_ref))  # the residual stream: same roundings
    got, want = to_np(out), to_np(y_ref)
    assert np.all(np.isfinite(got))
    ulp = np.abs(want) * 2.0**-7 + 1e-30  # one bf16 ulp (8 significant bits) at |want|
    assert np.all(np.abs(got - want) <= ulp), f"{name}: more than one bf16 ulp from combine + rmsnorm"
    assert np.mean(got != want) <= 0.01, f"{name}: {np.mean(got != want):.3%} of the entries differ"


if __name__ == "__main__":
    for case in CASES:
        test_moe_combine(case)
    for case in NORM_CASES:
        test_moe_combine_norm_equals_combine_then_rmsnorm(case)
    print("ok")
