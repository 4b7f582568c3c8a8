"""The request field `priority` (vLLM's): a server started with `--scheduling-policy priority` runs waiting requests
lowest value first; the default "fcfs" server answers a priority other than 0 with a 400 that names it, on every
endpoint that takes one."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from helpers.server import ServerProc


@pytest.fixture(scope="module")
def priority_server(tmp_path_factory):
    srv = ServerProc(tmp_path_factory.mktemp("priority") / "server.log", "--scheduling-policy", "priority",
                     "--max-num-seqs", "1")
    yield srv
    assert srv.stop() == 0, srv.log()


def _post(srv, path, body):
    return httpx.post(srv.url + path, headers=srv.headers, timeout=120.0, json={"model": "demo", **body})


def _wait_for(srv, metric: str, value: int) -> None:
    deadline = time.monotonic() + 60
    while srv.metrics().get(metric, 0) < value:
        assert time.monotonic() < deadline, f"{metric} never reached {value}"
        time.sleep(0.01)


def test_fcfs_server_refuses_a_priority_by_name(server):
    for path, body in (("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
                       ("/v1/completions", {"prompt": "Hello", "max_tokens": 0, "echo": True, "logprobs": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
                       ("/v1/responses", {"input": "Hi", "max_output_tokens": 2})):
        r = _post(server, path, {**body, "priority": 4})
        assert r.status_code == 400, (path, r.text)
        assert "priority 4: priority scheduling is not enabled" in r.json()["error"]["message"], r.text
        assert _post(server, path, {**body, "priority": 0}).status_code == 200, path
    r = _post(server, "/v1/completions", {"prompt": "Hello", "priority": "high"})
    assert r.status_code == 400 and "priority" in r.json()["error"]["message"], r.text


def test_priority_server_runs_the_urgent_request_first(priority_server):
    """One seat: while a long request holds it, a request with priority 3 and then one with -1 arrive; the second
    finishes first.  Both answers equal the same requests made alone (greedy)."""
    done, bodies = [], {}

    def send(name, body):
        r = _post(priority_server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        bodies[name] = r.json()["choices"][0]["text"]
        done.append(name)

    holder = threading.Thread(target=send, args=("holder", {"prompt": "Once upon a time", "max_tokens": 200,
                                                            "temperature": 0.0, "ignore_eos": True}))
    holder.start()
    _wait_for(priority_server, "kda_rt:num_requests_running", 1)
    late = {"prompt": "The storm", "max_tokens": 4, "temperature": 0.0, "priority": 3}
    urgent = {"prompt": "The keeper", "max_tokens": 4, "temperature": 0.0, "priority": -1}
    threads = [threading.Thread(target=send, args=("late", late))]
    threads[0].start()
    _wait_for(priority_server, "kda_rt:num_requests_waiting", 1)  # (the late one is queued first)
    threads.append(threading.Thread(target=send, args=("urgent", urgent)))
    threads[1].start()
    for t in [holder, *threads]:
        t.join(120)
    assert "holder" in done and len(bodies["holder"]) > 0
    assert done == ["holder", "urgent", "late"], (done, priority_server.log()[-2000:])
    for name, body in (("late", late), ("urgent", urgent)):  # alone, with nothing queued
        assert _post(priority_server, "/v1/completions", body).json()["choices"][0]["text"] == bodies[name]
