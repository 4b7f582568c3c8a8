"""The invariants of a bucketing plan (kernels_cu/moe_bucket.cuh, written by moe_bucket and moe_route_fused),
checked exactly against counts made here from the routed ids:

    expert_off  = exclusive prefix sum of the per-bin pair counts, expert_off[bins] = N
    sorted_pair = a permutation of the N pairs with pair_pos its inverse; the rows of bin e hold exactly
                  the pairs routed to e (shared slot: pair t·(A+1) + A goes to the last bin, E)
    tiles       = for each bin in order, ceil(count / BT) tiles of BT rows: tile_expert, tile_row, num_tiles
"""

from __future__ import annotations

import numpy as np

__all__ = ["assert_plan"]


def assert_plan(plan, ids: np.ndarray, num_experts: int, shared_slot: bool) -> None:
    """plan: a filled kda_rt.cuda.ops.moe_align.MoEPlan; ids: [T, A] the routed experts (host)."""
    T, A = ids.shape
    E, BT = num_experts, plan.tile_rows
    pairs = A + 1 if shared_slot else A
    bins, N = E + int(shared_slot), T * pairs
    off, sp, pos = (plan.expert_off.get(), plan.sorted_pair.get(), plan.pair_pos.get())
    tile_expert, tile_row, num_tiles = plan.tile_expert.get(), plan.tile_row.get(), int(plan.num_tiles.get()[0])
    bin_of = np.full((T, pairs), E, np.int64)  # the shared slot's bin is E
    bin_of[:, :A] = ids
    bin_of = bin_of.ravel()
    counts = np.bincount(bin_of, minlength=bins)
    assert off.tolist() == np.concatenate([[0], np.cumsum(counts)]).tolist(), "expert_off"
    assert np.array_equal(np.sort(sp), np.arange(N)), "sorted_pair is not a permutation of the pairs"
    assert np.array_equal(pos[sp], np.arange(N)), "pair_pos is not the inverse of sorted_pair"
    row_bin = np.repeat(np.arange(bins), counts)
    assert np.array_equal(bin_of[sp], row_bin), "a row holds a pair of another bin"
    want = [(e, off[e] + j * BT) for e in range(bins) for j in range(-(-counts[e] // BT))]
    assert num_tiles == len(want), f"num_tiles {num_tiles}, want {len(want)}"
    assert list(zip(tile_expert[:num_tiles].tolist(), tile_row[:num_tiles].tolist(), strict=True)) == want, "tiles"
