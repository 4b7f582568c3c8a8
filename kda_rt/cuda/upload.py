"""Upload checkpoint tensors to the GPU through a few fixed pinned staging buffers.

`cupy.asarray(host)` would stage through a pinned buffer as large as the array and keep it cached
(gpu_facts.md), so a 100 GB checkpoint would grow pinned host memory to match.  Instead every
tensor (or row range of it) goes mmap -> one of NUM_STAGES pinned buffers -> async copy into its
place on the device, with an event guarding each buffer's reuse.  Destinations can be slices of
bigger device arrays, which is how fused weights (q|k|v, gate|up, per-expert stacks) are built
without an extra device copy.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Uploader"]

STAGE_BYTES = 64 << 20
NUM_STAGES = 3


class Uploader:
    def __init__(self, stage_bytes: int = STAGE_BYTES, num_stages: int = NUM_STAGES) -> None:
        import cupy

        self.cupy = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stage_bytes = stage_bytes
        self.pinned = [cupy.cuda.alloc_pinned_memory(stage_bytes) for _ in range(num_stages)]
        self.events = [None] * num_stages
        self.turn = 0
        self.bytes_uploaded = 0

    def _stage(self) -> tuple[int, np.ndarray]:
        i = self.turn
        self.turn = (self.turn + 1) % len(self.pinned)
        if self.events[i] is not None:
            self.events[i].synchronize()  # the copy that last used this buffer has finished
        return i, np.frombuffer(self.pinned[i], dtype=np.uint8, count=self.stage_bytes)

    def copy(self, dst, src: np.ndarray) -> None:
        """dst (C-contiguous device array or slice) <- src (host array of the same shape, any dtype
        castable to dst.dtype; bf16 mmap views are copied as raw bits)."""
        src = np.asarray(src)
        if src.shape != dst.shape:
            raise ValueError(f"upload shape mismatch: device {dst.shape} vs host {src.shape}")
        if src.dtype != dst.dtype:
            src = src.astype(dst.dtype)
        if not dst.flags.c_contiguous:
            raise ValueError("upload destination must be C-contiguous")
        flat_src = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
        nbytes = flat_src.nbytes
        done = 0
        while done < nbytes:
            n = min(self.stage_bytes, nbytes - done)
            i, buf = self._stage()
            buf[:n] = flat_src[done:done + n]
            self.cupy.cuda.runtime.memcpyAsync(dst.data.ptr + done, buf.ctypes.data, n,
                                               self.cupy.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
            ev = self.cupy.cuda.Event()
            ev.record(self.stream)
            self.events[i] = ev
            done += n
        self.bytes_uploaded += nbytes

    def new(self, src: np.ndarray, dtype=None):
        """A fresh device array holding `src` (cast to `dtype` if given)."""
        dst = self.cupy.empty(src.shape, dtype=dtype or src.dtype)
        self.copy(dst, src)
        return dst

    def finish(self) -> None:
        self.stream.synchronize()
