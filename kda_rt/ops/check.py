"""Input checks shared by every launcher: one clear message per bad argument."""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["BF16", "expect", "i32", "f32"]

BF16 = np.dtype(ml_dtypes.bfloat16)


def expect(arr, name: str, *, dtype=None, ndim: int | None = None, shape: tuple | None = None) -> tuple[int, ...]:
    """Check a CuPy array argument; returns its shape.  `shape` entries of None match anything."""
    import cupy

    if not isinstance(arr, cupy.ndarray):
        raise TypeError(f"{name} must be a cupy.ndarray on the GPU, got {type(arr).__name__}")
    if dtype is not None and arr.dtype != np.dtype(dtype):
        raise TypeError(f"{name} must have dtype {np.dtype(dtype).name}, got {arr.dtype.name}")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if shape is not None:
        if len(shape) != arr.ndim or any(s is not None and s != a for s, a in zip(shape, arr.shape, strict=True)):
            raise ValueError(f"{name} must have shape {shape}, got {arr.shape}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if arr.device.id != cupy.cuda.Device().id:
        raise ValueError(f"{name} is on device {arr.device.id}, expected the current device {cupy.cuda.Device().id}")
    return arr.shape


def i32(v: int) -> np.int32:
    return np.int32(v)


def f32(v: float) -> np.float32:
    return np.float32(v)
