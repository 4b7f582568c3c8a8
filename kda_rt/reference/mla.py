"""MLA (multi-head latent attention, NoPE) mixer over a paged latent-KV pool (spec §4).

Per new token t (absolute position c+i of its sequence, c = context_lens[b]):

    q        = x · W_qᵀ                  [H, Dn+Dr]   per head [nope | pe]
    ckv      = x · W_kvaᵀ                [R+Dr]       [latent | k_pe]
    c_lat    = RMSNorm(ckv[:R]; kv_a_layernorm.weight, 1e-6)       k_pe stays raw, shared by heads
    pool row = [c_lat | k_pe]  written at position c+i through the block table
    score_h[τ] = s · (q_nope_h · k_nope_h[τ] + q_pe_h · k_pe[τ]),  τ = 0..c+i,  s = (Dn+Dr)^(-1/2)
    o_h      = Σ_τ softmax(score_h)[τ] · v_h[τ];   out = concat_h(o_h) · W_oᵀ

with k_nope_h = W_UK_h · c_lat, v_h = W_UV_h · c_lat (W_kvb per head = [W_UK_h (Dn rows) | W_UV_h
(Dv rows)]).  Prefill chunks (n > 1 new tokens) expand k_nope / v for every cached position;
decode (n == 1) uses the absorbed form of §4.3, attending directly over the latents:

    q_lat_h = W_UK_hᵀ · q_nope_h  [R];   score_h[τ] = s · (q_lat_h · c_lat[τ] + q_pe_h · k_pe[τ])
    ctx_h   = Σ_τ p_h[τ] c_lat[τ] [R];   o_h = W_UV_h · ctx_h

NoPE: no rotary embedding anywhere; positions only enter through the causal mask.  Every
attended row, including the tokens of this step, is read back from the pool, so prefill and
decode see identically rounded cache entries whatever the pool dtype.

Letters: T tokens in the batch, H heads, Dn/Dr/Dv nope/pe/value head dims, R latent rank,
L cached positions of one sequence, Q query rows of one block, P pages, S page (block) size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kda_rt.reference.layers import rms_norm
from kda_rt.reference.params import Compute

if TYPE_CHECKING:
    from kda_rt.engine.batch import ForwardBatch
    from kda_rt.loader.config import MLAConfig
    from kda_rt.loader.schema import MLAWeights

__all__ = ["mla_forward", "paged_positions"]

# Prefill queries are processed in blocks of this many rows so the [H, Q, L] score tensor stays
# bounded for long prompts (32 heads × 256 × 8192 × 4 B = 256 MiB at most).
_QUERY_BLOCK = 256


def paged_positions(
    table: np.ndarray, positions: np.ndarray, num_blocks: int, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(page ids, row offsets) of absolute token `positions` through one sequence's block table.

    table: [M] int32 page ids (-1 unused).  Raises ValueError when a position falls on a missing page.
    """
    slot = positions // block_size
    if positions.size and int(slot.max()) >= table.shape[0]:
        raise ValueError(f"MLA: position {int(positions.max())} needs page slot {int(slot.max())} "
                         f"but the block table has only {table.shape[0]} entries")
    pages = table[slot].astype(np.int64)
    bad = (pages < 0) | (pages >= num_blocks)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"MLA: position {int(positions[i])} maps to invalid page id {int(pages[i])} "
                         f"(pool has {num_blocks} pages)")
    return pages, positions % block_size


