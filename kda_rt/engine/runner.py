"""Backend selection: the one place that decides between the NumPy reference and the CUDA backend."""

from __future__ import annotations

import logging

__all__ = ["BACKENDS", "cuda_unavailable_reason", "select_backend"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "numpy", "cuda")


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run here, or None when it can."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed: pip install 'kda_rt[cuda12]' (CUDA 12 driver) or 'kda_rt[cuda13]'"
    try:
        from cupy.cuda import nvrtc, runtime

        if runtime.getDeviceCount() < 1:
            return "no CUDA device is visible"
        cc = int(cupy.cuda.Device().compute_capability)  # e.g. "90" -> 90
        if cc < 80:
            return f"compute capability {cc // 10}.{cc % 10} is below 8.0 (bf16 kernels need Ampere or newer)"
        if runtime.driverGetVersion() < 12000:
            return f"the NVIDIA driver supports CUDA {runtime.driverGetVersion()}, kda_rt needs CUDA >= 12.0"
        nvrtc.getVersion()
    except Exception as exc:  # no driver, broken install, NVRTC library missing
        return f"CUDA is not usable here ({type(exc).__name__}: {exc}); check the driver and the CuPy extra"
    return None


def select_backend(backend: str) -> str:
    """Resolve "auto" (cuda when a usable GPU and CuPy are present, else numpy) and check that the
    requested backend can run here."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "numpy":
        return backend
    reason = cuda_unavailable_reason()
    if backend == "cuda":
        if reason:
            raise RuntimeError(f"backend='cuda' is unavailable: {reason}")
        return "cuda"
    if reason:
        logger.info("using the numpy backend: %s", reason)
        return "numpy"
    return "cuda"
