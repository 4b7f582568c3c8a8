"""Launcher for kernels_cu/mla_store.cu: RMSNorm the latent and write [c | k_pe] rows into the pages.

Letters: T new tokens, B sequences, M page slots per sequence, R latent rank, Dr k_pe width.
Graph-safe: no host reads, no allocation; the token -> sequence map is found on the device.
"""

from __future__ import annotations

from kda_rt.cuda.ops.check import BF16, expect, f32, i32, leading_dim
from kda_rt.cuda.ops.compile import get_kernel

__all__ = ["check_rows", "mla_store"]


def mla_store(kv_a, norm_w, eps: float, kv_pool, cu_seqlens, context_lens, block_tables, *, stream=None):
    """kv_a: [T, R+Dr] bf16 (row-strided view allowed), norm_w: [R] bf16,
    kv_pool: [num_blocks, block_size, R+Dr] bf16 (written in place), cu_seqlens: [B+1] int32,
    context_lens: [B] int32, block_tables: [B, M] int32.  Token t of sequence b lands at position
    context_lens[b] + t - cu_seqlens[b] through its block table."""
    T, ld, R, Dr, block_size, B1, M = check_rows(kv_a, norm_w, kv_pool, cu_seqlens, context_lens, block_tables)
    if T == 0 or B1 == 1:
        return kv_pool
    kernel = get_kernel("mla_store.cu", "mla_store_rows", R=R, DR=Dr, BLOCK_SIZE=block_size)
    kernel((T,), (R // 8,), (kv_a, i32(ld), norm_w, kv_pool, cu_seqlens, context_lens, block_tables,
                             i32(B1 - 1), i32(M), f32(eps)), stream=stream)
    return kv_pool


def check_rows(kv_a, norm_w, kv_pool, cu_seqlens, context_lens, block_tables):
    """mla_store's checks of its inputs (also run by mla_attention where its launch writes the rows):
    (T, kv_a's leading dim, R, Dr, block_size, B + 1, M)."""
    import numpy as np

    T, W = expect(kv_a, "kv_a", ndim=2, dtype=BF16, row_stride=True)
    _, block_size, width = expect(kv_pool, "kv_pool", ndim=3, dtype=BF16)
    if width != W:
        raise ValueError(f"kv_pool rows are {width} wide but kv_a has {W} columns")
    (R,) = expect(norm_w, "norm_w", ndim=1, dtype=BF16)
    Dr = W - R
    if R % 256 or R > 8192 or Dr <= 0 or Dr % 8 or Dr > R:
        raise ValueError(f"mla_store: latent rank {R} must be a multiple of 256 (<= 8192), k_pe width {Dr} "
                         "a positive multiple of 8")
    (B1,) = expect(cu_seqlens, "cu_seqlens", ndim=1, dtype=np.int32)
    expect(context_lens, "context_lens", shape=(B1 - 1,), dtype=np.int32)
    _, M = expect(block_tables, "block_tables", shape=(B1 - 1, None), dtype=np.int32)
    ld = leading_dim(kv_a)
    if ld % 8 or kv_a.data.ptr % 16:
        raise ValueError("mla_store: kv_a rows must start on 16-byte boundaries (leading dim a multiple of 8)")
    return T, ld, R, Dr, block_size, B1, M
