"""Launcher for kernels_cu/moe_gemm_wg.cu: the prefill grouped GEMM on Hopper's warpgroup MMA (sm_90a),
128-row tiles over expert-sorted rows; gate/up with SiLU·up fused (bf16 out) or down (bf16 out).
Same contract as moe_gemm_tc.py with a plan built for tile_rows = 128; `available()` says whether it
runs here (arch sm_90a, KDA_RT_WGMMA not 0, shape fits), else callers use moe_gemm_tc.  e4m3 weights (uint8 codes
with one fp32 scale a row, loader/quant.py; moe_gemm_wg.cu WFMT = 1) through `scale`; with `src_scale` too the
source rows are e4m3 codes with a scale a row as well (ops/quant.quantize_activations_e4m3) and the products run
on the e4m3 tensor cores (WFMT = 2); ops/dense_w8a8.py runs fp8 models' dense prefill projections through it as
one expert over an identity plan (top_k 1).

Letters: T tokens, A active experts, E experts, N = T·A pairs, K reduction width, NOUT output width."""

from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np

from kda_rt import env
from kda_rt.cuda.ops import moe_gemm_tc
from kda_rt.cuda.ops.check import expect
from kda_rt.cuda.ops.compile import device_arch, get_kernel, sm_count
from kda_rt.cuda.ops.moe_align import MoEPlan, max_tiles
from kda_rt.cuda.ops.moe_gemm_tc import check_grouped_gemm
from kda_rt.cuda.ops.tma import allocation_rows, map_2d_swizzled

__all__ = ["E4M3_BK", "WgTile", "available", "moe_gemm_wg", "w8a8_fits", "wg_tile", "ws"]

BM, BK = 128, 64
E4M3_BK = 128  # the k step of e4m3 sources and weights (WFMT = 2): 128 codes, one 128-byte row as bf16's 64


class WgTile(NamedTuple):
    """BN features per CTA (128 or 256), the shared-memory pipeline depth, and the epilogue: the output tile
    staged in shared memory (coalesced 16-byte stores), or the accumulator pairs stored directly."""

    bn: int
    stages: int
    staged_out: bool = True

    @property
    def smem_bytes(self) -> int:  # stages of A [128][64] + B [BN][64] bf16, plus 1 KB to align to 1024
        return self.smem(False)

    def smem(self, e4m3: bool, e4m3_src: bool = False) -> int:
        """Dynamic shared memory; e4m3: stages of A bf16 + B e4m3 [BN][64], and the three widened bf16 B tiles;
        e4m3_src (both operands e4m3): stages of A [128][128] + B [BN][128] codes, bf16's bytes."""
        if not e4m3 or e4m3_src:
            return self.stages * (BM + self.bn) * BK * 2 + 1024
        return self.stages * (BM * BK * 2 + self.bn * BK) + 3 * self.bn * BK * 2 + 1024


# 192 KB of stages: 1 CTA per SM, 2 k steps in flight; H200 (bench_moe_gemm.py), T = 8192 gate/up | down:
# 484 | 390 TFLOP/s against (256, 3) 343 | 319, (128, 4) 379 | 325, (128, 3) at 2 CTAs per SM 390 | 333
_DEFAULT = WgTile(256, 4)
# epilogue by GEMM (fuse_silu -> staged), H200 (bench_moe_gemm.py --epilogue, T = 8192 | 16384): down staged
# -18 | -21% against direct stores; gate/up direct -8 | -7% against the old IEEE SiLU quotient, staged -6 | -4%
_STAGED_OUT = {False: True, True: False}


