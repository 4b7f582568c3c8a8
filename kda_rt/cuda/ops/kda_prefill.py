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

_CHUNK, _SUB = 64, 16  # tokens per chunk, rows per gate sub-block (as fla)
_THREADS = 256  # kda_prefill_chunk's thread maps are written for 256 threads
_ROW_PAD = 4  # floats after each chunk-tile row: rows tx + 16j then hit distinct 16-byte bank groups


def _constants(head_dim: int, conv_w: int) -> dict[str, int]:
    """The -D constants of kda_prefill.cu (the cache key of both kernels)."""
    return dict(HEAD_DIM=head_dim, CONV_W=conv_w, CHUNK=_CHUNK, SUB=_SUB, LD=head_dim + _ROW_PAD, THREADS=_THREADS)


def _chunk_smem_bytes(c: dict[str, int]) -> int:
    """The SM_* plan of kda_prefill.cu: state, 4 padded chunk tiles, A, gate tables, beta (fp32)."""
    K, L, num_sub = c["HEAD_DIM"], c["CHUNK"], c["CHUNK"] // c["SUB"]
    gate_rows = num_sub * (num_sub - 1) // 2 + 2 * num_sub  # cross-block offsets, first-row G, later sums
    return 4 * (K * K + 4 * L * c["LD"] + L * L + gate_rows * K + L)


def kda_prefill(qkv, f, b, gate, conv_w, A_log, dt_bias, o_norm_w, conv_pool, rec_pool, cu_seqlens, context_lens,
                state_slots, *, num_heads: int, head_dim: int, eps: float, out=None, stream=None, max_seqlen=None):
    """Sequences of any length >= 1 (cu_seqlens [B+1]); updates the slots' conv and recurrent state in
    place and returns out [T, P] bf16.  `max_seqlen` is accepted for interface symmetry and unused
    (the chunk grid is (H, B); each CTA loops over its own chunks)."""
    import cupy

    out = cupy.empty(f.shape, dtype=BF16) if out is None else out
    T, B, W = check_kda_args(qkv, f, b, gate, conv_w, A_log, dt_bias, o_norm_w, conv_pool, rec_pool, cu_seqlens,
                             context_lens, state_slots, num_heads, head_dim, out)
    if T == 0 or B == 0:
        return out
    work = cupy.empty((4, num_heads, T, head_dim), dtype=np.float32)  # q, k, v, g (log2) per head
    beta = cupy.empty((num_heads, T), dtype=np.float32)
    consts = _constants(head_dim, W)
    prep = get_kernel("kda_prefill.cu", "kda_prefill_prep", **consts)
    prep((T, num_heads), (head_dim,), (qkv, f, b, i32(leading_dim(b)), conv_w, A_log, dt_bias, conv_pool, cu_seqlens,
                                       context_lens, state_slots, work[0], work[1], work[2], work[3], beta, i32(T),
                                       i32(B), i32(num_heads)), stream=stream)
    smem = _chunk_smem_bytes(consts)
    chunk = get_kernel("kda_prefill.cu", "kda_prefill_chunk", max_dynamic_smem=smem, **consts)
    chunk((num_heads, B), (_THREADS,), (work[0], work[1], work[2], work[3], beta, qkv, gate, o_norm_w, conv_pool,
                                        rec_pool, cu_seqlens, context_lens, state_slots, out, i32(T), i32(num_heads),
                                        f32(eps)), shared_mem=smem, stream=stream)
    return out
