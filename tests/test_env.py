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


@pytest.mark.parametrize(("value", "expected"), [(None, 8), ("", 8), ("32", 32), ("0", 0)])
def test_fused_norm_max_t_defaults_to_the_callers_value(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("KDA_RT_FUSED_NORM_MAX_T", raising=False)
    else:
        monkeypatch.setenv("KDA_RT_FUSED_NORM_MAX_T", value)
    assert env.fused_norm_max_t(8) == expected


@pytest.mark.parametrize(("value", "match"), [("-1", ">= 0"), ("eight", "an integer"), ("1.5", "an integer")])
def test_fused_norm_max_t_rejects_bad_values(monkeypatch, value, match):
    monkeypatch.setenv("KDA_RT_FUSED_NORM_MAX_T", value)
    with pytest.raises(ValueError, match=f"KDA_RT_FUSED_NORM_MAX_T must be {match}"):
        env.fused_norm_max_t(8)
