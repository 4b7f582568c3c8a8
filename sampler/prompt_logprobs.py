"""Prompt logprobs from a sequence's logits, row chunk by row chunk, on whichever array module holds them (NumPy
for the reference runner, CuPy for the CUDA one): row i's log-softmax in float64, the logprob and rank of target
token i, and the `num` most likely tokens.  The CUDA runner keeps the [T, vocab] logits on the GPU and brings back
only these few numbers a position (the whole float32 logits of a 2048-token prompt are 1.3 GB at the 48B shape's
163,840-token vocabulary, and their host log-softmax took seconds a prompt); the math and its float64 roundings are
the ones `LLM.prompt_logprobs` did row by row on the host before."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = ["PromptLogprobRows", "prompt_logprob_rows"]

CHUNK_BYTES = 256 << 20  # float64 scratch of one chunk of rows (its log-softmax)


class PromptLogprobRows(NamedTuple):
    """Host arrays for N rows: logprob [N] float64 of each row's target token, rank [N] int64 (1 = most likely),
    top_ids [N, num] int64 and top_logprobs [N, num] float64, most likely first."""

    logprob: np.ndarray
    rank: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def prompt_logprob_rows(logits: Any, targets: Any, num: int, xp: Any = np) -> PromptLogprobRows:
    """logits [N, V] (NumPy or CuPy, any float dtype), targets [N] ints in [0, V), num in [0, V]: per row the
    log-softmax lp = (x - max x) - log(sum(exp(x - max x))) in float64, lp[target], its rank #{lp > lp[target]} + 1
    and the `num` largest lp in descending order (ties: NumPy in argpartition's order, CuPy the lower id first).
    `xp`: the logits' module."""
    n, vocab = logits.shape
    if not 0 <= num <= vocab:
        raise ValueError(f"num must be in [0, {vocab}], got {num}")
    targets = xp.asarray(targets, dtype=xp.int64)
    if targets.shape != (n,):
        raise ValueError(f"targets must have {n} entries, got shape {tuple(targets.shape)}")
    out = PromptLogprobRows(np.empty(n, np.float64), np.empty(n, np.int64), np.empty((n, num), np.int64),
                            np.empty((n, num), np.float64))
    step = max(1, CHUNK_BYTES // (8 * max(vocab, 1)))
    host = (lambda a: a) if xp is np else (lambda a: a.get())
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        lp = logits[r0:r1].astype(xp.float64)
        lp -= lp.max(axis=1, keepdims=True)
        lp -= xp.log(xp.exp(lp).sum(axis=1, keepdims=True))
        rows = xp.arange(r1 - r0)
        mine = lp[rows, targets[r0:r1]]
        out.logprob[r0:r1] = host(mine)
        out.rank[r0:r1] = host((lp > mine[:, None]).sum(axis=1) + 1)
        if num and xp is np:
            top = np.argpartition(-lp, num - 1, axis=1)[:, :num]
            top_lp = np.take_along_axis(lp, top, axis=1)
            order = np.argsort(-top_lp, axis=1, kind="stable")
            out.top_ids[r0:r1] = np.take_along_axis(top, order, axis=1)
            out.top_logprobs[r0:r1] = np.take_along_axis(top_lp, order, axis=1)
        elif num:  # CuPy's argpartition sorts whole rows: num (<= 20 from the engine) argmax passes instead
            top = _top_by_argmax(lp, num, xp)
            out.top_ids[r0:r1] = host(top)
            out.top_logprobs[r0:r1] = host(xp.take_along_axis(lp, top, axis=1))
    return out


def _top_by_argmax(lp: Any, num: int, xp: Any) -> Any:
    """[R, num] ids of each row's `num` largest entries, largest first (ties: the lower id first), by `num` argmax
    passes over a copy with each winner set to -inf."""
    work = lp.copy()
    rows = xp.arange(lp.shape[0])
    top = xp.empty((lp.shape[0], num), dtype=xp.int64)
    for j in range(num):
        top[:, j] = work.argmax(axis=1)
        work[rows, top[:, j]] = -xp.inf
    return top
