"""Launcher for kernels_cu/moe_gemm_tc.cu: the grouped GEMM (shared-memory tiles, cp.async pipeline, bf16
tensor cores) over expert-sorted rows; gate/up with SiLU·up fused (bf16 out) or down (bf16 out).  Same
contract as moe_gemm.py; the plan must be built with tile_rows = the tile's BM.  moe_decode_fused: both
GEMMs of a decode step (16-, 32- or 64-row tiles) in one launch.  Both take e4m3 weights too (uint8 bits with one fp32 scale a
row, loader/quant.py; moe_gemm_tc.cu WFMT = 1): pass `scale` (moe_gemm_tc) or `scale13` and `scale2`
(moe_decode_fused).

Letters: T tokens, A active experts, E experts, N = T·A pairs, K reduction width, NOUT output width."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kda_rt import env
from kda_rt.cuda.ops.check import BF16, expect
from kda_rt.cuda.ops.compile import arch_number, device_arch, get_kernel, sm_count
from kda_rt.cuda.ops.moe_align import MoEPlan, max_tiles

__all__ = ["E4M3_CONVERT", "FUSED32_BF16_MAX_AVG", "FUSED_MIN_TOKENS", "FUSED_TILE_ROWS", "MIN_AVG_ROWS",
           "MIN_AVG_ROWS_E4M3", "SMALL_DECODE_TOKENS", "TileConfig", "built_tile_rows", "check_grouped_gemm",
           "check_scale", "copies_weights_early", "e4m3_tile", "fused_decode_tile", "fused_e4m3_tile", "fused_rows",
           "moe_decode_fused", "moe_gemm_tc", "prefill_tile_rows", "sync_words", "tile_config", "weight_format"]

# Average rows per touched expert from which the CTA tile is 64 rows (below: the 16-row decode tile,
# which at decode sizes streams the expert weights at 3.6-4.0 TB/s on the H200, 1.3-1.5x moe_gemm.py:
# tests/gpu/bench_moe_decode.py) ...
MIN_AVG_ROWS = 4
# ... for e4m3 stacks: there the 64-row tiles widen e4m3 to bf16 in moe_gemm_tc (1.6 TB/s of codes at batch 256),
# while moe_decode_fused on 16-row tiles streams them at 3.6-3.9 (an expert's few tiles re-read its rows, mostly
# from L2).  H200, 2026-12-04, full model fp8, decode graph replays at 2K context (tests/gpu/bench_ab.py --env
# KDA_RT_MOE_MIN_AVG_ROWS --values 4,1000 --replays ... --quantization fp8, medians of 2 rounds, ms): batch 128 (4.5
# rows an expert on average) 16.53 -> 11.94, 256 (9.0) 22.88 -> 19.26, 384 (13.4) 33.58 -> 31.88, 512 (17.9) 35.76
# -> 33.95; larger steps not measured, so 64-row tiles from 18 rows on.  bf16 stacks keep 4: batch 128 16.16 ->
# 16.03, 256 22.64 -> 24.20 (worse).
MIN_AVG_ROWS_E4M3 = 18
# ... and from which the CTA tile is 128 rows instead of 64 (H200: 128 wins from 64 rows on).
BIG_TILE_AVG_ROWS = 48


class TileConfig(NamedTuple):
    """CTA tile BM x BN, k step BK, pipeline depth, warp grid, CTAs per SM the registers allow for."""

    bm: int
    bn: int
    bk: int
    stages: int
    warps_m: int
    warps_n: int
    min_blocks: int

    @property
    def smem_bytes(self) -> int:
        return self.smem(False)

    def smem(self, e4m3: bool) -> int:
        """Dynamic shared memory: the stages' bf16 A rows (BK + 8 elements apart) and B rows (bf16 the same; e4m3
        BK + 16 bytes apart)."""
        b_row = self.bk + 16 if e4m3 else (self.bk + 8) * 2
        return self.stages * (self.bm * (self.bk + 8) * 2 + self.bn * b_row)


# moe_gemm_tc.cu E4M3_CVT: how e4m3 weights become bf16 fragments (both exact): 0 moves each byte's bits into bf16
# places and multiplies by 2^120 in bf16, 1 goes through the conversion unit (sm_89+).  H200, 2026-12-02,
# tests/gpu/bench_moe_decode.py --e4m3 (moe_decode_fused in graph replays, 8 routings cycled): batch 32 with 67.9
# experts bf16 246.9 us, e4m3 bits 159.8, cvt 143.8 us; batch 2 (8 experts) 39.8 / 35.1 / 30.8 us: 1 it is
E4M3_CONVERT = 1


# Chosen on H200 from the sweep of tests/gpu/bench_moe_gemm.py (candidates in test_moe_gemm_tc.py)
_BIG = TileConfig(128, 128, 64, 3, 2, 2, 2)  # warp tile 64 x 64, 108 KB smem, 218 registers: 2 CTAs per SM
_SMALL = TileConfig(64, 128, 64, 4, 2, 2, 2)  # warp tile 32 x 64, 108 KB smem, 138 registers: 2 CTAs per SM
# decode: one m16 row tile per CTA, the weights streamed through 4 stages (83 KB smem: 2 CTAs per SM, so
# one block's start overlaps another's stream); H200, E=256 top-8 D=2304 I=1024 (bench_moe_decode.py
# --tiles, 2026-12-01), gate/up | down, batch 32 with 66 experts touched: 6 stages (1 CTA per SM)
# 166.4 | 92.8 us (3.74 | 3.36 TB/s), 4 stages 163.2 | 85.7 us (3.82 | 3.63); uniform routing (155
# experts) 366 | 189 against 369 | 186 us
_DECODE = TileConfig(16, 128, 64, 4, 1, 4, 2)
# batches of up to SMALL_DECODE_TOKENS tokens: 64-feature tiles, 69 KB smem, 3 CTAs per SM.  With 128
# features a batch-1 step of the 48B shape has 16 x 9 = 144 gate/up and 18 x 9 = 162 down CTAs of one
# per SM, two waves on 132 SMs: 36 + 18.5 us (ncu, cold weights) for 127 MB, 2.3 TB/s.
_DECODE_SMALL = TileConfig(16, 64, 64, 6, 1, 2, 3)
SMALL_DECODE_TOKENS = 8
# 32-row tiles (KDA_RT_MOE_FUSED32): decode batches of ~115-1370 tokens, where an expert's rows take two or more
# 16-row tiles (each re-reading its weights) and the 64-row tiles of moe_gemm_tc stream them at ~3.5 TB/s (bf16,
# batch 256) or widen e4m3 at ~1.6.  One warp row of 32 (two m16 fragments a warp), the _DECODE k steps: 92 KB of
# shared memory, 2 CTAs an SM; moe_decode_fused's producer-warp build 107 registers, no spills (NVRTC 13.5, sm_90a;
# its warps skip the m16 tile of a tile of at most 16 rows).  e4m3: the _FUSED_E4M3 k step (128 codes), 3 stages,
# 81 KB, 2 CTAs an SM (122 registers).
# FUSED32_E4M3: measured (H200, 2026-12-04, fiftieth session, full model fp8, decode graph replays at 2K context:
# tests/gpu/moe_fused32_check.sh, i.e. bench_ab.py --env KDA_RT_MOE_FUSED32 --values 0,1 --replays 128,256,512,768
# --rounds 2 --quantization fp8; same experts both ways, the two rounds within 0.3%), ms, 0 -> 1: batch 128 (4.5 rows
# an expert) 11.59 -> 13.05, 256 (9.0) 18.48 -> 19.80 (the 16-row tiles win there), 512 (17.9) 33.58 -> 33.51, 768
# (26.9, where 0 runs the 64-row tiles) 48.28 -> 47.22 (-2.2%).  So by default e4m3 stacks take 32-row tiles where
# they took 64-row ones (18 to 48 rows an expert); since the fifty-second session moe_decode_fused's own 64-row tiles
# take those steps instead (FUSED64_E4M3), the 32-row ones only with KDA_RT_MOE_FUSED64=0.
# FUSED32_BF16_MAX_AVG: bf16, the same replays (fifty-first session; --replays 128,256 in call 1, 128,192,256 in call 2
# against "0", 2 rounds each, same experts both ways), ms 64-row -> 32-row: batch 128 (4.48 rows an expert) 16.15 ->
# 15.52 and 15.88 -> 15.45 (-3.9% / -2.7%), 192 (6.72) 21.13 -> 21.77 (+3.0%), 256 (8.96) 22.65 -> 22.93 and 22.25 ->
# 22.63 (+1.2% / +1.7%).  So bf16 stacks take 32-row tiles from MIN_AVG_ROWS up to 5.5 rows an expert (batches of
# 115-157 tokens), where the measured crossover lies (between 4.48 and 6.72; 5.5 itself not measured).  (Found in the
# fifty-second session: bench_ab.py then replayed the smallest graph of at least the batch, so its "192" replays ran
# the 256-row graph, 64 of its rows padding, whose tile choice is that of 256 rows: the crossover lies between 4.48
# and 9.0 rows an expert; 5.5 stays until a 160 / 192-row graph is measured.)  Fifty-fifth session, against the
# 64-row tiles on moe_decode_fused with the A rows by cp.async and reversed items (the fifty-third's defaults; the
# fifty-first measured the 64-row tiles on two launches), exact graphs (tests/gpu/defaults53_bench.sh: bench_ab.py
# --env KDA_RT_MOE_FUSED32 --values auto,0 --replays 128,160 --rounds 1), ms 32-row -> 64-row: batch 128 14.942 ->
# 14.731 (-1.4%), 160 (5.0 rows an expert) 16.743 -> 16.747 (even).  So bf16 stacks no longer take 32-row tiles by
# default (KDA_RT_MOE_FUSED32=e4m3); "auto" keeps this band for A/Bs.
FUSED32_BF16_MAX_AVG = 5.5
_DECODE32 = TileConfig(32, 128, 64, 4, 1, 4, 2)
# 64-row tiles on moe_decode_fused (KDA_RT_MOE_FUSED64): two warp rows of 32 (2 x 4 consumer warps, each the 32-row
# tile's 32 x 32 warp tile: the same registers), the producer lane copying A rows lane and lane + 32; bf16 the _DECODE
# k step, 4 stages, 108 KB; e4m3 128 codes, 3 stages, 105 KB: 2 CTAs an SM.  A warp row with no rows of the tile skips
# its products.  H200, 2026-12-04, fifty-second session, full model, decode graph replays at 2K context
# (tests/gpu/moe_fused64_check.sh, 2 rounds within 0.5%, the same experts both ways):
# FUSED64_BF16: bf16 (bench_ab.py --env KDA_RT_MOE_FUSED64 --values 0,1 --replays 160,192,256,384), ms, two
# moe_grouped_gemm_tc launches -> fused: batch "160" 20.79 -> 21.44, "192" 21.56 -> 22.20 (both on the 256-row graph,
# bench_ab.py then taking the next bucket up), 256 22.87 -> 23.31, 384 29.33 -> 31.40 (+2-7%), with the A rows by one
# bulk copy each.  Fifty-third session (tests/gpu/dec_a_async_check.sh: bench_ab.py --env
# KDA_RT_MOE_DEC_A_ASYNC,KDA_RT_MOE_DEC_REVERSE,KDA_RT_MOE_FUSED64 --values 0:0:auto,1:0:auto,0:1:auto,1:1:1 --replays
# 32,128,256,384 --rounds 2, exact graphs; "auto" then meant today's "e4m3"), ms: 0:0:auto (bulk copies, plan order,
# bf16 64-row tiles on two launches) 8.707 / 15.352 / 22.626 / 28.989; A rows by cp.async 8.646 / 15.077 / 22.462 /
# 29.063; reverse order 8.587 / 15.224 / 22.479 / 28.955; both and the 64-row fused tiles 8.601 / 14.984 / 21.501 / 28.520 (-1.2 / -2.4 / -5.0 /
# -1.6%; at 256 the first three all run the two launches: ~0.7% is the replays' spread).  So by default the 64-row
# fused tiles take bf16 steps too, with the A rows by cp.async and the items in reverse order (env.moe_dec_a_async,
# env.moe_dec_reverse).  fp8 (--quantization fp8 --env KDA_RT_MOE_DEC_A_ASYNC --values 0,1 --replays 32,768):
# 6.113 / 46.272 -> 6.126 / 46.217, even; the reverse order there not timed.
# FUSED64_E4M3: fp8 (--env KDA_RT_MOE_FUSED32,KDA_RT_MOE_FUSED64 --values auto:1,0:1 --replays 512,768 --quantization
# fp8), 32-row fused -> 64-row fused: batch 768 (26.9 rows an expert) 47.83 -> 46.64 (-2.5%; batch 512, 17.9 rows,
# takes the 16-row tiles either way: 34.35 / 34.31); --values auto,0 --replays 640,960 (both on the 960-row graph,
# 33.6 rows an expert): 51.83 -> 50.54 and 57.99 -> 56.60.  So e4m3 stacks take the 64-row fused tiles from 18 rows
# an expert on.
_DECODE64 = TileConfig(64, 128, 64, 4, 2, 4, 2)


def _fits(t: TileConfig, nout: int, k: int, fuse_silu: bool, e4m3: bool = False) -> bool:
    threads = 32 * t.warps_m * t.warps_n
    rpp = threads // (t.bk // 8)
    ni = t.bn // t.warps_n // 8
    out_ok = (nout // 2) % (t.bn // 2) == 0 and ni % 4 == 0 and (t.bn // 2) % rpp == 0 if fuse_silu else nout % t.bn == 0
    if e4m3:  # (moe_gemm_tc.cu WFMT = 1: 16 weights a copied chunk, passes within each half, 4 n-tiles a load)
        rppw = threads // (t.bk // 16) if t.bk % 16 == 0 and threads % (t.bk // 16) == 0 else 0
        out_ok = out_ok and rppw > 0 and t.bn % rppw == 0 and (t.bn // 2) % rppw == 0 and ni % 4 == 0
    return out_ok and k % t.bk == 0 and k // t.bk >= t.stages - 1 and t.bm % rpp == 0 and t.bn % rpp == 0


def tile_config(bm: int, nout: int, k: int, fuse_silu: bool, tokens: int | None = None) -> TileConfig | None:
    """The tile for BM-row tiles of one GEMM (nout x k weights) in a step of `tokens` tokens (None: a
    larger batch), or None when no tile fits the shape."""
    small = bm == 16 and tokens is not None and tokens <= SMALL_DECODE_TOKENS
    base = _DECODE_SMALL if small else {128: _BIG, 32: _DECODE32, 16: _DECODE}.get(bm, _SMALL)
    short_k = base._replace(bk=32, stages=4)  # K of a few BK (small test shapes)
    for t in (base, short_k, base._replace(bn=128, warps_n=2), short_k._replace(bn=128, warps_n=2)):
        if _fits(t, nout, k, fuse_silu):
            return t
    return None


def built_tile_rows(e4m3: bool) -> tuple[int, ...]:
    """The tile rows prefill_tile_rows can pick for stacks of this format under KDA_RT_MOE_FUSED32 and
    KDA_RT_MOE_FUSED64 (the precompile builds their kernels): where 32-row tiles apply to e4m3 stacks they take every
    step that would have taken 64 rows."""
    rows32 = env.moe_fused32()
    if rows32 == "1" or (rows32 in ("e4m3", "auto") and e4m3 and 64 not in fused_rows(True)):
        return (16, 32, 128)
    return (16, 32, 64, 128) if rows32 == "auto" and not e4m3 else (16, 64, 128)


def prefill_tile_rows(num_pairs: int, num_experts: int, hidden: int, inter: int, e4m3: bool = False) -> int:
    """BM for a step of num_pairs (token, expert) rows (16 at decode sizes), or 0 when no tile fits (D, I);
    `e4m3`: the stacks hold e4m3 codes (16-row tiles up to more rows an expert)."""
    avg = num_pairs / max(1, min(num_experts, num_pairs))
    small_below = env.moe_min_avg_rows(MIN_AVG_ROWS_E4M3 if e4m3 else MIN_AVG_ROWS)
    bm = 128 if avg >= BIG_TILE_AVG_ROWS else 64 if avg >= small_below else 16
    rows32 = env.moe_fused32()
    if bm == 64 and e4m3 and rows32 in ("e4m3", "auto") and 64 not in fused_rows(True):
        bm = 32  # (FUSED32_E4M3's note; by default the 64-row fused tiles take these steps: FUSED64_E4M3)
    elif bm == 64 and not e4m3 and rows32 == "auto" and avg < FUSED32_BF16_MAX_AVG:
        bm = 32  # (FUSED32_BF16_MAX_AVG's note)
    elif bm != 128 and avg >= min(small_below, MIN_AVG_ROWS) and rows32 == "1":
        bm = 32  # (from MIN_AVG_ROWS in both formats, or from KDA_RT_MOE_MIN_AVG_ROWS where it is lower)
    ok = tile_config(bm, 2 * inter, hidden, True) and tile_config(bm, hidden, inter, False)
    return bm if ok else 0


def copies_weights_early(tile: TileConfig, fuse_silu: bool) -> bool:
    """The down GEMM of small decode batches (the 16 x 64 tile, 3 CTAs per SM) copies its first weight steps
    before waiting for gate/up (EARLY_B).  Graph replay on the full model (tests/gpu/bench_ab.py --replays,
    H200, 2026-12-01): batch 1 2.684 -> 2.577 ms, batch 8 5.775 -> 5.722; but with the batch-32 tile (one
    CTA per SM) 8.871 -> 8.950 ms, so not there: an early down block holds an SM that gate/up's next wave needs."""
    return not fuse_silu and tile.bm == 16 and tile.min_blocks >= 3 and env.early_weights()


