"""Launcher for kernels_cu/moe_route_small.cu: router logits, top-k and the pair bucketing of a small
decode batch (T <= MAX_T tokens, ungrouped routing) in one launch, in place of moe_route's two kernels
and moe_bucket (three launches of a few microseconds each per MoE layer at batch 1-8)."""

from __future__ import annotations

import numpy as np

from kda_rt.cuda.ops.check import BF16, expect, f32, i32
from kda_rt.cuda.ops.compile import get_kernel
from kda_rt.cuda.ops.moe_align import MoEPlan, max_tiles
from kda_rt.cuda.ops.moe_route import MAX_TOP_K

__all__ = ["MAX_T", "fits", "moe_route_small"]

MAX_T = 8  # tokens of one call (the x rows staged in shared memory)
_STATIC_SMEM = 48 * 1024
_BLOCK = 1024


def _smem_bytes(D: int, E: int, shared_slot: bool) -> int:
    bins = E + 1 if shared_slot else E
    return 2 * MAX_T * D + 4 * MAX_T * MAX_TOP_K + 4 * (3 * bins + 32 + 1)


def fits(T: int, D: int, E: int, top_k: int, num_groups: int, shared_slot: bool) -> bool:
    """The fused kernel handles this call: few tokens, no expert groups, its static shared memory fits."""
    bins = E + 1 if shared_slot else E
    return (1 <= T <= MAX_T and num_groups == 1 and 1 <= top_k <= min(MAX_TOP_K, E) and D % 4 == 0
            and bins <= _BLOCK and _smem_bytes(D, E, shared_slot) <= _STATIC_SMEM)


def moe_route_small(x, w_router, bias, plan: MoEPlan, *, top_k: int, renormalize: bool, scaling: float,
                    biased_weights: bool, logits, out_ids, out_w, ticket, shared_slot: bool, stats=None,
                    stream=None) -> None:
    """x [T, D] bf16, w_router [E, D] fp32, bias [E] fp32 -> out_ids [T, A] int32, out_w [T, A] fp32 and
    `plan` filled as moe_align.moe_bucket would (with the shared expert as bin E when `shared_slot`).
    logits: [T, E] (or larger) fp32 scratch; ticket: int32 [1], 0 before the first call (each call leaves
    it 0: zero it once when the buffer is new, outside graph capture)."""

    T, D = expect(x, "x", ndim=2, dtype=BF16)
    E, _ = expect(w_router, "w_router", shape=(None, D), dtype=np.float32)
    expect(bias, "bias", shape=(E,), dtype=np.float32)
    if not fits(T, D, E, top_k, 1, shared_slot):
        raise ValueError(f"moe_route_small: T={T} (<= {MAX_T}), D={D}, E={E}, top_k={top_k} do not fit")
    expect(out_ids, "out_ids", shape=(T, top_k), dtype=np.int32)
    expect(out_w, "out_w", shape=(T, top_k), dtype=np.float32)
    expect(ticket, "ticket", shape=(1,), dtype=np.int32)
    if logits.dtype != np.float32 or logits.size < T * E:
        raise ValueError(f"moe_route_small: logits scratch needs >= {T * E} fp32 values")
    bins = E + 1 if shared_slot else E
    N = T * (top_k + 1 if shared_slot else top_k)
    for name, shape in (("expert_off", (bins + 1,)), ("sorted_pair", (N,)), ("pair_pos", (N,)), ("num_tiles", (1,))):
        expect(getattr(plan, name), f"plan.{name}", shape=shape, dtype=np.int32)
    if min(plan.tile_expert.size, plan.tile_row.size) < max_tiles(N, bins, plan.tile_rows):
        raise ValueError("moe_route_small: the plan's tile arrays are too short")
    if stats is not None:
        expect(stats, "stats", shape=(2,), dtype=np.int32)
    kernel = get_kernel("moe_route_small.cu", "moe_route_small", D=D, E=E, MAX_T=MAX_T, MAX_TOP_K=MAX_TOP_K,
                        BT=plan.tile_rows, SHARED_A=int(shared_slot))
    kernel((-(-E // 32),), (_BLOCK,),
           (x, w_router, bias, logits, out_ids, out_w, ticket, plan.expert_off, plan.sorted_pair, plan.pair_pos,
            plan.tile_expert, plan.tile_row, plan.num_tiles, stats if stats is not None else np.uint64(0), i32(T),
            i32(top_k), i32(bool(renormalize)), i32(bool(biased_weights)), f32(scaling)),
           stream=stream)
