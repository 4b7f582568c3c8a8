"""Model runners: own the weights, the cache pools and the model of one backend, and turn a
`ForwardBatch` into float32 logits.  Backend selection (`select_backend`) and the NumPy runner.

Each runner plans its pools with `kda_rt.pools.plan_pools` at construction and exposes the plan
as `runner.plan`; `build_engine` hands the engine the plan's slots, pages and max_model_len.
"""

from __future__ import annotations

import logging
import resource
import sys
from typing import TYPE_CHECKING

import numpy as np

from kda_rt.cache import KDAStatePool, MLAKVPool
from kda_rt.pools import host_memory_bytes, plan_pools

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kda_rt.engine import EngineConfig
    from kda_rt.forward_batch import ForwardBatch
    from kda_rt.loader.config import ModelConfig

__all__ = ["BACKENDS", "NUMPY_DTYPES", "NumpyRunner", "make_runner", "select_backend", "cuda_unavailable_reason"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "numpy", "cuda")
NUMPY_DTYPES = ("float32", "float64", "bfloat16")


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


class NumpyRunner:
    """The reference backend: float32 (or float64) NumPy on the CPU."""

    name = "numpy"

    def __init__(self, config: ModelConfig, weights: Mapping[str, np.ndarray], engine: EngineConfig, *,
                 dtype: np.dtype | type = np.float32, bf16_activations: bool = False) -> None:
        from kda_rt.model.kimi_linear import KimiLinearModel

        self.config = config
        self.dtype = np.dtype(dtype)
        weight_bytes = sum(int(np.prod(w.shape)) for w in weights.values()) * self.dtype.itemsize
        self.plan = plan_pools(config, engine, itemsize=self.dtype.itemsize, memory_bytes=host_memory_bytes(),
                               weight_bytes=weight_bytes, cap_to_sequences=True, where="host")
        self.model = KimiLinearModel(config, weights, self.dtype, bf16_activations=bf16_activations)
        # np.zeros is backed by lazily committed pages, so a generous pool costs little until used
        self.kda_pool = KDAStatePool(config, self.plan.num_slots, dtype=self.dtype)
        self.mla_pool = MLAKVPool(config, self.plan.num_blocks, engine.block_size, dtype=self.dtype)

    def execute(self, batch: ForwardBatch) -> np.ndarray:
        """[N, vocab] float32 logits at `batch.logits_indices`."""
        return np.asarray(self.model.forward(batch, self.kda_pool, self.mla_pool), dtype=np.float32)

    def peak_memory_bytes(self) -> int:
        """Peak resident memory of this process (the CPU is the device here)."""
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)


def make_runner(backend: str, config: ModelConfig, weights: Mapping[str, np.ndarray], engine: EngineConfig, *,
                dtype: str = "float32"):
    """The NumPy runner.  dtype: "float32", "float64", or "bfloat16" (float32 math with activations
    rounded to bf16 where the bf16 references round them: the oracle for the CUDA backend)."""
    if backend == "numpy":
        if dtype not in NUMPY_DTYPES:
            raise ValueError(f"dtype must be one of {NUMPY_DTYPES} on the numpy backend, got {dtype!r}")
        emulate = dtype == "bfloat16"
        return NumpyRunner(config, weights, engine, dtype=np.float32 if emulate else np.dtype(dtype),
                           bf16_activations=emulate)
    raise ValueError(f"backend {backend!r} has no NumPy runner")
