"""What the HTTP process keeps of a request's output (`RequestRun.choices`): a stream keeps only its counts and
finishes (its chunks carry the output), a non-streaming request its output, gathered in time linear in its length."""

from __future__ import annotations

import asyncio
import time

from kda_rt.server import protocol
from kda_rt.server.metrics import Metrics
from kda_rt.server.run import RequestRun


class _State:
    """What a RequestRun reads of the server's state."""

    def __init__(self) -> None:
        self.open: dict = {}
        self.metrics = Metrics("demo", "kda_rt_test_stream_output:")


def _run(stream: bool, n: int = 2) -> RequestRun:
    req = protocol.CompletionRequest(prompt="x", n=n, stream=stream)
    added = {"prompt_tokens": 1, "prompts": [{"num_tokens": 1}]}
    return RequestRun(_State(), "cmpl-t", req, False, asyncio.Queue(), added, {"params": {"logprobs": 2}}, 0.0)


def _delta(index: int, finish: str | None = None) -> dict:
    return {"id": "cmpl-t", "finished": False, "outputs": [
        {"index": index, "text": "ab", "token_ids": [7], "logprobs": [[b"ab", -0.5, [[b"ab", -0.5], [b"c", -1.0]]]],
         "finish_reason": finish, "stop_reason": None}]}


def test_stream_keeps_no_copy_of_its_output():
    """A stream's run counts its tokens and finishes but keeps none of its text or logprobs (was: every delta's text
    and logprobs were gathered as for a JSON answer, so a long stream's whole output stayed in the HTTP process until it
    ended, on top of what its chunks carried)."""
    run = _run(stream=True)
    for k in range(1000):
        run.choices.add(_delta(k % 2, "length" if k >= 998 else None))
    assert run.choices.completion_tokens == 1000 and [f for f, _ in run.choices.finish] == ["length", "length"]
    assert run.choices.pieces == [[], []] and run.choices.logprobs == [None, None]


def test_answer_gathered_in_linear_time():
    """A non-streaming answer of many deltas is gathered in time linear in its length (was: each delta's text and
    logprobs were concatenated onto copies of everything before, quadratic: ~10 s of event-loop time for 100000
    one-token deltas, stalling every other request meanwhile) and built as before."""
    run = _run(stream=False, n=1)
    start = time.perf_counter()
    for _ in range(100_000):
        run.choices.add(_delta(0))
    assert time.perf_counter() - start < 3.0
    choice = run.choices.build()[0]
    assert choice["text"] == "ab" * 100_000 and len(choice["logprobs"]["tokens"]) == 100_000
    assert choice["logprobs"]["top_logprobs"][0] == {"ab": -0.5, "c": -1.0}
