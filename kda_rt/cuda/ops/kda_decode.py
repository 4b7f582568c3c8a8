"""Launcher for kernels_cu/kda_decode.cu: one fused KDA decode step for B sequences of one token each.

Conv state layout (owned here, used by kda_prefill too): conv_pool [S, 3, W-1, P] bf16, the previous
W-1 raw (pre-conv, pre-SiLU) q|k|v projections of each slot, oldest first — the layout of the
NumPy cache (kda_rt/cache.py); bf16 holds the raw projections exactly.
"""

from __future__ import annotations

import numpy as np

from kda_rt import env
from kda_rt.cuda.ops.check import BF16, expect, f32, i32, leading_dim
from kda_rt.cuda.ops.compile import clusters_supported as _clusters  # (tests monkeypatch this name)
from kda_rt.cuda.ops.compile import get_kernel, sm_count, smem_optin

__all__ = ["CONV_STATE_DTYPE", "FUSE_MAX_SEQS", "conv_state_shape", "check_kda_args", "decode_config",
           "fuses_low_rank", "kda_decode", "smem_state", "state_hints"]

CONV_STATE_DTYPE = BF16
# (SPLIT, THREADS) -> MIN_BLOCKS.  SPLIT: a head's value columns over that many CTAs of one cluster
# (sm_90+); MIN_BLOCKS: the CTAs per SM that __launch_bounds__ keeps registers for (sm_90a ptxas:
# 122, 116, 92, 71, 63 registers, no spills).
_VARIANTS = {(1, 256): 2, (2, 128): 4, (2, 256): 2, (4, 128): 7, (8, 128): 8}
# the low-rank gate GEMVs fused in (FUSE_FG) up to this batch: each CTA re-reads 2 x 32 rows of f_b / g_b
# (16 KB at rank 128) from L2, B x 2 MB in all, against two cuBLAS launches saved.  H200 (graph replay,
# the two GEMVs + kernel against the fused kernel): B = 1 9.7 -> 5.6 us, B = 8 18.4 -> 16.0 (but the
# unfused 256-thread kernel then takes 9.3 + the GEMVs), B = 32 56.4 -> 56.7, B = 64 100 -> 106
FUSE_MAX_SEQS = 4
# the column split (cluster of 4 CTAs per head) up to this batch; one CTA per head above
SPLIT_MAX_SEQS = 4
# kda_decode.cu STATE_HINTS by batch: the state loads without L1 allocation and its stores streaming (evict-first)
# up to this batch, the loads' hint alone above.  H200, 2026-12-02, tests/gpu/bench_decode_sweep.py --parts=kda
# --kda-define=STATE_HINTS=0,1,2,3 (graph replay, three interleaved rounds, us): B = 64 83.6-83.9 / 77.5-77.8 /
# 82.4-83.1 / 91.1-91.7, B = 128 159.1-159.6 / 154.3-154.4 / 156.2-156.8 / 177.5-178.1, B = 256 307.7-308.0 /
# 311.5-311.7 / 304.5-305.0 / 345.9-346.2 (the stores' hint alone is slower everywhere)
HINTS_BOTH_MAX_SEQS = 128


