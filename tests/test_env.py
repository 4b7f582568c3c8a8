"""kda_rt.env: typed `KDA_RT_*` switches that are not covered next to their users."""

from __future__ import annotations

import pytest

from kda_rt import env

_ON_OFF_SWITCHES = [("KDA_RT_WGMMA", env.wgmma), ("KDA_RT_MOE_DECODE_WS", env.moe_decode_ws),
                    ("KDA_RT_SKINNY_WS", env.skinny_ws), ("KDA_RT_SHARED_GRAPH_WS", env.shared_graph_ws),
                    ("KDA_RT_MOE_DEC_A_ASYNC", env.moe_dec_a_async),
                    ("KDA_RT_MOE_DEC_REVERSE", env.moe_dec_reverse),
                    ("KDA_RT_FP8_DECODE_GEMV", env.fp8_decode_gemv)]  # (default on)
_OFF_BY_DEFAULT = [("KDA_RT_MLA_WAVE_SPLITS", env.mla_wave_splits)]


@pytest.mark.parametrize(("name", "read"), _ON_OFF_SWITCHES + _OFF_BY_DEFAULT)
@pytest.mark.parametrize(("value", "expected"), [(None, True), ("", True), ("1", True), ("0", False)])
def test_on_off_switches(monkeypatch, name, read, value, expected):
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    if (name, read) in _OFF_BY_DEFAULT and value in (None, ""):
        expected = False  # (prepared or measured no faster: off unless asked for)
    assert read() is expected


@pytest.mark.parametrize(("name", "read"), _ON_OFF_SWITCHES + _OFF_BY_DEFAULT)
@pytest.mark.parametrize("value", ["yes", "2", "off", "-1"])
def test_on_off_switches_reject_other_values(monkeypatch, name, read, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name} must be 0 or 1"):
        read()


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


@pytest.mark.parametrize(("name", "read", "default", "value", "expected"), [
    ("KDA_RT_MLA_MIN_TILES", env.mla_min_tiles, 2, None, 2), ("KDA_RT_MLA_MIN_TILES", env.mla_min_tiles, 2, "1", 1),
    ("KDA_RT_MLA_MIN_TILES", env.mla_min_tiles, 2, "4", 4),
    ("KDA_RT_DENSE_GEMV_PRE", env.dense_gemv_pre, 1, None, 1), ("KDA_RT_DENSE_GEMV_PRE", env.dense_gemv_pre, 1, "", 1),
    ("KDA_RT_DENSE_GEMV_PRE", env.dense_gemv_pre, 1, "0", 0), ("KDA_RT_DENSE_GEMV_PRE", env.dense_gemv_pre, 1, "2", 2)])
def test_count_switches_default_to_the_callers_value(monkeypatch, name, read, default, value, expected):
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    assert read(default) == expected


@pytest.mark.parametrize(("value", "match"), [("0", ">= 1"), ("-1", ">= 1"), ("two", "an integer")])
def test_mla_min_tiles_rejects_bad_values(monkeypatch, value, match):
    monkeypatch.setenv("KDA_RT_MLA_MIN_TILES", value)
    with pytest.raises(ValueError, match=f"KDA_RT_MLA_MIN_TILES must be {match}"):
        env.mla_min_tiles(2)


@pytest.mark.parametrize("value", ["3", "-1", "one"])
def test_dense_gemv_pre_rejects_bad_values(monkeypatch, value):
    monkeypatch.setenv("KDA_RT_DENSE_GEMV_PRE", value)
    with pytest.raises(ValueError, match="KDA_RT_DENSE_GEMV_PRE must be"):
        env.dense_gemv_pre(1)


def test_unknown_variables_are_named(monkeypatch, caplog):
    """A KDA_RT_* variable that nothing reads (a misspelt switch) is named in a warning when an engine is built, as
    vLLM warns about unknown VLLM_* ones; KDA_RT_TEST_* belong to the tests; the known ones pass."""
    import logging

    from kda_rt import LLM
    from kda_rt.demo import demo_path

    assert env.unknown_variables({"KDA_RT_MOE_BTMA": "1", "KDA_RT_MOE_B_TMA": "1", "KDA_RT_TEST_48B_DIR": "x",
                                  "KDA_RT_PDL": "0", "PATH": "/"}) == ["KDA_RT_MOE_BTMA"]
    monkeypatch.setenv("KDA_RT_SKINY", "0")
    with caplog.at_level(logging.WARNING, logger="kda_rt.llm"):
        LLM(str(demo_path()), backend="numpy", max_model_len=32)
    assert "unknown KDA_RT_* environment variable(s), ignored: KDA_RT_SKINY" in caplog.text


