"""Launcher for kernels_cu/quant.cu: bf16 weight rows to e4m3 codes with one fp32 scale a row on the GPU, bit for
bit as loader/quant.quantize_rows (the expert kernels' FP8 format, WFMT = 1), so a model's bf16 expert stacks can be
quantized where they already are (a 48B model's stacks are ~90 GB: the host path would read them all back)."""

from __future__ import annotations

import numpy as np

from kda_rt.cuda.ops.check import BF16, expect
from kda_rt.cuda.ops.compile import get_kernel
from kda_rt.cuda.ops.gemv import check_e4m3_arch

__all__ = ["quantize_rows_e4m3"]

_THREADS = 256


def quantize_rows_e4m3(w, name: str = "weight", *, out=None, scale_out=None, stream=None):
    """w [..., K] bf16 (rows: every index but the last) -> (q uint8 [..., K] e4m3 codes, scale fp32 [...]).  A
    non-finite entry is refused with the tensor's name and the entry's row (flattened) and column, as the host's
    quantize_rows refuses it; nothing is returned then.  One device synchronization (the refusal check)."""
    import cupy

    if w.dtype != BF16 or w.ndim < 2:
        raise ValueError(f"quantize_rows_e4m3: {name} must be a bf16 array of 2 or more dimensions, got {w.dtype} "
                         f"{w.shape}")
    K = w.shape[-1]
    rows = int(np.prod(w.shape[:-1]))
    if K % 2 or not w.flags.c_contiguous or w.data.ptr % 4:
        raise ValueError(f"quantize_rows_e4m3: {name} must be C-contiguous, 4-byte aligned, with an even row width "
                         f"(got {w.shape})")
    check_e4m3_arch("quantize_rows_e4m3")
    # everything on `stream` (the fill of `bad` before the kernel's atomics; the uploader's stream is non-blocking)
    with stream if stream is not None else cupy.cuda.get_current_stream():
        q = cupy.empty(w.shape, dtype=np.uint8) if out is None else out
        scale = cupy.empty(w.shape[:-1], dtype=np.float32) if scale_out is None else scale_out
        expect(q, "out", shape=w.shape, dtype=np.uint8)
        expect(scale, "scale_out", shape=w.shape[:-1], dtype=np.float32)
        bad = cupy.full(1, np.iinfo(np.uint64).max, dtype=np.uint64)
        if rows:
            get_kernel("quant.cu", "quantize_rows_e4m3", THREADS=_THREADS)(
                (rows,), (_THREADS,), (w, np.int32(K), q, scale, bad))
        first = int(bad.get()[0])
    if first != np.iinfo(np.uint64).max:
        r, c = divmod(first, K)
        v = float(w.reshape(rows, K)[r, c].astype(np.float32).get())
        raise ValueError(f"quantize_rows_e4m3: {name} has a non-finite entry ({v}) at row {r}, column {c}")
    return q, scale
