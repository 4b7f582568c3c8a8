"""Launcher for kernels_cu/gemv.cu: one-token products as GEMVs whose rows are spread evenly over every warp of
a one-wave grid (batch-1 decode, where the tiled kernels leave some SMs a block more to stream than others):

- `moe_gemv_gate_up`: the gate/up projection of a one-token MoE step over its routed rows,
  h = SiLU(x · W_gate) · (x · W_up); moe_forward takes it where `moe_fits` (one token, KDA_RT_MOE_GEMV not 0).
- `gemv`: y = x · Wᵀ for one row x; gemm.linear takes it where `dense_fits` (one row, more outputs than
  skinny_gemm takes, a reduction width of at most MAX_K, KDA_RT_GEMV not 0).

Letters: E experts, N routed rows (pairs) or output features, K reduction width, I expert width."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kda_rt import env
from kda_rt.cuda.ops.check import BF16, expect
from kda_rt.cuda.ops.compile import get_kernel, sm_count
from kda_rt.cuda.ops.moe_align import MoEPlan

__all__ = ["DEFAULT", "MAX_K", "GemvConfig", "dense_fits", "dense_kernel", "gemv", "moe_fits", "moe_gemv_gate_up",
           "moe_kernel", "precompile"]

MAX_K = 2560  # a lane holds K / 256 pieces of each of two rows (twice with PIPE): K = 2304 (the hidden width)
MIN_N = 4097  # narrower outputs take skinny_gemm (ops/skinny_gemm.MAX_N)


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


def moe_fits(tokens: int, hidden: int) -> bool:
    """A MoE step of `tokens` tokens with hidden width `hidden` takes moe_gemv_gate_up."""
    return tokens == 1 and hidden % 8 == 0 and hidden <= MAX_K and env.moe_gemv()


def dense_fits(x, weight, out, accumulate: bool) -> bool:
    """gemv can compute out = x · weightᵀ (shapes already checked by the caller, as gemm.linear does)."""
    M, K = x.shape
    N = weight.shape[0]
    return (M == 1 and N >= MIN_N and K % 8 == 0 and K <= MAX_K and not accumulate and weight.flags.c_contiguous
            and weight.data.ptr % 16 == 0 and x.data.ptr % 16 == 0 and out.dtype in (BF16, np.dtype(np.float32))
            and env.gemv())


def moe_kernel(hidden: int, inter: int, cfg: GemvConfig = DEFAULT):
    """The MoE gate/up variant (built on first use; the runner builds it at start)."""
    return get_kernel("gemv.cu", "moe_gemv_gate_up", MOE=1, KW=hidden, INTER=inter, WARPS=cfg.warps,
                      PIPE=int(cfg.pipe))


def dense_kernel(k: int, out_f32: bool, cfg: GemvConfig = DEFAULT):
    """The dense variant for reduction width k (built on first use; the runner builds it at start)."""
    return get_kernel("gemv.cu", "gemv_dense", MOE=0, KW=k, OUT_F32=int(out_f32), WARPS=cfg.warps,
                      PIPE=int(cfg.pipe))


def precompile(shapes=()) -> int:
    """Build the dense variant of each (N, K, fp32 out) in `shapes` (the model's decode projections) that a
    one-row step sends here (so no step waits for NVRTC); returns the number of variants."""
    built = {(k, f32) for n, k, f32 in shapes if n >= MIN_N and k % 8 == 0 and k <= MAX_K and env.gemv()}
    for k, f32 in sorted(built):
        dense_kernel(k, f32)
    return len(built)


_resident: dict[tuple[int, int], int] = {}


def _grid(kernel, cfg: GemvConfig) -> int:
    """One wave: cfg.blocks_per_sm CTAs per SM, capped at what one SM holds at once."""
    import cupy

    key = (kernel.ptr, cfg.warps)
    if key not in _resident:
        from kda_rt.cuda.ops.pdl import max_active_blocks

        _resident[key] = max(1, max_active_blocks(kernel, 32 * cfg.warps, 0))
    return sm_count(cupy.cuda.Device().id) * min(cfg.blocks_per_sm, _resident[key])


def _check_k(K: int, name: str) -> None:
    if K % 8 or K > MAX_K:
        raise ValueError(f"{name}: reduction width {K} must be a multiple of 8 and at most {MAX_K}")


def moe_gemv_gate_up(x, w13, plan: MoEPlan, *, out, cfg: GemvConfig = DEFAULT, stream=None):
    """x [1, D] bf16, w13 [E, 2I, D] bf16 ([gate; up] rows), plan of the token's pairs -> out h [N, I] bf16,
    row tile_row[t] = SiLU(x · gate_e) · (x · up_e) for e = tile_expert[t], t < num_tiles (one row a tile)."""
    _, D = expect(x, "x", shape=(1, None), dtype=BF16)
    _, two_i, _ = expect(w13, "w13", shape=(None, None, D), dtype=BF16)
    N = plan.sorted_pair.shape[0]
    expect(out, "out", shape=(N, two_i // 2), dtype=BF16)
    _check_k(D, "moe_gemv_gate_up")
    if two_i % 2 or x.data.ptr % 16 or w13.data.ptr % 16:
        raise ValueError(f"moe_gemv_gate_up: w13 needs an even row count (got {two_i}) and x, w13 16-byte aligned")
    if N == 0:
        return out
    kernel = moe_kernel(D, two_i // 2, cfg)
    kernel((_grid(kernel, cfg),), (32 * cfg.warps,), (x, w13, plan.tile_expert, plan.tile_row, plan.num_tiles, out),
           stream=stream)
    return out


def gemv(x, weight, *, out, cfg: GemvConfig = DEFAULT, stream=None):
    """x [1, K] bf16 (a row-strided view is fine), weight [N, K] bf16 contiguous -> out [1, N] bf16 or fp32."""
    _, K = expect(x, "x", shape=(1, None), dtype=BF16, row_stride=True)
    N, _ = expect(weight, "weight", shape=(None, K), dtype=BF16)
    expect(out, "out", shape=(1, N), row_stride=True)
    _check_k(K, "gemv")
    if out.dtype not in (BF16, np.dtype(np.float32)):
        raise TypeError(f"gemv: out must be bfloat16 or float32, got {out.dtype.name}")
    if x.data.ptr % 16 or weight.data.ptr % 16:
        raise ValueError("gemv: x and weight must be 16-byte aligned")
    if N == 0:
        return out
    kernel = dense_kernel(K, out.dtype == np.dtype(np.float32), cfg)
    kernel((_grid(kernel, cfg),), (32 * cfg.warps,), (x, weight, np.int32(N), out), stream=stream)
    return out
