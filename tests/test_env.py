"""kda_rt.env: typed `KDA_RT_*` switches that are not covered next to their users."""

from __future__ import annotations

import pytest

from kda_rt import env


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("", True), ("1", True), ("0", False)])
def test_wgmma_switch(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("KDA_RT_WGMMA", raising=False)
    else:
        monkeypatch.setenv("KDA_RT_WGMMA", value)
    assert env.wgmma() is expected


@pytest.mark.parametrize("value", ["yes", "2", "off"])
def test_wgmma_switch_rejects_other_values(monkeypatch, value):
    monkeypatch.setenv("KDA_RT_WGMMA", value)
    with pytest.raises(ValueError, match="KDA_RT_WGMMA must be 0 or 1"):
        env.wgmma()


_MAX_T_SWITCHES = [("KDA_RT_FUSED_NORM_MAX_T", env.fused_norm_max_t), ("KDA_RT_ROUTE_NORM_MAX_T", env.route_norm_max_t)]


@pytest.mark.parametrize(("name", "read"), _MAX_T_SWITCHES)
@pytest.mark.parametrize(("value", "expected"), [(None, 8), ("", 8), ("32", 32), ("0", 0)])
def test_max_t_switches_default_to_the_callers_value(monkeypatch, name, read, value, expected):
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    assert read(8) == expected


@pytest.mark.parametrize(("name", "read"), _MAX_T_SWITCHES)
@pytest.mark.parametrize(("value", "match"), [("-1", ">= 0"), ("eight", "an integer"), ("1.5", "an integer")])
def test_max_t_switches_reject_bad_values(monkeypatch, name, read, value, match):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name} must be {match}"):
        read(8)


@pytest.mark.parametrize(("value", "expected"), [(None, 2), ("1", 1), ("4", 4)])
def test_mla_min_tiles_defaults_to_the_callers_value(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("KDA_RT_MLA_MIN_TILES", raising=False)
    else:
        monkeypatch.setenv("KDA_RT_MLA_MIN_TILES", value)
    assert env.mla_min_tiles(2) == expected


@pytest.mark.parametrize(("value", "match"), [("0", ">= 1"), ("-1", ">= 1"), ("two", "an integer")])
def test_mla_min_tiles_rejects_bad_values(monkeypatch, value, match):
    monkeypatch.setenv("KDA_RT_MLA_MIN_TILES", value)
    with pytest.raises(ValueError, match=f"KDA_RT_MLA_MIN_TILES must be {match}"):
        env.mla_min_tiles(2)


@pytest.mark.parametrize("value, expected", [(None, 1), ("", 1), ("0", 0), ("2", 2)])
def test_dense_gemv_pre_defaults_to_the_callers_value(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("KDA_RT_DENSE_GEMV_PRE", raising=False)
    else:
        monkeypatch.setenv("KDA_RT_DENSE_GEMV_PRE", value)
    assert env.dense_gemv_pre(1) == expected


@pytest.mark.parametrize("value", ["3", "-1", "one"])
def test_dense_gemv_pre_rejects_bad_values(monkeypatch, value):
    monkeypatch.setenv("KDA_RT_DENSE_GEMV_PRE", value)
    with pytest.raises(ValueError, match="KDA_RT_DENSE_GEMV_PRE must be"):
        env.dense_gemv_pre(1)
