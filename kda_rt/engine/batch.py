"""`ForwardBatch`: the flat varlen batch the runner hands to the model, one per step.

Both backends (NumPy reference, CUDA) read exactly these arrays; nothing else about requests
reaches the model (the sampler reads `sampler/batch.SamplingBatch`).  Letters: B sequences in the batch, T tokens in the batch (sum of new tokens),
N positions whose logits are wanted, M max pages per sequence.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from kda_rt.engine.prefix_cache import SNAPSHOT_ALIGN

__all__ = ["SNAPSHOT_ALIGN", "ForwardBatch"]


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: np.ndarray  # [T] int32: the new tokens of every sequence, back to back
    cu_seqlens: np.ndarray  # [B+1] int32: sequence b owns input_ids[cu_seqlens[b]:cu_seqlens[b+1]]
    context_lens: np.ndarray  # [B] int32: tokens of b already folded into its KDA state / MLA pages
    state_slots: np.ndarray  # [B] int32: KDA state slot of b (read unless context_lens[b] == 0, always written)
    block_tables: np.ndarray  # [B, M] int32: MLA page ids of b, in order; -1 where unused
    is_prefill: np.ndarray  # [B] bool: b is in prefill (possibly a chunk of it) rather than decode
    logits_indices: np.ndarray  # [N] int32: rows of input_ids whose logits the model returns, in order
    # [B, 2] int32 or None (prefix caching): row b = (n, slot): b's conv and recurrent state after its first n new
    # tokens also go to state slot `slot` (n = 0: none; else a multiple of SNAPSHOT_ALIGN below b's new tokens)
    snapshot: np.ndarray | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens.shape[0] - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_lens(self) -> np.ndarray:
        """[B] new tokens per sequence this step."""
        return np.diff(self.cu_seqlens)

    @classmethod
    def build(
        cls,
        new_tokens: list[list[int]],
        context_lens: list[int],
        state_slots: list[int],
        block_tables: list[list[int]],
        *,
        all_logits: bool = False,
        logits_for: list[bool] | None = None,
        snapshot: list[tuple[int, int]] | None = None,
    ) -> ForwardBatch:
        """Assemble a batch from per-sequence lists.  Logits come from each sequence's last new
        token, or from every token when `all_logits` (scoring).  `logits_for[b]` False drops
        sequence b's row (a prefill chunk that does not finish its prompt samples nothing).
        `snapshot[b]` = (n, slot): the `snapshot` field's row (None or all n = 0: no field)."""
        if not (len(new_tokens) == len(context_lens) == len(state_slots) == len(block_tables)):
            raise ValueError("ForwardBatch.build: per-sequence lists differ in length")
        if any(len(t) == 0 for t in new_tokens):
            raise ValueError("ForwardBatch.build: every sequence needs at least one new token")
        lens = np.array([len(t) for t in new_tokens], dtype=np.int32)
        cu = np.zeros(len(new_tokens) + 1, dtype=np.int32)
        np.cumsum(lens, out=cu[1:])
        width = max((len(bt) for bt in block_tables), default=0)
        tables = np.full((len(block_tables), max(width, 1)), -1, dtype=np.int32)
        for b, bt in enumerate(block_tables):
            tables[b, : len(bt)] = bt
        ids = np.fromiter(itertools.chain.from_iterable(new_tokens), dtype=np.int64, count=int(cu[-1]))
        logits_idx = np.arange(cu[-1], dtype=np.int32) if all_logits else (cu[1:] - 1).astype(np.int32)
        if logits_for is not None:
            if all_logits or len(logits_for) != len(new_tokens):
                raise ValueError("ForwardBatch.build: logits_for needs one flag per sequence and no all_logits")
            logits_idx = logits_idx[np.asarray(logits_for, dtype=bool)]
        snap = None
        if snapshot is not None and any(n for n, _ in snapshot):
            snap = np.asarray(snapshot, dtype=np.int64).reshape(-1, 2)
            _check_snapshot(snap, lens, np.asarray(state_slots, dtype=np.int64))
            snap = snap.astype(np.int32)
        return cls(
            input_ids=ids.astype(np.int32),
            cu_seqlens=cu,
            context_lens=np.asarray(context_lens, dtype=np.int32),
            state_slots=np.asarray(state_slots, dtype=np.int32),
            block_tables=tables,
            is_prefill=(lens > 1) | (np.asarray(context_lens) == 0),
            logits_indices=logits_idx,
            snapshot=snap,
        )


def _check_snapshot(snap: np.ndarray, lens: np.ndarray, slots: np.ndarray) -> None:
    """ValueError naming the row when a snapshot row is not (0, any) or (a multiple of SNAPSHOT_ALIGN below the
    row's new tokens, a slot of no row of the batch and of no other snapshot)."""
    if snap.shape[0] != lens.shape[0]:
        raise ValueError(f"ForwardBatch.build: snapshot needs one (tokens, slot) pair per sequence, got "
                         f"{snap.shape[0]} for {lens.shape[0]}")
    taken = set(slots.tolist())
    for b, (n, slot) in enumerate(snap.tolist()):
        if n == 0:
            continue
        if n < 0 or n % SNAPSHOT_ALIGN or n >= lens[b]:
            raise ValueError(f"ForwardBatch.build: snapshot of sequence {b} after {n} tokens: must be a positive "
                             f"multiple of {SNAPSHOT_ALIGN} below its {int(lens[b])} new tokens")
        if slot < 0 or slot in taken:
            raise ValueError(f"ForwardBatch.build: snapshot slot {slot} of sequence {b} is negative or another "
                             f"sequence's (a state slot of the batch or another snapshot)")
        taken.add(slot)
