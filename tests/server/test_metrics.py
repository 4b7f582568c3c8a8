"""/metrics against vLLM v1's (`vllm/v1/metrics/loggers.py`, its example Grafana dashboard): names, kinds, label
values and what each value counts, driven through `RequestRun` with a fake engine client and a fake clock (no server).
"""

from __future__ import annotations

import asyncio
import types

import pytest

from helpers.server import parse_metrics
from kda_rt.server import protocol
from kda_rt.server import run as run_mod
from kda_rt.server.engine_client import EngineDeadError
from kda_rt.server.metrics import Metrics
from kda_rt.server.run import RequestRun

PROMPT_TOKENS = 3


class _Client:
    async def wait(self, awaitable, what):
        return await awaitable

    def abort(self, rid):
        pass


class _State:
    """What a RequestRun reads of the server's state."""

    def __init__(self) -> None:
        self.open: dict = {}
        self.metrics = Metrics("demo", "vllm:")
        self.client = _Client()
        self.log_requests = False
        self.prompt_tokens_details = False
        self.model_name = "demo"


@pytest.fixture
def clock(monkeypatch):
    """The run module's perf_counter, moved by hand (`clock.now = ...`)."""
    fake = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(run_mod, "time", types.SimpleNamespace(perf_counter=lambda: fake.now, time=lambda: 0.0,
                                                               monotonic=lambda: fake.now))
    return fake


def _run(state: _State, n: int = 1, max_tokens: int = 8) -> RequestRun:
    req = protocol.CompletionRequest(prompt="x", n=n, max_tokens=max_tokens)
    added = {"prompt_tokens": PROMPT_TOKENS, "prompts": [{"num_tokens": PROMPT_TOKENS}]}
    return RequestRun(state, "cmpl-t", req, False, asyncio.Queue(), added, {"params": {"logprobs": None}}, 0.0)


def _delta(*outputs: tuple[int, int, str | None], finished: bool = False) -> dict:
    """outputs: (choice index, number of tokens, finish reason)."""
    return {"id": "cmpl-t", "finished": finished, "outputs": [
        {"index": i, "text": "a" * k, "token_ids": [7] * k, "logprobs": None, "finish_reason": f, "stop_reason": None}
        for i, k, f in outputs]}


def _scrape(state: _State, stats: dict | None = None) -> dict[str, float]:
    return parse_metrics(state.metrics.render(stats, True, False).decode())


def _serve(state: _State, run: RequestRun, clock, deltas: list[tuple[float, dict]]) -> None:
    """Deliver `deltas` ((clock time, item)) to a run collecting its answer."""

    async def gather():
        task = asyncio.ensure_future(run.collect(None))
        for at, item in deltas:
            clock.now = at
            run.queue.put_nowait(item)
            for _ in range(5):
                await asyncio.sleep(0)
        await task

    asyncio.run(gather())


