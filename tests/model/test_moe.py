"""MoE router and block vs. a plain per-token float64 loop (spec §5).

Reference, per token: s = sigmoid(x·W_rᵀ); s_sel = s + bias; with G groups keep the topk_group
groups of largest (sum of the two largest s_sel in the group); pick the A largest s_sel among the
kept experts; w = s[idx] (or s_sel[idx] when biased); renormalise (+1e-20); × scaling;
y = Σ w_k·Expert_k(x) + Shared(x).  Letters: T tokens, D hidden, E experts, A active, G groups.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kda_rt.loader.config import MoEConfig
from kda_rt.loader.schema import MoEWeights, Reader
from kda_rt.reference.moe import moe_forward, route

D, F, T = 24, 16, 37
BASE = MoEConfig(num_experts=8, top_k=2, num_shared_experts=1, intermediate_size=F, renormalize=True,
                 routed_scaling_factor=2.446, num_expert_group=1, topk_group=1)


def make_weights(cfg: MoEConfig, seed: int, bias_std: float = 0.3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = {"gate.weight": rng.normal(0, 0.5, (cfg.num_experts, D)),
         "gate.e_score_correction_bias": rng.normal(0, bias_std, (cfg.num_experts,))}
    for e in range(cfg.num_experts):
        w[f"experts.{e}.w1.weight"] = rng.normal(0, 0.3, (F, D))
        w[f"experts.{e}.w3.weight"] = rng.normal(0, 0.3, (F, D))
        w[f"experts.{e}.w2.weight"] = rng.normal(0, 0.3, (D, F))
    width = F * cfg.num_shared_experts
    w["shared_experts.gate_proj.weight"] = rng.normal(0, 0.3, (width, D))
    w["shared_experts.up_proj.weight"] = rng.normal(0, 0.3, (width, D))
    w["shared_experts.down_proj.weight"] = rng.normal(0, 0.3, (D, width))
    return w


def silu(v):
    return v / (1 + np.exp(-v))


def ref_route(w, x_t: np.ndarray, cfg: MoEConfig) -> tuple[list[int], list[float]]:
    s = 1 / (1 + np.exp(-(w["gate.weight"] @ x_t)))
    sel = s + w["gate.e_score_correction_bias"]
    size = cfg.num_experts // cfg.num_expert_group
    group_score = [sum(sorted(sel[g * size:(g + 1) * size])[-2:]) for g in range(cfg.num_expert_group)]
    groups = sorted(range(cfg.num_expert_group), key=lambda g: -group_score[g])[: cfg.topk_group]
    allowed = [e for e in range(cfg.num_experts) if e // size in groups]
    idx = sorted(allowed, key=lambda e: -sel[e])[: cfg.top_k]
    wt = [float((sel if cfg.biased_weights else s)[e]) for e in idx]
    if cfg.renormalize:
        total = sum(wt) + 1e-20
        wt = [v / total for v in wt]
    return idx, [v * cfg.routed_scaling_factor for v in wt]


def ref_moe(w, x: np.ndarray, cfg: MoEConfig) -> np.ndarray:
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        idx, wt = ref_route(w, x[t], cfg)
        for e, g in zip(idx, wt, strict=True):
            h = silu(w[f"experts.{e}.w1.weight"] @ x[t]) * (w[f"experts.{e}.w3.weight"] @ x[t])
            out[t] += g * (w[f"experts.{e}.w2.weight"] @ h)
        if cfg.num_shared_experts:
            h = silu(w["shared_experts.gate_proj.weight"] @ x[t]) * (w["shared_experts.up_proj.weight"] @ x[t])
            out[t] += w["shared_experts.down_proj.weight"] @ h
    return out


CASES = {
    "E8-A2": BASE,
    "E8-A2-norenorm": dataclasses.replace(BASE, renormalize=False),
    "E8-A2-biased": dataclasses.replace(BASE, biased_weights=True),
    "E16-A3-G4-top2": dataclasses.replace(BASE, num_experts=16, top_k=3, num_expert_group=4, topk_group=2),
    "E12-A4-G3-top2-noshared": dataclasses.replace(BASE, num_experts=12, top_k=4, num_expert_group=3, topk_group=2,
                                                   num_shared_experts=0),
    "E8-A1-2shared": dataclasses.replace(BASE, top_k=1, num_shared_experts=2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_matches_per_token_loop(name: str) -> None:
    cfg = CASES[name]
    w = make_weights(cfg, seed=len(name))
    x = np.random.default_rng(1).normal(size=(T, D))
    for t in range(T):
        idx, _ = route(x[t:t + 1], w["gate.weight"], w["gate.e_score_correction_bias"], cfg)
        assert idx[0].tolist() == ref_route(w, x[t], cfg)[0]
    out, ref = moe_forward(MoEWeights.read(Reader(w), cfg, D), x, cfg), ref_moe(w, x, cfg)
    assert np.max(np.abs(out - ref)) <= 1e-12 * np.max(np.abs(ref))


def test_bias_selects_but_does_not_weight() -> None:
    cfg = dataclasses.replace(BASE, routed_scaling_factor=1.0, renormalize=False)
    w = make_weights(cfg, seed=3, bias_std=0.0)
    x = np.random.default_rng(4).normal(size=(1, D))
    s = 1 / (1 + np.exp(-(w["gate.weight"] @ x[0])))
    unbiased_top = set(np.argsort(-s)[:2].tolist())
    loser = int(np.argsort(-s)[-1])  # the weakest expert: a large bias must force it in
    w["gate.e_score_correction_bias"][loser] = 5.0
    idx, wt = route(x, w["gate.weight"], w["gate.e_score_correction_bias"], cfg)
    assert loser in idx[0] and set(idx[0].tolist()) != unbiased_top
    k = idx[0].tolist().index(loser)
    assert wt[0, k] == pytest.approx(s[loser], rel=1e-14)  # weight from the unbiased score
    _, wt_biased = route(x, w["gate.weight"], w["gate.e_score_correction_bias"], dataclasses.replace(cfg, biased_weights=True))
    assert wt_biased[0, k] == pytest.approx(s[loser] + 5.0, rel=1e-14)


def test_group_limit_excludes_best_expert_of_weak_group() -> None:
    cfg = dataclasses.replace(BASE, num_experts=8, top_k=2, num_expert_group=4, topk_group=1)
    w = make_weights(cfg, seed=5, bias_std=0.0)
    x = np.random.default_rng(6).normal(size=(1, D))
    bias = np.zeros(8)
    bias[[0, 2, 3]] = [3.0, 2.5, 2.5]  # group 0 = {0,1}: one star; group 1 = {2,3}: two strong experts
    idx, _ = route(x, w["gate.weight"], bias, cfg)
    assert sorted(idx[0].tolist()) == [2, 3]  # expert 0 has the best score but its group loses


def test_ties_pick_lower_index() -> None:
    cfg = dataclasses.replace(BASE, top_k=3)
    x = np.zeros((2, D))  # all logits 0 -> all scores equal
    idx, wt = route(x, np.zeros((8, D)), np.zeros(8), cfg)
    assert idx.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert np.allclose(wt, 2.446 / 3)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))


def test_compute_weights_in_the_compute_dtype_are_read_only_views():
    """Compute.w: a weight already in the compute dtype comes back as a read-only view of it (no copy: the float64
    oracle's large MoE references spent most of their time copying float64 weights), the source left writeable; a
    weight in another dtype is converted (the bf16 checkpoint's rows into float32), read-only, and cached."""
    import ml_dtypes

    from kda_rt.reference.params import Compute

    num = Compute(np.float64)
    w = np.random.default_rng(3).normal(size=(5, 7))
    got = num.w(w)
    assert np.shares_memory(got, w) and not got.flags.writeable and w.flags.writeable
    assert np.array_equal(got, w)
    with pytest.raises(ValueError):
        got[0, 0] = 1.0
    num32 = Compute(np.float32)
    b = w.astype(np.float32).astype(ml_dtypes.bfloat16)
    conv = num32.w(b)
    assert conv.dtype == np.float32 and not np.shares_memory(conv, b) and not conv.flags.writeable
    assert np.array_equal(conv, b.astype(np.float32)) and num32.w(b) is conv
