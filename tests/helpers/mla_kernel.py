"""Paged-pool set-up shared by the mla_store and mla_attn kernel tests: shuffled page tables, a
NaN-poisoned latent pool, and `run_store` (tests/kernels/test_mla_store.py has the formula).  CuPy is
imported inside the functions.  Letters: T tokens, B sequences, S page size, M page slots per
sequence, R latent rank (512), Dr k_pe width (64).
"""

from __future__ import annotations

import numpy as np

from helpers.gpu import BF16, bf16_round, poison, to_gpu_bf16

__all__ = ["DR", "EPS", "R", "bench_decode_inputs", "nan_pool", "run_store", "shuffled_tables", "store_reference"]

R, DR = 512, 64
EPS = 1e-6


def shuffled_tables(rng, totals, block_size, spare_pages=7, spare_slots=2):
    """Disjoint shuffled page lists; returns (tables [B, M] int32 with -1 padding, num_blocks)."""
    need = [-(-n // block_size) for n in totals]
    num_blocks = sum(need) + spare_pages
    perm = rng.permutation(num_blocks)
    M = max(need) + spare_slots
    tables = np.full((len(totals), M), -1, np.int32)
    at = 0
    for b, k in enumerate(need):
        tables[b, :k] = perm[at:at + k]
        at += k
    return tables, num_blocks


def store_reference(kv_a, w):
    """Expected pool rows [T, R+Dr] (float64 of bf16) for raw rows kv_a [T, R+Dr] (bf16 values)."""
    c = kv_a[:, :R]
    inv = 1.0 / np.sqrt(np.mean(c.astype(np.float32) ** 2, axis=-1, keepdims=True) + EPS)
    return np.concatenate([bf16_round(bf16_round(c * inv) * w), kv_a[:, R:]], axis=-1)


def run_store(kv_a_np, w_np, pool, lens, ctx, tables, *, strided=False):
    """Upload and call mla_store for sequences with new-token counts `lens` after `ctx` cached rows."""
    import cupy

    from kda_rt.cuda.ops.mla_store import mla_store

    T = kv_a_np.shape[0]
    if strided:  # kv_a as a column slice of a fused q|kv_a projection output
        fused = to_gpu_bf16(np.zeros((T, 384 + R + DR + 24)))
        fused[:, 384:384 + R + DR] = to_gpu_bf16(kv_a_np)
        kv_a = fused[:, 384:384 + R + DR]
    else:
        kv_a = to_gpu_bf16(kv_a_np)
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    mla_store(kv_a, to_gpu_bf16(w_np), EPS, pool, cu, cupy.asarray(np.asarray(ctx, np.int32)), cupy.asarray(tables))
    return pool


def nan_pool(num_blocks, block_size):
    import cupy

    pool = cupy.empty((num_blocks, block_size, R + DR), dtype=BF16)
    poison(pool)  # spare pages and unwritten rows stay NaN: any read or write of them shows
    return pool


# -- MLA attention cases (test_mla_attn, test_mla_prefill) ----------------------------------------

DN, DV = 128, 128
SCALE = (DN + DR) ** -0.5
TOL = 1e-2


def make_case(seed, H, block_size, lens, ctx):
    """Pool with `ctx` earlier rows then `lens` new rows per sequence (all via mla_store), q, w_kvb."""
    rng = np.random.default_rng(seed)
    totals = [c + n for c, n in zip(ctx, lens, strict=True)]
    tables, num_blocks = shuffled_tables(rng, totals, block_size)
    pool = nan_pool(num_blocks, block_size)
    w = bf16_round(1 + 0.2 * rng.normal(size=R))
    if sum(ctx):
        run_store(bf16_round(rng.normal(size=(sum(ctx), R + DR))), w, pool, ctx, [0] * len(ctx), tables)
    run_store(bf16_round(rng.normal(size=(sum(lens), R + DR))), w, pool, lens, ctx, tables)
    q = bf16_round(rng.normal(size=(sum(lens), H, DN + DR)) * 1.5)
    w_kvb = bf16_round(rng.normal(size=(H * (DN + DV), R)) / np.sqrt(R))
    return q, pool, w_kvb, tables


def reference(q, pool_np, w_kvb, tables, lens, ctx, block_size, H):
    from kda_rt.loader.config import MLAConfig
    from kda_rt.reference.mla import _attend_absorbed, _attend_expanded

    cfg = MLAConfig(num_heads=H, kv_lora_rank=R, qk_nope_head_dim=DN, qk_rope_head_dim=DR, v_head_dim=DV)
    w = w_kvb.reshape(H, DN + DV, R)
    out, t = [], 0
    for b, (n, c) in enumerate(zip(lens, ctx, strict=True)):
        pos = np.arange(c + n)
        cached = pool_np[tables[b, pos // block_size], pos % block_size]
        if n == 1:
            out.append(_attend_absorbed(q[t], cached, w[:, :DN], w[:, DN:], cfg, SCALE)[None])
        else:
            out.append(_attend_expanded(q[t:t + n], cached, w[:, :DN], w[:, DN:], c, cfg, SCALE))
        t += n
    return np.concatenate(out).reshape(t, H * DV)


def device_meta(lens, ctx, tables):
    import cupy

    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return cupy.asarray(cu), cupy.asarray(np.asarray(ctx, np.int32)), cupy.asarray(tables)


def upload_q(q, strided):
    """q as [T, H, Dn+Dr], or as a column slice of a fused [T, H·(Dn+Dr) + 576 + 8] projection."""
    T, H, D = q.shape
    if not strided:
        return to_gpu_bf16(q)
    fused = to_gpu_bf16(np.zeros((T, H * D + R + DR + 8)))
    fused[:, :H * D] = to_gpu_bf16(q.reshape(T, H * D))
    return fused[:, :H * D]


def bench_decode_inputs(B, L, H=32, page=64, seed=0, scattered=False):
    """Device inputs of an absorbed MLA decode call for the device tools (bench_decode_sweep.py, ncu_mla_decode.sh):
    B sequences whose context is L positions (ctx = L - 1 earlier rows plus this step's token) in pages of `page`
    rows of a random bf16 pool (drawn on the GPU, never zeros), tables in order or (`scattered`) a permutation of
    the pages.  Returns dict(q, pool, w_kvb, cu, ctx, tables, M)."""
    import cupy

    M = -(-L // page) + 1
    rng = cupy.random.default_rng(seed)
    pool = rng.standard_normal((B * M, page, R + DR), dtype=np.float32).astype(BF16)
    order = np.random.default_rng(seed).permutation(B * M) if scattered else np.arange(B * M)
    return dict(q=rng.standard_normal((B, H, DN + DR), dtype=np.float32).astype(BF16), pool=pool,
                w_kvb=(rng.standard_normal((H * (DN + DV), R), dtype=np.float32) / 23).astype(BF16),
                cu=cupy.arange(B + 1, dtype=np.int32), ctx=cupy.full((B,), L - 1, dtype=np.int32),
                tables=cupy.asarray(order.astype(np.int32).reshape(B, M)), M=M)
