"""Tensor maps for the tensor-memory-accelerator copies (cp.async.bulk.tensor, sm_90+): a CUtensorMap, encoded by the
driver's cuTensorMapEncodeTiled (libcuda through ctypes: CuPy does not wrap it) and kept in a 128-byte device buffer
whose address a kernel takes (the map may sit in global memory).  One map per (array address, shape, box, stream),
the last _MAX_MAPS kept (weights: encoded once); a new one is copied to the device in the order of the stream that
launches its kernel (no host wait), so it may be made in the middle of a step.

Only the 2D, 128-byte-swizzled tile a kernel row of 128 bytes wants is offered: `map_2d_swizzled`."""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict

import numpy as np

from kda_rt import env

__all__ = ["allocation_rows", "encode_args_2d", "map_2d_swizzled"]

# (address, rows, cols, itemsize, box, stream, L2 promotion, row stride or None) -> (device, pinned)
_MAPS: OrderedDict[tuple, tuple] = OrderedDict()
_KEPT: dict[tuple, tuple] = {}  # the maps made with keep=True: never evicted
_MAX_MAPS = 512  # (an evicted buffer goes back to CuPy's pool, reused in its stream's order: a kernel queued on it
#                  before still reads the map)
_LOCK = threading.Lock()
_DRIVER = None

_DATA_TYPE = {1: 0, 2: 1}  # itemsize -> CU_TENSOR_MAP_DATA_TYPE_UINT8 / _UINT16 (the copy moves bytes)
_SWIZZLE_128B = 3  # CU_TENSOR_MAP_SWIZZLE_128B
_L2_PROMOTION = {"none": 0, "64": 1, "128": 2, "256": 3}  # KDA_RT_TMA_L2_PROMOTION -> CU_TENSOR_MAP_L2_PROMOTION_*


