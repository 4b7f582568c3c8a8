"""`SamplingBatch` (what a runner's sampler reads) and `StepOutput` (what a runner returns).

The engine builds one `SamplingBatch` per step from the sequences that sample (the rows of
`ForwardBatch.logits_indices`, same order); no backend sees a `Sequence`.  The flat arrays are
what the GPU sampler reads; `params`, `history`, `banned`, `logit_bias` and `allowed` serve the
host sampler (`reference.sample_rows`), which takes every row on the NumPy backend and the
`host_rows` (and rows with non-finite logits) on the CUDA backend.  A row with penalties, a logit_bias, a
min_tokens ban, allowed_token_ids or bad_words is a host row unless the runner does them on the device
(`device_extras`: the CUDA runner with KDA_RT_GPU_SAMPLING_EXTRAS=1, which keeps each penalised or biased
sequence's token counts and biases there, found by its row's `keys` entry, and uploads the bans and allowed ids
as bitmasks, `device_masks`).  A structured-output mask is applied by the GPU sampler itself (its bitmask is uploaded).

The masks may be given lazily (a callable): the CUDA runner asks for them only after it has launched
the forward pass, so the grammar work on the host overlaps the GPU's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .params import GREEDY_EPS, SamplingParams

__all__ = ["SamplingBatch", "StepOutput", "bad_word_bans", "has_penalties", "needs_host_sampling"]

_F32_MAX = float(np.finfo(np.float32).max)


def has_penalties(params: SamplingParams) -> bool:
    """A repetition, presence or frequency penalty (they read the sequence's prompt and output tokens)."""
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def needs_host_sampling(params: SamplingParams, num_output: int, device_extras: bool = False) -> bool:
    """Penalties, a logit_bias, a min_tokens ban, allowed_token_ids or bad_words, unless the runner does them on the
    device (`device_extras`: penalties and biases from per-sequence device rows, sampler/penalties.py; bans and
    allowed_token_ids as bitmasks, `SamplingBatch.device_masks`): the host sampler does all of them."""
    if device_extras:
        return False
    return (has_penalties(params) or num_output < params.min_tokens or bool(params.logit_bias)
            or params.allowed_token_ids is not None or bool(params.bad_words_token_ids))


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
    host_rows: np.ndarray  # [N] bool: the host sampler's rows (penalties, bias, bans, allowed ids; not device_extras)
    # (prompt, output ids) of host rows and penalised or biased rows: the sequence's own lists, read during this
    # step's launch only (without a pending token: `steps` counts it)
    history: tuple[tuple[Sequence[int], Sequence[int]] | None, ...]
    banned: tuple[tuple[int, ...], ...]  # token ids banned this step (min_tokens not reached)
    # (token ids int64 [B], biases float32 [B]) added to the row's logits, or None
    logit_bias: tuple[tuple[np.ndarray, np.ndarray] | None, ...]
    constrained: np.ndarray  # [N] bool: the row has a grammar mask (`allowed`)
    # each row's [ceil(V / 32)] int32 bitmask of allowed tokens (bit t % 32 of word t // 32) or None; or a
    # callable returning that sequence, called once when `allowed` is first read
    masks: Sequence[np.ndarray | None] | Callable[[], Sequence[np.ndarray | None]] | None = None
    # [N] bool: the row has a repetition / presence / frequency penalty (on the device unless a host row)
    penalty_rows: np.ndarray | None = None
    # [N] int64: an id of the row's sequence, unique while it lives (-1: none given); the CUDA runner keys each
    # sequence's device token counts by it
    keys: np.ndarray | None = None

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

    def device_masks(self, vocab: int) -> list[np.ndarray | None]:
        """Each row's [ceil(vocab / 32)] int32 bitmask for the GPU sampler (bit t % 32 of word t // 32: token t
        allowed), or None for a row with nothing to mask: its grammar mask, less this step's bans (min_tokens,
        bad_words), and with allowed_token_ids only those; ids past the vocabulary are left out, as the host
        sampler leaves them.  The same tokens are -inf as in `reference.sample_rows`, which applies the three in
        turn after the bias and the penalties."""
        words = (vocab + 31) // 32
        out: list[np.ndarray | None] = []
        for p, grammar, bans in zip(self.params, self.allowed, self.banned, strict=True):
            if grammar is None and not bans and p.allowed_token_ids is None:
                out.append(None)
                continue
            mask = np.full(words, -1, np.int32) if grammar is None else np.array(grammar[:words], np.int32)
            bits = mask.view(np.uint32)
            if p.allowed_token_ids is not None:
                ids = p.allowed_ids_array[p.allowed_ids_array < vocab]
                keep = np.zeros(words, np.uint32)
                np.bitwise_or.at(keep, ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
                bits &= keep
            banned = np.array([t for t in bans if 0 <= t < vocab], np.int64)
            if banned.size:
                np.bitwise_and.at(bits, banned >> 5, ~np.left_shift(np.uint32(1), (banned & 31).astype(np.uint32)))
            out.append(mask)
        return out

    @classmethod
    def build(cls, rows: Iterable[tuple], eos_token_ids: Iterable[int],
              allowed: Sequence[np.ndarray | None] | None = None, *, constrained: Sequence[bool] | None = None,
              masks: Callable[[], Sequence[np.ndarray | None]] | None = None, device_extras: bool = False,
              keys: Sequence[int] | None = None) -> SamplingBatch:
        """rows: (params, seed, prompt ids, output ids so far[, pending]) per sampling row, `pending` (default 0)
        output tokens sampled but not yet on the host (async scheduling: counted in `steps`, not in the ids);
        `allowed`: each row's grammar bitmask for this step, or None (no structured outputs in the batch); or,
        lazily, `masks` (a callable returning them) with `constrained` saying which rows will have one;
        `device_extras`: the runner applies penalties, bans and allowed_token_ids on the device (they make no host
        row); `keys`: each row's sequence id (SamplingBatch.keys)."""
        rows = [(*r, 0) if len(r) == 4 else tuple(r) for r in rows]
        if any(len(r) != 5 for r in rows):
            raise ValueError("SamplingBatch.build: each row is (params, seed, prompt ids, output ids[, pending])")
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
        steps = [len(out) + pend for *_, out, pend in rows]
        host = [needs_host_sampling(p, n, device_extras) for (p, *_), n in zip(rows, steps, strict=True)]
        penalty = [has_penalties(p) for p in params]
        # min_tokens bans the stop ids and every EOS id, also under ignore_eos (vLLM's _all_stop_token_ids)
        banned = tuple(
            ((*p.stop_token_ids, *eos) if n < p.min_tokens else ())
            + tuple(bad_word_bans(p, out))
            for (p, _, _, out, _), n in zip(rows, steps, strict=True))
        if keys is not None and len(keys) != len(rows):
            raise ValueError(f"SamplingBatch.build: {len(keys)} keys for {len(rows)} rows")
        return cls(
            params=params,
            seeds=np.array([s & 0xFFFFFFFFFFFFFFFF for _, s, *_ in rows], dtype=np.uint64),
            steps=np.array(steps, dtype=np.int32),
            # (a temperature past float32's range samples uniformly either way: clipped, it casts without a warning)
            temperature=np.array([0.0 if p.temperature < GREEDY_EPS else min(p.temperature, _F32_MAX) for p in params],
                                 np.float32),
            top_k=np.array([max(p.top_k, 0) for p in params], dtype=np.int32),
            top_p=np.array([p.top_p for p in params], dtype=np.float32),
            min_p=np.array([p.min_p for p in params], dtype=np.float32),
            num_logprobs=np.array([-1 if p.logprobs is None else p.logprobs for p in params], dtype=np.int32),
            host_rows=np.array(host, dtype=bool),
            history=tuple((prompt, out) if h or pen or b is not None else None
                          for h, pen, b, (_, _, prompt, out, _) in zip(host, penalty, bias, rows, strict=True)),
            banned=banned,
            logit_bias=bias,
            constrained=constrained,
            masks=masks,
            penalty_rows=np.array(penalty, dtype=bool),
            keys=np.full(len(rows), -1, np.int64) if keys is None else np.array(keys, dtype=np.int64),
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
