"""Prometheus metrics through `prometheus_client`, with vLLM's names under the `kda_rt:` prefix and a
`model_name` label, so dashboards built for vLLM work after a prefix rename.

vLLM names: num_requests_running, num_requests_waiting, kv_cache_usage_perc (a fraction in [0, 1]; also under its
older name gpu_cache_usage_perc, which vLLM's example Grafana dashboard reads), num_preemptions_total,
prompt_tokens_total, generation_tokens_total (both counted as they happen: at a choice's first token and at each
delta), request_success_total{finished_reason} (each finished choice's reason; stop / length / abort shown from the
start), time_to_first_token_seconds (observed at the first token), inter_token_latency_seconds and
time_per_output_token_seconds (vLLM's older name of the same thing: one observation a gap between deliveries),
request_time_per_output_token_seconds (a choice's mean), e2e_request_latency_seconds, request_queue_time_seconds,
request_prefill_time_seconds, request_inference_time_seconds, request_decode_time_seconds, request_prompt_tokens,
request_generation_tokens, request_max_num_generation_tokens, request_params_n, request_params_max_tokens (these
per-request histograms only of requests that finished, as vLLM's only of finished requests), iteration_tokens_total
(the engine's steps by their prefill tokens run plus tokens sampled, at vLLM's bounds, binned in the engine as it
steps and read at scrape time; vLLM's own adds a prompt's whole length at the step of its first token, its earlier
chunks and cached prefix included).  Every series of the model exists from the start, at 0, as vLLM's.

Counted as vLLM v1 counts them, which runs each prompt of a request as a parent and each of its n choices as a child
request: a choice (child) is one observation of TTFT, inter-token latency (a gap a choice), request_success, the
e2e / queue / prefill / inference / decode times, request_prompt_tokens, request_generation_tokens,
request_time_per_output_token and request_params_max_tokens, and adds its prompt to prompt_tokens_total; a prompt
(parent) is one observation of request_params_n and request_max_num_generation_tokens (its longest choice).

Ours: state_slot_usage_perc (KDA state slots, a fraction), kv_pages_used / _free / _cached,
state_slots_used / _free, engine_steps_total, prompt_tokens_computed_total (prefill tokens run,
recomputation included), engine_requests_finished_total / _aborted_total, http_requests_total
{endpoint, code}, requests_total{outcome}, requests_in_flight, engine_alive, draining.

HTTP-side counters and histograms are updated as a request runs (first token, deltas, gaps) and as it ends (the
per-request ones); engine gauges, counters and iteration_tokens_total are read from the engine process at scrape time
(`render(stats, ...)`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from kda_rt.engine.llm_engine import STEP_TOKEN_BOUNDS
from kda_rt.server.stats_log import usage_fractions

__all__ = ["CONTENT_TYPE", "ChoiceTimes", "Metrics", "PREFIX"]

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
PREFIX = "kda_rt:"
prometheus_client.disable_created_metrics()  # no `_created` samples (vLLM turns them off too)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets for a model of that context; at least 1)."""
    out, base = [], 1
    while base <= limit:
        out += [base * m for m in (1, 2, 5) if base * m <= limit]
        base *= 10
    return tuple(out) or (1,)
_FINISH_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason values: their series exist from the start

