"""MLA attention over the paged latent cache, absorbed form (kernels_cu/mla_attn.cu + two up-projections).

    (store)     this step's latent rows into the pool        in mla_absorb_q's launch (T <= 8), else mla_store
    q_lat[t, h] = W_UK_hᵀ q_nope[t, h]                    mla_absorb_q (T <= 8) or cuBLAS bmm (bf16 out)
    ctx[t, h]   = softmax(scale · [q_lat | q_pe] · kvᵀ) · c   mla_attn_split (+ mla_attn_combine{4,8,16})
    out[t, h]   = W_UV_h ctx[t, h]                         mla_expand_out (T <= 8) or bmm -> [T, H·Dv] for o_proj

Decode and prefill share the path (prefill queries are one group per token, causal by length).
Letters: T new tokens, B sequences, H heads, M page slots per sequence, R latent rank, Dn/Dr/Dv
nope/pe/value head dims, S context splits.  w_kvb is used as stored in the checkpoint
([H·(Dn+Dv), R], per head W_UK rows then W_UV rows): no load-time transform is needed.

Workspace (bytes from `decode_workspace_bytes`): q_lat/ctx bf16 [T, H, R], then when S > 1
partial bf16 [T, S, H, R] (each split's acc / l) and stats fp32 [T, S, H, 2] (m, l).  S depends only
on (T, M, block_size, SMs), so a decode launch has a fixed grid for a fixed (B, M) and captures in a
CUDA graph; the kernel shares each token's actual context out over at most S splits of at least
_MIN_TILES tiles at run time (a short context uses few splits, and one split writes ctx directly).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from kda_rt import env
from kda_rt.cuda.gemm import bmm
from kda_rt.cuda.ops.check import BF16, expect, f32, i32, leading_dim
from kda_rt.cuda.ops.compile import get_kernel, sm_count
from kda_rt.cuda.ops.mla_store import check_rows, mla_store

__all__ = ["LatentStore", "mla_attention", "mla_dims", "decode_workspace_bytes", "launch_splits", "num_splits"]

_NT = 64  # positions per tile of mla_attn_split (the score GEMM: 2 warps x 32 positions x 4 warps of depth)
_THREADS = 256
# A split reads at least this many tiles.  1 (was 2): at batch 1-4 and 2K context each token's 32 tiles go to 32
# one-tile splits on 32-128 SMs instead of 16 two-tile ones; a block's KV stream is bound by what one SM keeps in
# flight, so more SMs finish sooner, and the combine of 32 partials costs about what it did for 16.  Graph replays
# of the full model (tests/gpu/bench_ab.py --env KDA_RT_MLA_MIN_TILES, H200, 2026-12-01): batch 1 2.3335 ->
# 2.3193 ms (-0.6%), batch 2 2.9991 -> 2.9842 (-0.5%), batch 4 3.7681 -> 3.7601 (-0.2%), batch 8 unchanged (its
# 16 splits a token already hold 2 tiles each).
_MIN_TILES = 1
_SPLIT_COST = 2  # fixed cost of one split in tiles' time (Q load, prologue latency, partial write + combine read)
_GEMV_TOKENS = 8  # T <= this: the up-projections run as mla_absorb_q / mla_expand_out (TMAX), else cuBLAS bmm
_ROW_PAD_BYTES = 16  # after each shared-memory row, so ldmatrix phases hit 32 distinct banks


class LatentStore(NamedTuple):
    """This step's latent rows for mla_attention to write into the pool first (ops/mla_store.mla_store's
    kv_a [T, R+Dr] (row-strided view allowed), norm_w [R] bf16 and eps): small decode steps do it inside the
    mla_absorb_q launch."""

    kv_a: object
    norm_w: object
    eps: float


def num_splits(T: int, M: int, block_size: int) -> int:
    """S for T tokens over [.., M] tables: the split count minimising waves x (tiles per split + _SPLIT_COST),
    one block per SM, splits of at least _MIN_TILES tiles of the table width (ties: fewer splits).  The kernel
    cuts each token's own context into at most S splits at run time (decode graphs are captured for the
    table width, not the context)."""
    import cupy

    return _best_splits(T, M * block_size, sm_count(cupy.cuda.Device().id), _min_tiles())


def _min_tiles() -> int:
    return env.mla_min_tiles(_MIN_TILES)  # the bench switch KDA_RT_MLA_MIN_TILES, else the default


@functools.cache
def _best_splits(T: int, width: int, sms: int, min_tiles: int = _MIN_TILES) -> int:
    tiles = max(1, math.ceil(width / _NT))
    best, best_cost = 1, math.inf
    for s in range(1, math.ceil(tiles / min_tiles) + 1):
        waves = math.ceil(max(T, 1) * s / sms)
        cost = waves * (math.ceil(tiles / s) + _SPLIT_COST)
        if cost < best_cost:
            best, best_cost = s, cost
        if waves > 8:  # more splits only add waves
            break
    return best


# More tokens than SMs, KDA_RT_MLA_WAVE_SPLITS=1 (bench switch, left off): the splits a token that minimise waves x
# (_WAVE_TILES / splits + _SPLIT_COST), _WAVE_TILES the tiles of a 2K context (the shortest the rule is for; a longer
# one gains more from the same splits).  One split a token puts T blocks of a whole context each on the SMs: ceil(T /
# SMs) waves, the last one ragged (batch 160 at 2K context: 160 blocks on 132 SMs, 198 us a layer against 99 us at
# batch 128, fifty-second session's trace).  Measured once (fifty-second session, full model, decode graph replays at
# 2K context): batch 300 (3 splits) 24.13 against 24.24 ms (-0.45%); its batch 160 / 192 rows replayed the 256-row
# graph (bench_ab.py then picked the next bucket up), one split either way, so the rule is not measured there yet.
_WAVE_TILES = 32
_WAVE_MAX_SPLITS = 8


def launch_splits(T: int, S: int) -> int:
    """Splits per token of a launch: S (from the table width), but at most as many as put one wave of split
    blocks on the GPU (SMs // T).  Each token cuts its own context into at most this many (mla_attn.cu's
    split_plan, splits of at least _MIN_TILES tiles), so a decode graph captured for a long max_model_len no
    longer splits a short context ever finer: batch 32 at 2K context with the 48B shape's 1M-token table
    has S = 33 and used 17 splits of 2 tiles each (544 blocks, 4+ waves); now 4 of 8 tiles (128 blocks),
    as when the table is as wide as the context (tests/gpu/bench_decode_sweep.py --parts=mla).  More tokens than
    SMs take one split each, or with KDA_RT_MLA_WAVE_SPLITS=1 the count of at most min(S, 8) that fills the waves
    best (_WAVE_TILES' note): batch 160 on 132 SMs 4 (640 blocks, 5 waves of a quarter context)."""
    import cupy

    return _launch_splits(T, S, sm_count(cupy.cuda.Device().id), env.mla_wave_splits())


@functools.cache
def _launch_splits(T: int, S: int, sms: int, wave_splits: bool = False) -> int:
    if T <= sms or not wave_splits:
        return max(1, min(S, sms // max(T, 1)))
    costs = [(math.ceil(T * g / sms) * (_WAVE_TILES / g + _SPLIT_COST), g) for g in range(1, min(S, _WAVE_MAX_SPLITS) + 1)]
    return min(costs)[1]  # (ties: fewer splits)


def combine_groups(S: int, R: int) -> int:
    """Split groups of an mla_attn_combine{4,8,16} block (256 threads = 2048 / groups columns x groups): S rounded
    up to a power of two within [4, 16], raised until a block's 2048 / groups columns divide R (R % 128 == 0, so
    16 groups always fit)."""
    base = min(16, max(4, 1 << (S - 1).bit_length()))
    return next(g for g in (4, 8, 16) if g >= base and R % (2048 // g) == 0)


def _layout(T: int, H: int, R: int, S: int) -> tuple[int, int, int]:
    """(offset of partial, offset of stats, total bytes) in the workspace, 256-byte aligned."""
    up = lambda n: (n + 255) // 256 * 256  # noqa: E731
    o_partial = up(T * H * R * 2)
    o_stats = o_partial + (up(T * S * H * R * 2) if S > 1 else 0)
    return o_partial, o_stats, o_stats + (up(T * S * H * 8) if S > 1 else 0)


def decode_workspace_bytes(B: int, H: int, M: int, block_size: int, kv_lora_rank: int = 512) -> int:
    """Bytes of the `workspace` a decode call with B sequences and [B, M] block tables needs."""
    return _layout(B, H, kv_lora_rank, num_splits(B, M, block_size))[2]


def _view(buf, offset: int, shape: tuple, dtype, strides: tuple | None = None):
    import cupy

    dtype = np.dtype(dtype)
    strides = strides or tuple(int(np.prod(shape[i + 1:])) * dtype.itemsize for i in range(len(shape)))
    return cupy.ndarray(shape, dtype, memptr=buf.data + offset, strides=strides)


def _constants(H: int, R: int, Dr: int, Dn: int, Dv: int, block_size: int) -> dict[str, int]:
    """The -D constants of mla_attn.cu (its cache key): the shapes, the tile and the padded row strides
    (bf16 rows + 16 bytes and fp32 score rows + 32 bytes: ldmatrix / float2 phases on distinct banks)."""
    return dict(H=H, R=R, DR=Dr, DN=Dn, DV=Dv, BLOCK_SIZE=block_size, MIN_TILES=_min_tiles(), TMAX=_GEMV_TOKENS,
                THREADS=_THREADS, NT=_NT,
                HP=-(-H // 16) * 16,  # heads padded to whole m16 tiles
                LDK=R + Dr + _ROW_PAD_BYTES // 2, LDS_S=_NT + 8, LDP=_NT + _ROW_PAD_BYTES // 2)


def _split_smem_bytes(c: dict[str, int]) -> int:
    """mla_attn_split's shared memory: Q staging / the 4 partial score tiles (fp32), two KV stages (bf16),
    probabilities (bf16), alpha."""
    staging = max(c["HP"] * c["LDK"] * 2, 4 * c["HP"] * c["LDS_S"] * 4)
    return staging + 2 * c["NT"] * c["LDK"] * 2 + c["HP"] * (c["LDP"] * 2 + 4)


def mla_dims(q, kv_pool, w_kvb, H: int):
    """(q as [T, H·(Dn+Dr)], (QW, block_size, KD, HW, R, Dr, Dqk, Dkv, Dn, Dv)) after the shared checks:
    q row width, page size, pool width, kv_b rows, latent rank, and the per-head dims (Dn nope, Dr rope,
    Dqk = Dn + Dr, Dkv = Dn + Dv, Dv value)."""
    q2 = q.reshape(q.shape[0], -1) if q.ndim == 3 else q
    _, QW = expect(q2, "q", ndim=2, dtype=BF16, row_stride=True)
    _, block_size, KD = expect(kv_pool, "kv_pool", ndim=3, dtype=BF16)
    HW, R = expect(w_kvb, "w_kvb", ndim=2, dtype=BF16)
    Dr, Dqk, Dkv = KD - R, QW // H, HW // H
    Dn, Dv = Dqk - Dr, Dkv - (Dqk - Dr)
    return q2, (QW, block_size, KD, HW, R, Dr, Dqk, Dkv, Dn, Dv)


def mla_attention(q, kv_pool, w_kvb, cu_seqlens, context_lens, block_tables, *, num_heads: int, scale: float,
                  max_seqlen: int, decode: bool, out=None, workspace=None, stream=None,
                  store: LatentStore | None = None):
    """q: [T, H, Dn+Dr] bf16 (or a row-strided [T, H·(Dn+Dr)] view), kv_pool: [num_blocks, block_size, R+Dr]
    bf16 (rows already stored, or this step's written first: `store`), w_kvb: [H·(Dn+Dv), R] bf16, cu_seqlens
    [B+1] / context_lens [B] / block_tables [B, M] int32.  Token i of sequence b attends to positions 0 .. context_lens[b] + i.
    Returns out [T, H·Dv] bf16.  decode=True needs T == B and max_seqlen == 1; with `out` and
    `workspace` (uint8, >= decode_workspace_bytes) it allocates nothing and never reads the device.
    store (LatentStore): this step's rows are written into kv_pool first, as mla_store would (inside the
    mla_absorb_q launch where that runs and T <= R / 64)."""
    import cupy

    H = num_heads
    T = q.shape[0]
    if q.ndim == 3:
        expect(q, "q", shape=(None, H, None), dtype=BF16)
    q2, (QW, block_size, KD, HW, R, Dr, Dqk, Dkv, Dn, Dv) = mla_dims(q, kv_pool, w_kvb, H)
    if QW != H * Dqk or HW != H * Dkv or Dr <= 0 or Dn <= 0 or Dv <= 0 or H > 32 or R % 128 or (R + Dr) % 64 or Dn % 8:
        raise ValueError(f"mla_attention: inconsistent dims (q {q.shape}, kv_pool width {KD}, w_kvb {w_kvb.shape}, "
                         f"H {H}); need H <= 32, R % 128 == 0, (R + Dr) % 64 == 0, Dn % 8 == 0")
    if leading_dim(q2) % 8 or q2.data.ptr % 16:
        raise ValueError("mla_attention: q rows must start on 16-byte boundaries")
    (B1,) = expect(cu_seqlens, "cu_seqlens", ndim=1, dtype=np.int32)
    expect(context_lens, "context_lens", shape=(B1 - 1,), dtype=np.int32)
    _, M = expect(block_tables, "block_tables", shape=(B1 - 1, None), dtype=np.int32)
    if decode and (T != B1 - 1 or max_seqlen != 1):
        raise ValueError(f"mla_attention(decode=True) needs one token per sequence: T={T}, B={B1 - 1}, "
                         f"max_seqlen={max_seqlen}")
    out = cupy.empty((T, H * Dv), dtype=BF16) if out is None else out
    expect(out, "out", shape=(T, H * Dv), dtype=BF16, row_stride=True)
    S = num_splits(T, M, block_size)
    o_partial, o_stats, nbytes = _layout(T, H, R, S)
    workspace = cupy.empty(nbytes, dtype=np.uint8) if workspace is None else workspace
    (W,) = expect(workspace, "workspace", ndim=1, dtype=np.uint8)
    if W < nbytes:
        raise ValueError(f"workspace has {W} bytes, this call needs {nbytes} (decode_workspace_bytes)")
    if T == 0:
        return out
    ldq, ldo = leading_dim(q2), leading_dim(out)
    isz = 2
    q_lat = _view(workspace, 0, (H, T, R), BF16, (R * isz, H * R * isz, isz))  # per-head view of [T, H, R]
    stream = cupy.cuda.get_current_stream() if stream is None else stream
    consts = _constants(H, R, Dr, Dn, Dv, block_size)
    gemv = T <= _GEMV_TOKENS and R % 256 == 0 and Dn % 32 == 0 and Dv % 16 == 0 and w_kvb.data.ptr % 16 == 0
    fold = store is not None and gemv and T <= R // 64 and R <= 2048  # the store rides in mla_absorb_q's launch
    early = {"EARLY_W": 1} if gemv and env.mla_early_weights() else {}  # kernels_cu/mla_attn.cu EARLY_W
    if store is not None and not fold:
        mla_store(store.kv_a, store.norm_w, store.eps, kv_pool, cu_seqlens, context_lens, block_tables, stream=stream)
    elif fold:
        expect(store.kv_a, "kv_a", shape=(T, None), dtype=BF16, row_stride=True)
        check_rows(store.kv_a, store.norm_w, kv_pool, cu_seqlens, context_lens, block_tables)
    with stream:
        if gemv:
            absorb = get_kernel("mla_attn.cu", "mla_absorb_q", **consts, **early)
            null = np.uint64(0)
            store_args = ((i32(1), store.kv_a, i32(leading_dim(store.kv_a)), store.norm_w, kv_pool, cu_seqlens,
                           context_lens, block_tables, i32(B1 - 1), i32(M), f32(store.eps)) if fold else
                          (i32(0), null, i32(0), null, null, null, null, null, i32(0), i32(0), f32(0)))
            absorb((H + int(fold), R // 64), (256,), (q2, i32(ldq), w_kvb, i32(T), workspace, *store_args),
                   stream=stream)
        else:
            bmm(_view(q2, 0, (H, T, Dn), BF16, (Dqk * isz, ldq * isz, isz)),
                _view(w_kvb, 0, (H, Dn, R), BF16, (Dkv * R * isz, R * isz, isz)), out=q_lat)
        smem = _split_smem_bytes(consts)
        kernel = get_kernel("mla_attn.cu", "mla_attn_split", max_dynamic_smem=smem, **consts)
        G = launch_splits(T, S)  # the grid's splits (<= S: partial / stats, sized for S, have room)
        partial = workspace[o_partial:] if G > 1 else workspace
        stats = workspace[o_stats:] if G > 1 else workspace
        one_token = i32(decode)  # T == B, one token each (checked above): token t is sequence t
        kernel((T, G), (_THREADS,), (workspace, q2, i32(ldq), kv_pool, cu_seqlens, context_lens, block_tables,
                                     i32(B1 - 1), one_token, i32(M), f32(scale * math.log2(math.e)), workspace,
                                     partial, stats), shared_mem=smem, stream=stream)
        groups = combine_groups(G, R) if G > 1 else 0
        if groups:  # tokens whose context used one split were written by mla_attn_split (skipped here)
            combine = get_kernel("mla_attn.cu", f"mla_attn_combine{groups}", **consts)
            combine((T, H, R * groups // 2048), (256,), (partial, stats, cu_seqlens, context_lens, i32(B1 - 1),
                                                         one_token, i32(M), i32(G), workspace), stream=stream)
        if gemv:
            expand = get_kernel("mla_attn.cu", "mla_expand_out", **consts, **early)
            expand((H, Dv // 16), (256,), (workspace, w_kvb, i32(T), out, i32(ldo)), stream=stream)
        else:
            bmm(q_lat, _view(w_kvb, Dn * R * isz, (H, Dv, R), BF16, (Dkv * R * isz, R * isz, isz)),
                out=_view(out, 0, (H, T, Dv), BF16, (Dv * isz, ldo * isz, isz)), transpose_b=True)
    return out
