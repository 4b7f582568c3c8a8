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


def pytest_terminal_summary(terminalreporter):
    """GPU runs: what this process spent building kernels (NVRTC, or loading from the disk cache), beside pytest's
    --durations, to see how much of a device call's test time is compilation."""
    import sys

    compile_mod = sys.modules.get("kda_rt.cuda.ops.compile")
    if compile_mod is not None and compile_mod.BUILD_STATS["loaded"]:
        s = compile_mod.BUILD_STATS
        terminalreporter.write_line(f"kernel builds: {s['loaded']} variants loaded, {s['compiled']} compiled by NVRTC "
                                    f"(not in the disk cache), {s['seconds']:.1f} s in all")
