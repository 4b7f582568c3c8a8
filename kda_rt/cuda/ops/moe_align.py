"""Launchers for kernels_cu/moe_align.cu: bucket (token, expert) pairs by expert for the grouped
GEMM (`moe_bucket`), and gather the expert rows back per token with the routing weights (`moe_combine`).

Letters: T tokens, A active experts per token, E experts, N = T·A pairs, D hidden, BT tile rows."""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import numpy as np

from kda_rt.cuda.ops.check import expect, f32, i32
from kda_rt.cuda.ops.compile import get_kernel
from kda_rt.cuda.ops.rmsnorm import rmsnorm

__all__ = ["FUSED_NORM_MAX_T", "WIDE_MIN_PAIRS", "MoEPlan", "NormAfter", "bucket_kernel", "bucket_scratch_words",
           "check_plan", "fits_norm", "live_arg", "max_tiles", "moe_bucket", "moe_combine"]

_BUCKET_THREADS = 1024  # one block of 32 warps: its scan adds up one total per warp in a single warp
# From this many pairs the bucketing runs as count / plan / scatter over up to _WIDE_BLOCKS blocks instead of in
# one block (tests/gpu/bench_bucket.py, H200, 2026-12-01, graph replays, 257 bins: 4608 pairs 7.3 us in one
# block against 8.3 in three launches, 9216 pairs 12.4 against 9.2; table in moe_align.cu's header)
WIDE_MIN_PAIRS = 8192
_WIDE_BLOCKS = 64
_WIDE_MIN_CHUNK = 1024  # pairs per block at least
_COMBINE_THREADS = 64  # 256 columns per block: D = 2304 spreads one token over 9 SMs
_NORM_MAX_THREADS = 1024  # moe_combine_norm: one block per token


class NormAfter(NamedTuple):
    """The residual add and RMSNorm that follow the MoE block (moe_combine(norm=...)): residual [T, D] bf16
    (updated in place), weight [D] bf16, eps; residual_in: where the stream is read from when not residual
    itself (moe_route_fused's NormBefore.h_out)."""

    residual: object
    weight: object
    eps: float
    residual_in: object = None


class MoEPlan(NamedTuple):
    """Device arrays written by moe_bucket (all int32) and the tile height they were built for."""

    expert_off: object  # [E + 1]  first sorted row of each expert; [E] = N
    sorted_pair: object  # [N]     pair index t·A + k of each sorted row
    pair_pos: object  # [N]        sorted row of each pair
    tile_expert: object  # [max_tiles]
    tile_row: object  # [max_tiles]  first sorted row of each tile
    num_tiles: object  # [1]        tiles in use (the rest of the grid exits at once)
    tile_rows: int  # BT