def e4m3_tile(tile: TileConfig, shapes: list[tuple[int, int, bool]]) -> TileConfig | None:
    """The tile for e4m3 weights: a 16-row (decode) tile with twice its k step where every (nout, k, fuse_silu) GEMM
    of `shapes` takes it (the same weight bytes a stage as bf16: measured, bench_moe_decode.py --e4m3), else `tile`
    where they take that, else None.  Larger tiles keep their k step (twice it would double their A stages too and
    halve the CTAs an SM; not measured)."""
    for t in ((tile._replace(bk=2 * tile.bk), tile) if tile.bm == 16 else (tile,)):
        if all(_fits(t, nout, k, silu, e4m3=True) for nout, k, silu in shapes):
            return t
    return None


# moe_decode_fused with e4m3 weights: 128 features, a 128-wide k step (16 KB of codes a stage), 3 stages, 3 CTAs an SM
# (68,352 bytes of shared memory each) for every batch it runs (measured at 8, 32 and 64 tokens; 2-4 not).  H200,
# 2026-12-02, tests/gpu/bench_moe_decode.py --e4m3
# --tokens 8,32,64 --tiles ... (graph replays, 8 routings cycled), against e4m3_tile's (4 stages, 2 CTAs an SM from
# 9 tokens; 64 features, 6 stages, 3 CTAs up to 8): T = 8 58.9 experts 149.0 -> 115.9 us, 17.0 experts 50.2 -> 46.4;
# T = 32 164.0 experts 324.7 -> 300.5, 67.6 experts 143.0 -> 134.0; T = 64 221.5 experts 434.0 -> 403.9, 134.5
# experts 272.3 -> 253.8 (3.57-3.88 TB/s of codes).  Slower: 64-wide k steps at 6-8 stages (2.5-2.8 TB/s), 256
# features (8 warps) at 3 stages one CTA an SM (2.9) or 2 stages two (3.5-3.7), 64 features (2.7-2.9).
_FUSED_E4M3 = TileConfig(16, 128, 128, 3, 1, 4, 3)
_FUSED_E4M3_32 = TileConfig(32, 128, 128, 3, 1, 4, 2)  # (_DECODE32's note)
_FUSED_E4M3_64 = TileConfig(64, 128, 128, 3, 2, 4, 2)  # (_DECODE64's note)


