"""Launcher for kernels_cu/embed.cu: out[t] = table[ids[t]] (16-byte vector copies, exact)."""

from __future__ import annotations

import numpy as np

from kda_rt.cuda.ops.check import BF16, expect, i32
from kda_rt.cuda.ops.compile import get_kernel

__all__ = ["embed"]


def embed(ids, table, *, out=None, stream=None):
    """ids: [T] int32, table: [V, D] bf16 -> out [T, D] bf16.  An id outside [0, V) gives a zero row."""
    import cupy

    (T,) = expect(ids, "ids", ndim=1, dtype=np.int32)
    V, D = expect(table, "table", ndim=2, dtype=BF16)
    if D % 8:
        raise ValueError(f"embed: row width {D} must be a multiple of 8 (16-byte copies)")
    out = cupy.empty((T, D), dtype=BF16) if out is None else out
    expect(out, "out", shape=(T, D), dtype=BF16)
    threads = min(256, max(32, -(-D // 8 // 32) * 32))
    kernel = get_kernel("embed.cu", "embed_gather", D=D, THREADS=threads)
    if T:
        kernel((T,), (threads,), (ids, table, out, i32(T), i32(V)), stream=stream)
    return out
