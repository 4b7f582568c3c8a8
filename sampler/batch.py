"""`SamplingBatch` (what a runner's sampler reads) and `StepOutput` (what a runner returns).

The engine builds one `SamplingBatch` per step from the sequences that sample (the rows of
`ForwardBatch.logits_indices`, same order); no backend sees a `Sequence`.  The flat arrays are
what the GPU sampler reads; `params`, `history`, `banned`, `logit_bias` and `allowed` serve the
host sampler (`reference.sample_rows`), which takes every row on the NumPy backend and the
`host_rows` (and rows with non-finite logits) on the CUDA backend.  A row with a logit_bias or a
structured-output mask is a host row.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .params import GREEDY_EPS, SamplingParams

__all__ = ["SamplingBatch", "StepOutput", "needs_host_sampling"]


def needs_host_sampling(params: SamplingParams, num_output: int) -> bool:
    """Penalties or a min_tokens ban: the GPU sampler does neither, the host sampler does both."""
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or num_output < params.min_tokens)


@dataclass(frozen=True)
class SamplingBatch:
    params: tuple[SamplingParams, ...]  # [N] each row's request settings
    seeds: np.ndarray  # [N] uint64 Philox key of the row's sample
    steps: np.ndarray  # [N] int32 index of the token being drawn (Philox counter)
    temperature: np.ndarray  # [N] float32, 0 = greedy
    top_k: np.ndarray  # [N] int32, 0 = off
    top_p: np.ndarray  # [N] float32
    min_p: np.ndarray  # [N] float32
    num_logprobs: np.ndarray  # [N] int32: -1 no logprobs, else how many top tokens besides the sampled one
    host_rows: np.ndarray  # [N] bool: penalties or bans (the host sampler's rows)
    # (prompt, output ids) of host rows: the sequence's own lists, read during this step's execute only
    history: tuple[tuple[Sequence[int], Sequence[int]] | None, ...]
    banned: tuple[tuple[int, ...], ...]  # token ids banned this step (min_tokens not reached)
    # (token ids int64 [B], biases float32 [B]) added to the row's logits, or None
    logit_bias: tuple[tuple[np.ndarray, np.ndarray] | None, ...]
    # [ceil(V / 32)] int32 bitmask of the tokens the row's grammar allows (bit t % 32 of word t // 32), or None
    allowed: tuple[np.ndarray | None, ...]

    @property
    def num_rows(self) -> int:
        return len(self.params)

    @classmethod
    def build(cls, rows: Iterable[tuple[SamplingParams, int, Sequence[int], Sequence[int]]],
              eos_token_ids: Iterable[int], allowed: Sequence[np.ndarray | None] | None = None) -> SamplingBatch:
        """rows: (params, seed, prompt ids, output ids so far) per sampling row; `allowed`: each row's
        grammar bitmask for this step, or None (no structured outputs in the batch)."""
        rows = list(rows)
        eos = tuple(sorted(eos_token_ids))
        params = tuple(r[0] for r in rows)
        allowed = tuple(allowed) if allowed is not None else (None,) * len(rows)
        bias = tuple(
            (np.fromiter(p.logit_bias.keys(), np.int64, len(p.logit_bias)),
             np.fromiter(p.logit_bias.values(), np.float32, len(p.logit_bias))) if p.logit_bias else None
            for p in params)
        host = [needs_host_sampling(p, len(out)) or b is not None or a is not None
                for (p, _, _, out), b, a in zip(rows, bias, allowed, strict=True)]
        banned = tuple(
            (*p.stop_token_ids, *(() if p.ignore_eos else eos)) if len(out) < p.min_tokens else ()
            for p, _, _, out in rows)
        return cls(
            params=params,
            seeds=np.array([s & 0xFFFFFFFFFFFFFFFF for _, s, _, _ in rows], dtype=np.uint64),
            steps=np.array([len(out) for *_, out in rows], dtype=np.int32),
            temperature=np.array([0.0 if p.temperature < GREEDY_EPS else p.temperature for p in params], np.float32),
            top_k=np.array([max(p.top_k, 0) for p in params], dtype=np.int32),
            top_p=np.array([p.top_p for p in params], dtype=np.float32),
            min_p=np.array([p.min_p for p in params], dtype=np.float32),
            num_logprobs=np.array([-1 if p.logprobs is None else p.logprobs for p in params], dtype=np.int32),
            host_rows=np.array(host, dtype=bool),
            history=tuple((prompt, out) if h else None for h, (_, _, prompt, out) in zip(host, rows, strict=True)),
            banned=banned,
            logit_bias=bias,
            allowed=allowed,
        )


@dataclass
class StepOutput:
    """One entry per sampling row: the token (or None with an error), its logprobs when asked."""

    token_ids: list[int | None]
    logprobs: list[dict[int, float] | None]
    errors: list[str | None]  # why a row could not be sampled (non-finite logits); None when it was

    @classmethod
    def empty(cls, n: int) -> StepOutput:
        return cls([None] * n, [None] * n, [None] * n)
