"""Safetensors files: a small writer and a validating, memory-mapped reader.

File layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON, then the data section.
The JSON object maps each tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets
relative to the data section) plus an optional `"__metadata__"` str -> str map.

The reader trusts nothing: every check below raises `CheckpointError` naming the file and, where
there is one, the tensor.  Policy on unclaimed bytes: the tensors must cover the data section
exactly (any order, no overlap, no holes, no trailing bytes), which is what this writer and the
reference writer produce; anything else is treated as a truncated or corrupted file.

Tensors come back as read-only NumPy views of one read-only `mmap` per file: nothing is copied, and
bf16 stays raw bits typed as `ml_dtypes.bfloat16`.  Assumes a little-endian host.
"""

from __future__ import annotations

import json
import mmap
import os
import reprlib
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["CheckpointError", "DTYPES", "MAX_HEADER_BYTES", "read_safetensors", "read_safetensors_metadata",
           "save_safetensors"]

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's cap as well

# safetensors dtype code -> NumPy dtype (explicitly little-endian)
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_CODES = {dt.newbyteorder("=") if dt.byteorder in "<>" else dt: code for code, dt in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file or directory is malformed or does not match the model config."""


# ---------------------------------------------------------------------------------------------
# writer


def _dtype_code(arr: np.ndarray, name: str, path: str) -> str:
    dt = arr.dtype.newbyteorder("=") if arr.dtype.byteorder in "<>" else arr.dtype
    code = _CODES.get(dt)
    if code is None:
        raise CheckpointError(f"{path}: tensor '{name}': dtype {arr.dtype} has no safetensors code")
    return code


def save_safetensors(
    path: str | os.PathLike[str],
    tensors: dict[str, np.ndarray],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write `tensors` (in dict order) to a safetensors file at `path`."""
    path = os.fspath(path)
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError(f"{path}: __metadata__ must map str to str")
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": dict(metadata)}
    arrays: list[np.ndarray] = []
    offset = 0
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise CheckpointError(f"{path}: invalid tensor name {name!r}")
        arr = np.asarray(tensor)
        code = _dtype_code(arr, name, path)
        flat = np.ascontiguousarray(arr.astype(DTYPES[code], copy=False)).reshape(-1).view(np.uint8)  # [bytes]
        header[name] = {"dtype": code, "shape": list(arr.shape), "data_offsets": [offset, offset + flat.size]}
        offset += flat.size
        arrays.append(flat)
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-(8 + len(blob)) % 8)  # data section starts 8-byte aligned
    with open(path, "wb") as fh:
        fh.write(len(blob).to_bytes(8, "little"))
        fh.write(blob)
        for flat in arrays:
            fh.write(flat.data)


# ---------------------------------------------------------------------------------------------
# reader


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _read_header(path: str) -> tuple[dict[str, Any], int, int]:
    """Parse and structurally check the header.  Returns (header, data_start, data_len)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            prefix = fh.read(8)
            if size < 8 or len(prefix) < 8:
                raise CheckpointError(f"{path}: file is {size} bytes, shorter than the 8-byte header length")
            n = int.from_bytes(prefix, "little")
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap")
            if 8 + n > size:
                raise CheckpointError(f"{path}: header length {n} runs past the end of the {size}-byte file")
            raw = fh.read(n)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc})") from None
    if len(raw) != n:
        raise CheckpointError(f"{path}: file shrank while reading the header")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: header is not valid UTF-8 JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    meta = header.get("__metadata__")
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    ):
        raise CheckpointError(f"{path}: __metadata__ must be an object mapping str to str")
    return header, 8 + n, size - 8 - n


# Bounds on a header's shapes, checked before NumPy sees them (it refuses > 64 dims or sizes past
# intp with bare errors); no Kimi Linear tensor has more than 3 dimensions.
MAX_NDIM = 8
MAX_DIM = 1 << 48


def _check_entry(path: str, name: str, entry: Any, data_len: int) -> tuple[np.dtype, tuple[int, ...], int, int]:
    where = f"{path}: tensor '{name}'"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: entry must be an object")
    extra = set(entry) - {"dtype", "shape", "data_offsets"}
    if extra:
        raise CheckpointError(f"{where}: unknown fields {sorted(extra)}")
    code = entry.get("dtype")
    if not isinstance(code, str) or code not in DTYPES:  # a list or object is unhashable: check the type first
        raise CheckpointError(f"{where}: unknown or missing dtype {code!r}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative ints, got {reprlib.repr(shape)}")
    if len(shape) > MAX_NDIM or any(d > MAX_DIM for d in shape):
        raise CheckpointError(f"{where}: shape {reprlib.repr(shape)} has over {MAX_NDIM} dimensions or a dimension "
                              f"over {MAX_DIM}")
    offsets = entry.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise CheckpointError(f"{where}: data_offsets must be [begin, end] ints, got {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise CheckpointError(f"{where}: data_offsets {offsets} must satisfy 0 <= begin <= end")
    if end > data_len:
        raise CheckpointError(f"{where}: data_offsets {offsets} run past the {data_len}-byte data section")
    dtype = DTYPES[code]
    numel = 1
    for d in shape:
        numel *= d
    if numel * dtype.itemsize != end - begin:
        raise CheckpointError(
            f"{where}: {end - begin} bytes in data_offsets but shape {shape} x {code} needs {numel * dtype.itemsize}"
        )
    return dtype, tuple(shape), begin, end


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Memory-map a safetensors file and return read-only views of its tensors, in header order."""
    path = os.fspath(path)
    header, data_start, data_len = _read_header(path)
    entries = {}
    for name, entry in header.items():
        if name != "__metadata__":
            entries[name] = _check_entry(path, name, entry, data_len)
    spans = sorted((begin, end, name) for name, (_, _, begin, end) in entries.items())
    cursor, prev = 0, None
    for begin, end, name in spans:
        if begin < cursor:
            raise CheckpointError(f"{path}: tensor '{name}' overlaps tensor '{prev}' in the data section")
        if begin > cursor:
            raise CheckpointError(f"{path}: {begin - cursor} unclaimed bytes before tensor '{name}' in the data section")
        cursor, prev = end, name
    if cursor != data_len:
        raise CheckpointError(f"{path}: {data_len - cursor} unclaimed bytes at the end of the data section")
    try:
        with open(path, "rb") as fh:
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        data = np.frombuffer(mapped, dtype=np.uint8, count=data_len, offset=data_start)  # [bytes], read-only
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot memory-map ({exc})") from None
    out: dict[str, np.ndarray] = {}
    for name, (dtype, shape, begin, end) in entries.items():
        out[name] = data[begin:end].view(dtype).reshape(shape)
    return out


def read_safetensors_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The `__metadata__` map of a safetensors file ({} if absent); checks the header only."""
    header, _, _ = _read_header(os.fspath(path))
    return dict(header.get("__metadata__") or {})
