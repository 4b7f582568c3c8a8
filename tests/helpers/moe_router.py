"""Router inputs without near-ties, shared by the moe_route and moe_block kernel tests: inputs are
redrawn until every top-A / top-group boundary has a gap > GAP in the selection scores, so no
selection can flip under fp32 rounding.  Letters: T tokens, D hidden, E experts, G groups, A active.
"""

from __future__ import annotations

import numpy as np

from helpers.gpu import bf16_round

__all__ = ["GAP", "make_cfg", "make_router"]

GAP = 2e-5


def make_cfg(E, A=8, G=1, topk_group=1, renormalize=True, scaling=2.446, biased=False):
    from kda_rt.loader.config import MoEConfig

    return MoEConfig(num_experts=E, top_k=A, num_shared_experts=1, intermediate_size=1024, renormalize=renormalize,
                     routed_scaling_factor=scaling, num_expert_group=G, topk_group=topk_group, biased_weights=biased)


def _boundary_gap(x, w_router, bias, cfg) -> float:
    """Smallest gap in sel at the top-A cut (and the top-group cut) over all tokens."""
    from kda_rt.reference.layers import sigmoid

    sel = sigmoid(x @ w_router.T) + bias  # [T, E]
    gaps = [np.inf]
    E, G, A = cfg.num_experts, cfg.num_expert_group, cfg.top_k
    if G > 1:
        grouped = -np.sort(-sel.reshape(len(x), G, E // G), axis=-1)[:, :, : min(2, E // G)].sum(-1)  # [T, G]
        order = -np.sort(-grouped, axis=-1)
        if cfg.topk_group < G:
            gaps.append(np.min(order[:, cfg.topk_group - 1] - order[:, cfg.topk_group]))
        keep = grouped >= order[:, cfg.topk_group - 1 : cfg.topk_group]
        sel = np.where(np.repeat(keep, E // G, axis=-1), sel, -np.inf)
    top = -np.sort(-sel, axis=-1)
    if A < E and np.all(np.isfinite(top[:, A])):
        gaps.append(np.min(top[:, A - 1] - top[:, A]))
    return float(min(gaps))


def make_router(T, D, cfg, seed, bias_std=0.1):
    """x [T, D] (bf16 values), w_router [E, D] and bias [E] (fp32 values), all float64, redrawn
    until no selection is within GAP of a tie.  bias_std 0.1 is about half the spread of s, so the
    bias changes many selections (checked in test_moe_route)."""
    rng = np.random.default_rng(seed)
    for _ in range(20):
        x = bf16_round(rng.normal(size=(T, D)))
        w_router = rng.normal(size=(cfg.num_experts, D)).astype(np.float32).astype(np.float64) / np.sqrt(D)
        bias = (rng.normal(size=cfg.num_experts) * bias_std).astype(np.float32).astype(np.float64)
        if _boundary_gap(x, w_router, bias, cfg) > GAP:
            return x, w_router, bias
    raise RuntimeError("could not draw router inputs without near-ties")
