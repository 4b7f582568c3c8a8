"""`EngineClient` against a scripted engine on a socketpair (no model, no server): which request a step's outputs
reach, how long the engine's silence is counted, and `close()` with an engine that reads nothing."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import pytest

from kda_rt.server.engine_client import EngineClient, EngineDeadError, StreamBacklogError
from kda_rt.server.wire import FrameSocket


class ScriptedEngine:
    """The engine process's end of the socket, driven by the test (blocking; the client's frames are written to the
    socket as soon as it sends them)."""

    def __init__(self, sock: socket.socket) -> None:
        self.conn = FrameSocket(sock)
        self._got: list[dict] = []

    def recv(self, timeout: float = 5.0) -> dict:
        deadline = time.monotonic() + timeout
        while not self._got and time.monotonic() < deadline:
            self._got += self.conn.poll(0.05)
        assert self._got, "the client sent nothing"
        return self._got.pop(0)

    def send(self, message: dict) -> None:
        self.conn.send(message)

    def added(self, add: dict) -> None:
        self.send({"op": "added", "id": add["id"], "prompt_tokens": 1, "prompts": [{"num_tokens": 1}]})

    def outs(self, rid: str, text: str, finished: bool) -> None:
        self.send({"op": "outs", "items": [{"id": rid, "finished": finished, "outputs": [
            {"index": 0, "text": text, "token_ids": [1], "logprobs": None,
             "finish_reason": "length" if finished else None, "stop_reason": None}]}]})


async def _connected(engine_timeout: float = 60.0, **kwargs) -> tuple[EngineClient, ScriptedEngine]:
    """A client wired as `start()` wires it, to a scripted engine; its `proc` a stand-in that never exits alone."""
    client = EngineClient({}, engine_timeout=engine_timeout, **kwargs)
    ours, theirs = socket.socketpair()
    reader, client._writer = await asyncio.open_unix_connection(sock=ours)
    client._reader_task = asyncio.get_running_loop().create_task(client._read(reader))
    client.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return client, ScriptedEngine(theirs)


async def _close(client: EngineClient, engine: ScriptedEngine) -> None:
    client.proc.kill()
    engine.conn.sock.close()
    await asyncio.wait_for(client.close(timeout=2.0), 10)


def test_outputs_sent_before_an_abort_never_reach_a_later_request_of_its_id():
    """A client that disconnects and retries at once with the same X-Request-Id: the engine's outputs of the first
    request that were on their way when the abort left (one step's) must not reach the retry, which reuses the id
    (was: the retry's answer began with the aborted request's tokens, or was a 500 when their `n` differed)."""
    async def main() -> list[str]:
        client, engine = await _connected()
        try:
            first = asyncio.ensure_future(client.add("cmpl-same", {"params": {}}))
            await asyncio.sleep(0.05)
            old = engine.recv()
            engine.added(old)
            await first
            client.abort("cmpl-same")  # (the client went away)
            retry = asyncio.ensure_future(client.add("cmpl-same", {"params": {}}))
            await asyncio.sleep(0.05)
            # the engine, still in its step, sends that step's outputs of the first request; then it reads the abort
            # and the retry's add
            engine.outs(old["id"], "stale", finished=False)
            assert engine.recv()["op"] == "abort"
            new = engine.recv()
            engine.added(new)
            engine.outs(new["id"], "fresh", finished=True)
            queue, _ = await asyncio.wait_for(retry, 5)
            texts = []
            while (item := await asyncio.wait_for(queue.get(), 5)) is not None:
                texts += [c["text"] for c in item["outputs"]]
                assert item["id"] == "cmpl-same"
            return texts
        finally:
            await _close(client, engine)

    assert asyncio.run(main()) == ["fresh"]


def test_unread_stream_output_is_bounded():
    """A client that stops reading its stream while the engine keeps writing: once more than max_stream_backlog token
    entries (a token and its top logprobs) wait in its queue, the request is aborted in the engine, the waiting output
    dropped and the queue ends with StreamBacklogError (was: every delta was kept until the request ended and the
    client went away: a stalled reader of a long request held its whole output in the HTTP process, and its seat in
    the engine).  A reader that keeps up is never cut, however long its request."""
    def outs(rid: str, num_tokens: int, top: int) -> dict:
        lps = [[b"t", -1.0, [[b"t", -1.0]] * top]] * num_tokens
        return {"op": "outs", "items": [{"id": rid, "finished": False, "outputs": [
            {"index": 0, "text": "t" * num_tokens, "token_ids": [1] * num_tokens, "logprobs": lps,
             "finish_reason": None, "stop_reason": None}]}]}

    async def main() -> None:
        client, engine = await _connected(max_stream_backlog=100)
        try:
            for rid in ("cmpl-reader", "cmpl-stalled"):
                task = asyncio.ensure_future(client.add(rid, {"params": {}}))
                await asyncio.sleep(0.05)
                engine.added(engine.recv())
                await task
            reader, stalled = client.queues["cmpl-reader"], client.queues["cmpl-stalled"]
            ids = {rid: client._engine_ids[rid] for rid in client.queues}
            for _ in range(30):  # 30 x 4 tokens with 4 top logprobs = 600 entries for each
                engine.send(outs(ids["cmpl-reader"], 4, 4))
                item = await asyncio.wait_for(reader.get(), 5)
                assert item["outputs"][0]["token_ids"] == [1] * 4
                engine.send(outs(ids["cmpl-stalled"], 4, 4))
            abort = engine.recv()
            assert abort == {"op": "abort", "id": ids["cmpl-stalled"]}
            assert stalled.qsize() == 1 and stalled.held == 0
            with pytest.raises(StreamBacklogError, match="max-stream-backlog 100"):
                raise stalled.get_nowait()
            assert "cmpl-stalled" not in client.queues and "cmpl-reader" in client.queues
        finally:
            await _close(client, engine)

    asyncio.run(main())


def test_silence_is_counted_from_the_first_request_after_idle():
    """An engine that was idle (and so silent) for longer than --engine-timeout and then takes over a second to
    answer a request (a long prompt to tokenize, prompt logprobs to compute) is not stuck: its silence counts from
    that request (was: from its last frame before the idle time, so the request got a 503 "has not answered for N s"
    after its first second, and /health said 503 meanwhile)."""
    async def main() -> None:
        client, engine = await _connected(engine_timeout=3.0)
        try:
            client._last_heard -= 100.0  # the engine's last frame: 100 s ago (idle since)
            task = asyncio.ensure_future(client.add("cmpl-slow", {"params": {}}))
            await asyncio.sleep(1.3)  # past the client's first check (after 1 s), well within the timeout
            assert not client.stalled and not task.done()
            engine.added(engine.recv())
            await asyncio.wait_for(task, 5)
        finally:
            await _close(client, engine)

    asyncio.run(main())


def test_close_is_bounded_when_the_engine_reads_nothing():
    """Shutting down with an engine that stopped reading (hung, or SIGSTOPped) while frames it never read fill the
    socket: close() still ends within its timeout and kills the engine process (was: it waited forever for the
    shutdown frame to drain, so SIGTERM never finished and the hung engine outlived the server)."""
    async def main() -> None:
        client, engine = await _connected()
        big = asyncio.ensure_future(client.call("tokenize", {"prompt": "x" * (8 << 20)}))  # (never read)
        await asyncio.sleep(0.05)
        start = time.monotonic()
        try:
            await asyncio.wait_for(client.close(timeout=0.5), 15)
            assert time.monotonic() - start < 5
            assert client.proc.poll() is not None, "the engine process was left running"
            with pytest.raises(EngineDeadError):
                await big
        finally:
            client.proc.kill()
            engine.conn.sock.close()

    asyncio.run(main())
