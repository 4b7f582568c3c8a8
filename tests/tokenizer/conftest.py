"""Fixtures for the tokenizer tests: the bundled demo vocabulary (768 BPE tokens + 256 specials)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import kda_rt.demo
from kda_rt.text.tokenizer import Tokenizer

DEMO_DIR = Path(kda_rt.demo.__file__).parent


@pytest.fixture(scope="session")
def demo_tok() -> Tokenizer:
    return Tokenizer.from_dir(DEMO_DIR)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A writable copy of the demo tokenizer files, for tests that corrupt or extend them."""
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / name, tmp_path / name)
    return tmp_path
