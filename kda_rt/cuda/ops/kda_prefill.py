"""Launcher for kernels_cu/kda_prefill.cu: KDA over a varlen flat batch (chunked WY form, chunk 64).

Three launches: kda_prefill_intra (grid over (chunk, head): conv, l2norm, gates, beta and every
chunk-local product -> bf16 workspace), kda_prefill_state (grid over (state column block, head,
sequence): the sequential state recurrence and the output O, also the conv and recurrent slot
writes), kda_prefill_norm (gated RMSNorm in place).  Runs eagerly: allocates its workspace
(~1.1 KB per token and head, bf16).
"""

from __future__ import annotations

import numpy as np

from kda_rt import env
from kda_rt.cuda.ops.check import BF16, f32, i32, leading_dim
from kda_rt.cuda.ops.compile import get_kernel, sm_count
from kda_rt.cuda.ops.kda_decode import check_kda_args
from kda_rt.cuda.ops.quant import check_e4m3_out

__all__ = ["kda_prefill"]

_CHUNK = 64  # tokens per chunk (the kernels' thread maps are written for 64)
_INTRA_THREADS = 512  # 16 warps: the intra kernel's thread maps are written for this


# kda_prefill.cu QUAD_SPLIT: an unsafe diagonal sub-block's lower-left quadrant on tensor cores (its 24-row factor
# tiles: 26 KB more shared memory, still one CTA an SM)
_QUAD_SPLIT = True


def _intra_smem_bytes(K: int, L: int, W: int, quad: bool | None = None) -> int:
    """The IN_* plan of kda_prefill.cu: 3 bf16 [W-1+L][K+8] conv tiles, 2 bf16 [L][K+8] tiles, 10
    scaled-key sub-tiles, Lam and A_kk fp32, gate tables, T-solve scratch, beta, norms, q.k and flags; with `quad`
    (QUAD_SPLIT; default: _QUAD_SPLIT as it is at the call) the quadrant factors, bf16 [L/16][24][K+8] from the
    next 16-byte boundary."""
    quad = _QUAD_SPLIT if quad is None else quad
    num_sub, tile = L // 16, L * (K + 8) * 2
    num_pairs, num_cross = num_sub * (num_sub + 1) // 2, num_sub * (num_sub - 1) // 2
    base = (3 * (W - 1 + L) * (K + 8) * 2 + 2 * tile + num_pairs * 16 * (K + 8) * 2 + L * (K + 4) * 4
            + L * (L + 4) * 4 + ((2 * num_sub + num_cross) * K + (num_sub - 1) * 256) * 4 + 4 * L * 4 + 32)
    return (base + 15) // 16 * 16 + num_sub * 24 * (K + 8) * 2 if quad else base


def _state_smem_bytes(K: int, L: int, vb: int, pf: int = 0) -> int:
    """The ST_* plan: W, qg, kd [L][K+8] and A_qk [L][L+8] bf16, then U, V_new [L][vb+8] and S [K][vb+8]; with
    prefetch `pf` (STATE_PF) 1 a second A_qk and kd, 2 a second of each but V_new and S."""
    nb_wqu, nb_ak = (2 if pf == 2 else 1), (2 if pf >= 1 else 1)
    return (nb_wqu * (2 * L * (K + 8) + L * (vb + 8)) + nb_ak * (L * (K + 8) + L * (L + 8)) + (L + K) * (vb + 8)) * 2


def _state_columns(num_seqs: int, num_heads: int, head_dim: int) -> int:
    """State columns per kda_prefill_state CTA: narrower when few (head, sequence) pairs must fill
    the GPU (one long prompt), wider when there are many (less re-reading of W, qg, kd).  Measured on the
    H200 by tests/gpu/bench_kda_prefill.py (whole launcher, ms by width 16 / 32 / 64 / 128, 2026-12-01):
    1 x 2048 0.547 / 0.518 / 0.534 / 0.605, 1 x 32768 5.465 / 5.048 / 5.461 / 6.251, 8 x 2048 (a 16384-token
    step of 2K prompts) 2.675 / 2.564 / 2.407 / 2.411, 32 x 2048 10.02 / 9.19 / 8.50 / 8.53.  Two sequences take 64
    (128 CTAs at 32 heads: one wave with every tile a chunk ahead, `_state_prefetch`): H200, 2026-12-02, ms at 32
    columns (prefetch 1) / 64 (prefetch 2): 2 x 2048 0.750 / 0.720, 2 x 8192 2.417 / 2.341, 2 x 16384 4.429 / 4.362,
    2 x 65536 17.362 / 16.862; one sequence keeps 32 (1 x 32768 4.658 at 32, 4.965 at 64, both prefetch 2)."""
    pairs = num_seqs * num_heads
    return 32 if pairs <= 32 else 64


