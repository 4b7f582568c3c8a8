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
                 bf16_activations: bool = False, e4m3_dense: bool = False) -> None:
        self.dtype = np.dtype(dtype)
        self.bf16_activations = bf16_activations
        # the dense projections (`dense`) on e4m3 rows, as the CUDA backend's large fp8 prefill steps run them
        # (ops/dense_w8a8); off in the backend, set by measurements of how far that moves the model
        self.e4m3_dense = e4m3_dense
        self._e4m3: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # id(source) -> (source, dequantized e4m3 rows)
        self._budget = cache_bytes
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # id(source) -> (source, converted)

    def act(self, x: np.ndarray) -> np.ndarray:
        """Round an activation to bf16 (kept in the compute dtype) at the points where the bf16
        references and the CUDA kernels round; identity unless `bf16_activations`."""
        if not self.bf16_activations:
            return x
        return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(self.dtype)

    def dense(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """x · weightᵀ of a dense projection (KDA q / k / v and o_proj, MLA q / kv_a and o_proj, the dense MLP);
        with `e4m3_dense` both operands as e4m3 rows times a scale a row, x's by the activations' reciprocal rule
        (reference.moe.e4m3_rows) and the weight's by the weights' rule (loader/quant.quantize_rows)."""
        if not self.e4m3_dense:
            return x @ self.w(weight).T
        from kda_rt.loader.quant import dequantize_rows, quantize_rows
        from kda_rt.reference.moe import e4m3_rows

        hit = self._e4m3.get(id(weight))
        if hit is None or hit[0] is not weight:
            hit = self._e4m3[id(weight)] = (weight, dequantize_rows(*quantize_rows(
                np.asarray(weight, dtype=np.float32), "dense weight")).astype(self.dtype))
        return e4m3_rows(x) @ hit[1].T

    def w(self, weight: np.ndarray) -> np.ndarray:
        """`weight` in the compute dtype (read-only; cached while the budget lasts; a read-only view where it already
        is in that dtype: the float64 oracle's tests hand over float64 weights, whose copies took most of a large
        reference's time)."""
        source = np.asarray(weight)
        if source.dtype == self.dtype:
            view = source.view()
            view.flags.writeable = False
            return view
        hit = self._cache.get(id(weight))
        if hit is not None and hit[0] is weight:
            return hit[1]
        value = source.astype(self.dtype)
        if value.nbytes <= self._budget:
            self._budget -= value.nbytes
            value.flags.writeable = False
            self._cache[id(weight)] = (weight, value)  # the source is kept, so its id stays unique
        return value
