"""`PrefixCache`: computed prefixes kept for later requests (`enable_prefix_caching`; pure Python, owned by the
scheduler).

A prefix of a hybrid model is two things: the MLA latent rows of its positions (pages) and the KDA state after its
last token (the conv and recurrent state of every KDA layer: one *snapshot* slot of the runner's state pool, apart
from the running sequences' slots).  A KDA state exists only where a step's chunk ends, so entries are made at:

- a sequence's end (stopped or at its length; not aborted, not failed): its key is every token folded into its
  state, so the next turn of a chat, which repeats the conversation and adds to it, resumes there;
- a *junction*: a sequence about to be computed whose first j pages of tokens equal another sequence's prompt (the
  page hashes of prompts are noted when they are queued) runs its chunk only to that page boundary and leaves a
  snapshot there, so the next prompt with the same start (a shared system prompt, a document asked about again, the
  other samples of a request with n > 1) resumes from it (the scheduler holds back a sequence whose junction a
  running one is about to keep);
- a *prompt snapshot*: inside a prompt's final chunk, at its last SNAPSHOT_ALIGN-token chunk end below the last
  token, written by the model during the step into a slot `reserve`d for it (no copy, no extra step), so the same
  prompt sent again resumes there (evicted before the other entries).

A hit restores the snapshot into the new sequence's slot, shares the entry's full pages (a sequence only writes the
positions past its context, so they stay read-only) and copies a partial last page into a fresh one.  Pages are
counted by their holders (running sequences and entries); a page goes back to the free pool when nothing holds it.

Eviction (a snapshot slot or pages wanted): the least recently used entry that no request has resumed from goes
first (prompt snapshots before the others), then the least recently used of the rest.  So a shared start that requests resume from outlives a burst of
their end states (32 requests sharing a system prompt end in 32 entries, as many as the default slots: under plain
LRU the last of them evicted the shared one, and the next burst computed it again).  Two limits keep resumed entries
from filling the cache for good: at most half the slots count as resumed (beyond that the least recently used of
them counts as never resumed again), and an end entry stops counting once the request that resumed from it ends
(`demote`: a chat's earlier turn, which the new end holds in full).

A sequence's `cache_salt` (vLLM's request field) seeds its page hashes and is part of every entry it makes: it
resumes only from entries of the same salt and forms junctions only with prompts of the same salt, so requests of
different salts (tenants) share nothing and cannot learn from a prefix's speed what another one sent.

The copies (snapshot <- slot, slot <- snapshot, page <- page) are queued in `ops`; the engine hands them to the
runner before its next launch, so they run in stream order with the forwards around them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from kda_rt.engine.allocator import IdPool

__all__ = ["SNAPSHOT_ALIGN", "CacheEntry", "PrefixCache"]

# A snapshot written inside a step (a prompt snapshot, ForwardBatch.snapshot) lies this many tokens apart from the
# step's start of its sequence: the KDA prefill kernels' chunk (kernels_cu/kda_prefill.cu CHUNK), whose ends alone
# hold a state.
SNAPSHOT_ALIGN = 64
# How many page hashes of recent prompts the junction test remembers (oldest forgotten first).
_MAX_SEEN = 1 << 16
_SHARED = object()  # (a page two sequences brought: a junction for either)


@dataclass(eq=False)
class CacheEntry:
    tokens: tuple[int, ...]  # the prefix: every token folded into the snapshot
    snapshot: int  # the runner's state slot holding the KDA state after the prefix
    pages: list[int]  # the MLA pages of its positions, in order (the last one partial when len % block_size)
    bucket: int  # chain hash of its full pages: its key in the index
    junction: bool = False  # kept where prompts part (else at a request's end)
    resumed: bool = False  # a request resumed from it (since it was made or demoted): evicted after those not
    salt: str | None = None  # the cache_salt of the sequence that made it: only sequences of the same salt resume
    unconfirmed: bool = False  # kept before the row that computed its state was read: no lookup finds it until then
    prompt: bool = False  # a prompt snapshot (kept inside a prompt's last chunk): evicted before the other entries


class PrefixCache:
    def __init__(self, block_size: int, snapshot_slots: Iterable[int], pages: IdPool) -> None:
        self.block_size = block_size
        self.pages = pages  # the scheduler's page pool: pages no one holds go back here
        self._free_snapshots = sorted(snapshot_slots, reverse=True)  # (popped from the end: lowest id first)
        self._lru: OrderedDict[CacheEntry, None] = OrderedDict()  # least recently used first
        self._max_resumed = max(1, len(self._free_snapshots) // 2)  # entries counted as resumed at most
        self._num_resumed = 0
        self._by_block: dict[int, list[CacheEntry]] = {}  # chain hash of the entry's full pages -> entries
        self._holders: dict[int, int] = {}  # page -> holders (sequences and entries); absent: one sequence alone
        self._entry_holders: dict[int, int] = {}  # page -> entries holding it
        self._reclaimable = 0  # pages held by entries alone: free once those entries go
        # page chain hash of recent prompts -> the sequence that brought it (_SHARED: more than one)
        self._seen: OrderedDict[int, Hashable] = OrderedDict()
        self.ops: list[tuple[str, int, int]] = []  # ("slot" | "page", src, dst) copies for the runner, in order
        self.queries = 0  # tokens of the sequences looked up
        self.hits = 0  # of them, tokens found in the cache

    # -- keys ---------------------------------------------------------------------------------

    def _chain(self, tokens: list[int] | tuple[int, ...], num_pages: int, chain: list[int] | None = None,
               salt: str | None = None) -> list[int]:
        """Hash of the first j pages of tokens, j = 0..num_pages (each page's hash folds in the one before, the first
        the salt's); `chain`: the hashes of fewer pages of the same tokens (and salt), extended in place."""
        bs, out = self.block_size, [0 if salt is None else hash(("cache_salt", salt))] if chain is None else chain
        for j in range(len(out) - 1, num_pages):
            out.append(hash((out[-1], tuple(tokens[j * bs:(j + 1) * bs]))))
        return out

    def page_chain(self, seq) -> tuple[list[int], list[int]]:
        """A sequence's tokens (prompt and outputs) and the chain hashes of their full pages, the hashes kept on the
        sequence (`Sequence.page_chain`) and extended as outputs are added: a queue head that waits for room is
        looked up every step."""
        tokens = seq.prompt_token_ids + seq.output_token_ids
        bs, got = self.block_size, seq.page_chain
        chain = self._chain(tokens, len(tokens) // bs, got[2] if got and got[0] == bs and got[1] <= len(tokens) else None,
                            seq.cache_salt)
        seq.page_chain = (bs, len(tokens), chain)
        return tokens, chain

    def lookup(self, tokens: list[int], limit: int, chain: list[int] | None = None,
               salt: str | None = None) -> CacheEntry | None:
        """The entry of the longest cached prefix of `tokens` that is at most `limit` tokens long and was made under
        the same `salt`, or None.  `chain`: `tokens`' page hashes (under that salt) when known (page_chain)."""
        bs = self.block_size
        chain = self._chain(tokens, limit // bs, salt=salt) if chain is None else chain[: limit // bs + 1]
        for j in range(len(chain) - 1, -1, -1):  # (an entry keyed at page j is longer than every one below j)
            best = None
            for e in self._by_block.get(chain[j], ()):
                n = len(e.tokens)
                if n <= limit and (best is None or n > len(best.tokens)) and e.salt == salt and \
                        not e.unconfirmed and tuple(tokens[:n]) == e.tokens:
                    best = e
            if best is not None:
                self._lru.move_to_end(best)
                return best
        return None

    def remember(self, chain: list[int], who: Hashable) -> None:
        """Note the pages of a prompt `who` brought (when it is queued; `chain`: their hashes, `page_chain`'s first
        ones), for `junction`."""
        for h in chain[1:]:
            first = self._seen.get(h)
            if first is None:
                self._seen[h] = who
            else:
                if first != who:
                    self._seen[h] = _SHARED
                self._seen.move_to_end(h)
        while len(self._seen) > _MAX_SEEN:
            self._seen.popitem(last=False)

    def cached(self, tokens: list[int] | tuple[int, ...], bucket: int, salt: str | None = None) -> bool:
        """Whether an entry of exactly `tokens` (under `salt`) is cached; `bucket`: the chain hash of their full
        pages (page_chain's)."""
        key = tuple(tokens)
        return any(e.tokens == key and e.salt == salt for e in self._by_block.get(bucket, ()))

    def junction(self, tokens: list[int], start: int, limit: int, who: Hashable,
                 chain: list[int] | None = None) -> int:
        """The longest page boundary J with start < J <= limit up to which `tokens` equals a prompt another sequence
        brought (0: none; `who`: the asking sequence, as it was `remember`ed).  `chain` as `lookup`'s."""
        chain = self._chain(tokens, limit // self.block_size) if chain is None else chain
        for j in range(limit // self.block_size, start // self.block_size, -1):
            first = self._seen.get(chain[j])
            if first is not None and first != who:
                return j * self.block_size
        return 0

    # -- entries ------------------------------------------------------------------------------

    def reserve(self) -> int | None:
        """A snapshot slot for a state the model writes itself during a step (a prompt snapshot), evicting an entry
        no request resumed from when none is free; None when every entry was resumed from (those stay).  The slot is
        `insert`ed with `reserved=` or handed back with `unreserve`."""
        if not self._free_snapshots:
            victim = next(iter(self._eviction_order()), None)
            if victim is None or victim.resumed:
                return None
            self.evict(victim)
        return self._free_snapshots.pop()

    def unreserve(self, slot: int) -> None:
        """A reserved snapshot slot back to the free ones (its step was not committed: nothing kept)."""
        self._free_snapshots.append(slot)

    def insert(self, tokens: list[int], slot: int, pages: list[int], chain: list[int] | None = None, *,
               junction: bool = False, salt: str | None = None, unconfirmed: bool = False,
               reserved: int | None = None) -> CacheEntry | None:
        """Keep the state in `slot` (after `tokens`) and the pages of those positions as an entry: the slot is copied
        to a snapshot (evicting an entry when none is free: the module docstring's order); the pages are held, not
        copied.  None when the prefix is already cached (that entry counts as used) or no snapshot slot exists.
        `chain`: page hashes of tokens that start with `tokens`, when known (page_chain).  `junction`: kept where
        prompts part (not at a request's end).  `salt`: the sequence's cache_salt (`chain` made under it).
        `unconfirmed`: the row of the step that computed the state is not read yet (an error there may leave it
        non-finite): no lookup finds the entry until `confirm`.  `reserved`: a slot from `reserve` that already holds
        the state (`slot` unused, no copy; a prompt snapshot, evicted before the other entries); handed back when the
        prefix is cached already."""
        key = tuple(tokens)
        need = -(-len(key) // self.block_size)
        if not key or len(pages) < need:
            raise ValueError(f"prefix cache: {len(key)} tokens need {need} pages, got {len(pages)}")
        full = len(key) // self.block_size
        bucket = (self._chain(key, full, salt=salt) if chain is None else chain)[full]
        for e in self._by_block.get(bucket, ()):
            if e.tokens == key and e.salt == salt:
                self._lru.move_to_end(e)
                e.junction |= junction
                if reserved is not None:
                    self.unreserve(reserved)
                return None
        if reserved is None and not self._free_snapshots:
            if not self._lru:
                return None
            self.evict(self._victim())
        entry = CacheEntry(key, self._free_snapshots.pop() if reserved is None else reserved, list(pages[:need]),
                           bucket, junction, salt=salt, unconfirmed=unconfirmed, prompt=reserved is not None)
        if reserved is None:
            self.ops.append(("slot", slot, entry.snapshot))
        for p in entry.pages:
            self._change(p, 1, 1)
        self._lru[entry] = None
        self._by_block.setdefault(bucket, []).append(entry)
        return entry

    def restore(self, entry: CacheEntry, slot: int, new_page: Callable[[], int]) -> list[int]:
        """A sequence in `slot` resumes after `entry`'s prefix: the snapshot is copied into its slot, it holds the
        entry's full pages, and the partial last page (if any) is copied into a page of its own, `new_page()` (asked
        for once the full pages are held, so making room cannot free them).  Returns its pages.  (The pages free
        after it: `reclaimable` less `held_on_restore(entry)`.)"""
        n = len(entry.tokens)
        full = n // self.block_size
        self.ops.append(("slot", entry.snapshot, slot))
        blocks = entry.pages[:full]
        for p in blocks:
            self._change(p, 1, 0)
        if n % self.block_size:
            # (making room may evict `entry` itself, the last one, freeing the source: the copy is queued before
            # whatever writes it next, and a source handed back as the new page is copied onto itself)
            page = new_page()
            self.ops.append(("page", entry.pages[full], page))
            blocks = blocks + [page]
        self.hits += n
        if not entry.resumed and entry in self._lru:  # (making room for the page above may have evicted it)
            entry.resumed = True
            self._num_resumed += 1
            if self._num_resumed > self._max_resumed:  # the least recently used other one counts as never resumed
                self.demote(next(e for e in self._lru if e.resumed and e is not entry))
        return blocks

    def demote(self, entry: CacheEntry) -> None:
        """`entry` counts as never resumed from again (the module docstring's eviction order)."""
        if entry.resumed and entry in self._lru:
            entry.resumed = False
            self._num_resumed -= 1

    def _eviction_order(self, prompt_first: bool = True) -> list[CacheEntry]:
        """The entries in the order they go: prompt snapshots no request resumed from (`prompt_first`: for a snapshot
        slot; for pages they go in the next group, as their pages are mostly a running request's or its end entry's
        too, freeing none), the other entries no request resumed from, then the others, least recently used first in
        each."""
        first = [e for e in self._lru if not e.resumed and e.prompt] if prompt_first else []
        return first + [e for e in self._lru if not e.resumed and not (prompt_first and e.prompt)] + \
            [e for e in self._lru if e.resumed]

    def _victim(self) -> CacheEntry:
        return self._eviction_order()[0]

    def held_on_restore(self, entry: CacheEntry) -> int:
        """How many pages that count as reclaimable now a restore of `entry` holds (its full pages only entries
        hold)."""
        full = entry.pages[: len(entry.tokens) // self.block_size]
        return sum(1 for p in full if self._holders.get(p, 1) == self._entry_holders.get(p, 0))

    def release(self, pages: Iterable[int]) -> None:
        """A sequence lets go of its pages: each one no one else holds goes back to the pool."""
        own = []
        for p in pages:
            if p in self._holders:
                self._change(p, -1, 0)
            else:
                own.append(p)
        self.pages.release(own)

    def evict(self, entry: CacheEntry) -> None:
        self.demote(entry)
        del self._lru[entry]
        bucket = self._by_block[entry.bucket]
        bucket.remove(entry)
        if not bucket:
            del self._by_block[entry.bucket]
        self._free_snapshots.append(entry.snapshot)
        for p in entry.pages:
            self._change(p, -1, -1)

    @staticmethod
    def confirm(entries: list[CacheEntry]) -> None:
        """The rows that computed `entries`' states were read without an error: lookups may find them now."""
        for e in entries:
            e.unconfirmed = False

    def discard(self, entries: list[CacheEntry]) -> None:
        """Evict those of `entries` still cached (a sequence's, whose state went bad), and empty the list."""
        for e in entries:
            if e in self._lru:
                self.evict(e)
        entries.clear()

    def reclaim(self, num_pages: int) -> None:
        """Evict entries (the module docstring's order) until `num_pages` pages are free or no entry is left."""
        if self.pages.num_free >= num_pages:
            return
        for e in self._eviction_order(prompt_first=False):  # (made once: a reclaim of many entries stays linear)
            if self.pages.num_free >= num_pages:
                break
            self.evict(e)

    def clear(self, forget_prompts: bool = False) -> None:
        """Every entry out, and the copies not yet issued dropped (a failed step: what it left is not trusted);
        `forget_prompts`: the prompts' page hashes that junctions are found by too (a reset: prompts already queued
        then form no junction with each other)."""
        while self._lru:
            self.evict(next(iter(self._lru)))
        self.ops.clear()
        if forget_prompts:
            self._seen.clear()

    @property
    def reclaimable(self) -> int:
        """Pages only entries hold: free once `reclaim` evicts them."""
        return self._reclaimable

    @property
    def num_entries(self) -> int:
        return len(self._lru)

    def take_ops(self) -> list[tuple[str, list[int], list[int]]]:
        """The queued copies as runner calls, in order: (kind, sources, destinations), each a run of one kind in which
        no copy reads or writes what an earlier copy of the run writes (a call gathers every source, then writes)."""
        ops, self.ops = self.ops, []
        out: list[tuple[str, list[int], list[int]]] = []
        written: set[int] = set()
        for kind, src, dst in ops:
            if not out or out[-1][0] != kind or src in written or dst in written:
                out.append((kind, [], []))
                written = set()
            out[-1][1].append(src)
            out[-1][2].append(dst)
            written.add(dst)
        return out

    def _change(self, page: int, holders: int, entries: int) -> None:
        total = self._holders.get(page, 1) + holders
        by_entries = self._entry_holders.get(page, 0) + entries
        before = self._entry_holders.get(page, 0) > 0 and self._holders.get(page, 1) == self._entry_holders[page]
        after = by_entries > 0 and total == by_entries
        self._reclaimable += int(after) - int(before)
        if total == 0:
            self._holders.pop(page, None)
            self._entry_holders.pop(page, None)
            self.pages.release([page])
        elif total == 1 and by_entries == 0:  # one sequence alone again
            self._holders.pop(page, None)
            self._entry_holders.pop(page, None)
        else:
            self._holders[page] = total
            self._entry_holders[page] = by_entries
