"""`Scheduler`: which sequences run this step and how many of their tokens (pure Python).

One step, under a budget of `max_num_batched_tokens` new tokens:

1. Running sequences, decodes first, then unfinished (chunked) prefills, each group oldest first.
   A sequence gets min(uncomputed tokens, budget left) tokens and the MLA pages those tokens need
   (a prompt whose rest exceeds the budget left by at most the step's `prefill_tail_tokens` takes it
   all: no later step runs just its last few tokens, at the price of a step up to that many tokens
   over the budget; the same when a waiting prompt is admitted)
   (pages are allocated as tokens are computed, never for the whole length up front).  A prefill
   chunk shrinks to the pages that are free; when not even one token fits, the newest running
   sequence is preempted by recompute: its slot and pages are freed, `num_computed` drops to 0
   (its generated tokens are kept and run again as part of its prompt), and it goes back to the
   front of the waiting queue.  The oldest running sequence can therefore always progress.
2. If nothing was preempted, waiting sequences are admitted while a state slot is free, fewer than
   `max_num_seqs` run, and the pages for their whole prompt are free beyond what running prefills
   will still take and a reserve of one page per running sequence (room to grow, so new work does
   not immediately evict old work).  Only the pages of the first chunk are allocated.  The
   queue head goes first; then waiting prompts of similar length (same power-of-two bucket first)
   join it, so a step's prefills are alike.
3. `policy` "priority" (vLLM's `--scheduling-policy priority`): every "oldest" and "newest" above reads as the order
   (priority, arrival), a lower priority value first: the waiting queue is kept in that order (a preempted sequence
   goes back to its place in it, not to the front), running sequences are scheduled in it, the last in it is the
   one preempted, and admission groups prompts of a like length only among the waiting ones of the head's priority
   first.  "fcfs" (the default) orders by arrival alone.
4. With a prefix cache (`snapshot_slots`, kda_rt/engine/prefix_cache.py) an admitted sequence resumes after the
   longest cached prefix of its tokens (its slot and first pages restored from the entry, its pages past them its
   own), a sequence whose tokens meet a prompt seen before stops its chunk at the page boundary where they part
   (`Sequence.snapshot_at`; `commit` keeps the state there), a chunk that ends a prompt has the model write the
   state at its last 64-token chunk end into a reserved snapshot slot (`Sequence.prompt_snapshot`; `commit` keeps
   it: the same prompt again resumes there), and pages only entries hold count as free: entries are evicted for
   them before anything is preempted.

No array library is imported here; the engine turns `SchedulerOutput` into a `ForwardBatch`.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections import deque
from dataclasses import dataclass, field

from kda_rt.engine.allocator import IdPool
from kda_rt.engine.config import POLICIES
from kda_rt.engine.prefix_cache import SNAPSHOT_ALIGN, PrefixCache
from kda_rt.engine.sequence import Sequence, SequenceStatus
from kda_rt.env import prompt_snapshots

__all__ = ["POLICIES", "SchedulerConfig", "SchedulerOutput", "Scheduler"]


logger = logging.getLogger(__name__)

# How far down the waiting queue admission looks for prompts to group with the head.
_LOOKAHEAD = 64


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_blocks: int  # MLA pages the scheduler may hand out (ids 0..num_blocks-1)
    num_slots: int  # KDA state slots the scheduler may hand out (ids 0..num_slots-1)
    prefill_tail_tokens: int = 0  # tokens a step may run over its budget to finish a prompt (module docstring)
    snapshot_slots: tuple[int, ...] = ()  # the runner's state slots for prefix-cache snapshots (empty: no cache)
    prompt_snapshots: bool = False  # the runner writes ForwardBatch.snapshot (then KDA_RT_PROMPT_SNAPSHOTS decides)
    policy: str = "fcfs"  # POLICIES (module docstring, 3.)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks", "num_slots"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        t = self.prefill_tail_tokens
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"prefill_tail_tokens must be an int >= 0, got {t!r}")
        if t > self.max_num_batched_tokens:  # a step of up to twice the budget: more than the tail is for
            raise ValueError(f"prefill_tail_tokens ({t}) must be at most max_num_batched_tokens "
                             f"({self.max_num_batched_tokens})")


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens), batch order
    preempted: list[Sequence] = field(default_factory=list)
    queue_changes: int = 0  # the scheduler's `queue_changes` when this schedule was made

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by `order`: running[-1] is the newest (the least urgent)
        # (the key of a sequence's place in the queues: arrival, or (priority, arrival) under "priority")
        self.order = (lambda s: (s.priority, s.arrival)) if config.policy == "priority" else (lambda s: s.arrival)
        self.slots = IdPool(config.num_slots, "KDA state slot")
        self.pages = IdPool(config.num_blocks, "MLA page")
        self.cache = PrefixCache(config.block_size, config.snapshot_slots, self.pages) if config.snapshot_slots else None
        self.num_preemptions = 0
        # requests added to the waiting queue or aborted from it: one that came or went since a schedule can be
        # admitted by the next one although that schedule admitted nobody (the engine's KDA_RT_ASYNC_WAITING)
        self.queue_changes = 0

    # -- queues -------------------------------------------------------------------------------

    def pages_for(self, num_positions: int) -> int:
        return -(-num_positions // self.config.block_size)

    def check_fits(self, num_positions: int) -> None:
        """Raise ValueError if a sequence of `num_positions` cached tokens could never fit alone."""
        need = self.pages_for(num_positions)
        if need > self.config.num_blocks:
            raise ValueError(
                f"request needs {need} KV pages of {self.config.block_size} tokens for {num_positions} positions "
                f"but the pool has only {self.config.num_blocks} pages (num_blocks)"
            )

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (raises ValueError if it could never fit in the page pool alone)."""
        self.check_fits(seq.max_positions)
        seq.status = SequenceStatus.WAITING
        self.queue_changes += 1
        if self.cache is not None:  # (its prompt's pages: where a later or earlier one parts from it is a junction)
            _, chain = self.cache.page_chain(seq)
            # (by sequence: a request's n > 1 samples share their prompt through a junction too)
            self.cache.remember(chain[: len(seq.prompt_token_ids) // self.config.block_size + 1], seq.arrival)
        self._enqueue(seq, front=False)

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        """Into the waiting queue: at its end (new) or front (computed again) under "fcfs", at its place in
        (priority, arrival) under "priority"."""
        if self.config.policy == "fcfs":
            if front:
                self.waiting.appendleft(seq)
            else:
                self.waiting.append(seq)
        else:
            self.waiting.insert(bisect.bisect(self.waiting, self.order(seq), key=self.order), seq)

    def finish(self, seq: Sequence, keep: int = 0) -> None:
        """Take a sequence out of the queues for good and return its slot and pages now (a retired one has).  `keep`:
        its KDA state holds its first `keep` tokens (with a prefix cache: kept as an entry; 0: not kept)."""
        if seq.status is SequenceStatus.RUNNING:
            if seq.slot >= 0:  # (not retired)
                self.running.remove(seq)
                self._keep(seq, keep)
                self._release(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self.queue_changes += 1
        seq.status = SequenceStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # boxed: preemption refunds it.  Tokens left of the budget plus the tail: a chunk may use the tail only
        # to finish its prompt (_chunk), and no chunk starts once the budget proper is spent
        budget = [self.config.max_num_batched_tokens + self.config.prefill_tail_tokens]
        chosen: dict[Sequence, int] = {}
        decodes, prefills = [], []
        for s in self.running:  # (one pass: `in_prefill` is a chain of properties, read once a sequence)
            (prefills if s.in_prefill else decodes).append(s)
        for seq in decodes + prefills:
            if self._proper(budget) <= 0:  # the tail alone starts no chunk
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier this step
                continue
            n = self._grow(seq, self._chunk(seq, budget), chosen, budget, out.preempted)
            if n:
                chosen[seq] = n
                budget[0] -= n
        if not out.preempted:
            self._admit(chosen, budget)
        out.scheduled = list(chosen.items())
        out.queue_changes = self.queue_changes
        if self.cache is not None and self.config.prompt_snapshots and prompt_snapshots():
            self._prompt_snapshots(out.scheduled)
        return out

    def _prompt_snapshots(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """Prompt snapshots: a chunk that ends its prompt (or the prompt and outputs it recomputes) and runs past a
        chunk end of the KDA kernels (SNAPSHOT_ALIGN tokens from its start) has the state at the last such end below
        its last token written to a reserved snapshot slot during the step (`commit` keeps it): the same prompt sent
        again resumes there (a lookup takes at most all but the last token).  None when that prefix is cached
        already or no slot can be had (every entry resumed from)."""
        bs = self.config.block_size
        for seq, n in scheduled:
            if n <= SNAPSHOT_ALIGN:  # (no chunk end below its last token: every decode row)
                continue
            start, end = seq.num_computed, seq.num_computed + n
            if end != seq.num_tokens or seq.prompt_snapshot is not None:
                continue
            at = start + (n - 1) // SNAPSHOT_ALIGN * SNAPSHOT_ALIGN
            tokens, chain = self.cache.page_chain(seq)
            if self.cache.cached(tokens[:at], chain[at // bs], seq.cache_salt):
                continue
            slot = self.cache.reserve()
            if slot is None:
                return
            seq.prompt_snapshot = (at, slot)

    def _proper(self, budget: list[int]) -> int:
        """Tokens left of the budget proper (budget[0] holds the tail too)."""
        return budget[0] - self.config.prefill_tail_tokens

    def _chunk(self, seq: Sequence, budget: list[int]) -> int:
        """Tokens `seq` asks for: all its uncomputed tokens when they fit the budget and tail left, else as many
        as the budget proper has left."""
        n = seq.num_uncomputed
        n = n if n <= budget[0] else min(n, self._proper(budget))
        if seq.snapshot_at > seq.num_computed:  # (a junction: the chunk ends there, `commit` keeps the state)
            n = min(n, seq.snapshot_at - seq.num_computed)
        return n

    def commit(self, out: SchedulerOutput) -> None:
        """The model ran `out`: the scheduled tokens are now in the cache."""
        for seq, n in out.scheduled:
            seq.num_computed += n
            if seq.snapshot_at and seq.num_computed >= seq.snapshot_at:
                if seq.num_computed == seq.snapshot_at and seq.slot >= 0:
                    self._keep(seq, seq.num_computed, junction=True)
                seq.snapshot_at = 0
            if seq.prompt_snapshot is not None and seq.slot >= 0:
                (at, reserved), seq.prompt_snapshot = seq.prompt_snapshot, None
                # (unconfirmed: the step's row of it, read later, may end in an error that leaves the state bad)
                entry = self.cache.insert(seq.tokens(0, at), -1, seq.blocks, self.cache.page_chain(seq)[1],
                                          salt=seq.cache_salt, unconfirmed=True, reserved=reserved)
                if entry is not None:
                    seq.kept.append(entry)

    def _grow(self, seq: Sequence, n: int, chosen: dict[Sequence, int], budget: list[int],
              preempted: list[Sequence]) -> int:
        """Give `seq` pages for up to `n` more tokens; returns how many it gets (0: `seq` was preempted).  A chunk
        that the free pages cut short of the prompt's end keeps to the budget proper (the tail is only for a chunk
        that ends its prompt)."""
        bs = self.config.block_size
        while True:
            fit = min(n, (len(seq.blocks) + self.num_free_pages) * bs - seq.num_computed)
            if fit < seq.num_uncomputed:  # (the step is not spent: budget[0] > tail, so this stays >= 1)
                fit = min(fit, self._proper(budget))
            if fit > 0:
                extra = self.pages_for(seq.num_computed + fit) - len(seq.blocks)
                if extra > 0:
                    seq.blocks.extend(self.allocate_pages(extra))
                return fit
            victim = self.running[-1]
            budget[0] += chosen.pop(victim, 0)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return 0

    def _admit(self, chosen: dict[Sequence, int], budget: list[int]) -> None:
        if not self.waiting:
            return
        head = self.waiting[0]
        window = list(itertools.islice(self.waiting, 1, _LOOKAHEAD))
        bucket = head.num_uncomputed.bit_length()
        # (under "priority" the window's own order first: a prompt of like length never passes a more urgent one)
        urgency = (lambda s: s.priority) if self.config.policy == "priority" else (lambda s: 0)
        order = sorted(range(len(window)),
                       key=lambda i: (urgency(window[i]), abs(window[i].num_uncomputed.bit_length() - bucket), i))
        # pages the running prefills will still take, plus one page of growth per running sequence
        promised = sum(max(0, self.pages_for(s.num_tokens) - len(s.blocks)) for s in self.running if s.in_prefill)
        bs = self.config.block_size
        # (junction, its page hash) of the states running sequences are about to keep: a sequence with the same one
        # waits a step for it instead of computing the shared start again (a burst with one system prompt)
        producing = {(s.snapshot_at, s.page_chain[2][s.snapshot_at // bs]) for s in self.running
                     if s.snapshot_at > s.num_computed and s.page_chain} if self.cache is not None else set()
        for seq in [head] + [window[i] for i in order]:
            if self._proper(budget) <= 0 or self.slots.num_free == 0 or len(self.running) >= self.config.max_num_seqs:
                return
            hit, start, junction = None, 0, 0
            if self.cache is not None:
                tokens, chain = self.cache.page_chain(seq)
                hit = self.cache.lookup(tokens, seq.num_tokens - 1, chain, seq.cache_salt)
                start = len(hit.tokens) if hit is not None else 0
                junction = self.cache.junction(tokens, start, seq.num_tokens - 1, seq.arrival, chain)
                if junction and (junction, chain[junction // bs]) in producing:
                    continue  # (its state is kept at the end of this step: admitted next step, it resumes there)
            whole = self.pages_for(seq.num_tokens) - start // bs  # (the entry's full pages are shared, not taken)
            held = self.cache.held_on_restore(hit) if hit is not None else 0  # (reclaimable until it holds them)
            if whole > self.num_free_pages - held - promised - len(self.running):
                if seq is head:
                    return  # the head waits for room; nothing jumps ahead of it
                continue
            self.waiting.remove(seq)
            seq.slot = self.slots.allocate()[0]
            seq.num_computed = start
            if not seq.output_token_ids:  # (vLLM's num_cached_tokens: the prompt's, as first admitted or recomputed)
                seq.num_cached = min(start, len(seq.prompt_token_ids))
            if self.cache is not None:
                self.cache.queries += seq.num_tokens
                if hit is not None:
                    seq.blocks = self.cache.restore(hit, seq.slot, lambda: self.allocate_pages(1)[0])
                    seq.resumed_from = hit
                seq.snapshot_at = junction
                if junction:
                    producing.add((junction, chain[junction // bs]))
            n = self._chunk(seq, budget)
            shared = start // bs
            seq.blocks = seq.blocks + self.allocate_pages(self.pages_for(start + n) - len(seq.blocks))
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self.order)
            chosen[seq] = n
            budget[0] -= n
            promised += whole - (len(seq.blocks) - shared)

    def retire(self, seq: Sequence, keep: int = 0) -> None:
        """A running sequence that the step in flight ends (by length): its seat, slot and pages go back now, so a
        step scheduled before that step's tokens are known (the engine's async scheduling) has the room the
        synchronous engine's next step would have; `finish` completes it once its last token is accepted.  (The
        step in flight still writes the slot and pages; a later owner's writes queue behind it on the stream.)
        `keep`: as `finish`'s; the entry is found by no lookup until the engine reads that step's row
        (`PrefixCache.confirm`): a sequence admitted meanwhile would copy a state that an error there leaves
        non-finite."""
        self.running.remove(seq)
        self._keep(seq, keep, unconfirmed=True)
        self._release(seq)

    def requeue(self, seq: Sequence) -> None:
        """Send a running sequence back to the queue (its front; under "priority" its place), to be computed again from its first token (its
        slot and pages freed, its outputs kept): the engine's answer to a step whose launch raised, whose forward
        may have folded some of the step's tokens into the sequence's state already."""
        self._to_front(seq)
        seq.pending = 0  # (recomputed from the tokens the host holds; a pending one still to be accepted is appended)
        logger.warning("request %s (sample %d) queued again for recompute after a failed step", seq.request_id,
                       seq.index)

    def _to_front(self, seq: Sequence) -> None:
        """A running sequence (a retired one holds nothing) back to the queue's front (under "priority" its place in
        the order), to be computed from its first token: preemption, and `requeue`."""
        if seq.slot >= 0:
            self.running.remove(seq)
            self._release(seq)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq, front=True)

    def _preempt(self, seq: Sequence) -> None:
        self._to_front(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        logger.warning(
            "preempted request %s (sample %d) by recompute: out of KV pages (%d in the pool); "
            "%d tokens will be computed again (preemptions so far: %d)",
            seq.request_id, seq.index, self.config.num_blocks, seq.num_tokens, self.num_preemptions,
        )

    def _release(self, seq: Sequence) -> None:
        if self.cache is not None:
            self.cache.release(seq.blocks)
            if seq.prompt_snapshot is not None:  # (its step not committed: nothing kept; a step in flight that
                self.cache.unreserve(seq.prompt_snapshot[1])  # writes the slot runs before the slot's next writer)
                seq.prompt_snapshot = None
        else:
            self.pages.release(seq.blocks)
        self.slots.release([seq.slot])
        seq.blocks, seq.slot = [], -1

    def _keep(self, seq: Sequence, num_tokens: int, junction: bool = False, unconfirmed: bool = False) -> None:
        """With a prefix cache, keep the first `num_tokens` tokens of a running `seq` (its state holds exactly those
        once the steps queued so far have run) as an entry: at a junction, or at its end (then the end entry it
        resumed from, a chat's earlier turn, is demoted: the new one holds it)."""
        if self.cache is not None and num_tokens > 0:
            entry = self.cache.insert(seq.tokens(0, num_tokens), seq.slot, seq.blocks, self.cache.page_chain(seq)[1],
                                      junction=junction, salt=seq.cache_salt, unconfirmed=unconfirmed)
            if entry is not None:
                seq.kept.append(entry)
            # (not a prompt snapshot: the same prompt again cannot resume from the longer end entry that holds it)
            if not junction and seq.resumed_from is not None and not seq.resumed_from.junction \
                    and not seq.resumed_from.prompt:
                self.cache.demote(seq.resumed_from)

    @property
    def num_free_pages(self) -> int:
        """Free pages, counting those that evicting prefix-cache entries would free."""
        return self.pages.num_free + (self.cache.reclaimable if self.cache is not None else 0)

    def allocate_pages(self, count: int) -> list[int]:
        """`count` free pages, evicting prefix-cache entries for them as needed."""
        if count <= 0:
            return []
        if self.cache is not None:
            self.cache.reclaim(count)
        return self.pages.allocate(count)

    # -- accounting ----------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Pages as vLLM counts its blocks: `pages_used` those sequences hold, `pages_free` the others, pages only
        prefix-cache entries hold (`pages_cached`, lent once their entries are evicted) among them."""
        cached = self.cache.reclaimable if self.cache is not None else 0
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "preemptions": self.num_preemptions,
            "pages_used": self.pages.num_used - cached,
            "pages_free": self.pages.num_free + cached,
            "slots_used": self.slots.num_used,
            "slots_free": self.slots.num_free,
            **({"pages_cached": cached, "prefix_cache_entries": self.cache.num_entries,
                "prefix_cache_queries": self.cache.queries, "prefix_cache_hits": self.cache.hits}
               if self.cache is not None else {}),
        }
