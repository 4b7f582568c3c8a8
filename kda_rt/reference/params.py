"""`Compute`: the NumPy backend's compute dtype, applied to the typed host weights on use.

The loader hands over memory-mapped tensors in their stored dtype (bf16 stays raw bits), held by
the schema's dataclasses (`kda_rt.loader.schema`).  `w(array)` converts a weight to the compute
dtype (float32, or float64 in tests) when a layer asks for it; converted copies are kept while
they fit in `cache_bytes`, so tiny models convert once and a big checkpoint never holds a full
converted copy in RAM.

With `bf16_activations`, `act()` rounds activations to bf16 at the points the bf16 references
round them (projection outputs, norm outputs, residual stream, conv outputs, KDA output, expert
activations): the NumPy backend then emulates a bf16 run, which is what the CUDA backend is
compared against.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["Compute"]


class Compute:
    def __init__(self, dtype: np.dtype | type = np.float32, *, cache_bytes: int = 2 << 30,
                 bf16_activations: bool = False) -> None:
        self.dtype = np.dtype(dtype)
        self.bf16_activations = bf16_activations
        self._budget = cache_bytes
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # id(source) -> (source, converted)

    def act(self, x: np.ndarray) -> np.ndarray:
        """Round an activation to bf16 (kept in the compute dtype) at the points where the bf16
        references and the CUDA kernels round; identity unless `bf16_activations`."""
        if not self.bf16_activations:
            return x
        return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(self.dtype)

    def w(self, weight: np.ndarray) -> np.ndarray:
        """`weight` in the compute dtype (read-only; cached while the budget lasts)."""
        hit = self._cache.get(id(weight))
        if hit is not None and hit[0] is weight:
            return hit[1]
        value = np.asarray(weight).astype(self.dtype)
        if value.nbytes <= self._budget:
            self._budget -= value.nbytes
            value.flags.writeable = False
            self._cache[id(weight)] = (weight, value)  # the source is kept, so its id stays unique
        return value
