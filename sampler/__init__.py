"""Sampling: `SamplingParams` and the samplers (NumPy reference here; GPU kernels later)."""

from __future__ import annotations

from .params import SamplingParams

__all__ = ["SamplingParams"]
