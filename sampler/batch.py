"""`SamplingBatch` (what a runner's sampler reads) and `StepOutput` (what a runner returns).

The engine builds one `SamplingBatch` per step from the sequences that sample (the rows of
`ForwardBatch.logits_indices`, same order); no backend sees a `Sequence`.  The flat arrays are
what the GPU sampler reads; `params`, `history`, `banned`, `logit_bias` and `allowed` serve the
host sampler (`reference.sample_rows`), which takes every row on the NumPy backend and the
`host_rows` (and rows with non-finite logits) on the CUDA backend.  A row with a logit_bias,
allowed_token_ids or bad_words is a host row; a structured-output mask is applied by the GPU sampler
itself (its bitmask is uploaded).

The masks may be given lazily (a callable): the CUDA runner asks for them only after it has launched
the forward pass, so the grammar work on the host overlaps the GPU's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .params import GREEDY_EPS, SamplingParams

__all__ = ["SamplingBatch", "StepOutput", "bad_word_bans", "needs_host_sampling"]

_F32_MAX = float(np.finfo(np.float32).max)


def needs_host_sampling(params: SamplingParams, num_output: int) -> bool:
    """Penalties, a min_tokens ban, a logit_bias, allowed_token_ids or bad_words: the GPU sampler does none of them,
    the host sampler all."""
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or num_output < params.min_tokens or bool(params.logit_bias) or params.allowed_token_ids is not None
            or bool(params.bad_words_token_ids))


def bad_word_bans(params: SamplingParams, output_ids) -> list[int]:
    """The last token of each bad word whose other tokens end the output so far (vLLM's bad-words rule: a
    one-token word is always banned)."""
    bans = []
    for word in params.bad_words_token_ids:
        k = len(word) - 1
        if k <= len(output_ids) and all(output_ids[len(output_ids) - k + j] == word[j] for j in range(k)):
            bans.append(word[-1])
    return bans


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
    constrained: np.ndarray  # [N] bool: the row has a grammar mask (`allowed`)
    # each row's [ceil(V / 32)] int32 bitmask of allowed tokens (bit t % 32 of word t // 32) or None; or a
    # callable returning that sequence, called once when `allowed` is first read
    masks: Sequence[np.ndarray | None] | Callable[[], Sequence[np.ndarray | None]] | None = None

    @property
    def num_rows(self) -> int:
        return len(self.params)

    @property
    def allowed(self) -> tuple[np.ndarray | None, ...]:
        """Each row's grammar bitmask or None (computed now if the masks were given lazily)."""
        masks = self.masks
        if callable(masks):
            masks = masks()
        masks = tuple(masks) if masks is not None else (None,) * self.num_rows
        if len(masks) != self.num_rows or any((m is not None) != c for m, c in zip(masks, self.constrained, strict=True)):
            raise ValueError("SamplingBatch: the masks do not match the constrained rows")
        object.__setattr__(self, "masks", masks)
        return masks

    @classmethod
    def build(cls, rows: Iterable[tuple[SamplingParams, int, Sequence[int], Sequence[int]]],
              eos_token_ids: Iterable[int], allowed: Sequence[np.ndarray | None] | None = None, *,
              constrained: Sequence[bool] | None = None,
              masks: Callable[[], Sequence[np.ndarray | None]] | None = None) -> SamplingBatch:
        """rows: (params, seed, prompt ids, output ids so far) per sampling row; `allowed`: each row's
        grammar bitmask for this step, or None (no structured outputs in the batch); or, lazily, `masks`
        (a callable returning them) with `constrained` saying which rows will have one."""
        rows = list(rows)
        eos = tuple(sorted(eos_token_ids))
        params = tuple(r[0] for r in rows)
        if masks is not None:
            if allowed is not None or constrained is None:
                raise ValueError("SamplingBatch.build: give `allowed`, or `masks` with `constrained`")
            constrained = np.array(constrained, dtype=bool)
        else:
            allowed = tuple(allowed) if allowed is not None else (None,) * len(rows)
            constrained = np.array([a is not None for a in allowed], dtype=bool)
            masks = allowed
        if constrained.shape != (len(rows),):
            raise ValueError(f"SamplingBatch.build: {constrained.shape[0]} constrained flags for {len(rows)} rows")
        bias = tuple(
            (np.fromiter(p.logit_bias.keys(), np.int64, len(p.logit_bias)),
             np.fromiter(p.logit_bias.values(), np.float32, len(p.logit_bias))) if p.logit_bias else None
            for p in params)
        host = [needs_host_sampling(p, len(out)) for p, _, _, out in rows]
        banned = tuple(
            ((*p.stop_token_ids, *(() if p.ignore_eos else eos)) if len(out) < p.min_tokens else ())
            + tuple(bad_word_bans(p, out))
            for p, _, _, out in rows)
        return cls(
            params=params,
            seeds=np.array([s & 0xFFFFFFFFFFFFFFFF for _, s, _, _ in rows], dtype=np.uint64),
            steps=np.array([len(out) for *_, out in rows], dtype=np.int32),
            # (a temperature past float32's range samples uniformly either way: clipped, it casts without a warning)
            temperature=np.array([0.0 if p.temperature < GREEDY_EPS else min(p.temperature, _F32_MAX) for p in params],
                                 np.float32),
            top_k=np.array([max(p.top_k, 0) for p in params], dtype=np.int32),
            top_p=np.array([p.top_p for p in params], dtype=np.float32),
            min_p=np.array([p.min_p for p in params], dtype=np.float32),
            num_logprobs=np.array([-1 if p.logprobs is None else p.logprobs for p in params], dtype=np.int32),
            host_rows=np.array(host, dtype=bool),
            history=tuple((prompt, out) if h else None for h, (_, _, prompt, out) in zip(host, rows, strict=True)),
            banned=banned,
            logit_bias=bias,
            constrained=constrained,
            masks=masks,
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
