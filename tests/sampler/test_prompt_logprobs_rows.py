"""sampler/prompt_logprobs.py: prompt logprobs reduced a chunk of rows at a time (NumPy here; CuPy on the CUDA
runner) against the row-by-row host computation `LLM.prompt_logprobs` did before, on fresh random logits."""

from __future__ import annotations

import numpy as np
import pytest

import kda_rt.sampler.prompt_logprobs as pl


def row_by_row(logits: np.ndarray, targets: np.ndarray, num: int):
    """The earlier host loop: float64 log-softmax of each row, the target's logprob and rank, the top `num`."""
    out = []
    for row, token in zip(logits, targets, strict=True):
        lp = row.astype(np.float64) - row.astype(np.float64).max()
        lp -= np.log(np.exp(lp).sum())
        top = np.argpartition(-lp, num - 1)[:num] if num else np.zeros(0, np.int64)
        top = top[np.argsort(-lp[top], kind="stable")]
        out.append((lp[token], int((lp > lp[token]).sum()) + 1, lp[top]))
    return out


@pytest.mark.parametrize("num", [0, 1, 5, 64])
@pytest.mark.parametrize("chunk_rows", [1, 7, 1000])
def test_rows_equal_the_row_by_row_computation(num, chunk_rows, monkeypatch):
    """Logprob, rank and the top `num` logprobs bit for bit the row-by-row loop's (the same float64 operations in
    the same order), whatever the chunk (one row, a chunk that does not divide the rows, all rows in one); the top
    ids are the tokens with those logprobs.  Logits with a wide spread (scale 8) so ranks vary; float32 as the
    runners give them."""
    V, N = 64, 23
    monkeypatch.setattr(pl, "CHUNK_BYTES", 8 * V * chunk_rows)
    rng = np.random.default_rng(100 * num + chunk_rows)
    logits = (rng.standard_normal((N, V)) * 8).astype(np.float32)
    targets = rng.integers(0, V, N)
    got = pl.prompt_logprob_rows(logits, targets, num)
    for i, (lp, rank, top_lp) in enumerate(row_by_row(logits, targets, num)):
        assert got.logprob[i] == lp and got.rank[i] == rank, i
        np.testing.assert_array_equal(got.top_logprobs[i], top_lp)
        ref = logits[i].astype(np.float64) - logits[i].astype(np.float64).max()
        ref -= np.log(np.exp(ref).sum())
        np.testing.assert_array_equal(ref[got.top_ids[i]], got.top_logprobs[i])
    assert got.rank.min() >= 1 and got.rank.max() > 1  # (the draw gives ranks beyond the first)


def test_rows_edges_and_refusals():
    """No rows (a one-token prompt): empty arrays; a target that is the row's argmax: rank 1; num past the vocabulary
    or a targets count that does not match: ValueError naming it."""
    empty = pl.prompt_logprob_rows(np.zeros((0, 8), np.float32), np.zeros(0, np.int64), 3)
    assert empty.logprob.shape == (0,) and empty.top_ids.shape == (0, 3)
    logits = np.array([[0.0, 5.0, 1.0, -2.0]], np.float32)
    got = pl.prompt_logprob_rows(logits, [1], 4)
    assert got.rank[0] == 1 and got.top_ids[0].tolist() == [1, 2, 0, 3]
    assert np.isclose(np.exp(got.top_logprobs[0]).sum(), 1.0, rtol=1e-12)  # the whole distribution
    with pytest.raises(ValueError, match="num must be in"):
        pl.prompt_logprob_rows(logits, [1], 5)
    with pytest.raises(ValueError, match="targets must have 1 entries"):
        pl.prompt_logprob_rows(logits, [1, 2], 1)


def test_top_by_argmax_the_cupy_paths_selection():
    """The CuPy path's top-N (`_top_by_argmax`: N argmax passes, CuPy's argpartition sorting whole rows), run here on
    NumPy arrays (the same calls): the N largest values of each row, largest first, tied values by ascending id,
    and the row left as it was."""
    rng = np.random.default_rng(9)
    lp = np.round(rng.standard_normal((6, 200)), 1)  # (rounded: many ties)
    before = lp.copy()
    top = pl._top_by_argmax(lp, 7, np)
    np.testing.assert_array_equal(lp, before)
    np.testing.assert_array_equal(np.take_along_axis(lp, top, 1), -np.sort(-lp, axis=1)[:, :7])
    for row, ids in zip(lp, top, strict=True):
        for a, b in zip(ids, ids[1:], strict=False):
            assert row[a] > row[b] or (row[a] == row[b] and a < b)


@pytest.mark.gpu
def test_rows_on_cupy_equal_numpy():
    """The CUDA runner's path (xp = CuPy, the logits on the GPU): the same float64 log-softmax, so logprobs within
    1e-12 of NumPy's (the GPU's sum order differs: float64 roundings of a 163,840-term sum) and the same ranks and
    top ids where the logprobs are not within that of each other; chunks smaller than the rows."""
    import cupy

    V, N, num = 163840, 40, 5
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((N, V)) * 4).astype(np.float32)
    targets = rng.integers(0, V, N)
    want = pl.prompt_logprob_rows(logits, targets, num)
    got = pl.prompt_logprob_rows(cupy.asarray(logits), cupy.asarray(targets), num, xp=cupy)
    np.testing.assert_allclose(got.logprob, want.logprob, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got.top_logprobs, want.top_logprobs, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(got.rank, want.rank)
    np.testing.assert_array_equal(got.top_ids, want.top_ids)  # (standard normals: no ties among the top 5)
