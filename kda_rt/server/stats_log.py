"""The engine process's periodic log line (vLLM's "Avg prompt throughput ..." line), while busy:

    Engine: prompt throughput 512.0 tokens/s, generation throughput 88.4 tokens/s, running 4 reqs,
    waiting 0 reqs, KV cache usage 12.5%, state slots usage 25.0%, preemptions 0

Throughputs are averages over the busy time since the previous line; nothing is logged while the
engine is idle (a busy period shorter than the interval logs nothing).
"""

from __future__ import annotations

import logging
import time
from typing import Any

__all__ = ["StatsLogger", "usage_fractions"]

logger = logging.getLogger("kda_rt.engine_proc")


def usage_fractions(stats: dict[str, Any]) -> tuple[float, float]:
    """(KV-cache page usage, state-slot usage) as fractions in [0, 1]."""
    pages = stats["pages_used"] + stats["pages_free"]
    slots = stats["slots_used"] + stats["slots_free"]
    return (stats["pages_used"] / pages if pages else 0.0), (stats["slots_used"] / slots if slots else 0.0)


class StatsLogger:
    def __init__(self, engine, interval: float) -> None:
        self.engine = engine
        self.interval = interval
        self.last = time.monotonic()
        self.last_counts = self._counts()
        self.active = False  # inside a busy period

    def _counts(self) -> tuple[int, int]:
        c = self.engine.counters
        return c["prefill_tokens"], c["generated_tokens"]

    def maybe_log(self) -> None:
        """Call after each step; logs once `interval` seconds of a busy period have passed."""
        if self.interval <= 0:
            return
        now = time.monotonic()
        if not self.active:  # a busy period starts: measure from here
            self.active, self.last, self.last_counts = True, now, self._counts()
        if not self.engine.has_unfinished_requests():
            self.active = False
        if now - self.last < self.interval:
            return
        counts = self._counts()
        span = max(now - self.last, 1e-9)
        stats = self.engine.stats()
        kv, slots = usage_fractions(stats)
        logger.info("Engine: prompt throughput %.1f tokens/s, generation throughput %.1f tokens/s, running %d reqs, "
                    "waiting %d reqs, KV cache usage %.1f%%, state slots usage %.1f%%, preemptions %d",
                    (counts[0] - self.last_counts[0]) / span, (counts[1] - self.last_counts[1]) / span,
                    stats["running"], stats["waiting"], 100 * kv, 100 * slots, stats["preemptions"])
        self.last, self.last_counts = now, counts
