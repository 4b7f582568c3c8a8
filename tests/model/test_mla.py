"""MLA mixer over the paged latent pool vs. a dense float64 reference (spec §4).

Reference: the expanded form of §4.1 over the whole sequence at once, no cache:

    c = RMSNorm(x·W_kva[:R]ᵀ), k_pe = x·W_kva[R:]ᵀ, [k_nope|v]_h = c·W_kvb_hᵀ,
    o_h[t] = Σ_{τ≤t} softmax_τ(s·(q_nope_h[t]·k_nope_h[τ] + q_pe_h[t]·k_pe[τ])) v_h[τ],  out = o·W_oᵀ

Checks: decode steps (absorbed form) and chunked prefill (expanded form over pages) both equal
the reference to 1e-10 in float64, with block sizes 4 / 16 and shuffled, non-contiguous page
tables, several sequences per batch.  Letters: T tokens, H heads, R latent rank.
"""

from __future__ import annotations

import numpy as np
import pytest

from kda_rt.engine.batch import ForwardBatch
from kda_rt.loader.config import MLAConfig
from kda_rt.loader.schema import MLAWeights, Reader
from kda_rt.reference.mla import mla_forward

CFG = MLAConfig(num_heads=3, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
D = 40
TOL = 1e-10


def make_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    H, Dn, Dr, Dv, R = CFG.num_heads, CFG.qk_nope_head_dim, CFG.qk_rope_head_dim, CFG.v_head_dim, CFG.kv_lora_rank
    return {
        "q_proj.weight": rng.normal(0, 0.3, (H * (Dn + Dr), D)),
        "kv_a_proj_with_mqa.weight": rng.normal(0, 0.3, (R + Dr, D)),
        "kv_a_layernorm.weight": rng.normal(1, 0.2, (R,)),
        "kv_b_proj.weight": rng.normal(0, 0.3, (H * (Dn + Dv), R)),
        "o_proj.weight": rng.normal(0, 0.3, (D, H * Dv)),
    }


def reference(w: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Dense causal MLA of one whole sequence.  x: [T, D] -> [T, D]."""
    H, Dn, Dr, Dv, R = CFG.num_heads, CFG.qk_nope_head_dim, CFG.qk_rope_head_dim, CFG.v_head_dim, CFG.kv_lora_rank
    T = x.shape[0]
    q = (x @ w["q_proj.weight"].T).reshape(T, H, Dn + Dr)
    ckv = x @ w["kv_a_proj_with_mqa.weight"].T
    c = ckv[:, :R] / np.sqrt(np.mean(ckv[:, :R] ** 2, axis=-1, keepdims=True) + 1e-6) * w["kv_a_layernorm.weight"]
    kv = (c @ w["kv_b_proj.weight"].T).reshape(T, H, Dn + Dv)
    out = np.zeros((T, H, Dv))
    for h in range(H):
        k = np.concatenate([kv[:, h, :Dn], ckv[:, R:]], axis=-1)  # [T, Dn+Dr]
        scores = q[:, h] @ k.T / np.sqrt(Dn + Dr)
        scores[np.triu_indices(T, 1)] = -np.inf
        prob = np.exp(scores - scores.max(axis=-1, keepdims=True))
        prob /= prob.sum(axis=-1, keepdims=True)
        out[:, h] = prob @ kv[:, h, Dn:]
    return out.reshape(T, H * Dv) @ w["o_proj.weight"].T


def shuffled_tables(rng: np.random.Generator, lens: list[int], block_size: int) -> tuple[list[list[int]], int]:
    """Disjoint, shuffled page lists per sequence (with spare unused pages in the pool)."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 5
    pages = rng.permutation(num_blocks).tolist()
    tables, at = [], 0
    for k in need:
        tables.append(pages[at:at + k])
        at += k
    return tables, num_blocks


def run_schedule(w, xs: list[np.ndarray], steps: list[list[int]], block_size: int, seed: int) -> list[np.ndarray]:
    """Feed sequence b its tokens in pieces of steps[j][b] (0 = idle that step); return per-sequence outputs."""
    rng = np.random.default_rng(seed)
    tables, num_blocks = shuffled_tables(rng, [len(x) for x in xs], block_size)
    pool = np.full((num_blocks, block_size, CFG.cache_width), np.nan)  # NaN: unwritten rows must never be read
    done = [0] * len(xs)
    outs = [np.zeros_like(x) for x in xs]
    for step in steps:
        active = [b for b, n in enumerate(step) if n > 0]
        batch = ForwardBatch.build(
            [[0] * step[b] for b in active], [done[b] for b in active], list(range(len(active))), [tables[b] for b in active]
        )
        x = np.concatenate([xs[b][done[b]:done[b] + step[b]] for b in active])
        y = mla_forward(MLAWeights.read(Reader(w), CFG, D), x, batch, pool, CFG)
        for j, b in enumerate(active):
            outs[b][done[b]:done[b] + step[b]] = y[batch.cu_seqlens[j]:batch.cu_seqlens[j + 1]]
            done[b] += step[b]
    assert done == [len(x) for x in xs]
    return outs


def check(outs: list[np.ndarray], w, xs: list[np.ndarray]) -> None:
    for out, x in zip(outs, xs, strict=True):
        ref = reference(w, x)
        err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
        assert err <= TOL, f"max rel err {err:.3e}"


@pytest.mark.parametrize("block_size", [4, 16], ids=lambda s: f"bs{s}")
def test_decode_absorbed_matches_expanded(block_size: int) -> None:
    w = make_weights(1)
    rng = np.random.default_rng(2)
    prompts, decode = [7, 13, 1], 21  # decode crosses several page boundaries
    xs = [rng.normal(size=(p + decode, D)) for p in prompts]
    steps = [prompts] + [[1, 1, 1]] * decode
    check(run_schedule(w, xs, steps, block_size, seed=3), w, xs)


@pytest.mark.parametrize("block_size", [4, 16], ids=lambda s: f"bs{s}")
def test_chunked_prefill_matches_one_shot(block_size: int) -> None:
    w = make_weights(4)
    rng = np.random.default_rng(5)
    xs = [rng.normal(size=(n, D)) for n in (45, 30)]
    one_shot = run_schedule(w, xs, [[45, 30]], block_size, seed=6)
    chunked = run_schedule(w, xs, [[10, 7], [3, 0], [17, 1], [15, 22]], block_size, seed=7)
    check(one_shot, w, xs)
    check(chunked, w, xs)
    for a, b in zip(one_shot, chunked, strict=True):
        assert np.max(np.abs(a - b)) <= TOL * np.max(np.abs(a))


def test_mixed_prefill_and_decode_batch() -> None:
    w = make_weights(8)
    rng = np.random.default_rng(9)
    xs = [rng.normal(size=(n, D)) for n in (12, 9, 20)]
    steps = [[5, 9, 0], [1, 0, 8], [1, 0, 1], [5, 0, 11]]  # decode rows beside prefill chunks
    check(run_schedule(w, xs, steps, 4, seed=10), w, xs)


def test_missing_page_raises() -> None:
    w = make_weights(0)
    pool = np.zeros((4, 4, CFG.cache_width))
    batch = ForwardBatch.build([[0] * 6], [0], [0], [[2]])  # 6 tokens need two pages, table has one
    with pytest.raises(ValueError, match="block table"):
        mla_forward(MLAWeights.read(Reader(w), CFG, D), np.zeros((6, D)), batch, pool, CFG)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
