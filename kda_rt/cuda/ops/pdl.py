"""Programmatic dependent launch (PDL, sm_90+) for the kernels of a captured decode graph.

A kernel launched with the programmatic-stream-serialization attribute may be scheduled while the kernel
before it in the stream is still running, so that its launch and the placement of its CTAs overlap that
kernel's tail (H200, `tests/gpu/bench_pdl.py`: a chain of graph-replayed kernels 1.06 -> 0.77 us per
tiny kernel, 5.48 -> 4.95 us per one-wave kernel).  Every kernel of kernels_cu/ starts with
KDA_PDL_ENTRY() (common.cuh): `griddepcontrol.wait` before any memory access, so each kernel still sees
all of its predecessor's writes and the stream order stays exact.  Kernels of other libraries (cuBLAS)
are launched as before.

Only launches made inside `capturing()` (the runner's decode-graph capture) take this path: it goes
through the driver's cuLaunchKernelEx by ctypes, which costs tens of microseconds of host time per
launch, paid once at capture instead of at every eager launch.  KDA_RT_PDL=0 turns it off.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging

import numpy as np

__all__ = ["Kernel", "PdlError", "capturing", "launch", "max_active_blocks", "resident_per_sm", "supported"]

logger = logging.getLogger(__name__)

_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_active = False


class PdlError(RuntimeError):
    pass


class _Attr(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise PdlError(f"cannot load the CUDA driver library libcuda.so.1 ({exc})") from exc
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    lib.cuOccupancyMaxActiveBlocksPerMultiprocessor.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                                                ctypes.c_int, ctypes.c_size_t]
    lib.cuOccupancyMaxActiveBlocksPerMultiprocessor.restype = ctypes.c_int
    return lib


def max_active_blocks(function, threads: int, shared_mem: int) -> int:
    """CTAs of `function` (a CuPy Function or kernels_cu Kernel) that one SM holds at once with `threads`
    threads and `shared_mem` bytes of dynamic shared memory each (the driver's occupancy calculator)."""
    n = ctypes.c_int(0)
    handle = function.ptr if hasattr(function, "ptr") else function.kernel.ptr
    status = _driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), ctypes.c_void_p(handle), threads,
                                                                   shared_mem)
    if status != 0:
        raise PdlError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed with CUDA driver error {status}")
    return n.value


_resident: dict[tuple[int, int, int], int] = {}


def resident_per_sm(function, threads: int, shared_mem: int) -> int:
    """max_active_blocks, at least 1, asked once per (kernel, threads, shared memory): the CTAs per SM of a
    one-wave grid."""
    handle = function.ptr if hasattr(function, "ptr") else function.kernel.ptr
    key = (handle, threads, shared_mem)
    if key not in _resident:
        _resident[key] = max(1, max_active_blocks(function, threads, shared_mem))
    return _resident[key]


def supported() -> bool:
    """The current device runs programmatic dependent launches (compute capability 9.0 or newer)."""
    import cupy

    from kda_rt.cuda.ops.compile import compute_capability

    return compute_capability(cupy.cuda.Device().id) >= 90


@contextlib.contextmanager
def capturing(enabled: bool = True):
    """Kernels of kernels_cu/ launched inside this block carry the programmatic-serialization attribute
    when `enabled`, the device supports it and KDA_RT_PDL is not 0.  The switch is process-wide: the
    runner holds it only around a decode-graph capture, which runs on the engine's one thread."""
    global _active
    from kda_rt import env

    before = _active
    _active = bool(enabled) and env.pdl() and supported()
    try:
        yield _active
    finally:
        _active = before


_SCALARS = {np.int32: ctypes.c_int32, np.uint32: ctypes.c_uint32, np.int64: ctypes.c_int64,
            np.uint64: ctypes.c_uint64, np.float32: ctypes.c_float}


def _arguments(args) -> list | None:
    """ctypes values of a launch's arguments (CuPy arrays as device pointers, NumPy scalars by type), or
    None when one of them has another type (the caller then launches the usual way)."""
    import cupy

    out = []
    for a in args:
        if isinstance(a, cupy.ndarray):
            out.append(ctypes.c_void_p(a.data.ptr))
        elif type(a) in _SCALARS:
            out.append(_SCALARS[type(a)](a.item()))
        else:
            return None
    return out


def _dims(value) -> tuple[int, int, int]:
    dims = tuple(int(v) for v in (value if isinstance(value, tuple) else (value,)))
    return dims + (1,) * (3 - len(dims))  # type: ignore[return-value]


def launch(function, grid, block, args, *, shared_mem: int = 0, stream=None) -> bool:
    """Launch `function` (a CuPy `Function` or `RawKernel` whose kernel starts with KDA_PDL_ENTRY()) as
    `function(grid, block, args, shared_mem=..., stream=...)` would, with the programmatic-serialization
    attribute.  Returns False without launching when an argument type is not supported here."""
    import cupy

    values = _arguments(args)
    if values is None:
        return False
    pointers = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    attr = _Attr(id=_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    stream = stream if stream is not None else cupy.cuda.get_current_stream()
    config = _Config(grid=(ctypes.c_uint * 3)(*_dims(grid)), block=(ctypes.c_uint * 3)(*_dims(block)),
                     shared_mem=shared_mem, stream=ctypes.c_void_p(stream.ptr), attrs=ctypes.pointer(attr), num_attrs=1)
    handle = function.ptr if hasattr(function, "ptr") else function.kernel.ptr
    status = _driver().cuLaunchKernelEx(ctypes.byref(config), ctypes.c_void_p(handle), pointers, None)
    if status != 0:
        raise PdlError(f"cuLaunchKernelEx failed with CUDA driver error {status} (grid {grid}, block {block}, "
                       f"{shared_mem} B of shared memory)")
    return True


class Kernel:
    """A kernel of kernels_cu/ (compile.get_kernel): called as CuPy's Function, launched with PDL inside
    `capturing()`."""

    __slots__ = ("fn",)

    def __init__(self, fn) -> None:
        self.fn = fn

    def __getattr__(self, name):  # ptr and the rest of the Function's attributes
        return getattr(self.fn, name)

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None):
        if _active and launch(self.fn, grid, block, args, shared_mem=shared_mem, stream=stream):
            return None
        return self.fn(grid, block, args, shared_mem=shared_mem, stream=stream)
