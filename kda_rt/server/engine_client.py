"""`EngineClient`: the HTTP process's handle on the engine process.

Starts `python -m kda_rt.server.engine_proc` with one end of a socketpair, then talks to it
with msgpack frames (`wire.py`).  A reader task dispatches what comes back: answers to `add` and
`stats` resolve futures, step deltas go to per-request asyncio queues.  Nothing here waits on the
model, so the event loop stays free while the engine computes.

When the engine process dies (crash, OOM kill), the socket reaches end-of-stream: the client logs
one error line with the exit status, marks itself dead, and every open and later request gets
`EngineDeadError` (the app turns it into 503).

A request's deltas wait in its queue until its response takes them; a streaming client that reads slower than the
engine writes (or not at all) leaves them there.  Once more than `max_stream_backlog` token entries wait (a token
counts 1 plus its top logprobs), the request is aborted in the engine, the waiting deltas are dropped and the queue
ends with `StreamBacklogError` (logged at WARNING): the output held for one stalled reader is bounded.  vLLM keeps
it all until the request ends (its collector merges the deltas) and the connection closes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import subprocess
import sys
import time
from typing import Any

from kda_rt.server.wire import FrameError, pack, read_frame

__all__ = ["DeltaQueue", "EngineClient", "EngineDeadError", "EngineTimeoutError", "RequestRejected",
           "StreamBacklogError"]

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine process is gone (or shutting down); requests cannot be served."""


class EngineTimeoutError(RuntimeError):
    """The engine process has sent nothing for `engine_timeout` seconds while work was pending."""


class StreamBacklogError(RuntimeError):
    """A request's client read its output too slowly: more waited in the server than `max_stream_backlog` allows, so
    the request was aborted and the waiting output dropped."""


def _entries(item: Any) -> int:
    """What a delta item holds, in token entries: each new token counts 1 plus its top logprobs."""
    if not isinstance(item, dict):
        return 0
    return sum(len(c["token_ids"]) + sum(len(e[2]) for e in c["logprobs"] or ()) for c in item["outputs"])


class DeltaQueue(asyncio.Queue):
    """One request's delta items on their way to its response; `held`: the token entries queued and not yet taken."""

    def _init(self, maxsize: int) -> None:
        super()._init(maxsize)
        self.held = 0

    def _put(self, item: Any) -> None:
        self.held += _entries(item)
        super()._put(item)

    def _get(self) -> Any:
        item = super()._get()
        self.held -= _entries(item)
        return item


