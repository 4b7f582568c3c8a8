"""`load_format="dummy"` (vLLM's `--load-format dummy`): random weights of a config.json's shapes, no weight file
read, for trying a setup or benchmarking without the weights; other formats load the checkpoint."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from kda_rt import LLM, SamplingParams
from kda_rt.demo import demo_path
from kda_rt.engine.config import EngineConfig


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    """The demo's config and tokenizer, no weight file."""
    out = tmp_path_factory.mktemp("config_only")
    for name in ("config.json", "tiktoken.model", "tokenizer_config.json"):
        shutil.copy(demo_path() / name, out / name)
    return out


def _ids(llm: LLM) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return list(llm.generate(["a dummy-weight prompt"], params)[0].outputs[0].token_ids)


def test_dummy_needs_no_weight_file_and_follows_the_seed(config_only):
    a = LLM(str(config_only), backend="numpy", load_format="dummy", seed=3)
    ids = _ids(a)
    assert len(ids) == 8 and all(0 <= t < a.model_config.vocab_size for t in ids)
    assert _ids(LLM(str(config_only), backend="numpy", load_format="dummy", seed=3)) == ids  # same seed, same weights
    b = LLM(str(config_only), backend="numpy", load_format="dummy", seed=4)
    # another seed draws other weights (compared on the logits, not on 8 greedy tokens, which could agree)
    prompt = [1, 2, 3, 4]
    assert not np.allclose(a.score(prompt), b.score(prompt))


def test_auto_still_reads_the_checkpoint(config_only):
    with pytest.raises(Exception, match="safetensors"):  # names the missing weight files
        LLM(str(config_only), backend="numpy")
    demo = LLM(str(demo_path()), backend="numpy", load_format="safetensors", seed=3)
    assert _ids(demo) == _ids(LLM(str(demo_path()), backend="numpy", seed=3))


@pytest.mark.parametrize("value", ["pt", "", None, "DUMMY"])
def test_unknown_format_is_named(value):
    with pytest.raises(ValueError, match="load_format must be one of"):
        EngineConfig(load_format=value)


def test_cli_flag():
    from kda_rt.server.__main__ import build_parser

    args = build_parser().parse_args(["--load-format", "dummy"])
    assert EngineConfig.from_cli_args(args).load_format == "dummy"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--load-format", "gguf"])
