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


def _run(state: _State, n: int = 1, max_tokens: int = 8, prompts: tuple[int, ...] = (PROMPT_TOKENS,)) -> RequestRun:
    """A completion request of n choices a prompt; `prompts`: each prompt's tokens."""
    req = protocol.CompletionRequest(prompt=["x"] * len(prompts), n=n, max_tokens=max_tokens)
    added = {"prompt_tokens": sum(prompts), "prompts": [{"num_tokens": k} for k in prompts]}
    return RequestRun(state, "cmpl-t", req, False, asyncio.Queue(), added, {"params": {"logprobs": None}}, 0.0)


def _delta(*outputs: tuple[int, int, str | None], finished: bool = False, timing: list | None = None) -> dict:
    """outputs: (choice index, number of tokens, finish reason); timing: the engine's [first choice of a prompt,
    queue s, prefill s] of each prompt that gave its first output."""
    out = {"id": "cmpl-t", "finished": finished, "outputs": [
        {"index": i, "text": "a" * k, "token_ids": [7] * k, "logprobs": None, "finish_reason": f, "stop_reason": None}
        for i, k, f in outputs]}
    if timing is not None:
        out["timing"] = timing
    return out


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
    """time_per_output_token_seconds is vLLM's older name of inter_token_latency_seconds (one observation a gap of a
    choice, which its dashboard's "Time Per Output Token Latency" panel reads); the mean per choice is
    request_time_per_output_token_seconds, from its first token to its last, as vLLM's decode time of a child request
    (was: the per-request mean under the old name, divided by every choice's tokens, so n = 2 read half the time a
    token took; then one gap a delivery and one mean a request, where vLLM counts each of the n choices)."""
    state = _State()
    run = _run(state, n=2)
    deltas = [(1.0 + k, _delta((0, 1, None), (1, 1, None))) for k in range(4)]  # 4 tokens a choice, 1 s apart
    deltas.append((5.0, _delta((0, 0, "length"), (1, 0, "length"), finished=True)))
    _serve(state, run, clock, deltas)
    m = _scrape(state)
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds"):
        assert m[f"vllm:{name}_count"] == 6 and m[f"vllm:{name}_sum"] == pytest.approx(6.0), name
    assert m["vllm:request_time_per_output_token_seconds_count"] == 2
    assert m["vllm:request_time_per_output_token_seconds_sum"] == pytest.approx(2.0)  # (last 4 s - first 1 s) / 3, x2


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


def test_n_choices_counted_as_vllm_child_requests(clock):
    """vLLM v1 runs a request of n = 3 as three child requests: each is one observation of TTFT, inter-token latency,
    request_success, the e2e / queue / prefill / inference / decode times, request_prompt_tokens,
    request_generation_tokens, request_time_per_output_token and request_params_max_tokens, and adds its prompt to
    prompt_tokens_total; the parent is one of request_params_n and request_max_num_generation_tokens (was: the HTTP
    request counted once in each, its e2e up to its last choice's end)."""
    state = _State()
    run = _run(state, n=3)
    _serve(state, run, clock, [
        (1.0, _delta((0, 2, None), (1, 1, None), (2, 1, None), timing=[[0, 0.25, 0.5]])),
        (2.0, _delta((0, 1, "stop"), (1, 1, None), (2, 1, None))),
        (4.0, _delta((1, 1, "length"), (2, 2, "stop"), finished=True)),
    ])  # choice tokens 3, 3, 4; choice 0 ends at 2 s, the others at 4 s
    m = _scrape(state)

    def observed(name):
        return m[f"vllm:{name}_count"], pytest.approx(m[f"vllm:{name}_sum"])

    assert m['vllm:requests_total{outcome="finished"}'] == 1
    assert m['vllm:request_success_total{finished_reason="stop"}'] == 2
    assert m['vllm:request_success_total{finished_reason="length"}'] == 1
    assert m["vllm:prompt_tokens_total"] == 3 * PROMPT_TOKENS and m["vllm:generation_tokens_total"] == 10
    assert observed("time_to_first_token_seconds") == (3, 3.0)
    assert observed("inter_token_latency_seconds") == (5, 7.0)  # choice 0: 1 s; 1 and 2: 1 s, 2 s
    assert observed("e2e_request_latency_seconds") == (3, 10.0)
    assert observed("request_decode_time_seconds") == (3, 7.0)  # first token to last: 1 s, 3 s, 3 s
    assert observed("request_time_per_output_token_seconds") == (3, 0.5 + 1.5 + 1.0)
    assert observed("request_queue_time_seconds") == (3, 0.75)
    assert observed("request_prefill_time_seconds") == (3, 1.5)
    assert observed("request_inference_time_seconds") == (3, 10.0 - 0.75)
    assert observed("request_prompt_tokens") == (3, 3 * PROMPT_TOKENS)
    assert observed("request_generation_tokens") == (3, 10)
    assert observed("request_params_max_tokens") == (3, 3 * 8)
    assert observed("request_params_n") == (1, 3)
    assert observed("request_max_num_generation_tokens") == (1, 4)


