"""Hopper tensor maps (the descriptors of cp.async.bulk.tensor) without the CUDA Python bindings:
cuTensorMapEncodeTiled called through ctypes on the driver library that CuPy already uses.  The
128-byte map is returned as bytes; callers keep it in device memory (a kernel reads it from a global
pointer) and keep the tensor it names alive.

Only what the kernels use: 2-D bf16 tensors, row-major [rows, cols] with a row stride in bytes, boxes
of box_rows x box_cols elements, the 128-byte swizzle (box_cols * 2 must be 128), reads past the
tensor's end zero-filled."""

from __future__ import annotations

import ctypes
import functools

__all__ = ["encode_2d"]

_BF16 = 9            # CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
_SWIZZLE_128B = 3    # CU_TENSOR_MAP_SWIZZLE_128B
_L2_PROMOTE_256B = 3  # CU_TENSOR_MAP_L2_PROMOTION_L2_256B


@functools.cache
def _encode_fn():
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise RuntimeError("tensor maps need the CUDA driver library (libcuda.so.1), which was not found")
    fn = getattr(lib, "cuTensorMapEncodeTiled", None)
    if fn is None:
        raise RuntimeError("the CUDA driver has no cuTensorMapEncodeTiled (needs CUDA 12.0+)")
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def encode_2d(ptr: int, rows: int, cols: int, row_stride_bytes: int, box_rows: int, box_cols: int) -> bytes:
    """The tensor map of a bf16 [rows, cols] tensor at device address `ptr` read in box_rows x box_cols
    boxes into 128-byte-swizzled shared memory."""
    if box_cols * 2 != 128:
        raise ValueError(f"encode_2d: box_cols={box_cols} must span 128 bytes (64 bf16) for the 128-byte swizzle")
    if not 1 <= box_rows <= 256:
        raise ValueError(f"encode_2d: box_rows={box_rows} must be in 1..256")
    if ptr % 16 or row_stride_bytes % 16:
        raise ValueError(f"encode_2d: address {ptr:#x} and row stride {row_stride_bytes} must be multiples of 16 bytes")
    buf = (ctypes.c_uint8 * 192)()  # 128 bytes, 64-byte aligned inside
    addr = (ctypes.addressof(buf) + 63) & ~63
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(row_stride_bytes)
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    rc = _encode_fn()(addr, _BF16, 2, ctypes.c_void_p(ptr), dims, strides, box, elem, 0, _SWIZZLE_128B,
                      _L2_PROMOTE_256B, 0)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for [{rows}, {cols}] stride "
                           f"{row_stride_bytes} B, box [{box_rows}, {box_cols}]")
    return ctypes.string_at(addr, 128)