class RequestRejected(Exception):
    """The engine refused a request: `status` 400 (invalid) or 429 (waiting queue full)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


MAX_STREAM_BACKLOG = 1 << 20  # token entries waiting for one request's client (--max-stream-backlog; ~200 MB)


class EngineClient:
    def __init__(self, init: dict[str, Any], engine_timeout: float = 60.0,
                 max_stream_backlog: int = MAX_STREAM_BACKLOG) -> None:
        """engine_timeout: seconds without any frame from a busy engine (it sends a heartbeat at
        least every second while working) before it counts as stuck.  max_stream_backlog: token entries a request's
        queue may hold before the request is aborted (0: no bound)."""
        self.engine_timeout = engine_timeout
        self.max_stream_backlog = max_stream_backlog
        self._last_heard = time.monotonic()
        self._stuck = False
        self.init = {"op": "init", **init}
        self.proc: subprocess.Popen | None = None
        self.info: dict[str, Any] = {}
        self.dead_reason: str | None = None
        self.queues: dict[str, asyncio.Queue] = {}
        # the engine knows a request by an id of its own, new for every add ({request id}@{n}): the outputs of an
        # aborted request that were already on their way never reach a later request reusing its id (an X-Request-Id)
        self._engine_ids: dict[str, str] = {}  # request id -> engine id
        self._request_ids: dict[str, str] = {}  # engine id -> request id
        self._pending: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._closing = False

    @property
    def alive(self) -> bool:
        return self.dead_reason is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def start(self, timeout: float | None = None) -> None:
        """Spawn the engine process and wait until its model is loaded (raises RuntimeError if not)."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with child:  # (the engine process is killed when the thread that starts it exits: engine_proc._exit_with)
            self.proc = subprocess.Popen([sys.executable, "-m", "kda_rt.server.engine_proc", "--fd", str(child.fileno()),
                                          "--parent", str(os.getpid())],
                                         pass_fds=(child.fileno(),), env={**os.environ, "PYTHONUNBUFFERED": "1"})
        reader, self._writer = await asyncio.open_unix_connection(sock=parent)
        self._writer.write(pack(self.init))
        try:
            reply = await asyncio.wait_for(read_frame(reader), timeout)
        except asyncio.TimeoutError:
            await self.close()
            raise RuntimeError(f"engine process did not start within {timeout:g} s (--engine-start-timeout)") from None
        except FrameError as exc:
            await self.close()
            raise RuntimeError(f"engine process did not start ({exc})") from None
        if reply is None or reply["op"] != "ready":
            why = reply["error"] if reply else f"it exited with status {self.proc.wait()}"
            await self.close()
            raise RuntimeError(f"engine process failed to load the model: {why}")
        self.info = reply
        logger.info("engine process %d ready (backend %s, max_model_len %d)", self.proc.pid, reply["backend"],
                    reply["max_model_len"])
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader))

    def stalled_for(self) -> float:
        """Seconds the engine has been silent while work is pending (0.0 when idle or heard from)."""
        if not (self.queues or self._pending) or self.dead_reason is not None:
            return 0.0
        return time.monotonic() - self._last_heard

    @property
    def stalled(self) -> bool:
        """True once the engine was silent past engine_timeout with work pending, until it next
        sends anything (so /health stays 503 after the waiting requests have timed out)."""
        if self.stalled_for() > self.engine_timeout:
            self._stuck = True
        return self._stuck and self.dead_reason is None

    async def wait(self, awaitable, what: str):
        """Await `awaitable` (a future or coroutine); raises EngineTimeoutError once the engine has
        been silent for engine_timeout seconds with work pending (checked every second)."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait([task], timeout=min(1.0, self.engine_timeout))
                if done:
                    return task.result()
                if self.stalled:
                    raise EngineTimeoutError(f"the engine has not answered for {self.stalled_for():.0f} s "
                                             f"(--engine-timeout {self.engine_timeout:g}) while {what}")
        finally:
            if not task.done():
                task.cancel()

    # -- requests -------------------------------------------------------------------------------

    async def add(self, request_id: str, payload: dict[str, Any]) -> tuple[asyncio.Queue, dict[str, Any]]:
        """Submit one request; returns (its delta queue, the engine's `added` answer: `prompt_tokens`,
        and per prompt `num_tokens`, echo `text`, `logprobs`).  Raises RequestRejected or EngineDeadError.  The queue yields `outs` items, then None at the end
        (or an EngineDeadError instance if the engine dies first)."""
        self._check_alive()
        if request_id in self.queues:  # (registered while it is added and while it runs)
            raise RequestRejected(400, f"request id {request_id!r} is already in use")
        engine_id = f"{request_id}@{next(self._ids)}"
        try:
            frame = pack({"op": "add", "id": engine_id, **payload})
        except (OverflowError, TypeError, ValueError) as exc:  # e.g. an int beyond 64 bits in `tools`
            raise RequestRejected(400, f"request cannot be passed to the engine: {exc}") from None
        queue = DeltaQueue()
        fut = asyncio.get_running_loop().create_future()
        self._work_starts()
        self.queues[request_id] = queue
        self._engine_ids[request_id], self._request_ids[engine_id] = engine_id, request_id
        self._pending[engine_id] = fut
        self._write(frame)
        try:
            added = await self.wait(fut, "adding a request")
        except BaseException:
            self._pending.pop(engine_id, None)
            if self.queues.get(request_id) is queue:
                self.abort(request_id)  # it may have been added already
            raise
        return queue, added

    def abort(self, request_id: str) -> None:
        """Forget a request and tell the engine to free its slot and pages (no-op if finished)."""
        self.queues.pop(request_id, None)
        engine_id = self._engine_ids.pop(request_id, None)
        self._request_ids.pop(engine_id, None)
        if engine_id is not None and self.alive:
            self._send({"op": "abort", "id": engine_id})

    async def stats(self) -> dict[str, int]:
        return await self.call("stats", {})

    async def call(self, op: str, payload: dict[str, Any]) -> Any:
        """One question to the engine (`stats`, `tokenize`, `detokenize`) and its answer; a refusal
        raises RequestRejected."""
        self._check_alive()
        key = f"{op}-{next(self._ids)}"
        fut = asyncio.get_running_loop().create_future()
        self._work_starts()
        self._pending[key] = fut
        try:
            frame = pack({"op": op, "id": key, **payload})
        except (OverflowError, TypeError, ValueError) as exc:
            self._pending.pop(key, None)
            raise RequestRejected(400, f"request cannot be passed to the engine: {exc}") from None
        self._write(frame)
        try:
            return await self.wait(fut, f"answering {op}")
        finally:
            self._pending.pop(key, None)

    # -- internals ------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def _work_starts(self) -> None:
        """Called before a request or question is registered: when none was pending, the engine's silence is
        counted from now (it sends nothing while idle, so its last frame may be long ago)."""
        if not (self.queues or self._pending):
            self._last_heard = time.monotonic()

    def _send(self, message: dict[str, Any]) -> None:
        self._write(pack(message))

    def _write(self, frame: bytes) -> None:
        try:
            self._writer.write(frame)
        except (OSError, RuntimeError, AttributeError) as exc:
            self._mark_dead(f"cannot write to the engine process ({exc})")
            raise EngineDeadError(self.dead_reason) from None

    async def _read(self, reader: asyncio.StreamReader) -> None:
        reason = "the engine process closed its connection"
        try:
            while (msg := await read_frame(reader)) is not None:
                self._last_heard, self._stuck = time.monotonic(), False
                self._dispatch(msg)
                if msg["op"] == "fatal":
                    reason = f"engine step failed: {msg['error']}"
        except (FrameError, OSError) as exc:
            reason = f"bad data from the engine process ({exc})"
        status = await asyncio.to_thread(self._wait_exit)
        self._mark_dead(f"{reason}; process {self.pid} {status}")

    def _wait_exit(self, timeout: float = 5.0) -> str:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return "still running"
        return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"

    def _dispatch(self, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "outs":
            for item in msg["items"]:
                request_id = self._request_ids.get(item["id"])  # (None: aborted, or finished)
                queue = self.queues.get(request_id) if request_id is not None else None
                if queue is not None:
                    item["id"] = request_id
                    queue.put_nowait(item)
                    # (a finished item its reader had taken all before: nothing waited for it, whatever its size,
                    # e.g. a beam search's one answer; nothing more comes, so it is no stalled reader's backlog)
                    if 0 < self.max_stream_backlog < queue.held and not (item["finished"] and queue.qsize() == 1):
                        self._overflow(request_id, queue)
                    elif item["finished"]:
                        self.queues.pop(request_id, None)
                        self._request_ids.pop(self._engine_ids.pop(request_id, None), None)
                        queue.put_nowait(None)
        elif op in ("added", "rejected", "stats", "result"):
            fut = self._pending.pop(msg["id"], None)
            if fut is None or fut.done():
                return
            if op == "added":
                fut.set_result(msg)
            elif op == "stats":
                fut.set_result(msg["stats"])
            elif op == "result":
                fut.set_result(msg["result"])
            else:
                fut.set_exception(RequestRejected(msg["status"], msg["error"]))

    def _overflow(self, request_id: str, queue: DeltaQueue) -> None:
        """Abort a request whose client left more than max_stream_backlog token entries unread; its queue keeps only
        the StreamBacklogError that ends its response (sent if the client ever reads again)."""
        message = (f"the client read its stream too slowly: {queue.held} token entries (a token and its top "
                   f"logprobs) waited unread, over --max-stream-backlog {self.max_stream_backlog}; the request was "
                   "aborted")
        logger.warning("request %s: %s", request_id, message)
        self.abort(request_id)
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(StreamBacklogError(message))

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        if self._closing:
            logger.info("engine process stopped: %s", reason)
        else:
            logger.error("ENGINE PROCESS DIED: %s; every request now gets 503", reason)
        err = EngineDeadError(reason)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        for queue in self.queues.values():
            queue.put_nowait(err)
        self.queues.clear()
        self._engine_ids.clear()
        self._request_ids.clear()

    async def close(self, timeout: float = 10.0) -> None:
        """Ask the engine process to exit, then make sure it has: killed if it has not within `timeout` seconds."""
        self._closing = True
        deadline = time.monotonic() + timeout
        if self._writer is not None and self.dead_reason is None:
            try:
                self._writer.write(pack({"op": "shutdown"}))
                # (bounded: an engine that stopped reading, hung, never drains the frames before it; it is killed)
                await asyncio.wait_for(self._writer.drain(), timeout)
            except (OSError, RuntimeError, asyncio.TimeoutError):
                pass
        if self.proc is not None:
            await asyncio.to_thread(self._reap, max(0.0, deadline - time.monotonic()), timeout)
        if self._reader_task is not None:
            try:
                await asyncio.wait_for(self._reader_task, timeout)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
        self._mark_dead("the server is shutting down")
        if self._writer is not None:
            self._writer.close()

    def _reap(self, wait: float, timeout: float) -> None:
        try:
            self.proc.wait(wait)
        except subprocess.TimeoutExpired:
            logger.warning("engine process %d did not exit in %.0fs; killing it", self.proc.pid, timeout)
            self.proc.kill()
            self.proc.wait()
