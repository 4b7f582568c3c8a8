"""`Sequence`: one sample being generated — token ids, status, KDA state slot, MLA pages,
sampling state and incremental text."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kda_rt.sampler.params import SamplingParams
    from kda_rt.tokenizer import IncrementalDetokenizer

__all__ = ["SequenceStatus", "Sequence"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # sample index within its request (0..n-1)
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # Philox key for this sample
    max_tokens: int  # resolved: params.max_tokens or what max_model_len leaves
    detokenizer: IncrementalDetokenizer | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int = -1  # KDA state slot while running
    blocks: list[int] = field(default_factory=list)  # MLA pages while running
    num_computed: int = 0  # tokens already folded into the KDA state and the MLA pages
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def uncomputed_tokens(self) -> list[int]:
        """Tokens not yet in the cache (the prompt, or the last sampled token)."""
        return [self.token_at(i) for i in range(self.num_computed, self.num_tokens)]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