def test_each_prompt_a_parent(clock):
    """A completion of two prompts with n = 2 is, in vLLM, two parent requests of two children each: n and the longest
    choice are observed a prompt, and each choice takes its own prompt's tokens and the queue / prefill times the
    engine measured for its prompt (was: the first prompt's times for all)."""
    state = _State()
    run = _run(state, n=2, prompts=(3, 5))
    _serve(state, run, clock, [
        (1.0, _delta((0, 1, None), (1, 2, None), (2, 1, None), (3, 1, None),
                     timing=[[0, 0.1, 0.2], [2, 0.3, 0.4]])),
        (2.0, _delta((0, 0, "stop"), (1, 0, "stop"), (2, 3, "length"), (3, 0, "stop"), finished=True)),
    ])  # choice tokens 1, 2 (prompt 0), 4, 1 (prompt 1)
    m = _scrape(state)
    assert m["vllm:request_params_n_count"] == 2 and m["vllm:request_params_n_sum"] == 4
    assert m["vllm:request_max_num_generation_tokens_count"] == 2
    assert m["vllm:request_max_num_generation_tokens_sum"] == 2 + 4
    assert m["vllm:request_prompt_tokens_count"] == 4 and m["vllm:request_prompt_tokens_sum"] == 3 + 3 + 5 + 5
    assert m["vllm:prompt_tokens_total"] == 3 + 3 + 5 + 5
    assert m["vllm:request_queue_time_seconds_sum"] == pytest.approx(2 * 0.1 + 2 * 0.3)
    assert m["vllm:request_prefill_time_seconds_sum"] == pytest.approx(2 * 0.2 + 2 * 0.4)


def test_iteration_tokens_total():
    """vLLM's iteration_tokens_total (its bounds, vllm/v1/metrics/loggers.py): the engine's steps binned by their
    prefill plus sampled tokens, cumulative, the sum those tokens (was: absent)."""
    bins = [0] * 14
    bins[0], bins[1], bins[4], bins[13] = 2, 5, 1, 1  # 1 token; 2-8; 33-64; more than 16384
    stats = {"step_token_bins": bins, "prefill_tokens": 20000, "generated_tokens": 40, "steps": 9}
    text = _State().metrics.render(stats, True, False).decode()
    assert "# TYPE vllm:iteration_tokens_total histogram" in text
    m = parse_metrics(text)
    bounds = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    seen = [m[f'vllm:iteration_tokens_total_bucket{{le="{float(b)}"}}'] for b in bounds]
    assert seen == [2, 7, 7, 7, 8, 8, 8, 8, 8, 8, 8, 8, 8]
    assert m['vllm:iteration_tokens_total_bucket{le="+Inf"}'] == m["vllm:iteration_tokens_total_count"] == 9
    assert m["vllm:iteration_tokens_total_sum"] == 20040
    assert not any(k.startswith("vllm:iteration_tokens") for k in _scrape(_State()))  # (no engine stats: none)


def test_token_buckets_follow_max_model_len(clock):
    """The per-request token histograms' buckets run 1, 2, 5, ... up to the model's max_model_len, as vLLM's
    build_1_2_5_buckets (was: fixed up to 100,000, so every prompt of a 1M-token context's long requests fell in
    +Inf); unknown (None): the fixed ones; ServerState passes the engine's max_model_len."""
    from kda_rt.server.app import ServerState
    from kda_rt.server.metrics import one_two_five

    assert one_two_five(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert one_two_five(1_000_000)[-3:] == (200000, 500000, 1000000) and one_two_five(0) == (1,)
    state = _State()
    state.metrics = Metrics("demo", "vllm:", max_model_len=1_000_000)
    _serve(state, _run(state, prompts=(300_000,)), clock, [(0.5, _delta((0, 3, "length"), finished=True))])
    m = _scrape(state)
    assert m['vllm:request_prompt_tokens_bucket{le="200000.0"}'] == 0
    assert m['vllm:request_prompt_tokens_bucket{le="500000.0"}'] == 1
    assert 'vllm:request_prompt_tokens_bucket{le="1e+06"}' in m
    assert 'vllm:request_generation_tokens_bucket{le="2.0"}' in m
    for info, top in (({"max_model_len": 4096}, "2000.0"), ({}, "100000.0")):
        client = types.SimpleNamespace(info=info)
        text = ServerState(client, "m", metrics_prefix="vllm:").metrics.render(None, True, False).decode()
        tops = [line for line in text.splitlines() if line.startswith("vllm:request_prompt_tokens_bucket")]
        assert f'le="{top}"' in tops[-2], tops  # (the last finite bound, then +Inf)


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
