"""ops/moe_route.split_router (CPU): the router as three bf16 matrices that add up to it exactly, so the
tensor-core logits GEMM of long prefill steps multiplies the same fp32 values as the fp32 kernel."""

from __future__ import annotations

import numpy as np
import pytest

from kda_rt.cuda.ops.moe_route import split_router


def test_split_router_is_exact():
    w = (np.random.default_rng(1).normal(size=(256, 2304)) * np.logspace(-6, 1, 2304)).astype(np.float32)
    parts = split_router(w).astype(np.float32).reshape(3, 256, 2304)
    assert split_router(w).shape == (768, 2304)
    assert np.array_equal((parts[0] + parts[1]) + parts[2], w)


def test_split_router_of_a_bf16_router_has_zero_tails():
    w = np.random.default_rng(2).normal(size=(16, 64)).astype(np.float32)
    w = split_router(w)[:16].astype(np.float32)  # bf16 values
    parts = split_router(w).astype(np.float32).reshape(3, 16, 64)
    assert np.array_equal(parts[0], w) and not parts[1].any() and not parts[2].any()


def test_split_router_refuses_what_three_parts_cannot_hold():
    w = np.array([[1.2345678e-39]], dtype=np.float32)  # subnormal: bf16 keeps fewer bits down there
    with pytest.raises(ValueError, match="three bf16"):
        split_router(w)
