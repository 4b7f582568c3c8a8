"""Safetensors writer/reader: exact round trips, one crafted file per validation rule, and fuzzing.

The reader contract: on any bytes it either returns in-range read-only views or raises
`CheckpointError` whose message names the file (and the tensor, for per-tensor problems).
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.safetensors_files import HEADER_END, VALID, check_loads_or_rejects, make_tensors
from kda_rt.loader.safetensors_mmap import (
    DTYPES,
    MAX_HEADER_BYTES,
    CheckpointError,
    read_safetensors,
    read_safetensors_metadata,
    save_safetensors,
)


def bits(a: np.ndarray) -> np.ndarray:
    """Raw bytes of an array (exact comparison, NaN-safe, works for ml_dtypes)."""
    return np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype)).view(
        np.uint8
    )


def test_round_trip_every_dtype(tmp_path):
    tensors = make_tensors()
    path = tmp_path / "all.safetensors"
    save_safetensors(path, tensors, {"format": "pt", "note": "x"})
    back = read_safetensors(path)
    assert list(back) == list(tensors)
    for name, want in tensors.items():
        got = back[name]
        assert got.shape == want.shape, name
        assert got.dtype == (want.dtype.newbyteorder("<") if want.dtype.byteorder == ">" else want.dtype), name
        assert np.array_equal(bits(got), bits(want)), name
        assert not got.flags.writeable, name
    assert read_safetensors_metadata(path) == {"format": "pt", "note": "x"}
    assert (8 + int.from_bytes(path.read_bytes()[:8], "little")) % 8 == 0


def test_bf16_is_a_view_not_a_copy(tmp_path):
    path = tmp_path / "bf16.safetensors"
    save_safetensors(path, {"w": np.ones((64, 64), ml_dtypes.bfloat16)})
    w = read_safetensors(path)["w"]
    assert w.dtype == ml_dtypes.bfloat16 and not w.flags.owndata and not w.flags.writeable


def test_reference_library_reads_our_files(tmp_path):
    st_numpy = pytest.importorskip("safetensors.numpy")
    tensors = {k: v for k, v in make_tensors().items() if k not in ("F8_E4M3", "F8_E5M2", "BF16", "empty")}
    save_safetensors(tmp_path / "a.safetensors", tensors)
    back = st_numpy.load_file(str(tmp_path / "a.safetensors"))
    for name, want in tensors.items():
        assert np.array_equal(back[name], want), name


def test_writer_rejects_unknown_dtype(tmp_path):
    with pytest.raises(CheckpointError, match="'c'"):
        save_safetensors(tmp_path / "x.safetensors", {"c": np.zeros(2, np.complex64)})


# ---------------------------------------------------------------------------------------------
# crafted bad files


def raw_file(path, header, data: bytes = b"", *, header_len: int | None = None) -> str:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(blob) if header_len is None else header_len
    with open(path, "wb") as fh:
        fh.write(n.to_bytes(8, "little") + blob + data)
    return str(path)


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


BAD_FILES = {
    # id: (header, data, header_len override, tensor named in the message or None)
    "short-file": (b"", b"", None, None),
    "len-past-eof": (b"{}", b"", 1000, None),
    "len-over-cap": (b"{}", b"", MAX_HEADER_BYTES + 1, None),
    "not-utf8": (b'{"\xff": 1}', b"", None, None),
    "not-json": (b"{not json", b"", None, None),
    "not-object": (b"[1, 2]", b"", None, None),
    "duplicate-key": (b'{"t": 1, "t": 2}', b"", None, None),
    "deep-json": (b"[" * 100000 + b"]" * 100000, b"", None, None),
    "metadata-not-map": ({"__metadata__": ["a"]}, b"", None, None),
    "metadata-non-str": ({"__metadata__": {"a": 1}}, b"", None, None),
    "entry-not-object": ({"t": 5}, b"", None, "t"),
    "unknown-field": ({"t": {**entry(), "extra": 1}}, bytes(8), None, "t"),
    "unknown-dtype": ({"t": entry(dtype="F7")}, bytes(8), None, "t"),
    "missing-dtype": ({"t": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8), None, "t"),
    "dtype-list": ({"t": entry(dtype=[])}, bytes(8), None, "t"),  # unhashable: was a TypeError (fuzz find)
    "dtype-object": ({"t": entry(dtype={"F32": 1})}, bytes(8), None, "t"),
    "dtype-number": ({"t": entry(dtype=4)}, bytes(8), None, "t"),
    "shape-not-list": ({"t": {**entry(), "shape": 2}}, bytes(8), None, "t"),
    "shape-negative": ({"t": entry(shape=(-2,))}, bytes(8), None, "t"),
    "shape-float": ({"t": {**entry(), "shape": [2.0]}}, bytes(8), None, "t"),
    "shape-bool": ({"t": {**entry(), "shape": [True, 2]}}, bytes(8), None, "t"),
    "offsets-missing": ({"t": {"dtype": "F32", "shape": [2]}}, bytes(8), None, "t"),
    "offsets-three": ({"t": entry(offsets=(0, 4, 8))}, bytes(8), None, "t"),
    "offsets-float": ({"t": {**entry(), "data_offsets": [0, 8.0]}}, bytes(8), None, "t"),
    "offsets-reversed": ({"t": entry(offsets=(8, 0))}, bytes(8), None, "t"),
    "offsets-negative": ({"t": entry(offsets=(-8, 0))}, bytes(8), None, "t"),
    "size-mismatch": ({"t": entry(shape=(3,))}, bytes(8), None, "t"),
    "past-data": ({"t": entry(offsets=(8, 16))}, bytes(8), None, "t"),
    "huge-shape": ({"t": entry(shape=(2**62, 2**62))}, bytes(8), None, "t"),
    "huge-dim-zero-size": ({"t": entry(shape=(2**70, 0), offsets=(0, 0))}, b"", None, "t"),  # issue 10 #11
    "100-dims": ({"t": entry(shape=(1,) * 100, offsets=(0, 4))}, bytes(4), None, "t"),  # issue 10 #11
    "overlap": ({"a": entry(), "b": entry(offsets=(4, 12))}, bytes(12), None, "b"),
    "hole": ({"a": entry(), "b": entry(offsets=(12, 20))}, bytes(20), None, "b"),
    "trailing": ({"a": entry()}, bytes(12), None, None),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_validation_errors(tmp_path, case):
    header, data, header_len, tensor = BAD_FILES[case]
    path = tmp_path / f"{case}.safetensors"
    if case == "short-file":
        path.write_bytes(b"\x01\x02\x03")
    else:
        raw_file(path, header, data, header_len=header_len)
    with pytest.raises(CheckpointError) as info:
        read_safetensors(path)
    msg = str(info.value)
    assert str(path) in msg
    if tensor is not None:
        assert f"'{tensor}'" in msg


def test_missing_file_is_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="nope.safetensors"):
        read_safetensors(tmp_path / "nope.safetensors")


def test_empty_header_and_zero_size_tensors_are_fine(tmp_path):
    assert read_safetensors(raw_file(tmp_path / "e.safetensors", {})) == {}
    got = read_safetensors(raw_file(tmp_path / "z.safetensors", {"z": entry(shape=(0, 3), offsets=(0, 0))}))
    assert got["z"].shape == (0, 3)


# ---------------------------------------------------------------------------------------------
# fuzzing: mutated valid files and random headers


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    flips=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), max_size=6),
    header_flips=st.lists(st.tuples(st.integers(0, HEADER_END - 1), st.sampled_from(b'0123456789[]{}",:-. e')),
                          max_size=4),
    cut=st.one_of(st.none(), st.integers(0, len(VALID))),
    tail=st.binary(max_size=24),
)
def test_fuzz_mutated_file(flips, header_flips, cut, tail):
    blob = bytearray(VALID)
    for pos, value in [*flips, *header_flips]:
        blob[pos] = value
    if cut is not None:
        blob = blob[:cut]
    check_loads_or_rejects(bytes(blob) + tail)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
entries = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from([*DTYPES, "F7", 3]),
        "shape": st.lists(st.integers(-1, 5), max_size=3) | json_values,
        "data_offsets": st.lists(st.integers(-2, 40), min_size=2, max_size=2) | json_values,
    },
)


@settings(max_examples=200, deadline=None)
@given(
    header=st.dictionaries(st.text(max_size=3), entries | json_values, max_size=4),
    data=st.binary(max_size=40),
)
def test_fuzz_random_header(header, data):
    blob = json.dumps(header).encode()
    check_loads_or_rejects(len(blob).to_bytes(8, "little") + blob + data)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
