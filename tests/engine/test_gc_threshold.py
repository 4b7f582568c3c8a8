"""The engine raises Python's young-generation GC threshold (KDA_RT_GC_THRESHOLD, default 10000), never
lowers it, and leaves it alone with 0; a bad value is an error naming the variable."""

from __future__ import annotations

import gc

import pytest

from kda_rt import env
from kda_rt.engine.llm_engine import _raise_gc_threshold


@pytest.fixture(autouse=True)
def restore_threshold():
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


def test_raised_to_the_default(monkeypatch):
    monkeypatch.delenv("KDA_RT_GC_THRESHOLD", raising=False)
    gc.set_threshold(700, 10, 10)
    _raise_gc_threshold()
    assert gc.get_threshold() == (10000, 10, 10)


def test_never_lowered_and_zero_leaves_it(monkeypatch):
    gc.set_threshold(50000, 10, 10)
    monkeypatch.setenv("KDA_RT_GC_THRESHOLD", "10000")
    _raise_gc_threshold()
    assert gc.get_threshold() == (50000, 10, 10)
    gc.set_threshold(700, 10, 10)
    monkeypatch.setenv("KDA_RT_GC_THRESHOLD", "0")
    _raise_gc_threshold()
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize("bad", ["ten", "-5"])
def test_bad_values_name_the_variable(monkeypatch, bad):
    monkeypatch.setenv("KDA_RT_GC_THRESHOLD", bad)
    with pytest.raises(ValueError, match="KDA_RT_GC_THRESHOLD"):
        env.gc_threshold()
