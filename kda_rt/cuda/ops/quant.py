"""Launcher for kernels_cu/quant.cu: bf16 weight rows to e4m3 codes with one fp32 scale a row on the GPU, bit for
bit as loader/quant.quantize_rows (the expert kernels' FP8 format, WFMT = 1), so a model's bf16 expert stacks can be
quantized where they already are (a 48B model's stacks are ~90 GB: the host path would read them all back)."""

from __future__ import annotations

import numpy as np

from kda_rt.cuda.ops.check import BF16, expect
from kda_rt.cuda.ops.compile import get_kernel
from kda_rt.cuda.ops.gemv import check_e4m3_arch

__all__ = ["activation_kernel", "check_e4m3_out", "quantize_activations_e4m3", "quantize_rows_e4m3"]

_THREADS = 256


def check_e4m3_out(e4m3_out, T: int, K: int, who: str, align: int = 1) -> None:
    """A kernel's extra output of its rows as e4m3 codes (q [T, K] uint8, `align`-byte aligned, and scale [T] fp32,
    both C-contiguous), on a GPU that writes e4m3 (sm_89+); refused by name otherwise."""
    q, qs = e4m3_out
    expect(q, "e4m3_out[0]", shape=(T, K), dtype=np.uint8)
    expect(qs, "e4m3_out[1]", shape=(T,), dtype=np.float32)
    if not (q.flags.c_contiguous and qs.flags.c_contiguous) or q.data.ptr % align:
        raise ValueError(f"{who}: e4m3_out's codes{f' ({align}-byte aligned)' if align > 1 else ''} and scales must "
                         "be C-contiguous")
    check_e4m3_arch(f"{who} e4m3_out")


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


_WARP_ROWS = 8  # rows a block of the warp-per-row kernel (256 threads)


def _threads(K: int) -> int:
    """Threads a row's block in the block-per-row kernel: ~4 pairs each, 32 to _THREADS."""
    return max(32, min(_THREADS, (K // 8 + 31) // 32 * 32))


def _warp_rows(K: int) -> bool:
    """Rows of K take the warp-per-row kernel (16-byte pieces, at most 32 a lane)."""
    return K % 8 == 0 and 0 < K <= 8192


def _block_kernel(K: int):
    return get_kernel("quant.cu", "quantize_rows_e4m3", THREADS=_threads(K))


def activation_kernel(K: int):
    """quantize_activations_e4m3's kernel for rows of K (built on first use; the runner builds it at start): one warp
    a row holding its pieces in registers (quant.cu ROW_K), or for other widths a block a row."""
    if _warp_rows(K):
        return get_kernel("quant.cu", "quantize_rows_e4m3_warp", THREADS=32 * _WARP_ROWS, ROW_K=K)
    return _block_kernel(K)


def quantize_activations_e4m3(x, *, out, scale_out, stream=None):
    """x [N, K] bf16 rows -> out [N, K] uint8 e4m3 codes and scale_out [N] fp32: quantize_rows_e4m3's scales (one
    fp32 scale a row, amax / 448) with the activations' codes, e4m3(x · (1 / scale)) with the reciprocal rounded once
    (loader/quant.quantize_rows reciprocal=True; ~6e-4 of the codes differ from the weights' quotient rule, by one
    step), for a prefill GEMM's e4m3 sources (moe_gemm_wg.cu WFMT = 2).  Nothing synchronizes and nothing is
    refused: a row with a non-finite entry gets a NaN scale, so its products are NaN as bf16 ones would be.
    Capturable."""
    N, K = expect(x, "x", ndim=2, dtype=BF16)
    expect(out, "out", shape=(N, K), dtype=np.uint8)
    expect(scale_out, "scale_out", shape=(N,), dtype=np.float32)
    if K % 2 or not x.flags.c_contiguous or x.data.ptr % 4:
        raise ValueError(f"quantize_activations_e4m3: x must be C-contiguous, 4-byte aligned, with an even row width "
                         f"(got {x.shape})")
    if not out.flags.c_contiguous or out.data.ptr % 2:  # (the codes are stored in pairs)
        raise ValueError("quantize_activations_e4m3: out must be C-contiguous and 2-byte aligned")
    check_e4m3_arch("quantize_activations_e4m3")
    if N:
        if _warp_rows(K) and x.data.ptr % 16 == 0 and out.data.ptr % 8 == 0:
            activation_kernel(K)((-(-N // _WARP_ROWS),), (32 * _WARP_ROWS,), (x, np.int32(N), out, scale_out),
                                 stream=stream)
        else:  # (the block-per-row kernel: other widths, or sources not aligned for 16-byte pieces)
            _block_kernel(K)((N,), (_threads(K),), (x, np.int32(K), out, scale_out, np.uint64(0)), stream=stream)
    return out, scale_out
