"""`Workspace`: named device buffers reused across steps.

A decode step first runs eagerly, which creates every buffer it asks for; the CUDA graph of that
batch-size bucket is then captured from a second run that finds all of them already there, so
nothing is allocated inside the capture (CuPy issue #9655).  `frozen` turns a missing or resized
buffer into an error instead of an allocation.

Each name keeps one device allocation (its capacity, HEADROOM more than the bytes that made it grow), and a
request of another shape that fits is a view of it: eager prefill steps of slightly different sizes (the prompt
tails of the scheduler run steps of 16384, 16392, 16400, 16408 tokens) reuse their buffers instead of leaving the
previous ones in CuPy's pool (+3.5 GB of cached blocks at the end of the seed benchmark with exact shapes).

A `shared` workspace serves several decode graphs (KDA_RT_SHARED_GRAPH_WS): they run one at a time on one stream, so
their buffers can be views of one allocation a name, sized by the largest graph (captured first).  Frozen, it still
hands out views of other shapes that fit (each graph's own, at every replay's metadata upload), and `locked` (set
once a graph is captured on it) turns an allocation that would move a buffer those graphs use into WorkspaceFull; a
name new to it is allocated as usual (no captured graph uses it: the 4-row graph's pre-norm rows, which only steps of
up to 4 tokens ask for, do not drop the larger graphs captured before it)."""

from __future__ import annotations

import numpy as np

__all__ = ["Workspace", "WorkspaceFull"]


HEADROOM = 1 / 32  # a buffer that grows gets this much more than asked


class WorkspaceFull(RuntimeError):
    """A locked shared workspace was asked for a buffer larger than the allocation of its name (the graphs captured on
    it use that allocation: the caller drops them before the buffer may grow)."""


class Workspace:
    def __init__(self, shared: bool = False) -> None:
        self.buffers: dict[str, object] = {}  # name -> the array last handed out
        self._capacity: dict[str, object] = {}  # name -> its allocation (flat uint8)
        self.frozen = False
        self.shared = shared  # several graphs' buffers (the module's docstring)
        self.locked = False  # (shared) no allocation may move a buffer: WorkspaceFull instead

    def get(self, name: str, shape: tuple[int, ...], dtype) -> object:
        """A C-contiguous [shape] `dtype` device array, 256-byte aligned: the one handed out last under `name` when
        the shape and dtype are the same, else a view of the name's allocation (reallocated when too small)."""
        import cupy

        shape, dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        buf = self.buffers.get(name)
        if buf is not None and buf.shape == shape and buf.dtype == dtype:
            return buf
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        flat = self._capacity.get(name)
        fits = flat is not None and flat.nbytes >= nbytes
        if self.frozen and not (self.shared and fits):
            raise RuntimeError(f"workspace buffer {name!r} {shape} {dtype.name} would be allocated "
                               "inside a CUDA-graph capture")
        if not fits and self.locked and flat is not None:
            raise WorkspaceFull(f"shared workspace buffer {name!r} {shape} {dtype.name} is larger than its allocation")
        if not fits:
            self.buffers.pop(name, None)
            self._capacity.pop(name, None)  # (released before the larger one is allocated)
            flat = self._capacity[name] = cupy.empty(nbytes + int(nbytes * HEADROOM), dtype=np.uint8)
        buf = self.buffers[name] = flat[:nbytes].view(dtype).reshape(shape)
        return buf

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._capacity.values())
