"""Loader errors name the file (issue 10 #11): generation_config.json that is not an object, and
config sizes that would take long or exhaust memory are refused before anything is built."""

from __future__ import annotations

import json
import re
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


@pytest.mark.parametrize("eos", [5000, -1, [770, 99999], [770, "x"], True], ids=["past", "negative", "list-past",
                                                                                 "list-str", "bool"])
def test_eos_ids_outside_the_vocabulary_named(demo_copy, eos):
    """An EOS id no token can have (past the vocabulary, negative, not an int) is refused naming the file and field
    (was: accepted, so a sequence could never stop on EOS); none at all, from the files or the tokenizer, is allowed
    with a warning."""
    gen = demo_copy / "generation_config.json"
    gen.write_text(json.dumps({"eos_token_id": eos}))
    with pytest.raises(ValueError, match="generation_config.json: 'eos_token_id'"):
        LLM(str(demo_copy), backend="numpy")
    gen.unlink()
    cfg = json.loads((demo_copy / "config.json").read_text())
    (demo_copy / "config.json").write_text(json.dumps({**cfg, "eos_token_id": eos}))
    with pytest.raises(ConfigError, match="config.json: field 'eos_token_id'"):
        LLM(str(demo_copy), backend="numpy")


def test_no_eos_is_a_warning(demo_copy, caplog):
    cfg = json.loads((demo_copy / "config.json").read_text())
    (demo_copy / "config.json").write_text(json.dumps({**cfg, "eos_token_id": None}))
    (demo_copy / "generation_config.json").unlink(missing_ok=True)
    with caplog.at_level("WARNING"):
        llm = LLM(str(demo_copy), backend="numpy", max_model_len=64, skip_tokenizer_init=True)  # (its EOS: none)
    assert not llm.llm_engine.eos_token_ids and "names no EOS token" in caplog.text


@pytest.mark.parametrize(("field", "value"), [("num_hidden_layers", 10**9), ("num_experts", 10**7)])
def test_huge_sizes_refused_at_once(demo_copy, field, value):
    cfg = json.loads((demo_copy / "config.json").read_text())
    cfg[field] = value
    (demo_copy / "config.json").write_text(json.dumps(cfg))
    start = time.monotonic()
    with pytest.raises(ConfigError, match=f"config.json: field '{field}'"):
        LLM(str(demo_copy), backend="numpy")
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize(("name", "needle"), [
    ("tiktoken.model", "tiktoken.model: cannot read rank file (No such file or directory)"),
    ("generation_config.json", "generation_config.json: a link to a missing file"),
    ("chat_template.jinja", "chat_template.jinja: not a readable file (a directory, or a link to a missing file)"),
])
def test_dangling_links_are_named(demo_copy, name, needle):
    """A file of the directory that is a link to a missing file (a hub cache snapshot whose blob is gone) is an error
    naming it (was: taken for absent, silently: no tokenizer, no generation_config.json's EOS ids and sampling
    defaults, the config's or the built-in chat template)."""
    path = demo_copy / name
    path.unlink(missing_ok=True)
    path.symlink_to(demo_copy / "blobs" / name)
    with pytest.raises(ValueError, match=re.escape(needle)):
        LLM(str(demo_copy), backend="numpy")


def test_chat_template_directory_is_named(demo_copy):
    (demo_copy / "chat_template.jinja").mkdir()
    with pytest.raises(ValueError, match=r"chat_template.jinja: not a readable file \(a directory"):
        LLM(str(demo_copy), backend="numpy")


def test_many_experts_over_many_layers_refused_at_once(demo_copy):
    """Each size within its own bound, together 4096 experts x 1023 MoE layers (4.2M expert MLPs) (was: 45 s and
    4.4 GB building the weight schema before the checkpoint's first tensor was compared)."""
    cfg = json.loads((demo_copy / "config.json").read_text())
    cfg.update(num_hidden_layers=1024, num_experts=4096)
    cfg["linear_attn_config"].update(kda_layers=list(range(1, 1025)), full_attn_layers=[])
    (demo_copy / "config.json").write_text(json.dumps(cfg))
    start = time.monotonic()
    with pytest.raises(ConfigError, match="config.json: field 'num_experts'=4096 over 1023 MoE layers is 4190208 "
                                          "expert MLPs, over the 65536"):
        LLM(str(demo_copy), backend="numpy")
    assert time.monotonic() - start < 2.0

