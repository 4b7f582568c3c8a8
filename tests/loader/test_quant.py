"""loader/quant.py: e4m3 weights with one fp32 scale a row, against the format's definition.

Tolerance: a normal e4m3 value carries 3 mantissa bits, so rounding w / scale to it errs by at most half an ulp,
2^-4 of its magnitude; below e4m3's smallest normal (2^-6) the step is the subnormal one, 2^-9.  So
|dequantized - w| <= 2^-4 |w| + 2^-10 scale for every entry (a bound, not a fit: a wrong scale or a clipped
row breaks it by orders of magnitude)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kda_rt.loader.quant import E4M3, E4M3_MAX, dequantize_rows, quantize_rows


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16])
def test_quantize_rows_round_trip_within_half_an_ulp(dtype):
    rng = np.random.default_rng(3)
    w = (rng.normal(size=(64, 200)) * 2.0 ** rng.integers(-20, 20, size=(64, 1))).astype(dtype)
    q, scale = quantize_rows(w, "w")
    assert q.dtype == E4M3 and q.shape == w.shape and scale.dtype == np.float32 and scale.shape == (64,)
    w32 = w.astype(np.float32)
    assert np.all(np.abs(q.astype(np.float32)).max(axis=1) == E4M3_MAX), "each row should reach e4m3's largest value"
    err = np.abs(dequantize_rows(q, scale) - w32)
    assert np.all(err <= 2.0**-4 * np.abs(w32) + 2.0**-10 * scale[:, None]), float(err.max())


def test_quantize_rows_zero_rows_and_edges():
    w = np.zeros((3, 16), np.float32)
    w[1, 5] = -1e-30  # a tiny row: the scale follows it, the value stays exact at the row's top
    w[2, :] = np.float32(3.4e38)  # near fp32's largest: scale finite, every entry 448
    q, scale = quantize_rows(w)
    assert scale[0] == 1.0 and not q[0].astype(np.float32).any()
    assert q[1, 5].astype(np.float32) == -E4M3_MAX and np.isfinite(scale).all()
    assert np.all(q[2].astype(np.float32) == E4M3_MAX)
    assert not np.isnan(q.astype(np.float32)).any()
    # rows below 448 x fp32's smallest normal (~5e-36): zero rows (scale 1, q 0), never NaN from a subnormal scale
    t = np.zeros((2, 4), np.float32)
    t[0, 0], t[1, 1] = 1e-44, -3e-36
    q, scale = quantize_rows(t)
    assert scale.tolist() == [1.0, 1.0] and not q.astype(np.float32).any()


def test_quantize_rows_reciprocal_rule_moves_only_ties_by_one_step():
    """reciprocal=True (the activations' rule: w · (1 / scale), the reciprocal rounded once) gives the quotient
    rule's codes except where w / scale lies within an fp32 ulp or two of a point halfway between two e4m3 values:
    there it may take the neighbouring code, one step away.  Also on the edge rows above (zero, tiny, near fp32's
    top) it keeps the same scales and never makes NaN."""
    rng = np.random.default_rng(5)
    w = (rng.normal(size=(256, 1024)) * 2.0 ** rng.integers(-20, 20, size=(256, 1))).astype(ml_dtypes.bfloat16)
    qd, sd = quantize_rows(w, "w")
    qr, sr = quantize_rows(w, "w", reciprocal=True)
    assert np.array_equal(sd, sr)
    a, b = qd.astype(np.float32), qr.astype(np.float32)
    moved = a != b
    assert moved.mean() < 1e-3, f"{moved.mean():.2e} of the codes moved"
    step = np.abs(a[moved] - b[moved]) / np.maximum(np.abs(a[moved]), np.abs(b[moved]))
    assert np.all(step <= 2.0**-2), "a moved code went further than one e4m3 step"
    w32 = w.astype(np.float32)
    expect = np.clip(w32 * (np.float32(1) / sr)[:, None], -E4M3_MAX, E4M3_MAX).astype(E4M3).astype(np.float32)
    assert np.array_equal(b, expect)
    assert moved.any(), "the two rules gave the same codes on every entry: is reciprocal=True taken?"
    e = np.zeros((4, 16), np.float32)
    e[1, 5], e[2, :], e[3, 1] = -1e-30, np.float32(3.4e38), -3e-36  # row 3: below 448 x fp32's smallest normal
    q, scale = quantize_rows(e, reciprocal=True)
    assert scale[0] == 1.0 and q[1, 5].astype(np.float32) == -E4M3_MAX and np.all(q[2].astype(np.float32) == E4M3_MAX)
    assert scale[3] == 1.0 and not q[3].astype(np.float32).any()
    assert not np.isnan(q.astype(np.float32)).any()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantize_rows_refuses_non_finite_entries_by_name_and_place(bad):
    w = np.ones((4, 8), np.float32)
    w[2, 3] = bad
    with pytest.raises(ValueError, match=r"experts\.w2 has a non-finite entry .* row 2, column 3"):
        quantize_rows(w, "experts.w2")


def test_quantize_rows_refuses_entries_outside_float32_by_name_and_place():
    w = np.ones((3, 5))
    w[1, 4] = 1e39
    with pytest.raises(ValueError, match=r"w13 has an entry outside float32's range .* row 1, column 4"):
        quantize_rows(w, "w13")


def test_quantize_rows_refuses_other_shapes_and_dtypes():
    with pytest.raises(ValueError, match="2-D float"):
        quantize_rows(np.ones(8, np.float32))
    with pytest.raises(ValueError, match="2-D float"):
        quantize_rows(np.ones((2, 8), np.int32))
    with pytest.raises(ValueError, match="e4m3"):
        dequantize_rows(np.ones((2, 8), np.float32), np.ones(2, np.float32))