def test_series_exist_from_start():
    """stop / length / abort, the token counters and the histograms are shown at 0 before any request, as vLLM creates
    them (was: absent until first moved, so a dashboard's increase() or an alert on one read "no data", and a request
    aborted before its first token left generation_tokens_total absent)."""
    m = _scrape(_State())
    for reason in ("stop", "length", "abort"):
        assert m[f'vllm:request_success_total{{finished_reason="{reason}"}}'] == 0, reason
    for name in ("prompt_tokens_total", "generation_tokens_total", "e2e_request_latency_seconds_count",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count"):
        assert m[f"vllm:{name}"] == 0, name


def test_request_success_counts_each_choice(clock):
    """Each finished choice counts under its own finish reason, as vLLM counts each sequence of n (was: the request
    once, under its first choice's reason: a length-capped second choice was never seen)."""
    state = _State()
    run = _run(state, n=2)
    _serve(state, run, clock, [(1.0, _delta((0, 1, "stop"), (1, 1, None))), (2.0, _delta((1, 1, "length"),
                                                                                          finished=True))])
    m = _scrape(state)
    assert m['vllm:request_success_total{finished_reason="stop"}'] == 1
    assert m['vllm:request_success_total{finished_reason="length"}'] == 1
    assert m['vllm:request_success_total{finished_reason="abort"}'] == 0


def test_per_token_and_per_request_time_per_output_token(clock):
    """time_per_output_token_seconds is vLLM's older name of inter_token_latency_seconds (one observation a gap,
    which its dashboard's "Time Per Output Token Latency" panel reads); the per-request mean is
    request_time_per_output_token_seconds, over the longest choice's tokens when n > 1 (was: the per-request mean
    under the old name, divided by every choice's tokens, so n = 2 read half the time a token took)."""
    state = _State()
    run = _run(state, n=2)
    deltas = [(1.0 + k, _delta((0, 1, None), (1, 1, None))) for k in range(4)]  # 4 tokens a choice, 1 s apart
    deltas.append((5.0, _delta((0, 0, "length"), (1, 0, "length"), finished=True)))
    _serve(state, run, clock, deltas)
    m = _scrape(state)
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds"):
        assert m[f"vllm:{name}_count"] == 3 and m[f"vllm:{name}_sum"] == pytest.approx(3.0), name
    assert m["vllm:request_time_per_output_token_seconds_count"] == 1
    assert m["vllm:request_time_per_output_token_seconds_sum"] == pytest.approx(4.0 / 3)  # (end 5 s - first 1 s) / 3


def test_max_num_generation_tokens(clock):
    """vLLM's request_max_num_generation_tokens (its dashboard's "Max Generation Token in Sequence Group" panel):
    the longest choice's tokens (was: absent)."""
    state = _State()
    run = _run(state, n=2)
    _serve(state, run, clock, [(1.0, _delta((0, 2, "stop"), (1, 5, "length"), finished=True))])
    m = _scrape(state)
    assert m["vllm:request_max_num_generation_tokens_count"] == 1
    assert m["vllm:request_max_num_generation_tokens_sum"] == 5
    assert m["vllm:request_generation_tokens_sum"] == 7


def test_gpu_cache_usage_perc():
    """kv_cache_usage_perc also under vLLM's older name gpu_cache_usage_perc, which its example dashboard's "Cache
    Utilization" panel reads (was: absent)."""
    stats = {"running": 1, "waiting": 0, "pages_used": 3, "pages_free": 1, "slots_used": 1, "slots_free": 3}
    m = _scrape(_State(), stats)
    assert m["vllm:kv_cache_usage_perc"] == m["vllm:gpu_cache_usage_perc"] == 0.75


def test_counted_as_they_come(clock):
    """TTFT at the first token, prompt tokens then, generation tokens at each delta, as vLLM counts them every
    step (was: all at the request's end, so a long request's throughput showed as 0 tokens/s, then one spike)."""
    state = _State()
    run = _run(state)

    async def go():
        it = run.items()
        clock.now = 0.25
        run.queue.put_nowait(_delta((0, 2, None)))
        await it.__anext__()
        m = _scrape(state)
        assert m["vllm:time_to_first_token_seconds_count"] == 1
        assert m["vllm:time_to_first_token_seconds_sum"] == pytest.approx(0.25)
        assert m["vllm:prompt_tokens_total"] == PROMPT_TOKENS and m["vllm:generation_tokens_total"] == 2
        clock.now = 0.5
        run.queue.put_nowait(_delta((0, 1, None)))
        await it.__anext__()
        assert _scrape(state)["vllm:generation_tokens_total"] == 3
        await it.aclose()

    asyncio.run(go())


def test_only_finished_requests_in_request_histograms(clock):
    """A request that failed (or was aborted) shows in requests_total{outcome} and in what it did as it ran, but not
    in the per-request histograms nor request_success, which count finished requests as vLLM's do (was: its
    truncated latency and lengths were observed too, so e2e_request_latency_seconds_count exceeded the finished
    requests and the e2e mean fell with every disconnect)."""
    state = _State()
    run = _run(state)
    _serve(state, run, clock, [(1.0, _delta((0, 2, None))), (2.0, EngineDeadError("gone"))])
    m = _scrape(state)
    assert m['vllm:requests_total{outcome="error"}'] == 1 and m['vllm:requests_total{outcome="finished"}'] == 0
    assert m["vllm:generation_tokens_total"] == 2 and m["vllm:time_to_first_token_seconds_count"] == 1
    for name in ("e2e_request_latency_seconds", "request_generation_tokens", "request_prompt_tokens",
                 "request_decode_time_seconds", "request_params_n"):
        assert m.get(f"vllm:{name}_count", 0) == 0, name
    assert sum(v for k, v in m.items() if k.startswith("vllm:request_success_total")) == 0


def test_score_only_request_counts_its_prompt(clock):
    """A finished request that generated nothing (max_tokens 0: a prompt scored) counts its prompt tokens at its
    end, having had no first token to count them at."""
    state = _State()
    run = _run(state, max_tokens=0)
    _serve(state, run, clock, [(1.0, _delta((0, 0, "length"), finished=True))])
    m = _scrape(state)
    assert m["vllm:prompt_tokens_total"] == PROMPT_TOKENS and m["vllm:e2e_request_latency_seconds_count"] == 1
    assert m.get("vllm:time_to_first_token_seconds_count", 0) == 0
