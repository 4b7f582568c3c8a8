"""Model runners: own the weights, the cache pools and the model of one backend, and turn a
`ForwardBatch` into float32 logits.  The engine talks to a runner only through `execute`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from kda_rt.cache import KDAStatePool, MLAKVPool

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kda_rt.forward_batch import ForwardBatch
    from kda_rt.loader.config import ModelConfig

__all__ = ["NumpyRunner"]

logger = logging.getLogger(__name__)


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
    ) -> None:
        from kda_rt.model.kimi_linear import KimiLinearModel

        self.config = config
        self.dtype = np.dtype(dtype)
        self.model = KimiLinearModel(config, weights, self.dtype)
        # np.zeros is backed by lazily committed pages, so a generous pool costs little until used
        self.kda_pool = KDAStatePool(config, num_slots, dtype=self.dtype)
        self.mla_pool = MLAKVPool(config, num_blocks, block_size, dtype=self.dtype)
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.block_size = block_size

    def execute(self, batch: ForwardBatch) -> np.ndarray:
        """[N, vocab] float32 logits at `batch.logits_indices`."""
        return np.asarray(self.model.forward(batch, self.kda_pool, self.mla_pool), dtype=np.float32)
