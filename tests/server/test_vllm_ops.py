"""vLLM's operational surface that routers and dashboards read: `--metrics-prefix vllm:` (every /metrics name under
vLLM's prefix, so vLLM's Grafana dashboards, KEDA autoscalers and the production-stack router read them) and
`GET /load` (the generation requests in flight)."""

from __future__ import annotations

import threading
import time

import httpx

from helpers.server import ServerProc, parse_metrics


def test_vllm_prefix_and_load(tmp_path):
    srv = ServerProc(tmp_path / "server.log", "--metrics-prefix", "vllm:", "--enable-server-load-tracking")
    try:
        assert httpx.get(srv.url + "/load", timeout=10).json() == {"server_load": 0}
        body = {"model": "demo", "prompt": "The lighthouse", "max_tokens": 200, "temperature": 0.0, "ignore_eos": True}
        t = threading.Thread(target=lambda: httpx.post(srv.url + "/v1/completions", headers=srv.headers, json=body,
                                                       timeout=120))
        t.start()
        deadline, load = time.monotonic() + 30, 0
        while load == 0 and time.monotonic() < deadline:
            load = httpx.get(srv.url + "/load", timeout=10).json()["server_load"]
            time.sleep(0.01)
        assert load == 1
        t.join(120)
        assert httpx.get(srv.url + "/load", timeout=10).json() == {"server_load": 0}
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        m = parse_metrics(text)
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "generation_tokens_total",
                     "e2e_request_latency_seconds_count", "request_queue_time_seconds_count"):
            assert f"vllm:{name}" in m, name
        assert m["vllm:generation_tokens_total"] == 200 and "kda_rt:" not in text
    finally:
        assert srv.stop() == 0, srv.log()
