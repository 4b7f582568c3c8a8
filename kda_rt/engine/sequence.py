"""`Sequence`: one sample being generated — token ids, status, KDA state slot, MLA pages,
sampling state and incremental text.

Pure Python (the scheduler reads it and must not import an array library).

Token accounting: the sequence's tokens are prompt + outputs.  `num_computed` of them are folded
into its KDA state slot and written to its MLA pages.  While `num_computed < num_tokens - 1` the
sequence is in prefill (the prompt, or prompt + outputs again after a preemption); once only the
last sampled token is left it decodes one token per step.  Logits are sampled exactly when a step
brings `num_computed` up to `num_tokens`.

With async scheduling the engine schedules the next step before the host has the token this step
samples: `pending` counts that token (0 or 1) in `num_tokens`; its id is still on the device, the
runner feeds it from there, and `tokens()` gives 0 in its place until the engine accepts it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kda_rt.engine.structured import GrammarState
    from kda_rt.sampler.params import SamplingParams
    from kda_rt.text.detokenizer import IncrementalDetokenizer

__all__ = ["SequenceStatus", "Sequence"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted and queued again); holds no slot and no page
    RUNNING = "running"  # holds a KDA state slot and the MLA pages of its computed tokens (none once retired)
    FINISHED = "finished"  # done or aborted; holds nothing


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # sample index within its request (0..n-1)
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # Philox key for this sample
    max_tokens: int  # resolved: params.max_tokens or what max_model_len leaves
    arrival: int = 0  # engine-wide order of arrival; the largest running one is preempted first
    priority: int = 0  # scheduling_policy "priority": lower runs first (vLLM's); the order is (priority, arrival)
    arrival_time: float = 0.0  # time.time() when added (RequestOutput.metrics)
    scheduled_time: float = 0.0  # time.time() when first scheduled (0: not yet): its time in the queue ends
    first_token_time: float = 0.0  # time.time() when its first output token was accepted (0: none yet)
    detokenizer: IncrementalDetokenizer | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int = -1  # KDA state slot while running
    blocks: list[int] = field(default_factory=list)  # MLA pages while running, in position order
    num_computed: int = 0  # tokens already folded into the KDA state and the MLA pages
    num_preemptions: int = 0
    text: str = ""  # detokenized output so far (complete characters only)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    grammar: GrammarState | None = None  # structured outputs: the matcher of this sample's output
    sent: tuple[int, int] = (0, 0)  # (visible chars, tokens) already returned, for "delta" outputs
    pending: int = 0  # a sampled token whose id the host has not read yet (async scheduling; module docstring)
    snapshot_at: int = 0  # prefix cache: the position whose KDA state is kept once computed (a junction; 0: none)
    # prefix cache: (position, reserved snapshot slot) of the state the step scheduled writes inside its chunk (a
    # prompt snapshot; None: none), kept as an entry when that step is committed
    prompt_snapshot: tuple[int, int] | None = None
    num_cached: int = 0  # prefix cache: prompt tokens restored from it (RequestOutput.num_cached_tokens)
    kept: list = field(default_factory=list)  # prefix cache: the entries made from its state (dropped on an error)
    resumed_from: object = None  # prefix cache: the entry it last resumed from (demoted at its end: a chat's turn)
    cache_salt: str | None = None  # prefix cache: shares only with sequences of the same salt (vLLM's cache_salt)
    page_chain: tuple = ()  # prefix cache: (block size, tokens hashed, chain hashes of its full pages), reused

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.pending

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return self.num_tokens - self.num_computed

    @property
    def in_prefill(self) -> bool:
        """More than the last sampled token is uncomputed (a prompt, or a recompute after preemption)."""
        return self.num_uncomputed > 1 or self.num_computed == 0

    @property
    def max_positions(self) -> int:
        """Most tokens this sequence ever holds in the cache: the last output token is never computed."""
        return len(self.prompt_token_ids) + self.max_tokens - 1

    def tokens(self, start: int, stop: int) -> list[int]:
        """Token ids at positions start..stop-1 (IndexError outside 0 <= start <= stop <= num_tokens)."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"tokens({start}, {stop}) of a sequence of {self.num_tokens} tokens")
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        out = self.output_token_ids[max(start - n, 0):stop - n]
        if self.pending and start < stop == self.num_tokens:  # the pending token: its id comes from the device
            out = out + [0]
        return out if start >= n else self.prompt_token_ids[start:] + out

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
