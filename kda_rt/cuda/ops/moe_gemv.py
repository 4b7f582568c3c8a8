"""Launcher for kernels_cu/moe_gemv.cu: the gate/up projection of a one-token MoE step over its routed rows,
h = SiLU(x · W_gate) · (x · W_up), as a GEMV whose features are spread evenly over every warp of a one-wave grid
(at batch 1 the tiled kernel's 2.18 CTAs per SM leave some SMs a block more to stream than others).
moe_forward takes it where `fits` (one token, KDA_RT_MOE_GEMV not 0).

Letters: E experts, N routed rows (pairs), D hidden (the reduction width), I expert width."""

from __future__ import annotations

from typing import NamedTuple

from kda_rt import env
from kda_rt.cuda.ops.check import BF16, expect
from kda_rt.cuda.ops.compile import get_kernel, sm_count
from kda_rt.cuda.ops.moe_align import MoEPlan

__all__ = ["DEFAULT", "MAX_K", "GemvConfig", "fits", "gemv_kernel", "moe_gemv_gate_up"]

MAX_K = 2560  # a lane holds D / 256 pieces of each of two rows (twice with PIPE): D = 2304 at the 48B shape


class GemvConfig(NamedTuple):
    """Warps per CTA, CTAs per SM (at most as many as fit: the grid is one wave) and whether each warp loads
    its next unit's rows before reducing the current one (~166 registers a thread against ~100)."""

    warps: int = 8
    blocks_per_sm: int = 1
    pipe: bool = True


# H200 (tests/gpu/bench_moe_decode.py --gemv, 2026-12-01: graph replays of bucket + gate/up at batch 1, 9 routed
# rows): tiled 28.9-29.1 us, (8, 1, pipe) 25.6-25.8, (8, 2) 26.4-26.5, (8, 1) 26.6-26.7, (4, 3) / (4, 4) /
# (12, 1) / (16, 1) 27.0-27.3
DEFAULT = GemvConfig()


def fits(tokens: int, hidden: int) -> bool:
    """A MoE step of `tokens` tokens with hidden width `hidden` takes moe_gemv_gate_up."""
    return tokens == 1 and hidden % 8 == 0 and hidden <= MAX_K and env.moe_gemv()


def gemv_kernel(hidden: int, inter: int, cfg: GemvConfig = DEFAULT):
    """The kernel variant (built on first use; the runner builds it at start)."""
    return get_kernel("moe_gemv.cu", "moe_gemv_gate_up", KW=hidden, INTER=inter, WARPS=cfg.warps, PIPE=int(cfg.pipe))


def _grid(kernel, cfg: GemvConfig) -> int:
    """One wave: cfg.blocks_per_sm CTAs per SM, capped at what one SM holds at once."""
    import cupy

    from kda_rt.cuda.ops.pdl import resident_per_sm

    return sm_count(cupy.cuda.Device().id) * min(cfg.blocks_per_sm, resident_per_sm(kernel, 32 * cfg.warps, 0))


def moe_gemv_gate_up(x, w13, plan: MoEPlan, *, out, cfg: GemvConfig = DEFAULT, stream=None):
    """x [1, D] bf16, w13 [E, 2I, D] bf16 ([gate; up] rows), plan of the token's pairs -> out h [N, I] bf16,
    row tile_row[t] = SiLU(x · gate_e) · (x · up_e) for e = tile_expert[t], t < num_tiles (one row a tile)."""
    _, D = expect(x, "x", shape=(1, None), dtype=BF16)
    _, two_i, _ = expect(w13, "w13", shape=(None, None, D), dtype=BF16)
    N = plan.sorted_pair.shape[0]
    expect(out, "out", shape=(N, two_i // 2), dtype=BF16)
    if D % 8 or D > MAX_K:
        raise ValueError(f"moe_gemv_gate_up: hidden width {D} must be a multiple of 8 and at most {MAX_K}")
    if two_i % 2 or x.data.ptr % 16 or w13.data.ptr % 16:
        raise ValueError(f"moe_gemv_gate_up: w13 needs an even row count (got {two_i}) and x, w13 16-byte aligned")
    if N == 0:
        return out
    kernel = gemv_kernel(D, two_i // 2, cfg)
    kernel((_grid(kernel, cfg),), (32 * cfg.warps,), (x, w13, plan.tile_expert, plan.tile_row, plan.num_tiles, out),
           stream=stream)
    return out