def fused_e4m3_tile(tile: TileConfig, shapes: list[tuple[int, int, bool]]) -> TileConfig | None:
    """moe_decode_fused's tile for e4m3 weights, given its bf16 tile: _FUSED_E4M3 where both GEMMs of `shapes` take
    it, else e4m3_tile's."""
    fused = {16: _FUSED_E4M3, 32: _FUSED_E4M3_32, 64: _FUSED_E4M3_64}.get(tile.bm) if tile is not None else None
    if fused is not None and all(_fits(fused, n, k, silu, e4m3=True) for n, k, silu in shapes):
        return fused
    return e4m3_tile(tile, shapes) if tile is not None else None


def weight_format(e4m3: bool) -> dict[str, int]:
    """The build defines of a weight format (both grouped-GEMM kernels): e4m3 with the launcher's conversion."""
    return {"WFMT": 1, "E4M3_CVT": E4M3_CONVERT} if e4m3 else {}


def tc_kernel(tile: TileConfig, K: int, nout: int, fuse_silu: bool, top_k: int, e4m3: bool = False):
    """The kernel variant of one grouped GEMM (built on first use; the runner builds them at start)."""
    early = {"EARLY_B": 1} if copies_weights_early(tile, fuse_silu) else {}
    return get_kernel("moe_gemm_tc.cu", "moe_grouped_gemm_tc", max_dynamic_smem=tile.smem(e4m3), K=K, NOUT=nout,
                      FUSE_SILU=fuse_silu, TOPK=top_k, BM=tile.bm, BN=tile.bn, BK=tile.bk, STAGES=tile.stages,
                      WARPS_M=tile.warps_m, WARPS_N=tile.warps_n, MIN_BLOCKS=tile.min_blocks, **early, **weight_format(e4m3))


