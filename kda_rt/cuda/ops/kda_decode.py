"""Launcher for kernels_cu/kda_decode.cu: one fused KDA decode step for B sequences of one token each.

Conv state layout (owned here, used by kda_prefill too): conv_pool [S, 3, W-1, P] bf16, the previous
W-1 raw (pre-conv, pre-SiLU) q|k|v projections of each slot, oldest first — the layout of the
NumPy cache (kda_rt/cache.py); bf16 holds the raw projections exactly.
"""

from __future__ import annotations

import numpy as np

from kda_rt.cuda.ops.check import BF16, expect, f32, i32, leading_dim
from kda_rt.cuda.ops.compile import get_kernel

__all__ = ["CONV_STATE_DTYPE", "conv_state_shape", "check_kda_args", "kda_decode"]

CONV_STATE_DTYPE = BF16
_THREADS = 256  # 8 warps of 16 state rows each (K = 128)


def conv_state_shape(num_slots: int, P: int, W: int) -> tuple[int, int, int, int]:
    return (num_slots, 3, W - 1, P)


def check_kda_args(qkv, f, b, gate, conv_w, A_log, dt_bias, o_norm_w, conv_pool, rec_pool, cu_seqlens,
                   context_lens, state_slots, num_heads: int, head_dim: int, out) -> tuple[int, int, int]:
    """Validate the KDA boundary shared by kda_decode and kda_prefill; returns (T, B, W)."""
    P = num_heads * head_dim
    T, _ = expect(qkv, "qkv", shape=(None, 3 * P), dtype=BF16)
    expect(f, "f", shape=(T, P), dtype=BF16)
    expect(b, "b", shape=(T, num_heads), dtype=BF16, row_stride=True)
    expect(gate, "gate", shape=(T, P), dtype=BF16)
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
               state_slots, *, num_heads: int, head_dim: int, eps: float, out=None, stream=None, max_seqlen=None):
    """One token per sequence (T == B; token b is sequence b, cu_seqlens is not read).  Updates the
    slots' conv and recurrent state in place; returns out [B, P] bf16 (gated-RMSNorm output).
    Allocates nothing when `out` is given and never reads device data on the host (graph-capturable)."""
    import cupy

    out = cupy.empty(f.shape, dtype=BF16) if out is None else out
    T, B, W = check_kda_args(qkv, f, b, gate, conv_w, A_log, dt_bias, o_norm_w, conv_pool, rec_pool, cu_seqlens,
                             context_lens, state_slots, num_heads, head_dim, out)
    if T != B:
        raise ValueError(f"kda_decode takes one token per sequence, got {T} tokens for {B} sequences")
    kernel = get_kernel("kda_decode.cu", "kda_decode_step", HEAD_DIM=head_dim, CONV_W=W, THREADS=_THREADS)
    if B:
        kernel((num_heads, B), (_THREADS,), (qkv, f, b, i32(leading_dim(b)), gate, conv_w, A_log, dt_bias, o_norm_w,
                                             conv_pool, rec_pool, context_lens, state_slots, out, i32(num_heads),
                                             f32(eps)), stream=stream)
    return out