def encode_args_2d(address: int, rows: int, cols: int, itemsize: int, box_rows: int, row_stride: int | None = None,
                   box_past_rows: bool = False) -> tuple:
    """cuTensorMapEncodeTiled's arguments for a row-major [rows, cols] array of `itemsize`-byte elements at `address`
    (rows `row_stride` bytes apart, default cols · itemsize) and boxes of `box_rows` rows x 128 bytes in the 128-byte
    swizzle: (data type, global dims, global strides, box dims).  `box_past_rows`: a box may have more rows than the
    array (the copy fills the rows past its end with zeros).  Refuses what the driver would (with the limit named)
    before it is asked."""
    if itemsize not in _DATA_TYPE:
        raise ValueError(f"tensor map: elements of 1 or 2 bytes, got {itemsize}")
    row_bytes = cols * itemsize
    stride = row_bytes if row_stride is None else row_stride
    if address % 16 or stride % 16:
        raise ValueError(f"tensor map: the array's address ({address:#x}) and row stride ({stride} bytes) must be "
                         "multiples of 16")
    if row_bytes < 128 or stride < row_bytes:
        raise ValueError(f"tensor map: rows of at least 128 bytes (one swizzled box), at most their stride apart, "
                         f"got {row_bytes} bytes {stride} apart")
    if not 1 <= box_rows <= 256 or (rows < box_rows and not box_past_rows):
        raise ValueError(f"tensor map: box rows must be 1-256 and at most the array's {rows} rows, got {box_rows}")
    if rows > 1 << 32 or stride >= 1 << 40:
        raise ValueError(f"tensor map: [{rows}, {cols}] is past the driver's limits (2^32 rows, 2^40-byte strides)")
    return _DATA_TYPE[itemsize], (cols, rows), (stride,), (128 // itemsize, box_rows)


def _driver():
    global _DRIVER
    if _DRIVER is None:
        for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            raise RuntimeError("tensor map: the CUDA driver library (libcuda) could not be loaded")
        fn = getattr(lib, "cuTensorMapEncodeTiled", None)
        if fn is None:
            raise RuntimeError("tensor map: the CUDA driver has no cuTensorMapEncodeTiled (a CUDA 12.0+ driver is "
                               "needed; KDA_RT_MOE_B_TMA=0 copies without tensor maps)")
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                       ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        _DRIVER = fn
    return _DRIVER


def allocation_rows(arr) -> int:
    """How many rows of `arr`'s width its allocation holds from `arr`'s first byte on (at least `arr`'s own): a map
    over that many stays the same for every view of a reused buffer (a workspace) that starts there, whatever its row
    count, so it is encoded once, not once a step."""
    mem = arr.data.mem
    own = arr.size // arr.shape[-1]
    return max(own, (mem.ptr + mem.size - arr.data.ptr) // (arr.shape[-1] * arr.itemsize))


def map_2d_swizzled(arr, box_rows: int, what: str = "array", rows: int | None = None, stream=None,
                    keep: bool = False, box_past_rows: bool = False):
    """The device buffer (cupy uint8 [128]) holding a tensor map over `arr` seen as [rows, last dim] (C-contiguous,
    1- or 2-byte elements) with boxes of `box_rows` rows x 128 bytes, written into shared memory in the 128-byte
    swizzle (16-byte chunk c of box row r at chunk c ^ (r mod 8): wgmma's K-major SWIZZLE_128B layout).  Pass
    `buffer.data.ptr` to the kernel.  `rows`: more rows than `arr` has, up to `allocation_rows(arr)` (the buffer's
    bytes past `arr`).  `stream`: the stream of the kernels that read it (default: the current one).  `what` names the
    array in errors.  `keep`: never evicted (a map that a captured CUDA graph reads: the graph holds its address, not the
    buffer; for long-lived arrays such as weights, a few per layer and stream).  `box_past_rows`: `arr` may be a 2D
    array whose rows are further apart than their width (a column slice; `rows` not given), and a box may reach past
    its last row (those rows arrive as zeros)."""
    import cupy

    stride = None
    if box_past_rows and arr.ndim == 2 and arr.strides[1] == arr.itemsize and rows is None:
        stride = arr.strides[0]
    elif not arr.flags.c_contiguous:
        raise ValueError(f"tensor map over {what}: the array must be C-contiguous")
    cols = arr.shape[-1]
    if rows is None:
        rows = arr.size // cols
    elif not arr.size // cols <= rows <= allocation_rows(arr):
        raise ValueError(f"tensor map over {what}: {rows} rows, not between its {arr.size // cols} and the "
                         f"{allocation_rows(arr)} its allocation holds")
    stream = stream if stream is not None else cupy.cuda.get_current_stream()
    promotion = _L2_PROMOTION[env.tma_l2_promotion()]
    key = (arr.data.ptr, rows, cols, arr.itemsize, box_rows, stream.ptr, promotion, stride)
    with _LOCK:
        hit = _KEPT.get(key)
        if hit is not None:
            return hit[0]
        hit = _MAPS.get(key)
        if hit is not None:
            _MAPS.move_to_end(key)
            if keep:  # (from now on never evicted)
                _KEPT[key] = _MAPS.pop(key)
            return hit[0]
        try:
            dtype, dims, strides, box = encode_args_2d(arr.data.ptr, rows, cols, arr.itemsize, box_rows, stride,
                                                       box_past_rows)
        except ValueError as exc:
            raise ValueError(f"tensor map over {what} {tuple(arr.shape)}: {exc}") from None
        raw = (ctypes.c_uint8 * 128)()  # CUtensorMap: 128 bytes, 64-byte aligned (ctypes arrays: checked below)
        host = np.frombuffer(raw, dtype=np.uint8)
        if ctypes.addressof(raw) % 64:
            raw = (ctypes.c_uint8 * 192)()
            off = -ctypes.addressof(raw) % 64
            host = np.frombuffer(raw, dtype=np.uint8)[off:off + 128]
        status = _driver()(host.ctypes.data, dtype, 2, arr.data.ptr, (ctypes.c_uint64 * 2)(*dims),
                           (ctypes.c_uint64 * 1)(*strides), (ctypes.c_uint32 * 2)(*box), (ctypes.c_uint32 * 2)(1, 1),
                           0, _SWIZZLE_128B, promotion, 0)
        if status:
            raise RuntimeError(f"tensor map over {what} {tuple(arr.shape)}: cuTensorMapEncodeTiled returned CUresult "
                               f"{status} (dims {dims}, strides {strides}, box {box})")
        # staged in pinned memory: a copy from pageable memory may wait for the stream (and cannot be captured)
        pinned = cupy.cuda.alloc_pinned_memory(128)
        staged = np.frombuffer(pinned, dtype=np.uint8, count=128)
        staged[:] = host
        with stream:  # (allocated in the order of the stream that copies it and launches its kernel)
            buf = cupy.empty(128, dtype=np.uint8)
        buf.set(staged, stream=stream)  # in place before the stream's next kernel, no host wait
        (_KEPT if keep else _MAPS)[key] = (buf, pinned)  # (the pinned bytes kept alive with it: the copy is asynchronous)
        if len(_MAPS) > _MAX_MAPS:
            _MAPS.popitem(last=False)
        return buf