def check_scale(what: str, name: str, scale, weight) -> None:
    """An e4m3 weight's row scales: fp32 [E, NOUT], 8-byte aligned (the epilogue reads a thread's two as one piece)."""
    from kda_rt.cuda.ops.gemv import check_e4m3_arch

    expect(scale, name, shape=weight.shape[:2], dtype=np.float32)
    if not scale.flags.c_contiguous or scale.data.ptr % 8:
        raise ValueError(f"{what}: {name} must be C-contiguous and start on an 8-byte boundary")
    check_e4m3_arch(what)


def check_grouped_gemm(src, weight, plan: MoEPlan, fuse_silu: bool, out,
                       e4m3: bool = False, e4m3_src: bool = False) -> tuple[int, int, int, int]:
    """The contract shared by the grouped-GEMM launchers (this one and moe_gemm_wg.py); returns
    (K, E, NOUT, N).  e4m3: the weight is uint8 e4m3 bits (its scale checked by the caller); e4m3_src: the source
    too (moe_gemm_wg only)."""
    _, K = expect(src, "src", ndim=2, dtype=np.uint8 if e4m3_src else BF16)
    E, nout, _ = expect(weight, "weight", shape=(None, None, K))
    if weight.dtype != (np.uint8 if e4m3 else BF16):
        want = "uint8 (e4m3 bits, with scales)" if e4m3 else "bfloat16 (or uint8 e4m3 bits with scales)"
        raise TypeError(f"grouped GEMM: weight must have dtype {want}, got {weight.dtype.name}")
    N = plan.sorted_pair.shape[0]
    if fuse_silu:
        expect(out, "out", shape=(N, nout // 2), dtype=BF16)
    else:
        expect(src, "src", shape=(N, K))
        expect(out, "out", shape=(N, nout), dtype=BF16)
    return K, E, nout, N


def moe_gemm_tc(src, weight, plan: MoEPlan, *, top_k: int, fuse_silu: bool, out, tile: TileConfig | None = None,
                scale=None, stream=None):
    """fuse_silu: src = x [T, K], weight = w13 [E, 2I, K] -> out h [N, I] bf16 (h = SiLU(gate)·up).
    else:       src = h [N, K], weight = w2 [E, D, K]  -> out y [N, D] bf16 (unscaled expert rows).
    With scale [E, NOUT] fp32 the weight holds e4m3 values as uint8 bits (loader/quant.quantize_rows per expert):
    each sum is then its weight row's scale times the fp32 sum, rounded as above (default tile: e4m3_tile's)."""
    e4m3 = scale is not None
    K, E, nout, N = check_grouped_gemm(src, weight, plan, fuse_silu, out, e4m3=e4m3)
    if e4m3:
        check_scale("moe_gemm_tc", "scale", scale, weight)
    if tile is None:
        tile = tile_config(plan.tile_rows, nout, K, fuse_silu, tokens=N // top_k)
        tile = e4m3_tile(tile, [(nout, K, fuse_silu)]) if e4m3 and tile else tile
    if tile is None or tile.bm != plan.tile_rows or not _fits(tile, nout, K, fuse_silu, e4m3):
        raise ValueError(f"moe_gemm_tc: no tile {tile} for BM={plan.tile_rows}, K={K}, NOUT={nout}"
                         f"{' (e4m3 weights)' if e4m3 else ''}")
    kernel = tc_kernel(tile, K, nout, fuse_silu, top_k, e4m3)
    grid = ((nout // 2 if fuse_silu else nout) // (tile.bn // 2 if fuse_silu else tile.bn), max_tiles(N, E, tile.bm))
    if N:
        kernel(grid, (32 * tile.warps_m * tile.warps_n,), (src, plan.sorted_pair, weight, plan.tile_expert,
               plan.tile_row, plan.expert_off, plan.num_tiles, out, scale if e4m3 else np.uint64(0)),
               shared_mem=tile.smem(e4m3), stream=stream)
    return out


# ---------------------------------------------------------------------------------------------
# both decode GEMMs in one launch (moe_decode_fused in kernels_cu/moe_gemm_tc.cu)


# Steps of fewer tokens keep the two launches: at batch 1 the fused kernel lost (H200, 2026-12-01, graph
# replays: bench_moe_decode.py --fused T = 1 34.5 -> 39.1 us; the full model's batch-1 step 2.538 -> 2.565 ms),
# from T = 4 it wins (113.3 -> 107.4 us; batch 8 5.559 -> 5.425 ms, batch 32 8.416 -> 8.160 ms).
FUSED_MIN_TOKENS = 2
# the tile rows moe_decode_fused takes (its producer-warp form copies one A row a lane, two at 64 rows)
FUSED_TILE_ROWS = (16, 32, 64)


def fused_rows(e4m3: bool) -> tuple[int, ...]:
    """The tile rows of the steps that run moe_decode_fused (from FUSED_MIN_TOKENS tokens) for stacks of this format:
    16 and 32, and 64 where KDA_RT_MOE_FUSED64 says (by default both formats: FUSED64_E4M3, FUSED64_BF16)."""
    rows64 = env.moe_fused64()
    return FUSED_TILE_ROWS if rows64 in ("auto", "1") or (rows64 == "e4m3" and e4m3) else FUSED_TILE_ROWS[:2]


def fused_decode_tile(tokens: int, hidden: int, inter: int, bm: int = 16) -> TileConfig | None:
    """The `bm`-row decode tile (16, 32 or 64: FUSED_TILE_ROWS) that both GEMMs of a `tokens`-token step take
    as they are (gate/up: w13 [2I, D], down: w2 [D, I]), or None: then the two-launch path runs."""
    if bm not in FUSED_TILE_ROWS:
        return None
    if bm == 64:  # (not moe_grouped_gemm_tc's 64-row tile: _DECODE64's note)
        ok = _fits(_DECODE64, 2 * inter, hidden, True) and _fits(_DECODE64, hidden, inter, False)
        return _DECODE64 if ok else None
    t = tile_config(bm, 2 * inter, hidden, True, tokens)
    if t is None or t != tile_config(bm, hidden, inter, False, tokens):
        return None
    return t if _fits(t, 2 * inter, hidden, True) and _fits(t, hidden, inter, False) else None


def sync_words(num_pairs: int, num_bins: int) -> int:
    """int32 counters moe_decode_fused needs: the item counter and one per tile of 16 rows."""
    return 1 + max_tiles(num_pairs, num_bins, 16)


def decode_ws(tile: TileConfig | None = None, e4m3: bool = False) -> int:
    """1 where moe_decode_fused runs its producer-warp form (moe_gemm_tc.cu DEC_WS: tensor-map weight copies into
    128-byte-swizzled stages): sm_90+, KDA_RT_MOE_DECODE_WS on (the default), and `tile` (when given) with 128-byte
    k steps and the swizzled stages' 1024-byte alignment within its shared memory; else 0 (the plain form)."""
    if not env.moe_decode_ws() or arch_number(device_arch()) < 90:  # (the arch the kernels are built for)
        return 0
    if tile is not None:
        a_bytes = tile.stages * tile.bm * (tile.bk + 8) * 2
        swizzled = a_bytes + 1023 + tile.stages * tile.bn * 128
        if tile.bk * (1 if e4m3 else 2) != 128 or tile.bn // 2 > 256 or swizzled > tile.smem(e4m3):
            return 0
    return 1


def fused_kernel(tile: TileConfig, hidden: int, inter: int, top_k: int, e4m3: bool = False, form: int | None = None):
    """The moe_decode_fused variant (built on first use; the runner builds them at start); form: decode_ws's (None: asked
    here)."""
    form = decode_ws(tile, e4m3) if form is None else form
    # DEC_A_ASYNC (KDA_RT_MOE_DEC_A_ASYNC, the producer warp's A rows by cp.async) and DEC_REVERSE (KDA_RT_MOE_DEC_REVERSE,
    # the items in reverse tile order), both on by default (FUSED64_BF16's note), absent when off
    switches = {"DEC_A_ASYNC": 1} if form and env.moe_dec_a_async() else {}
    if env.moe_dec_reverse():
        switches["DEC_REVERSE"] = 1
    return get_kernel("moe_gemm_tc.cu", "moe_decode_fused", max_dynamic_smem=tile.smem(e4m3), FUSED_DECODE=1,
                      HIDDEN=hidden, INTER=inter, TOPK=top_k, BM=tile.bm, BN=tile.bn, BK=tile.bk, STAGES=tile.stages,
                      WARPS_M=tile.warps_m, WARPS_N=tile.warps_n, MIN_BLOCKS=tile.min_blocks, **weight_format(e4m3),
                      **({"DEC_WS": form} if form else {}), **switches)


def moe_decode_fused(x, w13, w2, plan: MoEPlan, *, top_k: int, h, out, sync, tile: TileConfig | None = None,
                     ctas: int | None = None, scale13=None, scale2=None, stream=None):
    """Both expert GEMMs of a decode step in one launch: h = SiLU(x·w13_gateᵀ)·(x·w13_upᵀ) per bucketed row,
    out = h·w2ᵀ, each exactly as moe_gemm_tc's two launches compute them on the same tile (same order; with e4m3
    weights the default tiles differ, fused_e4m3_tile against e4m3_tile).
    x [T, D] bf16, w13 [E, 2I, D], w2 [E, D, I] bf16, plan built with tile_rows = 16, 32 or 64 (moe_bucket with
    sync=sync: the counters must be zero), h [N, I] and out [N, D] bf16, sync int32 [>= sync_words(N, E)].
    ctas: the grid (default: as many CTAs as the GPU holds at once; any number >= 1 is correct, since every
    item is claimed from a counter by a running CTA).
    scale13 [E, 2I] and scale2 [E, D] fp32 (both or neither): w13 and w2 hold e4m3 values as uint8 bits
    (loader/quant.quantize_rows per expert), each sum its weight row's scale times the fp32 sum (default tile:
    fused_e4m3_tile's)."""
    if (scale13 is None) != (scale2 is None):
        raise ValueError("moe_decode_fused: e4m3 weights need both scale13 and scale2 (bf16: neither)")
    e4m3 = scale13 is not None
    K, E, two_i, N = check_grouped_gemm(x, w13, plan, True, h, e4m3=e4m3)
    inter = two_i // 2
    check_grouped_gemm(h, w2, plan, False, out, e4m3=e4m3)
    expect(w2, "w2", shape=(E, K, inter))
    if e4m3:
        check_scale("moe_decode_fused", "scale13", scale13, w13)
        check_scale("moe_decode_fused", "scale2", scale2, w2)
    expect(sync, "sync", ndim=1, dtype=np.int32)
    if sync.size < sync_words(N, E):
        raise ValueError(f"moe_decode_fused: sync has {sync.size} counters, needs {sync_words(N, E)}")
    if tile is None:
        tile = fused_decode_tile(N // top_k, K, inter, plan.tile_rows)
        tile = fused_e4m3_tile(tile, [(two_i, K, True), (K, inter, False)]) if e4m3 and tile else tile
    if (tile is None or plan.tile_rows not in FUSED_TILE_ROWS or tile.bm != plan.tile_rows
            or not (_fits(tile, two_i, K, True, e4m3) and _fits(tile, K, inter, False, e4m3))):
        raise ValueError(f"moe_decode_fused: no {plan.tile_rows}-row tile {tile} for D={K}, I={inter} (plan "
                         f"BM={plan.tile_rows}; tiles of {FUSED_TILE_ROWS} rows){' with e4m3 weights' if e4m3 else ''}")
    items = max_tiles(N, E, tile.bm) * (inter // (tile.bn // 2) + K // tile.bn)
    form = decode_ws(tile, e4m3)  # (DEC_WS: the consumer warps and one producer warp)
    kernel, threads = fused_kernel(tile, K, inter, top_k, e4m3, form), 32 * (tile.warps_m * tile.warps_n + (form > 0))
    if ctas is not None and ctas < 1:
        raise ValueError(f"moe_decode_fused: ctas must be >= 1, got {ctas}")
    if not ctas:
        import cupy

        from kda_rt.cuda.ops.pdl import resident_per_sm

        ctas = sm_count(cupy.cuda.Device().id) * resident_per_sm(kernel, threads, tile.smem(e4m3))
    grid = min(items, ctas)
    null = np.uint64(0)
    maps = (null, null)
    if form:  # (encoded once per weight and stream and never evicted: a decode graph keeps their addresses)
        from kda_rt.cuda.ops.tma import map_2d_swizzled

        maps = tuple(np.uint64(map_2d_swizzled(w, tile.bn // 2, name, stream=stream, keep=True).data.ptr)
                     for w, name in ((w13, "w13"), (w2, "w2")))
    if N:
        kernel((grid,), (threads,), (
            x, plan.sorted_pair, w13, w2, plan.tile_expert, plan.tile_row, plan.expert_off, plan.num_tiles, h, out,
            sync, scale13 if e4m3 else null, scale2 if e4m3 else null, *maps), shared_mem=tile.smem(e4m3),
            stream=stream)
    return out
