"""MLA prefill attention, expanded form (kernels_cu/mla_prefill.cu + one cuBLAS GEMM per round).

    lat[r]      = pool row [c | k_pe] of each attended position          mla_prefill_gather
    kv[r]       = c · W_kvbᵀ = per head [k_nope | v]                      linear (cuBLAS), [rows, H·(Dn+Dv)]
    out[t, h]   = softmax_causal(scale · q[t, h] · [k_nope_h | k_pe]ᵀ) · v_h   mla_prefill_attn

On Hopper (sm_90a, KDA_RT_WGMMA not 0, Dn and Dr multiples of 64, Dv = 128) the attention runs on
warpgroup MMA instead (mla_prefill_wg.cu), which wants the values transposed (keys contiguous), so the
decompression is two batched cuBLAS GEMMs over the heads: kn [H, rows, Dn] = c · W_k,hᵀ and
vt [H, Dv, rows] = W_v,h · cᵀ (same FLOPs as the one GEMM above).
H200 (2026-12-01, tests/gpu/bench_mla_prefill.py, attention kernel alone): 467-483 TFLOP/s against 258-264
for mma.sync from 32K context, 387 against 226 at 8 x 2048; outputs bit-identical.

Used for every non-decode step.  Query i of sequence b sits at position ctx_b + i and attends
positions 0 .. ctx_b + i.  The attended positions of all sequences are decompressed in rounds of
at most `keys_per_round` rows (bounded scratch: 16 KB of k_nope|v plus 1.1 KB of latent per row
at H = 32, so 1.1 GB at the default 65536; fp8=True adds their 8 KB of e4m3 codes a row, 0.5 GB, and one code
a query element); a sequence longer than that spans several rounds and
its queries carry an fp32 running state (o, m, l) from round to round.
Sequences with fewer than `expanded_min_tokens` new tokens (decode-like rows of a mixed step) go
to the absorbed path instead (mla_attention): decompressing a long context for a few queries
costs more than attending in the latent space (≈8.4 MFLOP per key vs 70 KFLOP per query-key pair).
Needs the lengths on the host: the caller passes its host copies (`host_lens`), else they are read
back (one sync; never in a graph).
Letters: T tokens, B sequences, H heads, M page slots, R latent rank, Dn/Dr/Dv head dims.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from kda_rt import env
from kda_rt.cuda.gemm import bmm, linear
from kda_rt.cuda.ops.check import BF16, expect, f32, i32, leading_dim
from kda_rt.cuda.ops.compile import device_arch, get_kernel

__all__ = ["mla_prefill", "plan_rounds", "use_wgmma", "use_fp8", "Round", "BLOCK_M", "KEYS_PER_ROUND", "EXPANDED_MIN_TOKENS",
           "SEGMENT_ALIGN"]

NUM_WARPS = 8
BLOCK_M = 16 * NUM_WARPS  # query rows per CTA of mla_prefill_attn
_BLOCK_N = 64
KEYS_PER_ROUND = 65536
EXPANDED_MIN_TOKENS = 128
FLAG_HAS_PREV, FLAG_FINAL = 1, 2
# scratch rows: each sequence's segment starts at a multiple of this (16-byte vt columns; the fp8 values' codes are
# permuted within 32-key groups counted from the segment's start, mla_prefill_fp8.cu)
SEGMENT_ALIGN = 32
_WG_THREADS = 256
# pipeline stages of mla_prefill_attn_wg (STAGES - 2 key tiles in flight); _WG_MIN_STAGES where these do not fit
# the CTA's shared memory.
# H200, 2026-12-01 (tests/gpu/bench_mla_prefill.py --variants 3,4): attention -2.2% at 1 x 32768, -2.9% at
# 32768 in chunks of 8192, -3.2% at 131072 in chunks of 8192 (467 -> 478 TFLOP/s), against 3
WG_STAGES = 4
_WG_MIN_STAGES = 3
_MAX_SMEM = 227 * 1024  # dynamic shared memory a CTA may take on sm_90
# mla_prefill_wg.cu hard-codes 128 query rows a CTA; the tile plan (BLOCK_M) must give the same
assert BLOCK_M == 128, "mla_prefill_wg.cu's BLOCK_M is 128: keep NUM_WARPS = 8"


@dataclass
class Round:
    """One decompress + attention launch.  seq_rec [B, 8] int32 (tok0, n, ctx, row0, ks, ke, flags, 0),
    row_start [B+1] (segment starts, multiples of SEGMENT_ALIGN), tiles [N, 2] (b, i0) heaviest first,
    rows = scratch rows used (padding included)."""
    seq_rec: np.ndarray
    row_start: np.ndarray
    tiles: np.ndarray
    rows: int


def plan_rounds(cu_seqlens: np.ndarray, context_lens: np.ndarray, seqs: list[int], keys_per_round: int) -> list[Round]:
    """Split the attended positions 0 .. ctx_b + n_b - 1 of sequences `seqs` into segments of at most
    keys_per_round, packed in order into rounds of at most keys_per_round rows (each segment's rows
    padded to a multiple of SEGMENT_ALIGN, the bound likewise rounded up).  A sequence's segments come
    in increasing position order; its first has ks = 0, its last sets FLAG_FINAL."""
    B = len(context_lens)
    segs = []
    for b in seqs:
        L = int(context_lens[b]) + int(cu_seqlens[b + 1] - cu_seqlens[b])
        segs += [(b, ks, min(ks + keys_per_round, L), L) for ks in range(0, L, keys_per_round)]
    rounds, cur, used, bound = [], [], 0, _pad(keys_per_round)
    for seg in segs + [None]:
        if seg is None or used + _pad(seg[2] - seg[1]) > bound:
            if cur:
                rounds.append(_round(cu_seqlens, context_lens, B, cur))
            cur, used = [], 0
        if seg is not None:
            cur.append(seg)
            used += _pad(seg[2] - seg[1])
    return rounds


def _pad(rows: int) -> int:
    return -(-rows // SEGMENT_ALIGN) * SEGMENT_ALIGN


def _round(cu_seqlens, context_lens, B, segs) -> Round:
    rec = np.zeros((B, 8), np.int32)
    rec[:, 0] = cu_seqlens[:B]
    rec[:, 1] = np.diff(cu_seqlens)
    rec[:, 2] = context_lens
    lengths = np.zeros(B, np.int64)
    tiles = []
    for b, ks, ke, L in segs:
        lengths[b] = _pad(ke - ks)
        final = ke == L
        rec[b, 4:7] = ks, ke, (FLAG_HAS_PREV if ks > 0 else 0) | (FLAG_FINAL if final else 0)
        ctx, n = int(context_lens[b]), int(rec[b, 1])
        for i0 in range(0, n, BLOCK_M):
            last = ctx + min(i0 + BLOCK_M, n) - 1  # position of the tile's last query
            if final or last >= ks:  # a tile with no key in this round still writes out in its final round
                tiles.append((max(0, min(ke, last + 1) - ks), b, i0))
    row_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    rec[:, 3] = row_start[:B]
    tiles.sort(key=lambda w: -w[0])  # heaviest first: the last wave holds the short tiles
    tile_arr = np.array([(b, i0) for _, b, i0 in tiles], np.int32).reshape(-1, 2)
    return Round(rec, row_start, tile_arr, int(row_start[-1]))


_PAD = 8  # bf16 elements (16 B) added to each smem row against ldmatrix bank conflicts


def _defines(H: int, R: int, Dn: int, Dr: int, Dv: int, block_size: int) -> dict:
    return dict(H=H, R=R, DN=Dn, DR=Dr, DV=Dv, BLOCK_SIZE=block_size, NUM_WARPS=NUM_WARPS, BLOCK_N=_BLOCK_N,
                LDQ=Dn + Dr + _PAD, LDK=Dn + Dr + _PAD, LDV=Dv + _PAD, FLAG_HAS_PREV=FLAG_HAS_PREV,
                FLAG_FINAL=FLAG_FINAL)


def _smem(defs: dict) -> int:
    """Dynamic shared memory of mla_prefill_attn: the Q tile and two stages of K and V tiles (bf16)."""
    return (BLOCK_M * defs["LDQ"] + 2 * defs["BLOCK_N"] * (defs["LDK"] + defs["LDV"])) * 2


@functools.cache
def _kernels(H: int, R: int, Dn: int, Dr: int, Dv: int, block_size: int):
    defs = _defines(H, R, Dn, Dr, Dv, block_size)
    attn = get_kernel("mla_prefill.cu", "mla_prefill_attn", max_dynamic_smem=_smem(defs), **defs)
    return get_kernel("mla_prefill.cu", "mla_prefill_gather", **defs), attn, _smem(defs)


def _wg_smem(Dn: int, Dr: int, stages: int = WG_STAGES) -> int:
    """Dynamic shared memory of mla_prefill_attn_wg: Q ([128][64] bf16 sub-tiles of 16 KB), `stages` stages of
    K ([64][64] sub-tiles of 8 KB) and Vᵀ (one [128][64]), plus 1 KB for the 1024-byte alignment."""
    qsub = (Dn + Dr) // 64
    return qsub * 16384 + stages * (qsub * 8192 + 16384) + 1024


def use_wgmma(Dn: int, Dr: int, Dv: int) -> bool:
    """Whether mla_prefill runs its attention on warpgroup MMA here (see the module docstring): Hopper, head
    dims it is written for, and its shared memory within the 227 KB a CTA may take (DN + DR <= 192)."""
    return (env.wgmma() and device_arch() == "sm_90a" and Dn % 64 == 0 and Dr % 64 == 0 and Dv == 128
            and _wg_smem(Dn, Dr, _WG_MIN_STAGES) <= _MAX_SMEM)


def _wg_stages(Dn: int, Dr: int) -> int:
    """WG_STAGES, or _WG_MIN_STAGES when that many stages do not fit in shared memory (DN + DR > 192)."""
    return WG_STAGES if _wg_smem(Dn, Dr, WG_STAGES) <= _MAX_SMEM else _WG_MIN_STAGES


@functools.cache
def _wg_kernel(H: int, R: int, Dn: int, Dr: int, Dv: int, stages: int = WG_STAGES):
    return get_kernel("mla_prefill_wg.cu", "mla_prefill_attn_wg", max_dynamic_smem=_wg_smem(Dn, Dr, stages), H=H, R=R,
                      DN=Dn, DR=Dr, DV=Dv, STAGES=stages, FLAG_HAS_PREV=FLAG_HAS_PREV, FLAG_FINAL=FLAG_FINAL)


_FP8_STAGES = 4
_FP8_SUB = 16384  # one [128][128 B] sub-tile of mla_prefill_fp8.cu


def use_fp8(Dn: int, Dr: int, Dv: int) -> bool:
    """Whether the FP8 attention of mla_prefill_fp8.cu can run here: the wgmma path and MLA's usual head dims."""
    return use_wgmma(Dn, Dr, Dv) and (Dn, Dr, Dv) == (128, 64, 128)


