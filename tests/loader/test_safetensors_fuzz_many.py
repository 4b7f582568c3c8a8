"""Thousands of mutated safetensors files: the reader returns in-range views or raises
`CheckpointError`, never another exception, a crash, or a read outside the file.

Complements the 300-example fuzz in test_safetensors_mmap.py with a larger run that also
splices header fields (lengths, offsets, shapes, dtypes) and rewrites the length prefix."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.safetensors_files import HEADER_END, VALID, check_loads_or_rejects

HEADER = VALID[8:HEADER_END]
TOKENS = [b"0", b"1", b"9", b"-1", b"18446744073709551616", b"1e3", b"null", b"[]", b"{}", b'"F32"', b'"BF16"',
          b'"X"', b'"', b",", b":", b"[", b"]", b"{", b"}", b"[0,0]", b"[1,2,3]", b"\xff", b"\\u0000"]


@pytest.mark.slow
@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    flips=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), max_size=8),
    splices=st.lists(st.tuples(st.integers(0, len(HEADER)), st.integers(0, 6), st.sampled_from(TOKENS)), max_size=3),
    length=st.one_of(st.none(), st.integers(0, 2**64 - 1), st.integers(len(HEADER) - 8, len(HEADER) + 8)),
    cut=st.one_of(st.none(), st.integers(0, len(VALID))),
    tail=st.binary(max_size=16),
)
def test_thousands_of_mutated_files(flips, splices, length, cut, tail):
    header = bytearray(HEADER)
    for at, drop, token in splices:
        header[at:at + drop] = token
    blob = bytearray(len(header).to_bytes(8, "little") + bytes(header) + VALID[HEADER_END:])
    for pos, value in flips:
        if pos < len(blob):
            blob[pos] = value
    if length is not None:
        blob[:8] = length.to_bytes(8, "little")
    if cut is not None:
        blob = blob[:cut]
    check_loads_or_rejects(bytes(blob) + tail)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
