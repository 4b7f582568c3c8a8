"""kernels_cu/mla_store.cu against NumPy: paged MLA latent rows (spec §4.4).

    row(t) = [bf16(bf16(c·rsqrt(mean(c²) + eps))·w) | k_pe],  c = kv_a[t, :R], k_pe = kv_a[t, R:]
    kv_pool[table[b, pos // S], pos % S] = row(t),  pos = context_lens[b] + t - cu_seqlens[b]

Tolerance: latent within 1 bf16 ulp (rtol 2^-7, atol 1e-6: same rounding points, only the fp32
summation order of mean(c²) differs); k_pe bit-exact; every row not written must keep its NaN
poison (catches writes to unowned pages).  Letters: T tokens, B sequences, S page size,
R latent rank (512), Dr k_pe width (64), M page slots per sequence.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_helpers import BF16, assert_close, bf16_round, poison, to_gpu_bf16, to_np

pytestmark = pytest.mark.gpu

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


@pytest.mark.parametrize("block_size", [16, 64], ids=lambda s: f"S{s}")
@pytest.mark.parametrize("lens, ctx", [((1, 5, 64, 130), (0, 0, 0, 0)), ((1, 5, 64, 130), (70, 3, 17, 0)),
                                       ((0, 3, 1), (5, 64, 127))], ids=["fresh", "with-context", "empty-seq"])
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
def test_mla_store(block_size, lens, ctx, strided):
    rng = np.random.default_rng(block_size + sum(lens) + sum(ctx) + strided)
    totals = [c + n for c, n in zip(ctx, lens, strict=True)]
    tables, num_blocks = shuffled_tables(rng, totals, block_size)
    kv_a = bf16_round(rng.normal(size=(sum(lens), R + DR)) * 2)
    w = bf16_round(1 + 0.2 * rng.normal(size=R))
    pool = run_store(kv_a, w, nan_pool(num_blocks, block_size), lens, ctx, tables, strided=strided)
    got = to_np(pool)
    ref = store_reference(kv_a, w)
    written = np.zeros(got.shape[:2], bool)
    t = 0
    for b, (n, c) in enumerate(zip(lens, ctx, strict=True)):
        pos = np.arange(c, c + n)
        page, row = tables[b, pos // block_size], pos % block_size
        assert_close(got[page, row, :R], ref[t:t + n, :R], atol=1e-6, rtol=2.0**-7, name=f"latent of seq {b}")
        assert np.array_equal(got[page, row, R:], ref[t:t + n, R:]), f"k_pe of seq {b} must be copied exactly"
        written[page, row] = True
        t += n
    assert np.isnan(got[~written]).all(), "mla_store wrote rows it does not own"


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v"]))
