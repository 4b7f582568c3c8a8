"""The bundled tiny demo checkpoint: a few-MB random-weight Kimi Linear model in hub layout with
its own tiny tiktoken vocabulary.  Rebuild it with `python -m kda_rt.demo.make_demo`."""

from __future__ import annotations

from pathlib import Path

__all__ = ["demo_path"]


def demo_path() -> Path:
    """Directory of the demo checkpoint (config.json, model.safetensors, tokenizer files)."""
    return Path(__file__).resolve().parent
