"""Launcher for kernels_cu/kda_prefill.cu: KDA over a varlen flat batch (chunked WY form, chunk 64).

Two launches: kda_prefill_prep (conv + SiLU, l2norm, gate, beta -> fp32 workspace [H, T, K]) and
kda_prefill_chunk (one CTA per (head, sequence) walking its chunks with the state in shared memory;
it also writes the conv and recurrent state back to the slots).  Runs eagerly: allocates workspace.
"""

from __future__ import annotations

import numpy as np

from kda_rt.cuda.ops.check import BF16, f32, i32, leading_dim
from kda_rt.cuda.ops.compile import get_kernel
from kda_rt.cuda.ops.kda_decode import check_kda_args

__all__ = ["kda_prefill"]

_CHUNK, _LD, _SUB = 64, 128 + 4, 16
_opted_in: set[int] = set()


def _chunk_smem_bytes(head_dim: int) -> int:
    """Must match the SM_* plan of kda_prefill.cu: state, 4 padded chunk tiles, A, gate tables, beta."""
    floats = head_dim * head_dim + 4 * _CHUNK * _LD + _CHUNK * _CHUNK + (6 + 2 * (_CHUNK // _SUB)) * head_dim + _CHUNK
    return 4 * floats


def kda_prefill(qkv, f, b, gate, conv_w, A_log, dt_bias, o_norm_w, conv_pool, rec_pool, cu_seqlens, context_lens,
                state_slots, *, num_heads: int, head_dim: int, eps: float, out=None, stream=None, max_seqlen=None):
    """Sequences of any length >= 1 (cu_seqlens [B+1]); updates the slots' conv and recurrent state in
    place and returns out [T, P] bf16.  `max_seqlen` is accepted for interface symmetry and unused
    (the chunk grid is (H, B); each CTA loops over its own chunks)."""
    import cupy
    from cupy_backends.cuda.api import driver

    out = cupy.empty(f.shape, dtype=BF16) if out is None else out
    T, B, W = check_kda_args(qkv, f, b, gate, conv_w, A_log, dt_bias, o_norm_w, conv_pool, rec_pool, cu_seqlens,
                             context_lens, state_slots, num_heads, head_dim, out)
    if T == 0 or B == 0:
        return out
    work = cupy.empty((4, num_heads, T, head_dim), dtype=np.float32)  # q, k, v, g (log2) per head
    beta = cupy.empty((num_heads, T), dtype=np.float32)
    prep = get_kernel("kda_prefill.cu", "kda_prefill_prep", HEAD_DIM=head_dim, CONV_W=W)
    prep((T, num_heads), (head_dim,), (qkv, f, b, i32(leading_dim(b)), conv_w, A_log, dt_bias, conv_pool, cu_seqlens,
                                       context_lens, state_slots, work[0], work[1], work[2], work[3], beta, i32(T),
                                       i32(B), i32(num_heads)), stream=stream)
    chunk = get_kernel("kda_prefill.cu", "kda_prefill_chunk", HEAD_DIM=head_dim, CONV_W=W)
    smem = _chunk_smem_bytes(head_dim)
    if chunk.ptr not in _opted_in:  # > 48 KB of dynamic shared memory needs an explicit opt-in
        driver.funcSetAttribute(chunk.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        _opted_in.add(chunk.ptr)
    chunk((num_heads, B), (256,), (work[0], work[1], work[2], work[3], beta, qkv, gate, o_norm_w, conv_pool, rec_pool,
                                   cu_seqlens, context_lens, state_slots, out, i32(T), i32(num_heads), f32(eps)),
          shared_mem=smem, stream=stream)
    return out