# kda_decode.cu SMEM_STATE (KDA_RT_KDA_SMEM_STATE): the state by bulk copies into 64 KB of dynamic shared memory,
# launch bounds for three CTAs an SM (80 registers, sm_90a ptxas; 11,264 bytes of static shared memory each: 3 x
# (65,536 + 11,264 + 1,024 reserved) bytes is exactly the H200's 228 KB an SM, so a byte more of static shared memory
# would leave two CTAs an SM: tests/kernels/test_kda_decode.py::test_kda_decode_smem_state_occupancy).  H200, 2026-12-04 (fifty-first session), register form -> SMEM_STATE:
# the kernel alone (tests/gpu/bench_decode_sweep.py --parts=kda --kda-define=KDA_RT_KDA_SMEM_STATE=0,1, graph of 20
# calls, three rounds, us) B = 8 9.3 -> 10.0, 32 42.0 -> 45.7, 64 78.0 -> 80.2, 128 154.5 -> 150.6, 256 304.7 ->
# 290.1 (3.52 -> 3.70 TB/s); in the full 27-layer model's decode graph (tests/gpu/bench_ab.py --env
# KDA_RT_KDA_SMEM_STATE --replays 32,128,192,256, 2 rounds, ms) batch 32 8.690 -> 8.666, 128 15.880 -> 15.721, "192"
# (the 256-row graph, 64 padding rows: bench_ab.py then took the next bucket up) 21.128 -> 20.871, 256 22.254 -> 21.873 (-0.3 / -1.0 / -1.2 / -1.7%: there its copies run beside the kernel before
# it, whose last CTAs leave SMs it can fill).  So from 32 sequences.  Fifty-second session (tests/gpu/kda_smem_check.sh,
# the same replays, 2 rounds, forms 1 / 0): batch 16 6.324 / 6.272 ms (the register form wins below 32), 32 8.708 /
# 8.731, 64 11.722 / 11.770, 256 22.414 / 22.703; form 2 (bulk stores too) slower than 1 at every batch (kda_decode.cu).
SMEM_STATE_MIN_SEQS = 32
SMEM_STATE_MIN_BLOCKS = 3
# kda_decode.cu SMEM_STATE = 3 (KDA_RT_KDA_SMEM_STATE=3, a bench form): one persistent CTA an SM walks its heads with
# PERSIST_BUFS state buffers (192 KB), the next heads' bulk copies in flight while it computes one; H100, 2026-12-05
# (tests/gpu/kda_persist_check.sh, kernel alone): 25-38% slower than forms 0 / 1 at 32-256 sequences (a head's own
# chain, ~8.8 us at 8 warps an SM, is not overlapped by another CTA's)
PERSIST_BUFS = 3
_STATE_BYTES = 128 * 128 * 4
# the opt-in shared memory a block that a GPU holding three of these CTAs an SM has (H100, H200, B200: 227 KB); on
# others (sm_120: 99 KB, one such CTA an SM) the register form runs whatever KDA_RT_KDA_SMEM_STATE says
_SMEM_STATE_OPTIN = 232448


def _smem_optin() -> int:  # (tests monkeypatch this name)
    import cupy

    return smem_optin(cupy.cuda.Device().id)


def smem_state(split: int, fused: bool, num_seqs: int) -> int:
    """kda_decode.cu SMEM_STATE for a variant (0: the register form): 1 for the one-CTA-per-head kernel (split 1, the
    gates not fused) on sm_90+ GPUs that hold three of its CTAs an SM, from SMEM_STATE_MIN_SEQS sequences;
    KDA_RT_KDA_SMEM_STATE forces 0, 1 or 2 there."""
    if split != 1 or fused or not _clusters() or _smem_optin() < _SMEM_STATE_OPTIN:
        return 0
    return env.kda_smem_state(int(num_seqs >= SMEM_STATE_MIN_SEQS))


def state_hints(num_seqs: int) -> int:
    """kda_decode.cu STATE_HINTS for a batch of num_seqs (KDA_RT_KDA_STATE_HINTS overrides it)."""
    return env.kda_state_hints(1 if num_seqs <= HINTS_BOTH_MAX_SEQS else 2)


def decode_config(split: int | None = None, threads: int | None = None, fused: bool = False,
                  num_seqs: int = 1) -> tuple[int, int, int]:
    """(SPLIT, THREADS, MIN_BLOCKS).  Default, from tests/gpu/check_kda_decode.sh on the H200
    (2026-11-30, graph replay): SPLIT 4 of 128 threads up to SPLIT_MAX_SEQS sequences on sm_90+ (B = 1:
    4.7 us against 5.4 for one CTA per head), else one 256-thread CTA per head, which is the fastest from
    B = 8 on (B = 8 / 32 / 128 / 256: 9.3 / 46.3 / 164 / 314 us, 3.6 / 2.9 / 3.3 / 3.4 TB/s; split 4 took
    13.4 / 50.2 / 180 / 347).  `split` / `threads` force a variant (tests, the sweep); `fused` (low-rank
    gates in the kernel) keeps registers for 4 CTAs per SM (no spills)."""
    if split is None:
        split = 4 if (_clusters() and (fused or num_seqs <= SPLIT_MAX_SEQS)) else 1
    threads = threads or (256 if split == 1 else 128)
    if (split, threads) not in _VARIANTS:
        raise ValueError(f"no kda_decode variant with split {split} and {threads} threads: {sorted(_VARIANTS)}")
    if fused and split < 4:
        raise ValueError(f"fused low-rank gates need split >= 4, got {split}")
    mode = smem_state(split, fused, num_seqs) if threads == 256 else 0
    if mode:
        return split, threads, 1 if mode == 3 else SMEM_STATE_MIN_BLOCKS
    return split, threads, min(_VARIANTS[(split, threads)], 4) if fused else _VARIANTS[(split, threads)]


