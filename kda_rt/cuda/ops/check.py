"""Input checks shared by every launcher: one clear message per bad argument."""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["BF16", "expect", "leading_dim", "i32", "f32"]

BF16 = np.dtype(ml_dtypes.bfloat16)


def expect(arr, name: str, *, dtype=None, ndim: int | None = None, shape: tuple | None = None,
           row_stride: bool = False) -> tuple[int, ...]:
    """Check a CuPy array argument; returns its shape.  `shape` entries of None match anything.
    With `row_stride`, a 2-D view whose rows are contiguous but spaced further apart is accepted
    (e.g. a column slice of a fused projection); read its leading dimension with `leading_dim`."""
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
    if row_stride and arr.ndim == 2:
        if arr.strides[1] != arr.itemsize or arr.strides[0] < arr.shape[1] * arr.itemsize or arr.strides[0] % arr.itemsize:
            raise ValueError(f"{name} must have contiguous rows (strides {arr.strides})")
    elif not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if arr.device.id != cupy.cuda.Device().id:
        raise ValueError(f"{name} is on device {arr.device.id}, expected the current device {cupy.cuda.Device().id}")
    return arr.shape


def i32(v: int) -> np.int32:
    return np.int32(v)


def f32(v: float) -> np.float32:
    return np.float32(v)


def leading_dim(arr) -> int:
    """Elements between consecutive rows of a 2-D array (its row stride)."""
    return arr.strides[0] // arr.itemsize
