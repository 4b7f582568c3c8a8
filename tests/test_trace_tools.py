"""tests/gpu/trace_decode.py's per-kernel "advance" (CPU only: it reads CUPTI kernel records, here made up)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def trace_decode():
    path = Path(__file__).resolve().parent / "gpu" / "trace_decode.py"
    spec = importlib.util.spec_from_file_location("trace_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_critical_advance_adds_up_to_the_span(trace_decode):
    # a (0-10), b starts early under programmatic launch and ends at 25, c inside b (ends 20: adds nothing),
    # d after a gap (30-32), a again (31-40): the frontier moves 10, 15, 0, 7 (30 -> 32 counts from 25), 8
    rep = [dict(ts=0.0, dur=10.0, name="a<float>"), dict(ts=5.0, dur=20.0, name="b"), dict(ts=12.0, dur=8.0, name="c"),
           dict(ts=30.0, dur=2.0, name="d"), dict(ts=31.0, dur=9.0, name="a<float>")]
    adv = trace_decode.critical_advance(list(reversed(rep)))  # any order in: sorted by start
    assert adv == {"a": 18.0, "b": 15.0, "c": 0.0, "d": 7.0}
    assert sum(adv.values()) == 40.0  # the span, first start to last end
