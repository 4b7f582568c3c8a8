"""Launcher for kernels_cu/l2_prefetch.cu: ask L2 for up to two weight regions while the kernels before the
one that reads them run (decode graphs, where those kernels are latency-bound: the KDA recurrence before
o_proj, the routing before the shared expert, MLA attention before its o_proj).  A hint: nothing is
written, and the results are the same with or without it."""

from __future__ import annotations

import numpy as np

from kda_rt.cuda.ops.compile import get_kernel

__all__ = ["CHUNK", "l2_prefetch"]

CHUNK = 16384  # bytes per thread: one bulk prefetch each
_THREADS = 128


def _size(a, name: str) -> int:
    """Bytes of a region (0 for None), after the kernel's checks."""
    if a is None:
        return 0
    if not a.flags.c_contiguous:
        raise ValueError(f"l2_prefetch: {name} must be contiguous (shape {a.shape}, strides {a.strides})")
    ptr, n = int(a.data.ptr), int(a.nbytes)
    if ptr % 16 or n % 16:
        raise ValueError(f"l2_prefetch: {name} must start 16-byte aligned and span a multiple of 16 bytes "
                         f"(address {ptr:#x}, {n} bytes)")
    return n


def l2_prefetch(first, second=None, *, stream=None) -> None:
    """Prefetch the bytes of `first` and `second` (contiguous device arrays, 16-byte aligned and sized)."""
    n0, n1 = _size(first, "first"), _size(second, "second")
    chunks = -(-n0 // CHUNK) + -(-n1 // CHUNK)
    if chunks == 0:
        return
    kernel = get_kernel("l2_prefetch.cu", "l2_prefetch", CHUNK=CHUNK)
    kernel((-(-chunks // _THREADS),), (_THREADS,),
           (first, np.uint64(n0), first if second is None else second, np.uint64(n1)), stream=stream)
