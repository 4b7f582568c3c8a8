"""Launcher for kernels_cu/moe_route.cu: MoE router logits (fp32) and group-limited sigmoid top-k."""

from __future__ import annotations

import numpy as np

from kda_rt.cuda.ops.check import BF16, expect, f32, i32
from kda_rt.cuda.ops.compile import get_kernel

__all__ = ["moe_route", "MAX_TOP_K"]

MAX_TOP_K = 16
_WARPS = 8  # one expert per warp in the logits kernel
_SMEM_X_BYTES = 48 * 1024  # static shared memory for the staged x rows


def moe_route(x, w_router, bias, *, top_k: int, num_groups: int, topk_group: int, renormalize: bool,
              scaling: float, biased_weights: bool = False, out_ids=None, out_w=None, logits=None, stream=None):
    """x: [T, D] bf16, w_router: [E, D] fp32, bias: [E] fp32 -> (ids [T, A] int32, w [T, A] fp32).
    `logits` is an optional [T, E] fp32 scratch (preallocate it for CUDA graphs)."""
    import cupy

    T, D = expect(x, "x", ndim=2, dtype=BF16)
    E, _ = expect(w_router, "w_router", shape=(None, D), dtype=np.float32)
    expect(bias, "bias", shape=(E,), dtype=np.float32)
    if not (1 <= top_k <= min(MAX_TOP_K, E)) or E > 1024 or D % 4:
        raise ValueError(f"moe_route: need 1 <= top_k <= min(16, E), E <= 1024, D % 4 == 0 (top_k={top_k}, E={E}, D={D})")
    if num_groups < 1 or E % num_groups or not (1 <= topk_group <= num_groups):
        raise ValueError(f"moe_route: bad grouping num_groups={num_groups}, topk_group={topk_group} for E={E}")
    tpb = next((t for t in (8, 4, 2, 1) if 2 * t * D <= _SMEM_X_BYTES), None)
    if tpb is None:
        raise ValueError(f"moe_route: hidden size {D} too large for the staged-x kernel")
    out_ids = cupy.empty((T, top_k), dtype=np.int32) if out_ids is None else out_ids
    out_w = cupy.empty((T, top_k), dtype=np.float32) if out_w is None else out_w
    logits = cupy.empty((T, E), dtype=np.float32) if logits is None else logits
    expect(out_ids, "out_ids", shape=(T, top_k), dtype=np.int32)
    expect(out_w, "out_w", shape=(T, top_k), dtype=np.float32)
    expect(logits, "logits", shape=(T, E), dtype=np.float32)
    if T == 0:
        return out_ids, out_w
    k_logits = get_kernel("moe_route.cu", "moe_route_logits", D=D, E=E, TPB=tpb, WARPS=_WARPS)
    k_logits((-(-T // tpb), -(-E // _WARPS)), (_WARPS * 32,), (x, w_router, logits, i32(T)), stream=stream)
    threads = max(128, -(-E // 32) * 32)
    k_select = get_kernel("moe_route.cu", "moe_route_select", E=E, THREADS=threads, MAX_TOP_K=MAX_TOP_K)
    k_select((T,), (threads,), (logits, bias, out_ids, out_w, i32(T), i32(top_k), i32(num_groups), i32(topk_group),
                                i32(bool(renormalize)), i32(bool(biased_weights)), f32(scaling)), stream=stream)
    return out_ids, out_w
