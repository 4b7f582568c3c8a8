"""Sigmoid top-k MoE with correction bias, group-limited routing and shared experts (spec §5).

Router, per token (x: the post_attention_layernorm output):

    logits = x · W_routerᵀ                 [E]     in the compute dtype
    s      = sigmoid(logits)
    s_sel  = s + e_score_correction_bias           used for SELECTION only
    groups : E experts in G equal groups; group score = sum of the two largest s_sel in the
             group; keep the topk_group best groups, mask the other experts to -inf
    idx    = the A largest s_sel among the kept experts
    w      = s[idx]        (s_sel[idx] when MoEConfig.biased_weights: the HF remote code)
    w      = w / (Σ w + 1e-20)                     when cfg.renormalize
    w      = w · routed_scaling_factor
    y      = Σ_k w_k · Expert_{idx_k}(x) + Σ shared experts(x)        (shared output unscaled)

Expert e: W_down · (silu(W_gate x) ⊙ (W_up x)) with checkpoint names w1 = gate, w3 = up,
w2 = down; the shared expert(s) use `shared_experts.{gate,up,down}_proj`.

Tie-break (deterministic): groups and experts are ranked by descending score with a stable sort,
so among equal scores the lower group / expert index wins, and `idx` lists experts in that rank
order.  (torch.topk leaves tie order unspecified; exact ties only happen with degenerate weights.)

Letters: T tokens, D hidden, E experts, G expert groups, A active experts per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kda_rt.reference.layers import gated_mlp, linear, sigmoid
from kda_rt.reference.params import Compute

if TYPE_CHECKING:
    from kda_rt.loader.config import MoEConfig
    from kda_rt.loader.schema import MoEWeights

__all__ = ["e4m3_rows", "moe_forward", "route"]

def _top_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """[T, k] indices of the k largest entries per row, descending, lower index first on ties."""
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


def route(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, cfg: MoEConfig) -> tuple[np.ndarray, np.ndarray]:
    """Top-k routing.  x: [T, D], weight: [E, D], bias: [E] -> (idx [T, A] int64, w [T, A])."""
    E, G, A = cfg.num_experts, cfg.num_expert_group, cfg.top_k
    scores = sigmoid(linear(x, weight))  # [T, E]
    sel = scores + bias  # [T, E]
    if G > 1:
        per_group = E // G
        grouped = sel.reshape(-1, G, per_group)  # [T, G, E/G]
        top2 = min(2, per_group)
        group_score = -np.sort(-grouped, axis=-1)[:, :, :top2].sum(axis=-1)  # [T, G]
        keep = np.zeros(group_score.shape, dtype=bool)
        np.put_along_axis(keep, _top_indices(group_score, cfg.topk_group), True, axis=-1)
        sel = np.where(np.repeat(keep, per_group, axis=-1), sel, -np.inf)
    idx = _top_indices(sel, A)  # [T, A]
    w = np.take_along_axis(sel if cfg.biased_weights else scores, idx, axis=-1)  # [T, A]
    if cfg.renormalize:
        w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
    return idx, w * cfg.routed_scaling_factor


def e4m3_rows(a: np.ndarray) -> np.ndarray:
    """a's rows as e4m3 codes times a scale a row (loader/quant.quantize_rows with the activations' reciprocal rule,
    as the CUDA backend's quantize_activations_e4m3 makes them), in a's dtype; a row with a non-finite entry becomes
    NaN (the kernel gives it a NaN scale, so every product of it is NaN)."""
    from kda_rt.loader.quant import dequantize_rows, quantize_rows

    finite = np.isfinite(a).all(axis=-1)
    out = np.full(a.shape, np.nan, dtype=a.dtype)
    if finite.any():
        out[finite] = dequantize_rows(*quantize_rows(a[finite], "source rows", reciprocal=True)).astype(a.dtype)
    return out


def moe_forward(w: MoEWeights, x: np.ndarray, cfg: MoEConfig, num: Compute | None = None, *,
                e4m3_sources: bool = False, shared_e4m3_sources: bool = False) -> np.ndarray:
    """MoE block.  w: one layer's block_sparse_moe weights; x: [T, D] -> [T, D]; num: compute dtype
    and bf16 rounding (default: x's dtype, no rounding).  e4m3_sources: each routed expert's source rows (x,
    then h) quantized to e4m3 a row at a time before its products, as the CUDA backend's prefill GEMMs on
    e4m3 stacks take them (KDA_RT_FP8_PREFILL); shared_e4m3_sources: the shared expert's too (it runs in the
    stacks there).

    Routed experts run once each on the tokens that picked them (only experts with at least one
    token are touched), accumulated in the compute dtype in ascending expert order.
    """
    num = num or Compute(x.dtype)
    routed_source = e4m3_rows if e4m3_sources else None
    idx, weight = route(x, num.w(w.gate), num.w(w.e_score_correction_bias), cfg)
    out = np.zeros_like(x)
    flat = idx.ravel()
    order = np.argsort(flat, kind="stable")  # token-slot pairs grouped by expert
    experts, starts = np.unique(flat[order], return_index=True)
    bounds = np.append(starts, flat.size)
    for j, e in enumerate(experts):
        pairs = order[bounds[j]:bounds[j + 1]]
        tokens, slots = pairs // cfg.top_k, pairs % cfg.top_k  # each token at most once per expert
        y = num.act(gated_mlp(w.experts[int(e)], x[tokens], num, routed_source))  # [n_e, D], bf16 as HF's expert output
        out[tokens] += weight[tokens, slots][:, None] * y
    if w.shared is not None:
        out += num.act(gated_mlp(w.shared, x, num, e4m3_rows if shared_e4m3_sources else None))
    return out

