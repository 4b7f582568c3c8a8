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
