"""Sampling: `SamplingParams` (params.py), the flat per-step `SamplingBatch` / `StepOutput`
(batch.py), the NumPy reference sampler (reference.py) and the GPU sampler's launcher
(sampling.py, kernels_cu/sampling.cu); both draw the same Philox stream."""

from __future__ import annotations

from .params import SamplingParams, StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]
