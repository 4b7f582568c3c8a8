"""`Workspace`: named device buffers reused across steps.

A decode step first runs eagerly, which creates every buffer it asks for; the CUDA graph of that
batch-size bucket is then captured from a second run that finds all of them already there, so
nothing is allocated inside the capture (CuPy issue #9655).  `frozen` turns a missing or resized
buffer into an error instead of an allocation."""

from __future__ import annotations

import numpy as np

__all__ = ["Workspace"]


class Workspace:
    def __init__(self) -> None:
        self.buffers: dict[str, object] = {}
        self.frozen = False

    def get(self, name: str, shape: tuple[int, ...], dtype) -> object:
        import cupy

        shape = tuple(int(s) for s in shape)
        buf = self.buffers.get(name)
        if buf is not None and buf.shape == shape and buf.dtype == np.dtype(dtype):
            return buf
        if self.frozen:
            raise RuntimeError(f"workspace buffer {name!r} {shape} {np.dtype(dtype).name} would be allocated "
                               "inside a CUDA-graph capture")
        buf = cupy.empty(shape, dtype=dtype)
        self.buffers[name] = buf
        return buf

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())
