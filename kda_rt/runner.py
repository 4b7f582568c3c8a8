"""Model runners: own the weights, the cache pools and the model of one backend, and turn a
`ForwardBatch` into float32 logits.  The engine talks to a runner only through `execute`.

`make_runner(backend, ...)` is the one place a backend is chosen; a CUDA runner plugs in there
with the same constructor arguments and the same `execute(batch) -> [N, V] logits` contract.

Pool sizing (`pool_sizes`): the runner holds `max_num_seqs + 1` KDA state slots and the engine's
pages plus `ceil(max_model_len / block_size)` more; the extra slot and pages are reserved for
`LLM.score()`.  The engine's page count is `num_blocks` when given; otherwise, on a backend that
reports device memory, what `gpu_memory_utilization` leaves after weights and state slots; on the
NumPy backend enough for `max_num_seqs` sequences of `max_model_len` tokens.
"""

from __future__ import annotations

import logging
import math
import resource
import sys
from typing import TYPE_CHECKING

import numpy as np

from kda_rt.cache import KDAStatePool, MLAKVPool

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kda_rt.engine import EngineConfig
    from kda_rt.forward_batch import ForwardBatch
    from kda_rt.loader.config import ModelConfig

__all__ = ["BACKENDS", "NumpyRunner", "make_runner", "pool_sizes", "select_backend", "cuda_unavailable_reason",
           "kv_bytes_per_block", "state_bytes_per_slot"]

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


def kv_bytes_per_block(config: ModelConfig, block_size: int, itemsize: int) -> int:
    """Bytes of one MLA page over all MLA layers (576 values per token per layer at full size)."""
    width = config.mla.cache_width if config.mla is not None else 0
    return len(config.mla_layer_ids) * block_size * width * itemsize


def state_bytes_per_slot(config: ModelConfig, itemsize: int, state_itemsize: int | None = None) -> int:
    """Bytes of one KDA state slot over all KDA layers: conv state (`itemsize` per value) + recurrent
    state (`state_itemsize`, default `itemsize`; the CUDA backend keeps bf16 conv and fp32 state)."""
    kda = config.kda
    if kda is None:
        return 0
    p = kda.num_heads * kda.head_dim
    conv = 3 * (kda.conv_kernel_size - 1) * p * itemsize
    rec = kda.num_heads * kda.head_dim * kda.head_dim * (state_itemsize or itemsize)
    return len(config.kda_layer_ids) * (conv + rec)


def pool_sizes(config: ModelConfig, engine: EngineConfig, *, itemsize: int, weight_bytes: int = 0,
               device_bytes: int | None = None, state_itemsize: int | None = None) -> tuple[int, int]:
    """(KDA state slots, MLA pages) the engine schedules over; the runner adds score()'s reserve.

    `device_bytes` is the device's total memory (None on the NumPy backend).
    """
    num_slots = engine.max_num_seqs
    if engine.num_blocks is not None:
        return num_slots, engine.num_blocks
    pages_per_seq = math.ceil(engine.max_model_len / engine.block_size)
    if device_bytes is None:
        return num_slots, num_slots * pages_per_seq
    budget = int(device_bytes * engine.gpu_memory_utilization) - weight_bytes
    budget -= (num_slots + 2) * state_bytes_per_slot(config, itemsize, state_itemsize)  # + score() + padding
    budget -= pages_per_seq * kv_bytes_per_block(config, engine.block_size, itemsize)  # score() reserve
    num_blocks = budget // max(1, kv_bytes_per_block(config, engine.block_size, itemsize))
    if num_blocks < pages_per_seq:
        raise ValueError(
            f"gpu_memory_utilization {engine.gpu_memory_utilization} leaves room for {max(num_blocks, 0)} KV pages; "
            f"one sequence of max_model_len {engine.max_model_len} needs {pages_per_seq}: lower max_model_len"
        )
    return num_slots, int(num_blocks)


class NumpyRunner:
    """The reference backend: float32 (or float64) NumPy on the CPU."""

    name = "numpy"

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, np.ndarray],
        *,
        num_slots: int,
        num_blocks: int,
        block_size: int,
        dtype: np.dtype | type = np.float32,
        bf16_activations: bool = False,
    ) -> None:
        from kda_rt.model.kimi_linear import KimiLinearModel

        self.config = config
        self.dtype = np.dtype(dtype)
        self.model = KimiLinearModel(config, weights, self.dtype, bf16_activations=bf16_activations)
        # np.zeros is backed by lazily committed pages, so a generous pool costs little until used
        self.kda_pool = KDAStatePool(config, num_slots, dtype=self.dtype)
        self.mla_pool = MLAKVPool(config, num_blocks, block_size, dtype=self.dtype)
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.block_size = block_size

    def execute(self, batch: ForwardBatch) -> np.ndarray:
        """[N, vocab] float32 logits at `batch.logits_indices`."""
        return np.asarray(self.model.forward(batch, self.kda_pool, self.mla_pool), dtype=np.float32)

    def peak_memory_bytes(self) -> int:
        """Peak resident memory of this process (the CPU is the device here)."""
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)


def make_runner(backend: str, config: ModelConfig, weights: Mapping[str, np.ndarray], *, num_slots: int,
                num_blocks: int, block_size: int, dtype: str = "float32"):
    """The NumPy runner.  dtype: "float32", "float64", or "bfloat16" (float32 math with activations
    rounded to bf16 where the bf16 references round them: the oracle for the CUDA backend)."""
    if backend == "numpy":
        if dtype not in NUMPY_DTYPES:
            raise ValueError(f"dtype must be one of {NUMPY_DTYPES} on the numpy backend, got {dtype!r}")
        emulate = dtype == "bfloat16"
        return NumpyRunner(config, weights, num_slots=num_slots, num_blocks=num_blocks, block_size=block_size,
                           dtype=np.float32 if emulate else np.dtype(dtype), bf16_activations=emulate)
    raise ValueError(f"backend {backend!r} has no NumPy runner")
