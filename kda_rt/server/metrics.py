"""Prometheus metrics in the text exposition format (version 0.0.4), without a client library.

HTTP-side counters and latency histograms live in `Metrics`; engine gauges (queue lengths, slot
and page use, preemptions, token counters) are read from the engine process at scrape time.
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Any

__all__ = ["Histogram", "Metrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_PREFIX = "kda_rt_"

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# engine stats key -> (metric name, type, help)
_ENGINE = {
    "running": ("num_requests_running", "gauge", "Sequences running in the engine."),
    "waiting": ("num_requests_waiting", "gauge", "Sequences waiting in the engine queue."),
    "preemptions": ("num_preemptions_total", "counter", "Sequences preempted (recomputed later)."),
    "pages_used": ("kv_pages_used", "gauge", "MLA KV-cache pages in use."),
    "pages_free": ("kv_pages_free", "gauge", "MLA KV-cache pages free."),
    "slots_used": ("state_slots_used", "gauge", "KDA state slots in use."),
    "slots_free": ("state_slots_free", "gauge", "KDA state slots free."),
    "steps": ("engine_steps_total", "counter", "Engine steps run."),
    "prefill_tokens": ("prompt_tokens_computed_total", "counter", "Prefill tokens run through the model."),
    "generated_tokens": ("generation_tokens_total", "counter", "Tokens sampled by the engine."),
    "requests_finished": ("engine_requests_finished_total", "counter", "Requests finished in the engine."),
    "requests_aborted": ("engine_requests_aborted_total", "counter", "Requests aborted in the engine."),
}


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for le, count in zip((*self.buckets, "+Inf"), self.counts, strict=True):
            total += count
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        out += [f"{name}_sum {self.sum}", f"{name}_count {total}"]
        return out


class Metrics:
    """Server-side counters; `render(engine_stats)` produces the /metrics page."""

    def __init__(self) -> None:
        self.requests = Counter()  # (endpoint, status code) -> count
        self.outcomes = Counter()  # finished | aborted | rejected | error -> count
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.in_flight = 0
        self.ttft = Histogram(_TTFT_BUCKETS)
        self.tpot = Histogram(_TPOT_BUCKETS)
        self.e2e = Histogram(_E2E_BUCKETS)

    def finish(self, outcome: str, prompt_tokens: int, completion_tokens: int, *, start: float, first: float | None,
               end: float) -> None:
        """Record one admitted request: outcome, tokens, and its latencies (perf_counter times)."""
        self.outcomes[outcome] += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        if first is not None:
            self.ttft.observe(first - start)
            if completion_tokens > 1:
                self.tpot.observe((end - first) / (completion_tokens - 1))
        self.e2e.observe(end - start)

    def render(self, engine_stats: dict[str, Any] | None, engine_alive: bool, draining: bool) -> str:
        p = _PREFIX
        lines = [f"# HELP {p}http_requests_total HTTP requests by endpoint and status code.",
                 f"# TYPE {p}http_requests_total counter"]
        lines += [f'{p}http_requests_total{{endpoint="{e}",code="{c}"}} {v}' for (e, c), v in sorted(self.requests.items())]
        lines += [f"# HELP {p}requests_total Admitted generation requests by outcome.", f"# TYPE {p}requests_total counter"]
        lines += [f'{p}requests_total{{outcome="{k}"}} {self.outcomes[k]}'
                  for k in ("finished", "aborted", "rejected", "error")]
        for name, kind, doc, value in (
            ("requests_in_flight", "gauge", "Generation requests open in the HTTP process.", self.in_flight),
            ("request_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", self.prompt_tokens),
            ("request_generation_tokens_total", "counter", "Tokens sent back to clients.", self.completion_tokens),
            ("engine_alive", "gauge", "1 while the engine process is serving.", int(engine_alive)),
            ("draining", "gauge", "1 after SIGTERM, while in-flight requests finish.", int(draining)),
        ):
            lines += [f"# HELP {p}{name} {doc}", f"# TYPE {p}{name} {kind}", f"{p}{name} {value}"]
        for key, (name, kind, doc) in _ENGINE.items():
            if engine_stats is not None and key in engine_stats:
                lines += [f"# HELP {p}{name} {doc}", f"# TYPE {p}{name} {kind}", f"{p}{name} {engine_stats[key]}"]
        for name, doc, hist in (
            ("time_to_first_token_seconds", "Time from request arrival to its first token.", self.ttft),
            ("time_per_output_token_seconds", "Mean time between output tokens after the first, per request.", self.tpot),
            ("e2e_request_latency_seconds", "Time from request arrival to its end.", self.e2e),
        ):
            lines += [f"# HELP {p}{name} {doc}", f"# TYPE {p}{name} histogram", *hist.lines(f"{p}{name}")]
        return "\n".join(lines) + "\n"
