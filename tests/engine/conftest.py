"""Fixtures for the engine tests: a tiny random checkpoint without tokenizer files."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.configs import tiny_config
from kda_rt.random_checkpoint import write_random_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers (KDA, KDA, MLA, KDA; dense MLP then MoE), vocab 512: a step takes about a millisecond."""
    return write_random_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny"), seed=7)