def max_tiles(num_pairs: int, num_experts: int, tile_rows: int) -> int:
    """Upper bound of Σ_e ceil(n_e / BT) over experts with n_e > 0: N / BT + (touched experts)."""
    return -(-num_pairs // tile_rows) + min(num_experts, num_pairs)


def bucket_scratch_words(num_pairs: int, num_bins: int) -> int:
    """int32 scratch moe_bucket needs for `num_pairs` pairs into `num_bins` bins (0: the one-block kernel)."""
    return _wide_scratch_words(num_bins) if num_pairs >= WIDE_MIN_PAIRS else 0


def _wide_scratch_words(num_bins: int) -> int:  # counts [bins], then base [_WIDE_BLOCKS][bins]
    return num_bins * (1 + _WIDE_BLOCKS)


def moe_bucket(ids, num_experts: int, plan: MoEPlan, *, stats=None, shared_slot: bool = False, sync=None,
               scratch=None, wide: bool | None = None, stream=None, live=None) -> MoEPlan:
    """ids: [T, A] int32 expert ids (each token's ids distinct) -> fills `plan` in place.
    stats: optional int32 [2] device counter: [0] += routed experts touched by this call, [1] += 1.
    shared_slot: the shared expert is expert `num_experts` of the stacks: every token gets an
    (A+1)-th pair for it (pairs t·(A+1) + k, the plan has T·(A+1) rows and num_experts + 1 bins).
    sync: optional int32 [n] device array, zeroed in the same launch (the counters of moe_decode_fused).
    scratch: int32 device array of >= bucket_scratch_words(N, bins) words for the three-launch path of large N
    (allocated here when None); wide: force that path (True) or the one-block kernel (False), None: by N.
    live: optional int32 [1] device count of live tokens: only the pairs of tokens below it are planned (the plan's
    rows then stop at live x pairs-a-token; moe_bucket.cuh LIVE_PAIRS)."""
    T, A = expect(ids, "ids", ndim=2, dtype=np.int32)
    pairs = A + 1 if shared_slot else A
    N, E = T * pairs, num_experts + (1 if shared_slot else 0)
    if not 1 <= E <= _BUCKET_THREADS:
        raise ValueError(f"moe_bucket: num_experts must be in [1, {_BUCKET_THREADS - int(shared_slot)}], got {num_experts}")
    check_plan(plan, N, E, stats, sync, "moe_bucket")
    largs = live_arg(live)
    live_pairs = pairs if largs else 0
    if N and (N >= WIDE_MIN_PAIRS if wide is None else wide):
        _bucket_wide(ids, N, E, A if shared_slot else 0, plan, stats, sync, scratch, stream, largs, live_pairs)
        return plan
    kernel = bucket_kernel(E, plan.tile_rows, A if shared_slot else 0, live_pairs=live_pairs)
    null = np.uint64(0)
    kernel((1,), (_BUCKET_THREADS,), (ids, i32(N), plan.expert_off, plan.sorted_pair, plan.pair_pos,
                                      plan.tile_expert, plan.tile_row, plan.num_tiles,
                                      stats if stats is not None else null, sync if sync is not None else null,
                                      i32(0 if sync is None else sync.size), *largs), stream=stream)
    return plan


def live_arg(live) -> tuple:
    """The kernels' last argument where a live token count is given (moe_bucket.cuh LIVE_PARAM: int32 [1] on the
    device, checked here), else none."""
    if live is None:
        return ()
    expect(live, "live", shape=(1,), dtype=np.int32)
    return (live,)


def _bucket_wide(ids, N: int, E: int, shared_a: int, plan: MoEPlan, stats, sync, scratch, stream, largs=(),
                 live_pairs: int = 0) -> None:
    """moe_bucket_count / _plan / _scatter (moe_align.cu) over G blocks of whole tokens."""
    import cupy

    per_token = shared_a + 1 if shared_a else 1
    blocks = max(1, min(_WIDE_BLOCKS, N // _WIDE_MIN_CHUNK))
    per_block = -(-N // blocks)
    chunk = -(-per_block // per_token) * per_token  # whole tokens per block
    blocks = -(-N // chunk)
    words = _wide_scratch_words(E)
    if scratch is None:
        scratch = cupy.empty(words, dtype=np.int32)
    expect(scratch, "scratch", ndim=1, dtype=np.int32)
    if scratch.size < words:
        raise ValueError(f"moe_bucket: scratch has {scratch.size} int32 words, needs {words} (bucket_scratch_words)")
    counts, base = scratch[:E], scratch[E:words]
    kernel = functools.partial(bucket_kernel, E, plan.tile_rows, shared_a, live_pairs=live_pairs)
    null = np.uint64(0)
    on = stream if stream is not None else cupy.cuda.get_current_stream()
    cupy.cuda.runtime.memsetAsync(counts.data.ptr, 0, 4 * E, on.ptr)
    kernel("moe_bucket_count")((blocks,), (_BUCKET_THREADS,), (ids, i32(N), i32(chunk), counts, base, *largs),
                               stream=stream)
    kernel("moe_bucket_plan")(
        (1,), (_BUCKET_THREADS,), (counts, plan.expert_off, plan.tile_expert, plan.tile_row, plan.num_tiles,
                                   stats if stats is not None else null, sync if sync is not None else null,
                                   i32(0 if sync is None else sync.size)), stream=stream)
    kernel("moe_bucket_scatter")(
        (blocks,), (_BUCKET_THREADS,), (ids, i32(N), i32(chunk), plan.expert_off, base, plan.sorted_pair,
                                        plan.pair_pos, *largs), stream=stream)


def check_plan(plan: MoEPlan, num_pairs: int, num_bins: int, stats, sync, who: str) -> None:
    """The plan arrays (and the optional stats / sync arrays) a bucketing of `num_pairs` pairs into `num_bins`
    bins writes: names the first one of the wrong shape or dtype."""
    tiles = max_tiles(num_pairs, num_bins, plan.tile_rows)
    for name, shape in (("expert_off", (num_bins + 1,)), ("sorted_pair", (num_pairs,)), ("pair_pos", (num_pairs,)),
                        ("num_tiles", (1,)), ("tile_expert", (None,)), ("tile_row", (None,))):
        expect(getattr(plan, name), f"plan.{name}", shape=shape, dtype=np.int32)
    if min(plan.tile_expert.size, plan.tile_row.size) < tiles:
        raise ValueError(f"{who}: tile arrays need >= {tiles} entries")
    if stats is not None:
        expect(stats, "stats", shape=(2,), dtype=np.int32)
    if sync is not None:
        expect(sync, "sync", ndim=1, dtype=np.int32)


def bucket_kernel(num_bins: int, tile_rows: int, shared_a: int, name: str = "moe_bucket", live_pairs: int = 0):
    """The moe_bucket variant (or `name`: moe_bucket_count / _plan / _scatter, the same module) for `num_bins`
    experts (with the shared slot: E + 1), tiles of `tile_rows`, `shared_a` = top_k when the shared expert is a
    slot, else 0; live_pairs: the pairs a token, for the build that takes a live token count (LIVE_PAIRS)."""
    return get_kernel("moe_align.cu", name, E=num_bins, BT=tile_rows, BUCKET_THREADS=_BUCKET_THREADS,
                      SHARED_A=shared_a, **({"LIVE_PAIRS": live_pairs} if live_pairs else {}))


def moe_combine(y, pair_pos, w, shared=None, *, shared_in_y: bool = False, out=None, norm=None, stream=None,
                live=None):
    """out[t] = bf16(shared[t] + Σ_k w[t, k] · y[pair_pos[t·A + k]]).
    y: [N, D] bf16, pair_pos: [N] int32, w: [T, A] fp32, shared: optional [T, D] fp32 -> out [T, D] bf16.
    shared_in_y: the plan was bucketed with shared_slot (N = T·(A+1)): the shared expert's row of token t
    is y[pair_pos[t·(A+1) + A]] (then `shared` must be None).
    norm: a NormAfter (residual [T, D] bf16, weight [D] bf16, eps): also the block's residual add and the
    next RMSNorm: residual = bf16(residual_in + bf16(combine)) (residual_in: norm.residual unless given),
    out = RMSNorm(residual), as rmsnorm(combine, weight, eps, residual=residual, out=out); in the same launch
    (moe_combine_norm) where `fits_norm(D)`, else the combine then rmsnorm.
    live: optional int32 [1] device count of live tokens (moe_bucket's `live`): tokens from it on get zeros (with
    `norm`: zeros out, their residual rows untouched; moe_bucket.cuh LIVE_TOKENS) and read no plan row."""
    import cupy

    from kda_rt.cuda.ops.check import BF16

    T, A = expect(w, "w", ndim=2, dtype=np.float32)
    pairs = A + 1 if shared_in_y else A
    _, D = expect(y, "y", shape=(T * pairs, None), dtype=BF16)
    expect(pair_pos, "pair_pos", shape=(T * pairs,), dtype=np.int32)
    if shared is not None:
        if shared_in_y:
            raise ValueError("moe_combine: give `shared` or shared_in_y, not both")
        expect(shared, "shared", shape=(T, D), dtype=np.float32)
    if D % 4:
        raise ValueError(f"moe_combine: hidden size {D} must be a multiple of 4")
    out = cupy.empty((T, D), dtype=BF16) if out is None else out
    expect(out, "out", shape=(T, D), dtype=BF16)
    has_shared = 2 if shared_in_y else int(shared is not None)
    args = (y, pair_pos, w, shared if shared is not None else y)
    largs = live_arg(live)
    live_kw = {"LIVE_TOKENS": 1} if largs else {}
    if norm is not None:
        expect(norm.residual, "norm.residual", shape=(T, D), dtype=BF16)
        expect(norm.weight, "norm.weight", shape=(D,), dtype=BF16)
        if norm.residual_in is not None:
            expect(norm.residual_in, "norm.residual_in", shape=(T, D), dtype=BF16)
        for name in ("residual", "residual_in"):
            arr = getattr(norm, name)
            if arr is not None and arr.data.ptr % 8:
                raise ValueError(f"moe_combine: norm.{name} must start on an 8-byte boundary (8-byte accesses)")
    if norm is not None and not fits_norm(D):  # the combine, then the add and norm as their own kernel
        delta = moe_combine(y, pair_pos, w, shared, shared_in_y=shared_in_y, stream=stream, live=live)
        if norm.residual_in is not None:
            with stream if stream is not None else contextlib.nullcontext():
                norm.residual[...] = norm.residual_in
        return rmsnorm(delta, norm.weight, norm.eps, residual=norm.residual, out=out, stream=stream)
    if norm is not None:
        threads = max(-(-D // 128) * 32, -(-(pairs + 1) // 32) * 32)  # 4 columns a thread, whole warps
        kernel = get_kernel("moe_align.cu", "moe_combine_norm", D=D, A=A, THREADS=threads, HAS_SHARED=has_shared,
                            NORM=1, **live_kw)
        res_in = norm.residual if norm.residual_in is None else norm.residual_in
        if T:
            kernel((T,), (threads,), (*args, norm.residual, norm.weight, out, i32(T), f32(norm.eps), res_in,
                                      *largs), stream=stream)
        return out
    threads = max(_COMBINE_THREADS, -(-(pairs + 1) // 32) * 32)  # 4 columns a thread; >= one thread per pair
    kernel = get_kernel("moe_align.cu", "moe_combine", D=D, A=A, THREADS=threads, HAS_SHARED=has_shared, **live_kw)
    if T:
        kernel((T, -(-D // (4 * threads))), (threads,), (*args, out, i32(T), *largs), stream=stream)
    return out


def fits_norm(hidden: int) -> bool:
    """moe_combine(norm=...) runs for this hidden size (one block of <= 1024 threads covers a row)."""
    return hidden % 4 == 0 and hidden <= 4 * _NORM_MAX_THREADS


# The model fuses the combine with the next norm for steps of up to this many tokens: graph replay on the full
# model (tests/gpu/bench_ab.py --replays, H200, 2026-12-01): batch 1 2.684 -> 2.660 ms, batch 8 5.775 -> 5.751,
# batch 32 8.871 -> 8.957 (32 blocks of one token each load 9 rows with 8-byte loads: slower than the combine's
# 288 narrow blocks followed by rmsnorm).  Measured again after the programmatic launches and the fused decode
# MoE (seventeenth session, `bench_ab.py --env KDA_RT_FUSED_NORM_MAX_T --values 8,32 --replays 16,32`, two calls):
# batch 32 7.9219 -> 7.8920 and 7.8070 -> 7.7785 ms (-0.4%), batch 16 7.0095 -> 6.9775 (-0.5%); the seed
# prefill with every step fused (100000) 0.925 -> 0.924 s TTFT max: no gain, so prefill steps keep two kernels.
FUSED_NORM_MAX_T = 32
