"""kernels_cu/silu_mul.cu: out = bf16(bf16(SiLU(gate)) · up) with gate = gu[:, :I], up = gu[:, I:],
against layers.silu(gate) · up in float64 on the same bf16 inputs.

Tolerance: two bf16 roundings (SiLU result, product), each ≤ u = 2^-8 relative, plus fp32 expf
error (~1e-7) -> |out - ref| ≤ (2u + u²)·|ref| + tiny = 7.83e-3·|ref|: rtol 8e-3, atol 1e-30 (no
absolute slack: the gate stays within ±25, so no value nears the bf16 denormal range)."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.gpu import assert_close, bf16_round, poison, to_gpu_bf16, to_np

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T, I", [(1, 1024), (7, 1024), (300, 9216), (3, 8)], ids=str)
def test_silu_mul(T, I):  # noqa: E741 (I: the intermediate width of the spec)
    from kda_rt.cuda.ops.silu_mul import silu_mul
    from kda_rt.reference.layers import silu

    rng = np.random.default_rng(T * I)
    gu = bf16_round(rng.normal(size=(T, 2 * I)) * 4)  # gate spans the SiLU knee and both tails
    ref = silu(gu[:, :I]) * gu[:, I:]
    out = to_gpu_bf16(np.zeros((T, I)))
    poison(out)
    silu_mul(to_gpu_bf16(gu), out=out)
    assert_close(to_np(out), ref, atol=1e-30, rtol=8e-3, name="silu_mul")


if __name__ == "__main__":
    test_silu_mul(300, 9216)
    print("ok")
