"""Load: 64 concurrent streaming clients, a random 20% of them hanging up mid-stream.

Every other stream must complete with exactly the tokens `LLM.generate` gives for its seed (so no
request is lost, duplicated or mixed with another), the server's outcome counters must add up,
and afterwards every KDA slot and MLA page must be free again (read from /metrics)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from kda_rt import SamplingParams

NUM_CLIENTS = 64
MAX_TOKENS = 12
TIME_LIMIT_S = 180


# float64 on both sides: each stream's seeded samples are compared with a batch of 64 computed at once, and float32
# logprobs move by ~3e-6 with the batch's mix (enough to flip a temperature-1 draw near a boundary, rarely)
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from helpers.server import ServerProc, pid_gone

    srv = ServerProc(tmp_path_factory.mktemp("load") / "server.log", "--dtype", "float64")
    yield srv
    assert srv.stop() == 0, srv.log()
    assert pid_gone(srv.engine_pid), "engine process outlived the server"


@pytest.fixture(scope="module")
def reference_llm():
    from helpers.server import MAX_MODEL_LEN
    from kda_rt import LLM
    from kda_rt.demo import demo_path

    return LLM(str(demo_path()), backend="numpy", dtype="float64", max_model_len=MAX_MODEL_LEN, max_num_seqs=16)


def _prompt(i: int) -> str:
    return f"client {i} asks about the weather"


async def _client(server, http: httpx.AsyncClient, i: int, hang_up_after: int | None) -> dict:
    body = {"model": "demo", "prompt": _prompt(i), "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 1000 + i,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    got = {"i": i, "ids": set(), "text": "", "finish": None, "done": False, "usage": None, "chunks": 0}
    async with http.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                got["done"] = True
                continue
            chunk = json.loads(line[6:])
            got["ids"].add(chunk["id"])
            got["usage"] = chunk.get("usage") or got["usage"]
            for c in chunk["choices"]:
                got["text"] += c["text"]
                got["finish"] = c["finish_reason"] or got["finish"]
            got["chunks"] += 1
            if hang_up_after is not None and got["chunks"] >= hang_up_after:
                return got  # leaving the block closes the connection mid-stream
    return got


async def _run_all(server, hang_ups: dict[int, int]) -> list[dict]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=120) as http:
        tasks = [_client(server, http, i, hang_ups.get(i)) for i in range(NUM_CLIENTS)]
        return await asyncio.wait_for(asyncio.gather(*tasks), TIME_LIMIT_S)


@pytest.mark.slow
def test_concurrent_streams_with_disconnects(server, reference_llm):
    rng = random.Random(2024)
    hang_ups = {i: rng.randint(1, MAX_TOKENS // 2) for i in rng.sample(range(NUM_CLIENTS), round(NUM_CLIENTS * 0.2))}
    before = server.metrics()
    t0 = time.monotonic()
    results = asyncio.run(_run_all(server, hang_ups))
    elapsed = time.monotonic() - t0

    prompts = [_prompt(i) for i in range(NUM_CLIENTS)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=1000 + i, ignore_eos=True)
              for i in range(NUM_CLIENTS)]
    ref = reference_llm.generate(prompts, params)
    all_ids = [rid for r in results for rid in r["ids"]]
    assert len(all_ids) == len(set(all_ids)) == NUM_CLIENTS, "each stream must carry exactly one request id"
    for r in results:
        if r["i"] in hang_ups:
            continue
        assert r["done"] and r["finish"] == "length", r
        assert r["text"] == ref[r["i"]].outputs[0].text, f"client {r['i']} got another request's tokens"
        assert r["usage"]["completion_tokens"] == MAX_TOKENS

    # disconnects are noticed asynchronously: wait for the engine to settle, then check the books
    deadline = time.monotonic() + 30
    while True:
        m = server.metrics()
        idle = m["kda_rt:num_requests_running"] == 0 and m["kda_rt:num_requests_waiting"] == 0
        if (idle and m["kda_rt:requests_in_flight"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert m["kda_rt:state_slots_used"] == 0 and m["kda_rt:kv_pages_used"] == 0, m
    assert m["kda_rt:num_requests_running"] == 0 and m["kda_rt:num_requests_waiting"] == 0, m
    assert m["kda_rt:state_slots_free"] == 16

    def delta(key):
        return m.get(key, 0) - before.get(key, 0)

    finished, aborted = delta('kda_rt:requests_total{outcome="finished"}'), delta('kda_rt:requests_total{outcome="aborted"}')
    # a client may hang up just as its last chunk goes out, so a hang-up can still count as finished
    assert finished + aborted == NUM_CLIENTS and finished >= NUM_CLIENTS - len(hang_ups), (finished, aborted)
    assert aborted >= 1
    engine_done = delta("kda_rt:engine_requests_finished_total") + delta("kda_rt:engine_requests_aborted_total")
    assert engine_done == NUM_CLIENTS, "every request ends exactly once in the engine"
    assert server.metrics()["kda_rt:time_to_first_token_seconds_count"] >= NUM_CLIENTS - len(hang_ups)
    print(f"{NUM_CLIENTS} clients, {len(hang_ups)} hung up, {elapsed:.1f}s")


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-s"]))
