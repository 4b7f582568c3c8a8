"""Process lifecycle: SIGTERM drains in-flight requests (health and new requests get 503 meanwhile),
a drain past --shutdown-timeout aborts the rest, every child process is gone after exit, and a
crashed engine process turns into 503s and one clear log line instead of a hung server."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from helpers.server import MAX_MODEL_LEN, ServerProc, pid_gone

LONG = {"prompt": "drain me", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True, "temperature": 0.0, "stream": True}


def _start_streams(srv: ServerProc, count: int) -> tuple[list[dict], list[threading.Thread], threading.Barrier]:
    """`count` streaming requests in threads; returns their results, threads, and a barrier passed
    once every stream has its first chunk."""
    results: list[dict] = []
    first = threading.Barrier(count + 1, timeout=60)

    def run(i: int) -> None:
        res = {"finish": None, "done": False, "tokens": 0, "error": None}
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json={**LONG, "seed": i}, headers=srv.headers,
                              timeout=120) as r:
                seen_first = False
                for line in r.iter_lines():
                    if not seen_first:
                        seen_first = True
                        first.wait()
                    if line == "data: [DONE]":
                        res["done"] = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            res["error"] = chunk["error"]
                        for c in chunk.get("choices", []):
                            res["finish"] = c["finish_reason"] or res["finish"]
                            res["tokens"] += 1 if c["text"] or c["finish_reason"] is None else 0
        except httpx.TransportError as exc:
            res["error"] = repr(exc)
        results.append(res)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    return results, threads, first


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests(tmp_path):
    srv = ServerProc(tmp_path / "server.log", "--shutdown-timeout", "60", "--max-num-seqs", "4")
    results, threads, first = _start_streams(srv, 4)
    first.wait()
    srv.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while httpx.get(srv.url + "/health").status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert httpx.get(srv.url + "/health").status_code == 503  # draining
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, headers=srv.headers)
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    for t in threads:
        t.join(120)
    assert srv.proc.wait(60) == 0, srv.log()
    assert len(results) == 4
    assert all(r["done"] and r["finish"] == "length" for r in results), results
    assert pid_gone(srv.engine_pid), "engine process outlived the server"
    assert "drained: every in-flight request finished" in srv.log()


def test_shutdown_timeout_aborts_the_rest(tmp_path):
    srv = ServerProc(tmp_path / "server.log", "--shutdown-timeout", "0.3", "--max-num-seqs", "2")
    results, threads, first = _start_streams(srv, 2)
    first.wait()
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert srv.proc.wait(30) == 0, srv.log()
    assert time.monotonic() - t0 < 15
    assert [r["finish"] for r in results] == ["abort", "abort"], results
    assert pid_gone(srv.engine_pid), "engine process outlived the server"
    assert "shutdown timeout: aborting 2 requests" in srv.log()


def test_engine_crash_becomes_503(tmp_path):
    srv = ServerProc(tmp_path / "server.log", "--max-num-seqs", "2")
    try:
        results, threads, first = _start_streams(srv, 1)
        first.wait()
        os.kill(srv.engine_pid, signal.SIGKILL)
        for t in threads:
            t.join(60)
        # the open stream is told: an error event with no finish_reason, then [DONE] as vLLM's streams end
        assert results[0]["error"] is not None and results[0]["finish"] is None and results[0]["done"], results
        deadline = time.monotonic() + 10
        while httpx.get(srv.url + "/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.02)
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "signal 9" in health.json()["reason"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=srv.headers)
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        m = httpx.get(srv.url + "/metrics")
        assert m.status_code == 200 and re.search(r'^kda_rt:engine_alive\{model_name="[^"]+"\} 0', m.text, re.M)
        log = srv.log()
        assert "ENGINE PROCESS DIED" in log and "killed by signal 9" in log, log
    finally:
        assert srv.stop() == 0, srv.log()



def test_engine_process_exits_with_the_server(tmp_path):
    """A server killed outright takes its engine process with it even when the engine reads nothing (loading the
    model, or hung: here stopped), as a SIGTERM before the drain handler is set (while the model loads) kills it too
    (was: the engine learnt of it only when it next used the socket, so it loaded on for minutes holding its memory,
    and a hung one stayed for ever)."""
    srv = ServerProc(tmp_path / "server.log")
    try:
        os.kill(srv.engine_pid, signal.SIGSTOP)
        srv.proc.kill()
        srv.proc.wait(10)
        assert pid_gone(srv.engine_pid), "the engine process outlived its server"
    finally:
        try:
            os.kill(srv.engine_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        srv.stop()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
