"""`Params`: read-only view of checkpoint tensors in the NumPy backend's compute dtype.

The loader hands over memory-mapped tensors in their stored dtype (bf16 stays raw bits).  A
weight is converted to the compute dtype (float32, or float64 in tests) when a layer asks for it;
converted copies are kept while they fit in `cache_bytes`, so tiny models convert once and a big
checkpoint never holds a full converted copy in RAM.

With `bf16_activations`, `act()` rounds activations to bf16 at the points the bf16 references
round them (projection outputs, norm outputs, residual stream, conv outputs, KDA output, expert
activations): the NumPy backend then emulates a bf16 run, which is what the CUDA backend is
compared against.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import ml_dtypes
import numpy as np

__all__ = ["Params"]


class Params(Mapping[str, np.ndarray]):
    def __init__(
        self,
        raw: Mapping[str, np.ndarray],
        dtype: np.dtype | type = np.float32,
        *,
        prefix: str = "",
        cache_bytes: int = 2 << 30,
        _cache: dict[str, np.ndarray] | None = None,
        _budget: list[int] | None = None,
        bf16_activations: bool = False,
    ) -> None:
        self.raw = raw
        self.dtype = np.dtype(dtype)
        self.prefix = prefix
        self._cache = {} if _cache is None else _cache
        self._budget = [cache_bytes] if _budget is None else _budget
        self.bf16_activations = bf16_activations

    def act(self, x: np.ndarray) -> np.ndarray:
        """Round an activation to bf16 (kept in the compute dtype) at the points where the bf16
        references and the CUDA kernels round; identity unless `bf16_activations`."""
        if not self.bf16_activations:
            return x
        return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(self.dtype)

    def sub(self, prefix: str) -> Params:
        """View whose keys are relative to `prefix` (e.g. 'model.layers.3.self_attn.')."""
        return Params(self.raw, self.dtype, prefix=self.prefix + prefix, _cache=self._cache, _budget=self._budget,
                      bf16_activations=self.bf16_activations)

    def __getitem__(self, name: str) -> np.ndarray:
        key = self.prefix + name
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        value = np.asarray(self.raw[key]).astype(self.dtype)
        if value.nbytes <= self._budget[0]:
            self._budget[0] -= value.nbytes
            value.flags.writeable = False
            self._cache[key] = value
        return value

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (self.prefix + name) in self.raw

    def __iter__(self) -> Iterator[str]:
        n = len(self.prefix)
        return (k[n:] for k in self.raw if k.startswith(self.prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)