def _state_prefetch(num_seqs: int, num_heads: int, head_dim: int, vb: int, sms: int) -> int:
    """How far ahead kda_prefill_state streams a chunk's tiles (kda_prefill.cu STATE_PF): 2 (every tile a whole chunk
    ahead, in second buffers) when the grid is one wave at one CTA an SM (one or two long prompts at 32 heads: a CTA
    alone on its SM waited out each chunk's copies), else 1 (A_qk and kd a chunk ahead: 106 KB, still two CTAs an
    SM) at 32 state columns or fewer, else 0 (one buffer a tile, two CTAs an SM hiding each other's copies).  With
    `_state_columns` on 128+ SMs at 32 heads, 32 columns always come with a one-wave grid, so depth 1 runs on smaller
    GPUs, with other head counts or with an explicit width.  H200, 2026-12-02, `PYTHONPATH=. python
    tests/gpu/bench_kda_prefill.py --state-pf` (whole launcher, H = 32, 5 interleaved rounds, ms at depth 0 / 1 /
    2): 1 x 2048 0.517 / 0.498 / 0.498, 1 x 32768 5.112 / 4.820 / 4.704, 1 x 131072 19.686 / 18.539 / 18.097 (128
    CTAs); 2 x 2048 0.771 / 0.756 / 0.783, 2 x 16384 4.616 / 4.508 / 4.703 (256 CTAs at 32 columns, the width two
    sequences had then); 8 x 2048 2.295 / 2.319 / 2.323, 32 x 2048 8.461 / 8.616 / 8.645 (64 columns)."""
    if head_dim // vb * num_heads * num_seqs <= sms:
        return 2
    return 1 if vb <= 32 else 0


def _consts(K: int, W: int, vb: int, pf: int = 0) -> dict:
    """The defines of kda_prefill.cu's module for one state width and prefetch, and the intra kernel's variants as
    their KDA_RT_KDA_* switches are set at the call: a variant's define is passed only where its switch differs from
    the kernel's default (so the default module's cache key has none of them)."""
    consts = dict(HEAD_DIM=K, CONV_W=W, CHUNK=_CHUNK, VB=vb, INTRA_THREADS=_INTRA_THREADS, QUAD_SPLIT=int(_QUAD_SPLIT),
                  STATE_PF=pf)
    for name, on, default in _intra_variants():
        if on != default:
            consts[name] = int(on)
    t_rows = env.kda_t_rows()
    if t_rows != 2:
        consts["T_ROWS"] = t_rows
    return consts


def _intra_variants() -> list[tuple[str, bool, bool]]:
    """(define, its switch now, the kernel's default) of each intra-kernel variant: on by default once measured
    (each one's 0 builds without it), off until then.  LOOKUP_BOUNDS applies with EARLY_LOOKUP and COPY_ROWS,
    ROW_SCATTER with ROW_NORM_SPREAD, T_ROWS with T_HALVES, E_SCAN with QUAD_SPLIT: without them they
    build as off."""
    return [("CONV_ONE_ROUND", env.kda_conv_one_round(), True), ("GATE_FAST", env.kda_gate_fast(), True),
            ("SCALE_UNROLL", env.kda_scale_unroll(), True), ("ROW_NORM_SPREAD", env.kda_row_norm_spread(), True),
            ("EXP2_FTZ", env.kda_exp2_ftz(), True), ("CONV_PAIRS", env.kda_conv_pairs(), True),
            ("T_HALVES", env.kda_t_halves(), True), ("BETA_EARLY", env.kda_beta_early(), True),
            ("COPY_ROWS", env.kda_copy_rows(), True), ("EARLY_LOOKUP", env.kda_early_lookup(), True),
            ("G_BALANCE", env.kda_g_balance(), True), ("SILU_FAST", env.kda_silu_fast(), True),
            ("G_STAGED", env.kda_g_staged(), True), ("ROW_SCATTER", env.kda_row_scatter(), True),
            ("GATE_POLY", env.kda_gate_poly(), True), ("LOOKUP_BOUNDS", env.kda_lookup_bounds(), True),
            ("PAD_FIXUP", env.kda_pad_fixup(), True), ("E_SCAN", env.kda_e_scan(), True)]