def fuses_low_rank(num_seqs: int, f_a_out, g_a_out) -> bool:
    """Whether kda_decode should take the low-rank gate inputs (f_b, g_b applied in the kernel) for a
    batch of num_seqs: clusters (sm_90+), a small batch, ranks that are multiples of 8 up to 256 and
    16-byte aligned rows.  f_a_out [B, Rf], g_a_out [B, Rg] bf16 (row-strided views)."""
    return 1 <= num_seqs <= FUSE_MAX_SEQS and _low_rank_ok(f_a_out, g_a_out)


def _low_rank_ok(f_a_out, g_a_out) -> bool:
    return _clusters() and f_a_out.strides[0] == g_a_out.strides[0] and all(
        a.shape[1] % 8 == 0 and 0 < a.shape[1] <= 256 and a.data.ptr % 16 == 0 and a.strides[0] % 16 == 0
        for a in (f_a_out, g_a_out))


def conv_state_shape(num_slots: int, P: int, W: int) -> tuple[int, int, int, int]:
    return (num_slots, 3, W - 1, P)


def check_kda_args(qkv, f, b, gate, conv_w, A_log, dt_bias, o_norm_w, conv_pool, rec_pool, cu_seqlens,
                   context_lens, state_slots, num_heads: int, head_dim: int, out, *,
                   low_rank: bool = False, qkv_row_stride: bool = False) -> tuple[int, int, int]:
    """Validate the KDA boundary shared by kda_decode and kda_prefill; returns (T, B, W).  With
    `low_rank`, f and gate are the f_a / g_a outputs [T, R] (row-strided views) instead of [T, P]; with
    `qkv_row_stride` (kda_decode), qkv may be a row-strided view with 16-byte aligned rows."""
    P = num_heads * head_dim
    T, _ = expect(qkv, "qkv", shape=(None, 3 * P), dtype=BF16, row_stride=qkv_row_stride)
    if qkv_row_stride and (qkv.data.ptr % 16 or qkv.strides[0] % 16):
        raise ValueError(f"qkv rows must be 16-byte aligned (pointer {qkv.data.ptr:#x}, row stride {qkv.strides[0]} B)")
    expect(f, "f", shape=(T, None if low_rank else P), dtype=BF16, row_stride=low_rank)
    expect(b, "b", shape=(T, num_heads), dtype=BF16, row_stride=True)
    expect(gate, "gate", shape=(T, None if low_rank else P), dtype=BF16, row_stride=low_rank)
    _, W = expect(conv_w, "conv_w", shape=(3 * P, None), dtype=np.float32)
    expect(A_log, "A_log", shape=(num_heads,), dtype=np.float32)
    expect(dt_bias, "dt_bias", shape=(P,), dtype=np.float32)
    expect(o_norm_w, "o_norm_w", shape=(head_dim,), dtype=np.float32)
    S = expect(conv_pool, "conv_pool", ndim=4, dtype=CONV_STATE_DTYPE)[0]
    expect(conv_pool, "conv_pool", shape=conv_state_shape(S, P, W), dtype=CONV_STATE_DTYPE)
    expect(rec_pool, "rec_pool", shape=(S, num_heads, head_dim, head_dim), dtype=np.float32)
    B = expect(cu_seqlens, "cu_seqlens", ndim=1, dtype=np.int32)[0] - 1
    expect(context_lens, "context_lens", shape=(B,), dtype=np.int32)
    expect(state_slots, "state_slots", shape=(B,), dtype=np.int32)
    expect(out, "out", shape=(T, P), dtype=BF16)
    if head_dim != 128 or W < 2:
        raise ValueError(f"KDA kernels need head_dim == 128 and conv width >= 2, got {head_dim}, {W}")
    if gate.data.ptr % 16 or out.data.ptr % 16:
        raise ValueError("gate and out must be 16-byte aligned")
    return T, B, W


