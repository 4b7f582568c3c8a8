"""Model runners: own the weights, the cache pools and the model of one backend, and turn a
`ForwardBatch` into float32 logits.  Backend selection (`select_backend`) and the NumPy runner.

Each runner plans its pools with `kda_rt.engine.pools.plan_pools` at construction and exposes the plan
as `runner.plan`; `build_engine` hands the engine the plan's slots, pages and max_model_len.
"""

from __future__ import annotations

import logging
import resource
import sys
from typing import TYPE_CHECKING

import numpy as np

from kda_rt.engine.pools import host_memory_bytes, plan_pools
from kda_rt.reference.cache import KDAStatePool, MLAKVPool

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kda_rt.engine import EngineConfig
    from kda_rt.engine.batch import ForwardBatch
    from kda_rt.loader.config import ModelConfig

__all__ = ["NUMPY_DTYPES", "NumpyRunner", "make_runner"]

logger = logging.getLogger(__name__)

NUMPY_DTYPES = ("float32", "float64", "bfloat16")


class NumpyRunner:
    """The reference backend: float32 (or float64) NumPy on the CPU."""

    name = "numpy"

    def __init__(self, config: ModelConfig, weights: Mapping[str, np.ndarray], engine: EngineConfig, *,
                 dtype: np.dtype | type = np.float32, bf16_activations: bool = False) -> None:
        from kda_rt.reference.kimi_linear import KimiLinearModel

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
