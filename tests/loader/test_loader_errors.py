"""Loader errors name the file (issue 10 #11): generation_config.json that is not an object, and
config sizes that would take long or exhaust memory are refused before anything is built."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from kda_rt import LLM
from kda_rt.demo import demo_path
from kda_rt.loader.config import ConfigError


@pytest.fixture
def demo_copy(tmp_path):
    for f in demo_path().iterdir():
        if f.is_file() and f.suffix in (".json", ".model", ".safetensors"):
            shutil.copy(f, tmp_path / f.name)
    return tmp_path


@pytest.mark.parametrize("body", ["[1, 2]", '"eos"', "[" * 100_000 + "]" * 100_000, '{"eos_token_id": ' + "7" * 5000 + "}"],
                         ids=["array", "string", "deep", "5000-digits"])
def test_generation_config_named(demo_copy, body):
    (demo_copy / "generation_config.json").write_text(body)
    with pytest.raises(ValueError, match="generation_config.json"):
        LLM(str(demo_copy), backend="numpy")


@pytest.mark.parametrize(("field", "value"), [("num_hidden_layers", 10**9), ("num_experts", 10**7)])
def test_huge_sizes_refused_at_once(demo_copy, field, value):
    cfg = json.loads((demo_copy / "config.json").read_text())
    cfg[field] = value
    (demo_copy / "config.json").write_text(json.dumps(cfg))
    start = time.monotonic()
    with pytest.raises(ConfigError, match=f"config.json: field '{field}'"):
        LLM(str(demo_copy), backend="numpy")
    assert time.monotonic() - start < 2.0
