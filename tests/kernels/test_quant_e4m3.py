"""kernels_cu/quant.cu (ops/quant.quantize_rows_e4m3) against loader/quant.quantize_rows on the same bf16 rows: the
same e4m3 codes and fp32 scales, bit for bit (weights: both divide in fp32; activations: both multiply by the
reciprocal scale rounded once, reciprocal=True; then round to nearest even and saturate at 448), and
the same refusal of non-finite entries, named by row and column.  Rows span 2^-60 .. 2^60 in magnitude and include
a zero row, a row below the zero threshold (448 x fp32's smallest normal), -0 entries, bf16's largest values and a
row with one nonzero entry; the outputs are poisoned first."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

BF = np.dtype(ml_dtypes.bfloat16)


def _rows(rng, n, k):
    w = rng.normal(size=(n, k)) * 2.0 ** rng.integers(-60, 61, size=(n, 1))
    w[0] = 0.0                                   # zero row: scale 1, codes 0
    w[1] = rng.normal(size=k) * 1e-37            # below 448 x FLT_MIN: a zero row too
    w[2, ::3] = -0.0                             # negative zeros among normal values
    w[3] = rng.choice([-1, 1], size=k) * 3.3e38  # near bf16's largest
    w[4] = 0.0
    w[4, k // 2] = -2.5                          # one nonzero entry
    return w.astype(BF)


@pytest.mark.parametrize("shape", [(64, 2304), (3, 7, 10), (5, 2)], ids=["64x2304", "3x7x10", "5x2"])
def test_quantize_rows_matches_host(shape):
    import cupy

    from kda_rt.cuda.ops.quant import quantize_rows_e4m3
    from kda_rt.loader.quant import quantize_rows

    rng = np.random.default_rng(sum(shape))
    k = shape[-1]
    w = _rows(rng, int(np.prod(shape[:-1])), k).reshape(shape)
    q = cupy.full(shape, 0x7F, dtype=np.uint8)             # the NaN code: any code left unwritten fails
    s = cupy.full(shape[:-1], np.nan, dtype=np.float32)
    quantize_rows_e4m3(cupy.asarray(w), "w", out=q, scale_out=s)
    qh, sh = quantize_rows(w.reshape(-1, k), "w")
    assert np.array_equal(cupy.asnumpy(q).reshape(-1, k), qh.view(np.uint8)), "codes differ from quantize_rows"
    assert np.array_equal(cupy.asnumpy(s).reshape(-1).view(np.uint32), sh.view(np.uint32)), "scales differ"


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_quantize_rows_refuses_non_finite(bad):
    import cupy

    from kda_rt.cuda.ops.quant import quantize_rows_e4m3

    w = np.ones((6, 8), dtype=np.float32)
    w[3, 5] = bad
    w[4, 1] = bad  # (a later one: the first in row-major order is named)
    with pytest.raises(ValueError, match=r"w13 has a non-finite entry .* at row 3, column 5"):
        quantize_rows_e4m3(cupy.asarray(w.astype(BF)), "w13")


def test_quantize_rows_refusals():
    import cupy

    from kda_rt.cuda.ops.quant import quantize_rows_e4m3

    with pytest.raises(ValueError, match="must be a bf16 array"):
        quantize_rows_e4m3(cupy.zeros((4, 8), np.float32), "w")
    with pytest.raises(ValueError, match="even row width"):
        quantize_rows_e4m3(cupy.zeros((4, 7), BF), "w")


@pytest.mark.parametrize(("shape", "offset"), [((300, 2304), 0), ((257, 1024), 0), ((257, 1024), 2), ((5, 2), 0)],
                         ids=["300x2304", "257x1024", "257x1024-offset", "5x2"])
def test_quantize_activations_matches_host(shape, offset):
    """quantize_activations_e4m3 (the prefill GEMMs' e4m3 sources: one warp a row where the width is a multiple of 8
    and x 16-byte aligned; else, as for x `offset` elements into its buffer or rows of 2, a block a row): the codes
    and scales of quantize_rows bit for bit, and a row with a non-finite entry gets a NaN scale instead of a refusal
    (its other rows as the host's)."""
    import cupy

    from kda_rt.cuda.ops.quant import quantize_activations_e4m3
    from kda_rt.loader.quant import quantize_rows

    rng = np.random.default_rng(sum(shape) + 1)
    n, k = shape
    x = _rows(rng, n, k)
    q = cupy.full(shape, 0x7F, dtype=np.uint8)
    s = cupy.full(n, -1.0, dtype=np.float32)  # (a scale is never negative)

    def on_gpu(a):
        buf = cupy.empty(a.size + offset, dtype=BF)
        buf[offset:] = cupy.asarray(a.reshape(-1))
        return buf[offset:].reshape(a.shape)

    quantize_activations_e4m3(on_gpu(x), out=q, scale_out=s)
    qh, sh = quantize_rows(x, "x", reciprocal=True)  # (the activations' rule)
    assert np.array_equal(cupy.asnumpy(q), qh.view(np.uint8)), "codes differ from quantize_rows"
    assert np.array_equal(cupy.asnumpy(s).view(np.uint32), sh.view(np.uint32)), "scales differ"
    if n > 4:
        x_bad = x.copy()
        x_bad[n - 2, k // 3] = np.inf
        quantize_activations_e4m3(on_gpu(x_bad), out=q, scale_out=s)
        s_np = cupy.asnumpy(s)
        assert np.isnan(s_np[n - 2]), "a row with a non-finite entry must get a NaN scale"
        keep = np.arange(n) != n - 2
        assert np.array_equal(s_np[keep].view(np.uint32), sh[keep].view(np.uint32)), "the other rows' scales moved"
        assert np.array_equal(cupy.asnumpy(q)[keep], qh.view(np.uint8)[keep]), "the other rows' codes moved"