# engine stats key -> (metric name, kind, help)
_ENGINE = {
    "running": ("num_requests_running", "gauge", "Sequences running in the engine."),
    "waiting": ("num_requests_waiting", "gauge", "Sequences waiting in the engine queue."),
    "preemptions": ("num_preemptions", "counter", "Sequences preempted (recomputed later)."),
    "pages_used": ("kv_pages_used", "gauge", "MLA KV-cache pages sequences hold."),
    "pages_free": ("kv_pages_free", "gauge", "MLA KV-cache pages free (prefix-cache pages among them)."),
    "pages_cached": ("kv_pages_cached", "gauge", "Of the free pages, those holding prefix-cache entries."),
    "slots_used": ("state_slots_used", "gauge", "KDA state slots in use."),
    "slots_free": ("state_slots_free", "gauge", "KDA state slots free."),
    "steps": ("engine_steps", "counter", "Engine steps run."),
    "prefill_tokens": ("prompt_tokens_computed", "counter", "Prefill tokens run through the model (with recomputes)."),
    "requests_finished": ("engine_requests_finished", "counter", "Engine requests finished (a beam search runs one a live beam a step: each counts)."),
    "requests_aborted": ("engine_requests_aborted", "counter", "Requests aborted in the engine."),
    "prefix_cache_queries": ("prefix_cache_queries", "counter",
                             "Tokens of sequences looked up in the prefix cache when admitted (vLLM's name)."),
    "prefix_cache_hits": ("prefix_cache_hits", "counter", "Of those, tokens resumed from the prefix cache."),
    "prefix_cache_entries": ("prefix_cache_entries", "gauge", "Prefixes kept in the prefix cache."),
    "steps_launched_ahead": ("engine_steps_launched_ahead", "counter",
                             "Decode steps launched before the previous step's tokens reached the host."),
}


@dataclass(slots=True)
class ChoiceTimes:
    """One choice of a request (vLLM's child request) as the HTTP process saw it: perf_counter times."""

    first: float | None = None  # its first token came
    last: float | None = None  # its latest token came
    end: float | None = None  # its finish reason came