def _softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis with max subtraction; -inf entries get probability 0."""
    m = np.max(scores, axis=-1, keepdims=True)
    e = np.exp(scores - m)
    return e / np.sum(e, axis=-1, keepdims=True)


def _attend_expanded(q: np.ndarray, cached: np.ndarray, w_uk: np.ndarray, w_uv: np.ndarray,
                     start: int, cfg: MLAConfig, scale: float) -> np.ndarray:
    """Causal attention of n new queries (positions start..start+n-1) over `cached` rows 0..L-1.

    q: [n, H, Dn+Dr], cached: [L, R+Dr], w_uk: [H, Dn, R], w_uv: [H, Dv, R] -> [n, H, Dv].
    """
    R, Dn = cfg.kv_lora_rank, cfg.qk_nope_head_dim
    c_lat, k_pe = cached[:, :R], cached[:, R:]  # [L, R], [L, Dr]
    k_nope = np.einsum("lr,hdr->hld", c_lat, w_uk)  # [H, L, Dn]
    v = np.einsum("lr,hdr->hld", c_lat, w_uv)  # [H, L, Dv]
    q_nope = q[:, :, :Dn].transpose(1, 0, 2)  # [H, n, Dn]
    q_pe = q[:, :, Dn:].transpose(1, 0, 2)  # [H, n, Dr]
    n, L = q.shape[0], cached.shape[0]
    out = np.empty((n, cfg.num_heads, cfg.v_head_dim), dtype=q.dtype)
    for lo in range(0, n, _QUERY_BLOCK):
        hi = min(n, lo + _QUERY_BLOCK)
        keys = min(L, start + hi)  # the block's last query sees rows 0 .. start + hi - 1: later rows weigh 0
        scores = (q_nope[:, lo:hi] @ k_nope[:, :keys].transpose(0, 2, 1) + q_pe[:, lo:hi] @ k_pe[:keys].T) * scale
        qpos = start + np.arange(lo, hi)[:, None]  # [Q, 1]
        scores = np.where(np.arange(keys)[None, :] <= qpos, scores, -np.inf)  # [H, Q, keys]
        out[lo:hi] = (_softmax(scores) @ v[:, :keys]).transpose(1, 0, 2)  # [Q, H, Dv]
    return out


def _attend_absorbed(q: np.ndarray, cached: np.ndarray, w_uk: np.ndarray, w_uv: np.ndarray,
                     cfg: MLAConfig, scale: float) -> np.ndarray:
    """One decode query (the last cached position) over all cached rows, absorbed form.

    q: [H, Dn+Dr], cached: [L, R+Dr] -> [H, Dv].
    """
    R, Dn = cfg.kv_lora_rank, cfg.qk_nope_head_dim
    c_lat, k_pe = cached[:, :R], cached[:, R:]  # [L, R], [L, Dr]
    q_lat = np.einsum("hd,hdr->hr", q[:, :Dn], w_uk)  # [H, R]
    scores = (q_lat @ c_lat.T + q[:, Dn:] @ k_pe.T) * scale  # [H, L]
    ctx = _softmax(scores) @ c_lat  # [H, R]
    return np.einsum("hr,hdr->hd", ctx, w_uv)  # [H, Dv]


def mla_forward(w: MLAWeights, x: np.ndarray, batch: ForwardBatch, kv_pool: np.ndarray, cfg: MLAConfig,
                num: Compute | None = None) -> np.ndarray:
    """MLA mixer for a varlen batch.  Writes this step's latent rows into `kv_pool` in place.

    w: one layer's self_attn weights; x: [T, D] normed hidden; kv_pool: [P, S, R+Dr] pages of this
    layer; num: compute dtype and bf16 rounding (default: x's dtype, no rounding).  Returns [T, D].
    """
    H, Dn, Dr, Dv, R = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    T = x.shape[0]
    num_blocks, block_size, width = kv_pool.shape
    if width != R + Dr:
        raise ValueError(f"MLA: kv_pool rows are {width} wide, expected kv_lora_rank + qk_rope_head_dim = {R + Dr}")
    scale = float(Dn + Dr) ** -0.5

    num = num or Compute(x.dtype)
    p, act = num.w, num.act  # act: bf16 rounding points (identity unless emulating bf16)
    q = act(num.dense(x, w.q_proj)).reshape(T, H, Dn + Dr)  # [T, H, Dn+Dr]
    ckv = act(num.dense(x, w.kv_a_proj_with_mqa))  # [T, R+Dr]
    c_lat = rms_norm(ckv[:, :R], p(w.kv_a_layernorm), cfg.kv_a_layernorm_eps, act)  # [T, R]
    rows = np.concatenate([c_lat, ckv[:, R:]], axis=-1)  # [T, R+Dr] pool rows
    w_kvb = p(w.kv_b_proj).reshape(H, Dn + Dv, R)
    w_uk, w_uv = w_kvb[:, :Dn], w_kvb[:, Dn:]  # [H, Dn, R], [H, Dv, R]

    out = np.empty((T, H, Dv), dtype=x.dtype)
    for b in range(batch.num_seqs):
        s, e = int(batch.cu_seqlens[b]), int(batch.cu_seqlens[b + 1])
        n, start = e - s, int(batch.context_lens[b])
        table = batch.block_tables[b]
        pages, offs = paged_positions(table, np.arange(start, start + n), num_blocks, block_size)
        kv_pool[pages, offs] = rows[s:e]
        pages, offs = paged_positions(table, np.arange(start + n), num_blocks, block_size)
        cached = kv_pool[pages, offs].astype(x.dtype)  # [L, R+Dr]
        if n == 1:
            out[s] = _attend_absorbed(q[s], cached, w_uk, w_uv, cfg, scale)
        else:
            out[s:e] = _attend_expanded(q[s:e], cached, w_uk, w_uv, start, cfg, scale)
    return num.dense(act(out).reshape(T, H * Dv), w.o_proj)