def test_scripts_and_readme_name_known_switches():
    """Every KDA_RT_* name in the GPU scripts (bench_ab.py's --env, the A/B shell scripts) and the README is one the
    runtime reads: a misspelt switch there would time one build twice.  (Kernel defines and placeholders apart.)"""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    apart = {"KDA_RT_HOPPER", "KDA_RT_KDA", "KDA_RT_X"}  # a kernel define; the KDA_RT_KDA_<NAME> prefix; a placeholder
    files = [*sorted((root / "tests" / "gpu").glob("*")), root / "README.md", root / "ARCHITECTURE.md"]
    unknown = {(p.name, n) for p in files if p.is_file()
               for n in re.findall(r"KDA_RT_[A-Z0-9_]*[A-Z0-9]", p.read_text(errors="replace"))
               if n not in apart and not n.startswith("KDA_RT_TEST_") and env.unknown_variables({n: ""})}
    assert not unknown, sorted(unknown)


def test_tma_l2_promotion_switch(monkeypatch):
    """KDA_RT_TMA_L2_PROMOTION: 256 unset (the maps' promotion before the switch), none / 64 / 128 / 256 as given,
    anything else refused by name; ops/tma.py maps each to the driver's enum value in order."""
    from kda_rt.cuda.ops.tma import _L2_PROMOTION

    monkeypatch.delenv("KDA_RT_TMA_L2_PROMOTION", raising=False)
    assert env.tma_l2_promotion() == "256" and _L2_PROMOTION["256"] == 3
    for value, enum in (("none", 0), ("64", 1), ("128", 2)):
        monkeypatch.setenv("KDA_RT_TMA_L2_PROMOTION", value)
        assert env.tma_l2_promotion() == value and _L2_PROMOTION[value] == enum
    monkeypatch.setenv("KDA_RT_TMA_L2_PROMOTION", "512")
    with pytest.raises(ValueError, match="KDA_RT_TMA_L2_PROMOTION must be none, 64, 128 or 256"):
        env.tma_l2_promotion()


@pytest.mark.parametrize(("value", "expected"), [(None, 2), ("", 2), ("0", 0), ("1", 1), ("2", 2)])
def test_skip_pad_levels(monkeypatch, value, expected):
    """KDA_RT_SKIP_PAD: 2 by default (the KDA decode kernel's padding CTAs also leave at once), 0 the padding rows
    run like live rows, 1 they skip their KDA state and MoE pairs; any other value refused by name."""
    if value is None:
        monkeypatch.delenv("KDA_RT_SKIP_PAD", raising=False)
    else:
        monkeypatch.setenv("KDA_RT_SKIP_PAD", value)
    assert env.skip_pad() == expected


@pytest.mark.parametrize("value", ["yes", "3", "off", "-1"])
def test_skip_pad_rejects_other_values(monkeypatch, value):
    monkeypatch.setenv("KDA_RT_SKIP_PAD", value)
    with pytest.raises(ValueError, match="KDA_RT_SKIP_PAD must be 0, 1 or 2"):
        env.skip_pad()


_GEMV_ROWS = [("KDA_RT_FP8_DECODE_GEMV_MAX_T", env.fp8_decode_gemv_max_t),
              ("KDA_RT_DENSE_GEMV_MAX_T", env.dense_gemv_max_t)]


@pytest.mark.parametrize(("name", "read", "default"), [(*_GEMV_ROWS[0], 2), (*_GEMV_ROWS[1], 1)])
@pytest.mark.parametrize(("value", "expected"), [(None, None), ("", None), ("1", 1), ("2", 2), ("4", 4)])
def test_gemv_max_rows(monkeypatch, name, read, default, value, expected):
    """KDA_RT_FP8_DECODE_GEMV_MAX_T (default 2: measured) and KDA_RT_DENSE_GEMV_MAX_T (default 1: one-row GEMVs), up
    to 4 (gemv_dense's rows); 0, 5 and words refused by name."""
    expected = default if expected is None else expected
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    assert read() == expected


@pytest.mark.parametrize(("name", "read"), _GEMV_ROWS)
@pytest.mark.parametrize("value", ["0", "5", "two", "-1"])
def test_gemv_max_rows_refused(monkeypatch, name, read, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        read()


@pytest.mark.parametrize(("ours", "vllm", "expected"), [(None, None, False), ("1", None, True), (None, "1", True),
                                                        ("0", "1", False), ("", "1", True)])
@pytest.mark.parametrize(("read", "name"), [(env.server_dev_mode, "SERVER_DEV_MODE"),
                                            (env.responses_store, "ENABLE_RESPONSES_API_STORE")],
                         ids=["server-dev-mode", "responses-store"])
def test_switches_vllm_names_too(monkeypatch, read, name, ours, vllm, expected):
    """KDA_RT_SERVER_DEV_MODE / KDA_RT_ENABLE_RESPONSES_API_STORE, else vLLM's VLLM_ names (ours wins when set); off
    by default; other values refused by name (the server says so and exits 2 before loading)."""
    for var, value in ((f"KDA_RT_{name}", ours), (f"VLLM_{name}", vllm)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    assert read() is expected
    monkeypatch.setenv(f"KDA_RT_{name}", "yes")
    with pytest.raises(ValueError, match=f"KDA_RT_{name} must be 0 or 1"):
        read()
