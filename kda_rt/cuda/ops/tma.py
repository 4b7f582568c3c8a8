"""Hopper tensor maps (the descriptors of cp.async.bulk.tensor) without the CUDA Python bindings:
cuTensorMapEncodeTiled called through ctypes on the driver library that CuPy already uses.  Maps live in
device memory (a kernel reads them through a global pointer), one per weight tensor, cached by address and
shape; the tensor must outlive its map's use (model weights do).

Only what the kernels use: 2-D bf16 tensors, row-major [rows, cols] with a row stride in bytes, boxes of
box_rows x box_cols elements, the 128-byte swizzle (box_cols * 2 must be 128), reads past the tensor's end
zero-filled.  Checked on the H200 by tests/gpu/probe_tma.py (plain and multicast loads)."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

__all__ = ["encode_2d", "weight_map"]

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


_maps: dict[tuple[int, int, int, int, int], Any] = {}


def weight_map(weight, box_rows: int):
    """Device copy (uint8 [128]) of the map of `weight` [..., cols] bf16 viewed as 2-D [rows, cols] and read in
    box_rows x 64 boxes (cached per address, shape and box)."""
    import cupy

    cols = int(weight.shape[-1])
    rows = int(weight.size // cols)
    if not weight.flags.c_contiguous:
        raise ValueError(f"weight_map: the weight {weight.shape} must be C-contiguous")
    key = (int(weight.data.ptr), rows, cols, box_rows, cupy.cuda.Device().id)
    if key not in _maps:
        raw = encode_2d(key[0], rows, cols, cols * 2, box_rows, 64)
        _maps[key] = cupy.asarray(np.frombuffer(raw, dtype=np.uint8))
    return _maps[key]