def _fp8_smem(stages: int = _FP8_STAGES) -> int:
    """Q (two sub-tiles), `stages` stages of K nope, K pe and Vᵀ sub-tiles, 1 KB for the 1024-byte alignment."""
    return 2 * _FP8_SUB + stages * 3 * _FP8_SUB + 1024


@functools.cache
def _fp8_kernels(H: int, R: int, Dn: int, Dr: int, Dv: int):
    defs = dict(H=H, R=R, DN=Dn, DR=Dr, DV=Dv, STAGES=_FP8_STAGES, FLAG_HAS_PREV=FLAG_HAS_PREV, FLAG_FINAL=FLAG_FINAL)
    names = ("mla_fp8_amax", "mla_fp8_quant_k", "mla_fp8_quant_v", "mla_fp8_quant_q")
    quant = [get_kernel("mla_prefill_fp8.cu", n, **defs) for n in names]
    attn = get_kernel("mla_prefill_fp8.cu", "mla_prefill_attn_fp8", max_dynamic_smem=_fp8_smem(), **defs)
    return (*quant, attn)


def mla_prefill(q, kv_pool, w_kvb, cu_seqlens, context_lens, block_tables, *, num_heads: int, scale: float,
                out=None, keys_per_round: int = KEYS_PER_ROUND, expanded_min_tokens: int = EXPANDED_MIN_TOKENS,
                stream=None, host_lens=(None, None), fp8: bool = False):
    """q: [T, H·(Dn+Dr)] bf16 (rows may be strided) or [T, H, Dn+Dr]; kv_pool [num_blocks, block_size, R+Dr]
    bf16 with the new rows stored; w_kvb [H·(Dn+Dv), R] bf16; cu_seqlens [B+1], context_lens [B],
    block_tables [B, M] int32.  Returns out [T, H·Dv] bf16 (may be row-strided).  host_lens: NumPy
    copies of (cu_seqlens, context_lens) when the caller has them (no device -> host sync then).
    fp8: the expanded path's products in e4m3 (mla_prefill_fp8.cu: lossy, opt-in; needs `use_fp8`)."""
    import cupy

    from kda_rt.cuda.ops.mla_attn import mla_attention, mla_dims

    H, T = num_heads, q.shape[0]
    q2, (QW, block_size, KD, HW, R, Dr, Dqk, Dkv, Dn, Dv) = mla_dims(q, kv_pool, w_kvb, H)
    if QW != H * Dqk or HW != H * Dkv or Dn % 16 or Dr % 16 or Dv % 16 or R % 8 or leading_dim(q2) % 8 or q2.data.ptr % 16:
        raise ValueError(f"mla_prefill: inconsistent dims or misaligned q (q {q.shape}, pool width {KD}, "
                         f"w_kvb {w_kvb.shape}, H {H})")
    if fp8 and not use_fp8(Dn, Dr, Dv):
        raise ValueError(f"mla_prefill: fp8=True needs sm_90a with KDA_RT_WGMMA on and head dims Dn = 128, Dr = 64, "
                         f"Dv = 128 (here {device_arch()}, KDA_RT_WGMMA {int(env.wgmma())}, Dn {Dn}, Dr {Dr}, Dv {Dv})")
    (B1,) = expect(cu_seqlens, "cu_seqlens", ndim=1, dtype=np.int32)
    expect(context_lens, "context_lens", shape=(B1 - 1,), dtype=np.int32)
    _, M = expect(block_tables, "block_tables", shape=(B1 - 1, None), dtype=np.int32)
    out = cupy.empty((T, H * Dv), dtype=BF16) if out is None else out
    expect(out, "out", shape=(T, H * Dv), dtype=BF16, row_stride=True)
    if T == 0:
        return out
    cu, ctx = host_lens
    if cu is None or ctx is None:
        cu, ctx = cupy.asnumpy(cu_seqlens), cupy.asnumpy(context_lens)  # host lengths: one sync
    cu, ctx = np.asarray(cu, np.int32), np.asarray(ctx, np.int32)
    if cu.shape != (B1,) or ctx.shape != (B1 - 1,):
        raise ValueError(f"mla_prefill: host_lens shapes {cu.shape}, {ctx.shape} do not match B = {B1 - 1}")
    n = np.diff(cu)
    if np.any(ctx + n > M * block_size):
        raise ValueError(f"mla_prefill: a sequence attends past its block table ({M} pages of {block_size})")
    short = [b for b in range(B1 - 1) if 0 < n[b] < expanded_min_tokens]
    long_ = [b for b in range(B1 - 1) if n[b] >= max(expanded_min_tokens, 1)]
    stream = cupy.cuda.get_current_stream() if stream is None else stream
    with stream:
        if short:
            _absorbed(short, q2, kv_pool, w_kvb, cu, ctx, block_tables, H, scale, out, mla_attention)
        rounds = plan_rounds(cu, ctx, long_, keys_per_round)
        if not rounds:
            return out
        gather, attn, smem = _kernels(H, R, Dn, Dr, Dv, block_size)
        wg = use_wgmma(Dn, Dr, Dv)
        rows = max(r.rows for r in rounds)
        lat = cupy.empty((rows, KD), dtype=BF16)
        if wg:
            wg_stages = _wg_stages(Dn, Dr)
            attn_wg = _wg_kernel(H, R, Dn, Dr, Dv, wg_stages)
            w3 = w_kvb.reshape(H, Dn + Dv, R)
            kn = cupy.empty((H, rows, Dn), dtype=BF16)
            vt = cupy.empty((H, Dv, rows), dtype=BF16)
            scratch = kn
            if fp8:
                fp8_kernels = _fp8_kernels(H, R, Dn, Dr, Dv)
                kn8 = cupy.empty((H, rows, Dn), dtype=np.uint8)
                kpe8 = cupy.empty((rows, Dr), dtype=np.uint8)
                vt8 = cupy.empty((H, Dv, rows), dtype=np.uint8)
                q8 = cupy.empty((T, H * (Dn + Dr)), dtype=np.uint8)
                qsc = cupy.empty((T, H), dtype=np.float32)
                sv = cupy.empty((H, Dv), dtype=np.float32)
                amax = cupy.empty((H + 1,), dtype=np.uint32)
        else:
            kv = cupy.empty((rows, HW), dtype=BF16)
            scratch = kv
        o_state = ml_state = scratch  # unread unless a sequence spans several rounds
        scale_log2 = f32(scale * math.log2(math.e))
        if len(rounds) > 1:
            o_state = cupy.empty((T, H, Dv), dtype=np.float32)
            ml_state = cupy.empty((T, H, 2), dtype=np.float32)
        for rd in rounds:
            meta = cupy.asarray(np.concatenate([rd.seq_rec.ravel(), rd.row_start, rd.tiles.ravel()]))
            rec, row_start, tiles = meta, meta[rd.seq_rec.size:], meta[rd.seq_rec.size + B1:]
            chunks = rd.rows * (KD // 8)
            gather(((chunks + 255) // 256,), (256,), (kv_pool, block_tables, i32(M), rec, row_start, i32(B1 - 1),
                                                     i32(rd.rows), lat), stream=stream)
            if wg:
                c = cupy.broadcast_to(lat[None, :rd.rows, :R], (H, rd.rows, R))  # batch stride 0
                bmm(c, w3[:, :Dn], out=kn[:, :rd.rows], transpose_b=True)    # kn[h] = c · W_k,hᵀ
                bmm(w3[:, Dn:], c, out=vt[:, :, :rd.rows], transpose_b=True)  # vt[h] = W_v,h · cᵀ
                if fp8 and len(rd.tiles):
                    _fp8_round(rd, fp8_kernels, q2, kn, vt, lat, rows, rec, tiles,
                               (kn8, kpe8, vt8, q8, qsc, sv, amax), scale_log2, out, o_state, ml_state, stream)
                elif len(rd.tiles):
                    attn_wg((len(rd.tiles), H), (_WG_THREADS,), (
                        q2, i32(leading_dim(q2)), kn, vt, lat, i32(rows), rec, tiles, scale_log2, out,
                        i32(leading_dim(out)), o_state, ml_state), shared_mem=_wg_smem(Dn, Dr, wg_stages), stream=stream)
                continue
            linear(lat[:rd.rows, :R], w_kvb, out=kv[:rd.rows])
            if len(rd.tiles):
                attn((len(rd.tiles), H), (NUM_WARPS * 32,), (
                    q2, i32(leading_dim(q2)), kv, lat, rec, tiles, scale_log2, out,
                    i32(leading_dim(out)), o_state, ml_state), shared_mem=smem, stream=stream)
    return out


def _fp8_round(rd, kernels, q2, kn, vt, lat, rows, rec, tiles, bufs, scale_log2, out, o_state, ml_state, stream):
    """One round of the FP8 attention: the scales and codes of the round's keys, values and every query row, then
    mla_prefill_attn_fp8 (mla_prefill_fp8.cu has the scheme)."""
    amax_k, quant_k, quant_v, quant_q, attn_fp8 = kernels
    kn8, kpe8, vt8, q8, qsc, sv, amax = bufs
    H, _, Dn = kn.shape
    Dv, T = vt.shape[1], q2.shape[0]
    amax.fill(0)
    blocks = (min(-(-rd.rows * (Dn // 8) // 256), 1024), H + 1)
    amax_k(blocks, (256,), (kn, lat, i32(rows), i32(rd.rows), amax), stream=stream)
    quant_k(blocks, (256,), (kn, lat, i32(rows), i32(rd.rows), amax, kn8, kpe8), stream=stream)
    quant_v((H * Dv,), (256,), (vt, i32(rows), i32(rd.rows), vt8, sv), stream=stream)
    quant_q((-(-T * H // 8),), (256,), (q2, i32(leading_dim(q2)), i32(T), amax, q8, qsc), stream=stream)
    attn_fp8((len(rd.tiles), H), (_WG_THREADS,), (q8, qsc, kn8, kpe8, vt8, sv, i32(rows), rec, tiles, scale_log2, out,
                                                   i32(leading_dim(out)), o_state, ml_state),
             shared_mem=_fp8_smem(), stream=stream)


def _absorbed(seqs, q2, kv_pool, w_kvb, cu, ctx, block_tables, H, scale, out, mla_attention) -> None:
    """The absorbed path for the sequences `seqs` (few new tokens each): gather their rows, attend, scatter."""
    import cupy

    idx = cupy.asarray(np.concatenate([np.arange(cu[b], cu[b + 1]) for b in seqs]).astype(np.int64))
    sub_cu = np.concatenate([[0], np.cumsum([cu[b + 1] - cu[b] for b in seqs])]).astype(np.int32)
    sel = cupy.asarray(np.asarray(seqs, np.int64))
    sub_out = mla_attention(q2[idx], kv_pool, w_kvb, cupy.asarray(sub_cu), cupy.asarray(ctx[seqs]),
                            cupy.ascontiguousarray(block_tables[sel]), num_heads=H, scale=scale,
                            max_seqlen=int(np.diff(sub_cu).max()), decode=False)
    out[idx] = sub_out
