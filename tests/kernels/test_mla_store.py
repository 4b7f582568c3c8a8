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

from helpers.gpu import assert_close, bf16_round, to_np
from helpers.mla_kernel import DR, R, nan_pool, run_store, shuffled_tables, store_reference

pytestmark = pytest.mark.gpu



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
