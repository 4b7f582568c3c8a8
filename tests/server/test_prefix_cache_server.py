"""The server with `--enable-prefix-caching --enable-prompt-tokens-details`: usage says how many prompt tokens each
request resumed after (vLLM's prompt_tokens_details.cached_tokens, the Responses API's input_tokens_details), the
completions equal the uncached model's, and /metrics counts the cache's queries and hits."""

from __future__ import annotations

import json

import httpx
import pytest

from helpers.server import ServerProc


@pytest.fixture(scope="module")
def cached_server(tmp_path_factory):
    srv = ServerProc(tmp_path_factory.mktemp("prefix") / "server.log", "--enable-prefix-caching",
                     "--enable-prompt-tokens-details", "--block-size", "16", env={"KDA_RT_SERVER_DEV_MODE": "1"})
    yield srv
    assert srv.stop() == 0, srv.log()


def test_usage_reports_the_cached_prompt_tokens(cached_server, reference_llm):
    from kda_rt import SamplingParams

    system = list(range(40, 90))  # 50 tokens: 3 pages of 16 shared
    # the server is the module's: counters relative to what its other tests left (was: passed only when run first)
    before = cached_server.metrics()
    hits0 = before.get("kda_rt:prefix_cache_hits_total", 0.0)
    queries0 = before.get("kda_rt:prefix_cache_queries_total", 0.0)
    got = []
    for i in range(3):
        prompt = system + [200 + i, 300 + i, 7]
        r = httpx.post(cached_server.url + "/v1/completions", headers=cached_server.headers, timeout=60.0,
                       json={"model": "demo", "prompt": prompt, "max_tokens": 5, "temperature": 0.0})
        assert r.status_code == 200, r.text
        body = r.json()
        want = reference_llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=5))
        assert body["choices"][0]["text"] == want[0].outputs[0].text
        got.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert got == [0, 0, 48]  # (the second stops its chunk where the two part, the third resumes there)
    prompt = system + [205, 305, 7]  # a fourth, streamed with usage in every chunk: the same count from the first
    with httpx.stream("POST", cached_server.url + "/v1/completions", headers=cached_server.headers, timeout=60.0,
                      json={"model": "demo", "prompt": prompt, "max_tokens": 5, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [c["usage"]["prompt_tokens_details"]["cached_tokens"] for c in chunks if c.get("usage")]
    assert len(counts) >= 5 and set(counts) == {48}, counts
    hits = cached_server.metrics()["kda_rt:prefix_cache_hits_total"]
    assert hits - hits0 == 2 * 48 and cached_server.metrics()["kda_rt:prefix_cache_queries_total"] - queries0 > 150
    text = "Tell me a long story about a lighthouse keeper and the storm that came in the winter of the comet."
    cached = []
    for _ in range(3):  # the same input thrice: the second resumes from the first's prompt snapshot (its last 64-token
        # chunk end: the prompt is 65-128 tokens long), the third where the second kept its state (the junction)
        r = httpx.post(cached_server.url + "/v1/responses", headers=cached_server.headers, timeout=60.0,
                       json={"model": "demo", "input": text, "max_output_tokens": 4, "temperature": 0.0})
        assert r.status_code == 200, r.text
        cached.append(r.json()["usage"]["input_tokens_details"]["cached_tokens"])
    assert cached[:2] == [0, 64] and cached[2] > 64 and cached[2] % 16 == 0, cached
    assert cached_server.metrics()["kda_rt:prefix_cache_hits_total"] == hits + cached[1] + cached[2]


def test_reset_prefix_cache_in_dev_mode(cached_server, server):
    """KDA_RT_SERVER_DEV_MODE=1: POST /reset_prefix_cache (vLLM's dev endpoint) drops every kept prefix: a prompt
    resumed after its shared start before the reset computes it again after (cached_tokens 0, the entries gone from
    /metrics), then resumes once more; it needs the API key; a server without dev mode has no such route (404)."""
    system = list(range(500, 560))  # 60 tokens: 3 pages of 16 shared

    def cached_tokens(tail: int) -> int:
        r = httpx.post(cached_server.url + "/v1/completions", headers=cached_server.headers, timeout=60.0,
                       json={"model": "demo", "prompt": system + [tail, 7], "max_tokens": 2, "temperature": 0.0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert [cached_tokens(t) for t in (600, 601, 602)] == [0, 0, 48]
    assert cached_server.metrics()["kda_rt:prefix_cache_entries"] > 0
    denied = httpx.post(cached_server.url + "/reset_prefix_cache", timeout=10.0)
    assert denied.status_code == 401, denied.text
    r = httpx.post(cached_server.url + "/reset_prefix_cache", headers=cached_server.headers, timeout=10.0)
    assert r.status_code == 200 and r.content == b"", r.text
    assert cached_server.metrics()["kda_rt:prefix_cache_entries"] == 0
    assert [cached_tokens(t) for t in (603, 604, 605)] == [0, 0, 48]  # the prompts seen before forgotten too
    missing = httpx.post(server.url + "/reset_prefix_cache", headers=server.headers, timeout=10.0)
    assert missing.status_code == 404 and "no route /reset_prefix_cache" in missing.text


def test_cache_salt_keeps_tenants_apart(cached_server, reference_llm):
    """`cache_salt` (vLLM's field, completions and chat): requests resume only from entries of their own salt, and
    their answers are the uncached model's; an empty salt is a 400 naming it."""
    from kda_rt import SamplingParams

    system = list(range(120, 170))  # 50 tokens: 3 pages of 16 shared
    cached = []
    for i, salt in enumerate(["tenant-a", "tenant-a", "tenant-a", "tenant-b", None, "tenant-a"]):
        prompt = system + [300 + i, 400 + i, 9]
        body = {"model": "demo", "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
        if salt is not None:
            body["cache_salt"] = salt
        r = httpx.post(cached_server.url + "/v1/completions", headers=cached_server.headers, timeout=60.0, json=body)
        assert r.status_code == 200, r.text
        want = reference_llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=4))
        assert r.json()["choices"][0]["text"] == want[0].outputs[0].text
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached == [0, 0, 48, 0, 0, 48], cached
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})):
        r = httpx.post(cached_server.url + path, headers=cached_server.headers, timeout=60.0,
                       json={"model": "demo", **body, "cache_salt": ""})
        assert r.status_code == 400 and "cache_salt must be a non-empty string" in r.text, r.text
    r = httpx.post(cached_server.url + "/v1/chat/completions", headers=cached_server.headers, timeout=60.0,
                   json={"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                         "cache_salt": "tenant-c"})
    assert r.status_code == 200, r.text