class _EngineCollector:
    """Engine gauges and counters from the stats snapshot taken for this scrape."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self):
        m, labels = self.metrics, [self.metrics.model_name]
        for name, doc, value in (("engine_alive", "1 while the engine process is serving.", m.alive),
                                 ("draining", "1 after SIGTERM, while in-flight requests finish.", m.draining)):
            family = GaugeMetricFamily(m.prefix + name, doc, labels=["model_name"])
            family.add_metric(labels, int(value))
            yield family
        stats = m.snapshot
        if stats is None:
            return
        for key, (name, kind, doc) in _ENGINE.items():
            if key not in stats:
                continue
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = cls(m.prefix + name, doc, labels=["model_name"])
            family.add_metric(labels, stats[key])
            yield family
        if {"pages_used", "pages_free", "slots_used", "slots_free"} <= stats.keys():
            kv, slots = usage_fractions(stats)
            for name, doc, value in (("kv_cache_usage_perc", "KV-cache (MLA page) usage, 1 = full.", kv),
                                     ("gpu_cache_usage_perc", "KV-cache (MLA page) usage, 1 = full (vLLM's older "
                                      "name of kv_cache_usage_perc).", kv),
                                     ("state_slot_usage_perc", "KDA state-slot usage, 1 = full.", slots)):
                family = GaugeMetricFamily(m.prefix + name, doc, labels=["model_name"])
                family.add_metric(labels, value)
                yield family
        if "step_token_bins" in stats:
            yield _iteration_tokens(m.prefix, labels, stats)


def _iteration_tokens(prefix: str, labels: list[str], stats: dict[str, Any]) -> HistogramMetricFamily:
    """vLLM's iteration_tokens_total from the engine's per-step bins (its sum: the prefill and sampled tokens)."""
    family = HistogramMetricFamily(prefix + "iteration_tokens_total", "Engine steps by their tokens (prefill tokens "
                                   "run plus tokens sampled).", labels=["model_name"])
    buckets, total = [], 0
    for bound, count in zip((*STEP_TOKEN_BOUNDS, float("inf")), stats["step_token_bins"], strict=True):
        total += count
        buckets.append((floatToGoString(bound), total))
    family.add_metric(labels, buckets, stats["prefill_tokens"] + stats["generated_tokens"])
    return family


class Metrics:
    """Server-side metrics of one model; `render(engine_stats, ...)` produces the /metrics page."""

    def __init__(self, model_name: str = "", prefix: str = PREFIX, max_model_len: int | None = None) -> None:
        """`prefix`: of every metric's name (--metrics-prefix; "vllm:" lets vLLM's dashboards and routers read them).
        `max_model_len`: the per-request token histograms' buckets run 1, 2, 5, 10, ... up to it, as vLLM's (None: up
        to 100,000; a 1M-token context's long prompts would all land in +Inf there)."""
        if not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", prefix):
            raise ValueError(f"metrics prefix {prefix!r} is not a Prometheus metric-name start ([a-zA-Z_:][a-zA-Z0-9_:]*)")
        self.model_name, self.prefix = model_name, prefix
        self.registry = CollectorRegistry(auto_describe=True)
        self.snapshot: dict[str, Any] | None = None
        self.alive, self.draining = True, False
        r, p, name = self.registry, prefix, ["model_name"]
        tokens = _TOKEN_BUCKETS if not max_model_len else one_two_five(int(max_model_len))
        self._http = Counter(p + "http_requests", "HTTP requests by endpoint and status code.",
                             ["model_name", "endpoint", "code"], registry=r)
        self._outcomes = Counter(p + "requests", "Admitted generation requests by outcome.", ["model_name", "outcome"],
                                 registry=r)
        self._success = Counter(p + "request_success", "Finished choices (sequences) by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._in_flight = Gauge(p + "requests_in_flight", "Generation requests open in the HTTP process.", name,
                                registry=r)
        self._prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of each choice, counted at its first token "
                                      "(or end, when none came).", name, registry=r)
        self._generation_tokens = Counter(p + "generation_tokens", "Tokens sent back to clients, counted as they come.",
                                          name, registry=r)
        self._ttft = Histogram(p + "time_to_first_token_seconds", "Time from request arrival to a choice's first "
                               "token.", name, buckets=_TTFT_BUCKETS, registry=r)
        self._tpot = Histogram(p + "time_per_output_token_seconds", "Time between a choice's successive token "
                               "deliveries (vLLM's older name of inter_token_latency_seconds).", name,
                               buckets=_TPOT_BUCKETS, registry=r)
        self._req_tpot = Histogram(p + "request_time_per_output_token_seconds",
                                   "Mean time between output tokens after the first, per choice.", name,
                                   buckets=_TPOT_BUCKETS, registry=r)
        self._e2e = Histogram(p + "e2e_request_latency_seconds", "Time from request arrival to a choice's end.", name,
                              buckets=_E2E_BUCKETS, registry=r)
        self._req_prompt = Histogram(p + "request_prompt_tokens", "Prompt tokens per choice.", name,
                                     buckets=tokens, registry=r)
        self._req_gen = Histogram(p + "request_generation_tokens", "Generated tokens per choice.", name,
                                  buckets=tokens, registry=r)
        self._req_max_gen = Histogram(p + "request_max_num_generation_tokens", "The most tokens a choice of the "
                                      "prompt generated.", name, buckets=tokens, registry=r)
        self._decode = Histogram(p + "request_decode_time_seconds", "Time from a choice's first token to its last.",
                                 name, buckets=_E2E_BUCKETS, registry=r)
        self._queue = Histogram(p + "request_queue_time_seconds", "Time a choice's prompt waited in the engine's queue "
                                "before it was first scheduled.", name, buckets=_E2E_BUCKETS, registry=r)
        self._prefill = Histogram(p + "request_prefill_time_seconds", "Time from a choice's prompt's first scheduling "
                                  "to its first token (in the engine).", name, buckets=_E2E_BUCKETS, registry=r)
        self._inference = Histogram(p + "request_inference_time_seconds", "Time from a choice's first scheduling to "
                                    "its end: e2e latency less its queue time.", name, buckets=_E2E_BUCKETS,
                                    registry=r)
        self._itl = Histogram(p + "inter_token_latency_seconds", "Time between a choice's successive token deliveries.",
                              name, buckets=_TPOT_BUCKETS, registry=r)
        self._params_n = Histogram(p + "request_params_n", "The n of each prompt.", name,
                                   buckets=(1, 2, 5, 10, 20), registry=r)
        self._params_max_tokens = Histogram(p + "request_params_max_tokens", "The max_tokens of each choice.", name,
                                            buckets=tokens, registry=r)
        for outcome in ("finished", "aborted", "rejected", "error"):
            self._outcomes.labels(model_name, outcome)
        for reason in _FINISH_REASONS:
            self._success.labels(model_name, reason)
        labelled = (self._http, self._outcomes, self._success)  # (their other labels' values: above, or as they come)
        for metric in vars(self).values():  # every series of this model from the start, at 0, as vLLM's
            if isinstance(metric, (Counter, Gauge, Histogram)) and metric not in labelled:
                metric.labels(model_name)
        self.registry.register(_EngineCollector(self))

    def http(self, endpoint: str, code: int) -> None:
        self._http.labels(self.model_name, endpoint, str(code)).inc()

    def rejected(self) -> None:
        self._outcomes.labels(self.model_name, "rejected").inc()

    def started(self) -> None:
        self._in_flight.labels(self.model_name).inc()

    def first_token(self, seconds: float, prompt_tokens: int) -> None:
        """A choice's first token came `seconds` after its request's arrival: its prompt has been run (vLLM counts
        prompt tokens then too, a child request's each)."""
        m = self.model_name
        self._ttft.labels(m).observe(seconds)
        self._prompt_tokens.labels(m).inc(prompt_tokens)

    def tokens(self, num_tokens: int) -> None:
        """Tokens of a delta, as it comes (rates of generation_tokens_total follow a long request as it runs)."""
        self._generation_tokens.labels(self.model_name).inc(num_tokens)

    def token_gap(self, seconds: float) -> None:
        """One gap between a choice's successive deliveries of tokens (vLLM's inter-token latency)."""
        m = self.model_name
        self._itl.labels(m).observe(seconds)
        self._tpot.labels(m).observe(seconds)

    def finish(self, outcome: str, prompt_tokens: list[int], choice_tokens: list[int],
               finish_reasons: list[str | None], times: list[ChoiceTimes], *, n: int, start: float, end: float,
               max_tokens: int | None = None, timing: dict[int, tuple[float, float | None]] | None = None) -> None:
        """Record the end of one admitted request: its outcome and, when it finished, each choice's finish reason,
        latencies and token counts, and each prompt's parameters.  `prompt_tokens`: a prompt's; `choice_tokens`,
        `finish_reasons`, `times`: a choice's, choice i of prompt i // n; `start`, `end`: the request's arrival and
        end (perf_counter); `timing`: prompt -> the queue and prefill durations the engine measured for it.  A
        request ended otherwise (aborted, failed) shows only in requests_total and in what was counted as it ran
        (first tokens, tokens, gaps)."""
        m = self.model_name
        self._in_flight.labels(m).dec()
        self._outcomes.labels(m, outcome).inc()
        if outcome != "finished":
            return
        timing = timing or {}
        for p in range(len(prompt_tokens)):  # (vLLM: one parent request a prompt)
            self._params_n.labels(m).observe(n)
            self._req_max_gen.labels(m).observe(max(choice_tokens[p * n:(p + 1) * n], default=0))
        for i, (num_tokens, reason, t) in enumerate(zip(choice_tokens, finish_reasons, times, strict=True)):
            num_prompt = prompt_tokens[i // n]
            if reason is not None:
                self._success.labels(m, reason).inc()
            if t.first is None:  # (no token came: a score-only request; its prompt was run all the same)
                self._prompt_tokens.labels(m).inc(num_prompt)
            if max_tokens is not None:
                self._params_max_tokens.labels(m).observe(max_tokens)
            self._req_prompt.labels(m).observe(num_prompt)
            self._req_gen.labels(m).observe(num_tokens)
            if t.first is not None:
                self._decode.labels(m).observe(t.last - t.first)
                if num_tokens > 1:
                    self._req_tpot.labels(m).observe((t.last - t.first) / (num_tokens - 1))
            done = (t.end if t.end is not None else end) - start
            self._e2e.labels(m).observe(done)
            queue, prefill = timing.get(i // n, (None, None))
            if queue is not None:
                self._queue.labels(m).observe(queue)
                self._inference.labels(m).observe(max(done - queue, 0.0))
            if prefill is not None:
                self._prefill.labels(m).observe(prefill)

    def render(self, engine_stats: dict[str, Any] | None, engine_alive: bool, draining: bool) -> bytes:
        self.snapshot, self.alive, self.draining = engine_stats, engine_alive, draining
        return prometheus_client.generate_latest(self.registry)
