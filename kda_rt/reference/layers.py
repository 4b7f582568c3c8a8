"""Small NumPy building blocks shared by every mixer: linear, RMSNorm, SiLU, the SiLU-gated MLP.

    linear(x, W)      = x · Wᵀ                              W: [out, in] (PyTorch layout, no bias)
    rms_norm(x, w)    = (x · rsqrt(mean(x²) + eps)) · w       statistics over the last axis
    silu(x)           = x · sigmoid(x)
    gated_mlp(x)      = W_down · (silu(W_gate x) ⊙ (W_up x))  (§5.1: dense layer, shared / routed experts)

All functions compute in the dtype of their inputs (float32 at run time, float64 in tests); the
caller picks the compute dtype through `Compute`.  Letters: T tokens, D hidden, F FFN width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kda_rt.loader.schema import MLPWeights
    from kda_rt.reference.params import Compute

__all__ = ["gated_mlp", "linear", "rms_norm", "sigmoid", "silu"]


def linear(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """y = x · Wᵀ.  x: [..., in], weight: [out, in] -> [..., out]."""
    return x @ weight.T


def _same(x: np.ndarray) -> np.ndarray:
    return x


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, act=_same) -> np.ndarray:
    """(x · rsqrt(mean(x²) + eps)) · w over the last axis.  x: [..., D], weight: [D].

    The weight multiplies as-is (not `1 + w`).  Normalise first, then scale, as in §6.  `act`
    rounds the normalised value and the product (bf16 emulation, see Compute.act).
    """
    var = np.mean(np.square(x), axis=-1, keepdims=True)
    return act(act(x / np.sqrt(var + eps)) * weight)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)), overflow-free for large |x| (exp of a non-positive number only)."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(x.dtype, copy=False)


def silu(x: np.ndarray) -> np.ndarray:
    """x · sigmoid(x)."""
    return x * sigmoid(x)


def gated_mlp(w: MLPWeights, x: np.ndarray, num: Compute, source=None, *, dense: bool = False) -> np.ndarray:
    """SiLU-gated MLP of §5.1 (dense layer, shared experts, one routed expert).  x: [T, D] -> [T, D]; `source`
    (optional): what each projection's source rows (x, then h) become before their products, e.g. e4m3 codes;
    `dense` (the dense layer): the products through `num.dense` (Compute.e4m3_dense)."""
    act, source = num.act, source or (lambda a: a)
    x = source(x)
    mm = num.dense if dense else (lambda a, weight: linear(a, num.w(weight)))
    h = act(act(silu(act(mm(x, w.gate)))) * act(mm(x, w.up)))  # [T, F]
    return mm(source(h), w.down)  # [T, D] (callers round: the routed experts' bf16 outputs are combined in fp32)
