"""`Staging`: pinned host buffers for the small per-step transfers of the CUDA runner.

A step packs its metadata (token ids, sequence offsets, contexts, slots, logits rows), its sampling
settings and its grammar masks into a few pinned buffers and moves each with one asynchronous copy;
the sampler's outputs come back the same way, with one copy and one synchronisation.  Many small
copies from pageable NumPy arrays cost ~10-20 us of host time each and are staged synchronously by
the driver; pinned copies are queued on the stream and return at once.

A pinned buffer is reused by the next step.  Its copy may still be queued when that step wants to
write it (a prefill chunk that samples nothing never synchronises), so each buffer records an event
after its copy and `host()` waits for that event before handing the buffer out again.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Staging", "pack_layout"]

_ALIGN = 16


def pack_layout(parts: list[tuple[int, np.dtype]]) -> tuple[list[int], int]:
    """Byte offsets of (count, dtype) parts packed one after another, each 16-byte aligned; total bytes."""
    offs, pos = [], 0
    for count, dtype in parts:
        offs.append(pos)
        pos += -(-int(count) * np.dtype(dtype).itemsize // _ALIGN) * _ALIGN
    return offs, max(pos, _ALIGN)


class _Pinned:
    def __init__(self, cupy, nbytes: int) -> None:
        self.mem = cupy.cuda.alloc_pinned_memory(nbytes)
        self.array = np.frombuffer(self.mem, np.uint8, nbytes)
        self.event = None


class Staging:
    def __init__(self) -> None:
        import cupy

        self.cupy = cupy
        self.buffers: dict[str, _Pinned] = {}

    def host(self, name: str, nbytes: int) -> np.ndarray:
        """The pinned uint8 buffer `name` of at least `nbytes`, once its last copy has run."""
        buf = self.buffers.get(name)
        if buf is not None and buf.event is not None:
            buf.event.synchronize()
        if buf is None or buf.array.size < nbytes:
            buf = self.buffers[name] = _Pinned(self.cupy, max(nbytes, 2 * (buf.array.size if buf else 0), 4096))
        return buf.array

    def _copy(self, name: str, dst: int, src: int, nbytes: int, kind: int, stream) -> None:
        rt = self.cupy.cuda.runtime
        rt.memcpyAsync(dst, src, nbytes, kind, stream.ptr)
        buf = self.buffers[name]
        if buf.event is None:
            buf.event = self.cupy.cuda.Event(block=False, disable_timing=True)
        buf.event.record(stream)

    def to_device(self, name: str, dev, nbytes: int, stream) -> None:
        """Queue the copy of the first `nbytes` of pinned buffer `name` into device array `dev`."""
        if dev.nbytes < nbytes:
            raise ValueError(f"staging {name!r}: device buffer of {dev.nbytes} bytes, {nbytes} to copy")
        src = self.buffers[name].array
        self._copy(name, dev.data.ptr, src.ctypes.data, nbytes, self.cupy.cuda.runtime.memcpyHostToDevice, stream)

    def from_device(self, name: str, dev, nbytes: int, stream) -> np.ndarray:
        """Copy the first `nbytes` of device array `dev` into pinned buffer `name`, wait, return them."""
        host = self.from_device_async(name, dev, nbytes, stream)
        self.wait(name)
        return host

    def from_device_async(self, name: str, dev, nbytes: int, stream) -> np.ndarray:
        """Queue the copy of the first `nbytes` of `dev` into pinned buffer `name`; the returned bytes
        are valid once `wait(name)` returns (and until the next copy into `name` is queued)."""
        host = self.host(name, nbytes)
        self._copy(name, host.ctypes.data, dev.data.ptr, nbytes, self.cupy.cuda.runtime.memcpyDeviceToHost, stream)
        return host[:nbytes]

    def wait(self, name: str) -> None:
        """Block until the last copy queued on pinned buffer `name` has run."""
        event = self.buffers[name].event
        if event is not None:
            event.synchronize()