def _fits(t: WgTile, nout: int, k: int, fuse_silu: bool, e4m3_src: bool = False) -> bool:
    out_ok = (nout // 2) % (t.bn // 2) == 0 if fuse_silu else nout % t.bn == 0
    bk = E4M3_BK if e4m3_src else BK
    return out_ok and k % bk == 0 and k // bk >= t.stages - 2 and t.bn in (128, 256) and t.stages >= 3


def wg_tile(nout: int, k: int, fuse_silu: bool, e4m3_src: bool = False) -> WgTile | None:
    """The tile for one GEMM (nout x k weights; e4m3_src: 128-code k steps), or None when none fits."""
    if e4m3_src and (forced := env.w8a8_tile()) is not None:
        t = WgTile(*forced, _STAGED_OUT[fuse_silu])
        if not _fits(t, nout, k, fuse_silu, e4m3_src):
            raise ValueError(f"KDA_RT_W8A8_TILE={forced[0]}x{forced[1]} does not fit the GEMM (NOUT={nout}, K={k})")
        return t
    for t in (_DEFAULT, WgTile(128, 4), WgTile(128, 3)):
        if _fits(t, nout, k, fuse_silu, e4m3_src):
            return t._replace(staged_out=_STAGED_OUT[fuse_silu])
    return None


def w8a8_fits(hidden: int, inter: int) -> bool:
    """Both MoE GEMMs of a prefill step can take e4m3 sources (128-code k steps: K % 128 and a tile with enough of
    them)."""
    return (wg_tile(2 * inter, hidden, True, e4m3_src=True) is not None
            and wg_tile(hidden, inter, False, e4m3_src=True) is not None)


def available(tile_rows: int, hidden: int, inter: int) -> bool:
    """Both MoE GEMMs of a step with `tile_rows`-row tiles can run here on wgmma."""
    return (tile_rows == BM and env.wgmma() and device_arch() == "sm_90a"
            and wg_tile(2 * inter, hidden, True) is not None and wg_tile(hidden, inter, False) is not None)


def b_tma(e4m3: bool, e4m3_src: bool = False) -> bool:
    """Whether the weights' copies go by tensor maps (KDA_RT_MOE_B_TMA, moe_gemm_wg.cu B_TMA): bf16 weights, or e4m3
    weights with e4m3 sources (e4m3 weights with bf16 sources are widened in shared memory first: cp.async)."""
    return env.moe_b_tma() and (e4m3_src or not e4m3)


def a_tma(fuse_silu: bool, e4m3: bool, e4m3_src: bool = False) -> bool:
    """Whether the down GEMM's source rows go by a tensor map too (KDA_RT_MOE_A_TMA with B_TMA, moe_gemm_wg.cu
    A_TMA): contiguous rows only, so never gate/up's gathered x rows."""
    return env.moe_a_tma() and not fuse_silu and b_tma(e4m3, e4m3_src)


def ws(e4m3: bool, e4m3_src: bool = False) -> bool:
    """Whether the GEMM runs in its persistent, warp-specialized form (KDA_RT_MOE_WS, moe_gemm_wg.cu WS; unset: for
    e4m3 sources only): where B_TMA can be built (bf16 weights, or e4m3 weights with e4m3 sources)."""
    on = env.moe_ws()
    return (e4m3_src if on is None else on) and (e4m3_src or not e4m3)


SMEM_LIMIT = 227 * 1024  # the most shared memory a block can opt in to on sm_90 (232,448 bytes)
_WS_STATIC = 256  # the WS kernel's static shared memory (mbarriers, item slots: 96 bytes, MC ~140), within SMEM_LIMIT
WS_THREADS = 384  # moe_gemm_wg.cu WS: two consumer warpgroups and the producer warpgroup
_claims: dict[tuple[int, int, int], object] = {}  # (device, stream, thread) -> the WS kernel's item counters
_PER_THREAD_STREAM = 2  # cudaStreamPerThread's handle


def _claim_counter(stream):
    """The WS kernel's item counters for launches on `stream` (zeroed once; every launch leaves them at 0): one pair
    a stream, so launches on different streams never share them, while launches on one stream run one at a time.
    CUDA's per-thread default stream has one handle for a different stream in each host thread: keyed by thread."""
    import cupy

    s = stream if stream is not None else cupy.cuda.get_current_stream()
    ptr = int(s.ptr)
    key = (cupy.cuda.Device().id, ptr, threading.get_ident() if ptr == _PER_THREAD_STREAM else 0)
    if key not in _claims:
        with s:
            _claims[key] = cupy.zeros(2, dtype=np.int32)
    return _claims[key]


def ws_stages(tile: WgTile, fuse_silu: bool) -> int:
    """The WS form's pipeline depth: the tile's stages, or as many as fit beside the staged epilogue's own output
    tile (the down GEMM's BN = 256 tile: 3); a stage is BM + BN rows of 128 bytes (bf16's 64 or e4m3's 128 of K)."""
    fit = (SMEM_LIMIT - _WS_STATIC - 1024 - _ws_out_bytes(tile, fuse_silu)) // ((BM + tile.bn) * 128)
    if fit < 3:
        raise ValueError(f"moe_gemm_wg: the WS form of tile {tile} needs 3 stages, {fit} fit")
    return min(tile.stages, fit)


def _ws_out_bytes(tile: WgTile, fuse_silu: bool) -> int:  # the staged epilogue's [BM][OUT_COLS] tile, padded rows
    return BM * ((tile.bn // 2 if fuse_silu else tile.bn) * 2 + 16) if tile.staged_out else 0


def ws_smem(tile: WgTile, fuse_silu: bool) -> int:
    """Dynamic shared memory of the WS form: its stages, the staged epilogue's tile, 1 KB to align to 1024."""
    return ws_stages(tile, fuse_silu) * (BM + tile.bn) * 128 + _ws_out_bytes(tile, fuse_silu) + 1024


def wg_kernel(tile: WgTile, K: int, nout: int, fuse_silu: bool, top_k: int, e4m3: bool = False,
              e4m3_src: bool = False, src_map: bool | None = None):
    """The kernel variant of one grouped GEMM (built on first use; the runner builds them at start); e4m3_src: both
    operands e4m3 (WFMT = 2); src_map: the A_TMA build or not (None: as the switches say).  Where `ws` says so
    (KDA_RT_MOE_WS; unset: e4m3 sources) the persistent, warp-specialized form: B_TMA always, A_TMA for the down GEMM
    unless src_map is False, MC with KDA_RT_MOE_MC=1."""
    fmt = {"WFMT": 2} if e4m3_src else moe_gemm_tc.weight_format(e4m3)
    multicast = env.moe_multicast()  # (read, and a bad value refused, whichever form runs)
    if ws(e4m3, e4m3_src):
        tma = {"WS": 1, "B_TMA": 1, **({"A_TMA": 1} if not fuse_silu and src_map is not False else {})}
        if multicast:  # (absent when off: the WS module's key unchanged)
            tma["MC"] = 1
        return get_kernel("moe_gemm_wg.cu", "moe_grouped_gemm_ws", max_dynamic_smem=ws_smem(tile, fuse_silu), K=K,
                          NOUT=nout, FUSE_SILU=int(fuse_silu), TOPK=top_k, BN=tile.bn,
                          STAGES=ws_stages(tile, fuse_silu), STAGED_OUT=int(tile.staged_out),
                          HALF_SKIP=int(env.moe_half_skip()), **fmt, **tma)
    tma = {"B_TMA": 1} if b_tma(e4m3, e4m3_src) else {}  # (absent when off: the default module's key unchanged)
    if a_tma(fuse_silu, e4m3, e4m3_src) and src_map is not False:
        tma["A_TMA"] = 1
    return get_kernel("moe_gemm_wg.cu", "moe_grouped_gemm_wg", max_dynamic_smem=tile.smem(e4m3, e4m3_src), K=K,
                      NOUT=nout, FUSE_SILU=int(fuse_silu), TOPK=top_k, BN=tile.bn, STAGES=tile.stages,
                      STAGED_OUT=int(tile.staged_out), HALF_SKIP=int(env.moe_half_skip()), **fmt, **tma)


def weight_map(weight, tile: WgTile, what: str = "weight", stream=None):
    """The tensor map of B_TMA's weight copies: `weight` [E, NOUT, K] as [E NOUT] rows, boxes of BN / 2 rows x one
    128-byte k step (ops/tma.py)."""
    return map_2d_swizzled(weight, tile.bn // 2, what, stream=stream)


def source_map(src, stream=None):
    """The tensor map of A_TMA's source copies: `src` [N, K] (h, or its e4m3 codes) over all the rows its allocation
    holds from its first byte (one map for the steps whose h starts at the same place), boxes of 128 rows x one
    128-byte k step (ops/tma.py)."""
    return map_2d_swizzled(src, BM, "the down GEMM's source rows", rows=allocation_rows(src), stream=stream)


def moe_gemm_wg(src, weight, plan: MoEPlan, *, top_k: int, fuse_silu: bool, out, tile: WgTile | None = None,
                scale=None, src_scale=None, stream=None):
    """fuse_silu: src = x [T, K], weight = w13 [E, 2I, K] -> out h [N, I] bf16 (h = SiLU(gate)·up).
    else:       src = h [N, K], weight = w2 [E, D, K]  -> out y [N, D] bf16 (unscaled expert rows).
    With scale [E, NOUT] fp32 the weight holds e4m3 values as uint8 bits (loader/quant.quantize_rows per expert):
    each sum is then its weight row's scale times the fp32 sum, rounded as above.  With src_scale [T] (gate/up) or
    [N] (down) fp32 as well, src holds e4m3 codes too (ops/quant.quantize_activations_e4m3, K % 128 == 0) and the
    products run on the e4m3 tensor cores: each sum is then the fp32 sum of code products times its weight row's
    scale times its source row's."""
    e4m3, e4m3_src = scale is not None, src_scale is not None
    if e4m3_src and not e4m3:
        raise ValueError("moe_gemm_wg: e4m3 sources (src_scale) need e4m3 weights (scale) too")
    K, E, nout, N = check_grouped_gemm(src, weight, plan, fuse_silu, out, e4m3=e4m3, e4m3_src=e4m3_src)
    if e4m3:
        moe_gemm_tc.check_scale("moe_gemm_wg", "scale", scale, weight)
    if e4m3_src:
        expect(src_scale, "src_scale", shape=(src.shape[0],), dtype=np.float32)
        if K % E4M3_BK:
            raise ValueError(f"moe_gemm_wg: e4m3 sources need K % {E4M3_BK} == 0 (128-code k steps), got K={K}")
    tile = tile or wg_tile(nout, K, fuse_silu, e4m3_src)
    if tile is None or plan.tile_rows != BM or not _fits(tile, nout, K, fuse_silu, e4m3_src):
        raise ValueError(f"moe_gemm_wg: no tile {tile} for BM={plan.tile_rows} (needs {BM}), K={K}, NOUT={nout}")
    # A_TMA where its map fits: a box of 128 rows within what the source's allocation holds
    persistent = ws(e4m3, e4m3_src)
    src_map = ((persistent and not fuse_silu) or a_tma(fuse_silu, e4m3, e4m3_src)) and N > 0 and allocation_rows(src) >= BM
    kernel = wg_kernel(tile, K, nout, fuse_silu, top_k, e4m3, e4m3_src, src_map)
    grid = ((nout // 2 if fuse_silu else nout) // (tile.bn // 2 if fuse_silu else tile.bn), max_tiles(N, E, BM))
    null = np.uint64(0)
    if N:
        args = (src, plan.sorted_pair, weight, plan.tile_expert, plan.tile_row, plan.expert_off, plan.num_tiles, out,
                scale if e4m3 else null, src_scale if e4m3_src else null)
        if persistent or b_tma(e4m3, e4m3_src):  # B_TMA builds take the weights' tensor map as an 11th argument
            args += (weight_map(weight, tile, "w13" if fuse_silu else "w2", stream),)
        if persistent:  # the WS kernel its item counters as a 12th
            args += (_claim_counter(stream),)
        if src_map:  # and A_TMA builds the source's as the last
            args += (source_map(src, stream),)
        if persistent:  # one CTA an SM (at most one a (tile, feature block) item) claims the items
            dev = int(src.device.id)
            if env.moe_multicast():  # clusters of two CTAs claim pair items (two tiles, one feature block)
                ctas = (2 * min(sm_count(dev) // 2, grid[0] * ((grid[1] + 1) // 2)),)
            else:
                ctas = (min(sm_count(dev), grid[0] * grid[1]),)
            kernel(ctas, (WS_THREADS,), args, shared_mem=ws_smem(tile, fuse_silu), stream=stream)
        else:
            kernel(grid, (256,), args, shared_mem=tile.smem(e4m3, e4m3_src), stream=stream)
    return out
