"""Test-suite root.  Its presence puts `tests/` on sys.path, so test files can `import helpers.<module>`.

Tests marked `gpu` need an NVIDIA GPU and CuPy; without them they are skipped with a reason
(CI has no GPU: run `python -m pytest -m gpu` on the GPU machine)."""

from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=1)
def gpu_unavailable_reason() -> str | None:
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 'kda_rt[cuda12]' or '[cuda13]')"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:  # no driver
        return f"no usable CUDA driver/device ({type(exc).__name__})"
    return None


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason() if any("gpu" in item.keywords for item in items) else None
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
