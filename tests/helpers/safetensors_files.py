"""Safetensors files for the reader tests: one small tensor of every dtype, a valid file as bytes
(`VALID`, header ending at `HEADER_END`) for the fuzzers to mutate, and the reader contract on any
bytes (`check_loads_or_rejects`).
"""

from __future__ import annotations

import os
import tempfile

import ml_dtypes
import numpy as np

from kda_rt.loader.safetensors_mmap import DTYPES, CheckpointError, read_safetensors, save_safetensors

__all__ = ["HEADER_END", "VALID", "check_loads_or_rejects", "make_tensors"]


def make_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """One small tensor of every supported dtype, plus 0-d and empty shapes."""
    rng = np.random.default_rng(seed)
    out = {}
    for code, dtype in DTYPES.items():
        if code == "BOOL":
            out[code] = rng.integers(0, 2, size=(3, 5)).astype(np.bool_)
        elif dtype.kind in "iu":
            info = np.iinfo(dtype)
            out[code] = rng.integers(info.min, info.max, size=(3, 5), dtype=dtype, endpoint=True)
        else:
            out[code] = (rng.standard_normal((3, 5)) * 4).astype(dtype)
    out["scalar"] = np.array(3.5, np.float32)
    out["empty"] = np.zeros((0, 7), ml_dtypes.bfloat16)
    out["big_endian"] = np.arange(6, dtype=">i4").reshape(2, 3)
    return out


def _valid_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "v.safetensors")
        save_safetensors(path, {k: make_tensors()[k] for k in ("F32", "BF16", "I64", "U8", "scalar", "empty")},
                         {"format": "pt"})
        with open(path, "rb") as fh:
            return fh.read()


VALID = _valid_bytes()
HEADER_END = 8 + int.from_bytes(VALID[:8], "little")


def check_loads_or_rejects(blob: bytes) -> None:
    """Write `blob` to a file and read it: either a CheckpointError naming the file, or views whose every
    byte can be touched (an out-of-range view would fault)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f.safetensors")
        with open(path, "wb") as fh:
            fh.write(blob)
        try:
            tensors = read_safetensors(path)
        except CheckpointError as exc:
            assert path in str(exc)
            return
        for arr in tensors.values():  # touch every byte: an out-of-range view would fault here
            int(np.ascontiguousarray(arr).view(np.uint8).sum())
        del tensors