def kda_decode(qkv, f, b, gate, conv_w, A_log, dt_bias, o_norm_w, conv_pool, rec_pool, cu_seqlens, context_lens,
               state_slots, *, num_heads: int, head_dim: int, eps: float, out=None, stream=None, max_seqlen=None,
               f_b=None, g_b=None, split: int | None = None, threads: int | None = None, skip_pad: int = 0):
    """One token per sequence (T == B; token b is sequence b, cu_seqlens is not read); qkv [B, 3P] may be a
    row-strided view (the q|k|v columns of the model's fused decode projection).  Updates the
    slots' conv and recurrent state in place; returns out [B, P] bf16 (gated-RMSNorm output).
    Allocates nothing when `out` is given and never reads device data on the host (graph-capturable).
    With f_b [P, Rf] and g_b [P, Rg] (see fuses_low_rank), f and gate are the f_a / g_a outputs
    [B, Rf], [B, Rg] and the kernel applies f_b / g_b itself.  `split` / `threads` force a kernel
    variant (see decode_config); every variant computes the same math.  `skip_pad` 1: a negative slot is a padding
    row (kda_decode.cu SKIP_PAD): a fresh state whose conv history and state are stored nowhere; 2: its output row
    zeros and no work at all; 0 (False): every slot must lie in the pools."""
    import cupy

    fused = f_b is not None or g_b is not None
    P = num_heads * head_dim
    out = cupy.empty((qkv.shape[0], P), dtype=BF16) if out is None else out
    T, B, W = check_kda_args(qkv, f, b, gate, conv_w, A_log, dt_bias, o_norm_w, conv_pool, rec_pool, cu_seqlens,
                             context_lens, state_slots, num_heads, head_dim, out, low_rank=fused, qkv_row_stride=True)
    if T != B:
        raise ValueError(f"kda_decode takes one token per sequence, got {T} tokens for {B} sequences")
    if o_norm_w.data.ptr % 16:
        raise ValueError("o_norm_w must be 16-byte aligned (16-byte async copies of its slices)")
    rank_f, rank_g, ldr = 0, 0, 0
    if fused:
        rank_f, rank_g = f.shape[1], gate.shape[1]
        expect(f_b, "f_b", shape=(P, rank_f), dtype=BF16)
        expect(g_b, "g_b", shape=(P, rank_g), dtype=BF16)
        ldr = leading_dim(f)
        if not _low_rank_ok(f, gate) or f_b.data.ptr % 16 or g_b.data.ptr % 16:
            raise ValueError("fused low-rank gates need sm_90+, ranks that are multiples of 8 up to 256, one row "
                             "stride for f and gate, and 16-byte aligned rows")
    n_split, n_threads, min_blocks = decode_config(split, threads, fused, num_seqs=B)
    mode = smem_state(n_split, fused, B) if n_threads == 256 else 0
    smem = _STATE_BYTES * (PERSIST_BUFS if mode == 3 else 1) if mode else 0
    extra = {"SMEM_STATE": mode} if mode else {}  # (the register form's builds keep their cache keys)
    grid = (num_heads * n_split, B)
    if mode == 3:  # one CTA an SM walks heads blockIdx.x, + grid, ... (kda_decode.cu PERSIST)
        extra["PERSIST_BUFS"] = PERSIST_BUFS
        grid = (min(B * num_heads, env.kda_persist_ctas() or sm_count(cupy.cuda.Device().id)), 1)
    if skip_pad not in (0, 1, 2):
        raise ValueError(f"kda_decode: skip_pad must be 0, 1 or 2, got {skip_pad!r}")
    if skip_pad:
        extra["SKIP_PAD"] = int(skip_pad)
    kernel = get_kernel("kda_decode.cu", "kda_decode_step", max_dynamic_smem=smem, HEAD_DIM=head_dim, CONV_W=W,
                        THREADS=n_threads, SPLIT=n_split, MIN_BLOCKS=min_blocks, FUSE_FG=int(fused), RANK_F=rank_f,
                        RANK_G=rank_g, EARLY_STATE=int(env.kda_early_state()), STATE_HINTS=state_hints(B), **extra)
    if B:
        kernel(grid, (n_threads,),
               (qkv, i32(leading_dim(qkv)), f, b, i32(leading_dim(b)), gate, conv_w, A_log, dt_bias, o_norm_w,
                conv_pool, rec_pool, context_lens, state_slots, out, i32(num_heads), f32(eps), f_b if fused else np.uint64(0),
                g_b if fused else np.uint64(0), i32(ldr), i32(B)), shared_mem=smem, stream=stream)
    return out
