"""`IdPool`: a free list of integer ids (KDA state slots or MLA pages) that refuses leaks' cousins:
double allocation, double free and freeing an id it never handed out.

Pure Python; the scheduler owns one pool for slots and one for pages.  Ids are handed out lowest
first and freed ids are reused first-in first-out, so a run is deterministic.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

__all__ = ["IdPool"]


class IdPool:
    def __init__(self, num_ids: int, what: str) -> None:
        if not isinstance(num_ids, int) or num_ids < 0:
            raise ValueError(f"{what} pool size must be an int >= 0, got {num_ids!r}")
        self.num_ids = num_ids
        self.what = what
        self._free: deque[int] = deque(range(num_ids))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, count: int = 1) -> list[int]:
        """`count` ids; raises RuntimeError (a scheduler bug) when fewer are free."""
        if count > len(self._free):
            raise RuntimeError(f"{self.what} pool: asked for {count} but only {len(self._free)} are free")
        ids = [self._free.popleft() for _ in range(count)]
        self._used.update(ids)
        return ids

    def release(self, ids: Iterable[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise RuntimeError(f"{self.what} pool: id {i} released but not allocated")
            self._used.remove(i)
            self._free.append(i)

    def used_ids(self) -> frozenset[int]:
        return frozenset(self._used)