def _kernels(K: int, W: int, vb: int, pf: int = 0):
    """The intra, state and norm kernels of one state width and prefetch (one module: built together)."""
    consts = _consts(K, W, vb, pf)
    return (get_kernel("kda_prefill.cu", "kda_prefill_intra", max_dynamic_smem=_intra_smem_bytes(K, _CHUNK, W), **consts),
            get_kernel("kda_prefill.cu", "kda_prefill_state", max_dynamic_smem=_state_smem_bytes(K, _CHUNK, vb, pf),
                       **consts),
            get_kernel("kda_prefill.cu", "kda_prefill_norm", **consts))


def _norm_e4m3_kernel(K: int, W: int, vb: int, pf: int = 0):
    """kda_prefill_norm_e4m3 of the module of one state width and prefetch (the same build as _kernels')."""
    return get_kernel("kda_prefill.cu", "kda_prefill_norm_e4m3", **_consts(K, W, vb, pf))


def _variants(num_heads: int, head_dim: int, sms: int) -> list[tuple[int, int]]:
    """Every (state width, prefetch) the rules pick for some number of sequences."""
    return sorted({(vb, _state_prefetch(b, num_heads, head_dim, vb, sms))
                   for b in range(1, 4096 // max(1, num_heads) + 2)
                   for vb in (_state_columns(b, num_heads, head_dim),)})


def precompile(num_heads: int, head_dim: int, conv_w: int, sms: int | None = None) -> int:
    """Build (or load from the disk cache) the module of every (state width, prefetch) the rules pick for some
    batch ((32, 2), (64, 2), (64, 0) at H = 32 on 132 SMs), so no prefill waits for NVRTC (~1.5 s a module) because
    its number of sequences is new.  `sms`: the GPU's SM count (default: the current device's).  Returns the number of
    modules."""
    if sms is None:
        import cupy

        sms = sm_count(cupy.cuda.Device().id)
    variants = _variants(num_heads, head_dim, sms)
    for vb, pf in variants:
        _kernels(head_dim, conv_w, vb, pf)
    return len(variants)


def kda_prefill(qkv, f, b, gate, conv_w, A_log, dt_bias, o_norm_w, conv_pool, rec_pool, cu_seqlens, context_lens,
                state_slots, *, num_heads: int, head_dim: int, eps: float, out=None, stream=None, max_seqlen=None,
                state_columns: int | None = None, state_prefetch: int | None = None, e4m3_out=None, snapshot=None):
    """Sequences of any length >= 1 (cu_seqlens [B+1]); updates the slots' conv and recurrent state in
    place and returns out [T, P] bf16.  `max_seqlen` is accepted for interface symmetry and unused;
    `state_columns` overrides the state-kernel width (16, 32, 64 or 128; benchmarks), `state_prefetch` its STATE_PF
    (0, 1 or 2; tests and benchmarks).  e4m3_out: optional
    (q [T, P] uint8, s [T] fp32) that also receive out's rows as e4m3 codes with a scale a row, as
    ops/quant.quantize_activations_e4m3 makes them from out (kda_prefill_norm_e4m3; sm_89+, num_heads <= 64).
    snapshot: optional [B, 2] int32 on the device, (n, slot) a sequence: its conv and recurrent state after its
    first n tokens of this step also go to slot `slot` (the prefix cache's snapshot); n = 0: none, else a multiple of
    64 below the sequence's length (the caller checks the values: ForwardBatch.snapshot)."""
    if state_columns is not None and (isinstance(state_columns, bool) or state_columns not in (16, 32, 64, 128)):
        raise ValueError(f"kda_prefill: state_columns must be 16, 32, 64 or 128, got {state_columns!r}")
    if state_prefetch is not None and (isinstance(state_prefetch, bool) or state_prefetch not in (0, 1, 2)):
        raise ValueError(f"kda_prefill: state_prefetch must be 0, 1 or 2, got {state_prefetch!r}")
    import cupy

    out = cupy.empty(f.shape, dtype=BF16) if out is None else out
    T, B, W = check_kda_args(qkv, f, b, gate, conv_w, A_log, dt_bias, o_norm_w, conv_pool, rec_pool, cu_seqlens,
                             context_lens, state_slots, num_heads, head_dim, out)
    if e4m3_out is not None:
        check_e4m3_out(e4m3_out, T, num_heads * head_dim, "kda_prefill", align=8)
        if num_heads * 16 > 1024:
            raise ValueError(f"kda_prefill: e4m3_out takes one token a block of 16 threads a head: at most 64 heads, "
                             f"got {num_heads}")
    if snapshot is not None and (snapshot.dtype != np.int32 or snapshot.shape != (B, 2)
                                 or not snapshot.flags.c_contiguous):
        raise ValueError(f"kda_prefill: snapshot must be a contiguous [{B}, 2] int32 array, got {snapshot.dtype} "
                         f"{tuple(snapshot.shape)}")
    if T == 0 or B == 0:
        return out
    for name, arr in (("qkv", qkv), ("f", f), ("conv_w", conv_w), ("dt_bias", dt_bias), ("conv_pool", conv_pool)):
        if arr.data.ptr % 16:  # kda_prefill_intra copies them in 16-byte pieces
            raise ValueError(f"{name} must be 16-byte aligned")
    K, L = head_dim, _CHUNK
    num_chunks = B + T // L  # chunk ids: b + cu_seqlens[b] // L + j (kda_prefill.cu's header)
    sms = sm_count(cupy.cuda.Device().id)
    vb = int(state_columns) if state_columns is not None else _state_columns(B, num_heads, K)
    pf = _state_prefetch(B, num_heads, K, vb, sms) if state_prefetch is None else int(state_prefetch)
    qkdwu = cupy.empty((4, num_chunks, num_heads, L, K), dtype=BF16)  # qg, kd, W, U per chunk and head
    a_qk = cupy.empty((num_chunks, num_heads, L, L), dtype=BF16)
    g_last = cupy.empty((num_chunks, num_heads, K), dtype=np.float32)
    intra, state, norm = _kernels(K, W, vb, pf)
    smem = _intra_smem_bytes(K, L, W)
    intra((num_chunks, num_heads), (_INTRA_THREADS,),
          (qkv, f, b, i32(leading_dim(b)), conv_w, A_log, dt_bias, conv_pool, cu_seqlens, context_lens, state_slots,
           qkdwu[0], qkdwu[1], qkdwu[2], qkdwu[3], a_qk, g_last, i32(B), i32(num_heads),
           i32(sms)),  # one CTA per SM: the next wave starts that many ids on
          shared_mem=smem, stream=stream)
    smem = _state_smem_bytes(K, L, vb, pf)
    state((K // vb, num_heads, B), (32 * 4 * max(vb // 32, 1),),
          (qkdwu[0], qkdwu[1], qkdwu[2], qkdwu[3], a_qk, g_last, qkv, conv_pool, rec_pool, cu_seqlens, context_lens,
           state_slots, out, i32(num_heads), snapshot if snapshot is not None else np.uint64(0)),
          shared_mem=smem, stream=stream)
    if e4m3_out is not None:
        _norm_e4m3_kernel(K, W, vb, pf)((T,), (16 * num_heads,), (gate, o_norm_w, out, f32(eps), *e4m3_out), stream=stream)
        return out
    rows = T * num_heads
    norm(((rows * 16 + 255) // 256,), (256,), (gate, o_norm_w, out, i32(rows), f32(eps)), stream=stream)
    return out
