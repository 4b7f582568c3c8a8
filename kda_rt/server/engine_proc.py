"""The engine process: loads the model, then serves `add` / `abort` / `stats` / `shutdown` frames
from the HTTP process and streams back per-request deltas after every engine step.

    python -m kda_rt.server.engine_proc --fd N      (started by `EngineClient`, never by hand)

Loop: take every frame that has arrived (waiting for one only when the engine is idle), apply
them, run one `LLMEngine.step()` when there is work, send the step's deltas in one `outs` frame.
Prompt validation happens here, against the real engine (max_model_len, vocabulary, page pool),
so the HTTP process never needs the model.  The process exits when the HTTP process sends
`shutdown` or closes its end of the socket; an exception in a step sends `fatal` and exits 1.
SIGINT and SIGTERM are ignored: a Ctrl-C in the terminal (or a SIGTERM to the whole process group)
reaches the server too, which drains and then shuts this process down.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import time
import traceback
from typing import Any

from kda_rt.engine.postprocess import DeltaTracker
from kda_rt.server.wire import FrameSocket

__all__ = ["EngineWorker", "HEARTBEAT_S", "main"]

HEARTBEAT_S = 1.0  # while busy, a `beat` frame at least this often, so the HTTP side can tell busy from stuck

logger = logging.getLogger(__name__)


class _Open:
    """Per-request state in the engine process."""

    __slots__ = ("tracker", "reported", "logprobs")

    def __init__(self, logprobs: int | None) -> None:
        self.tracker = DeltaTracker()
        self.reported: set[int] = set()  # sample indices whose finish was already sent
        self.logprobs = logprobs


class EngineWorker:
    def __init__(self, llm, conn: FrameSocket, max_waiting: int) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.tokenizer = llm.tokenizer
        self.conn = conn
        self.max_waiting = max_waiting
        self.open: dict[str, _Open] = {}
        self.running = True

    # -- frames from the HTTP process -----------------------------------------------------------

    def handle(self, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "add":
            self._add(msg)
        elif op == "abort":
            self.open.pop(msg["id"], None)
            self.engine.abort(msg["id"])
        elif op == "stats":
            self.conn.send({"op": "stats", "id": msg["id"], "stats": self.engine.stats()})
        elif op == "shutdown":
            for rid in list(self.open):
                self.engine.abort(rid)
            self.open.clear()
            self.running = False
        else:
            logger.warning("engine process: unknown op %r ignored", op)

    def _add(self, msg: dict[str, Any]) -> None:
        from kda_rt.sampler.params import SamplingParams

        rid = msg["id"]
        waiting = self.engine.num_waiting()  # sequences: a request adds n of them
        n = msg["params"].get("n", 1)
        n = n if isinstance(n, int) and n > 0 else 1
        if n > self.max_waiting:
            self.conn.send({"op": "rejected", "id": rid, "status": 400,
                            "error": f"n = {n} exceeds the server's max_waiting {self.max_waiting} (--max-waiting)"})
            return
        if waiting + n > self.max_waiting:
            self.conn.send({"op": "rejected", "id": rid, "status": 429,
                            "error": f"the waiting queue is full ({waiting} sequences waiting + {n} new > max_waiting "
                                     f"{self.max_waiting}); retry later"})
            return
        try:
            params = SamplingParams(**msg["params"])
            prompt = msg.get("prompt")
            if msg.get("messages") is not None:
                if self.tokenizer is None:
                    raise ValueError("this model has no tokenizer files, so chat requests are unavailable")
                prompt = {"prompt_token_ids": self.tokenizer.encode_chat(msg["messages"], tools=msg.get("tools"))}
            elif isinstance(prompt, list):
                prompt = {"prompt_token_ids": prompt}
            self.engine.add_request(rid, prompt, params)
        except (ValueError, TypeError, KeyError) as exc:
            self.conn.send({"op": "rejected", "id": rid, "status": 400, "error": str(exc)})
            return
        except Exception as exc:  # a bug while preparing one request must not take the engine down
            logger.exception("engine process: request %s could not be prepared", rid)
            self.conn.send({"op": "rejected", "id": rid, "status": 500, "error": f"{type(exc).__name__}: {exc}"})
            return
        self.open[rid] = _Open(params.logprobs)
        seqs = self.engine.requests[rid][1]
        self.conn.send({"op": "added", "id": rid, "prompt_tokens": len(seqs[0].prompt_token_ids)})

    # -- one step -------------------------------------------------------------------------------

    def step(self) -> None:
        items = []
        for out in self.engine.step():
            state = self.open.get(out.request_id)
            if state is None:
                continue
            delta = state.tracker.delta(out)
            comps = []
            for c in delta.outputs:
                new_finish = c.finish_reason is not None and c.index not in state.reported
                if not (c.token_ids or c.text or new_finish):
                    continue
                if new_finish:
                    state.reported.add(c.index)
                comps.append({"index": c.index, "text": c.text, "token_ids": c.token_ids,
                              "logprobs": self._logprobs(c, state.logprobs), "finish_reason": c.finish_reason,
                              "stop_reason": c.stop_reason})
            if out.finished:
                self.open.pop(out.request_id, None)
            if comps or out.finished:
                items.append({"id": out.request_id, "outputs": comps, "finished": out.finished})
        if items:
            self.conn.send({"op": "outs", "items": items})

    def _logprobs(self, comp, num: int | None) -> list | None:
        """Per new token: [token bytes, logprob, [[bytes, logprob] x top `num`, most likely first]]."""
        if comp.logprobs is None or num is None:
            return None
        out = []
        for tok, lps in zip(comp.token_ids, comp.logprobs, strict=True):
            top = sorted(lps.items(), key=lambda kv: -kv[1])[:num]
            out.append([self._bytes(tok), lps[tok], [[self._bytes(t), lp] for t, lp in top]])
        return out

    def _bytes(self, token_id: int) -> bytes:
        if self.tokenizer is None:
            return f"<{token_id}>".encode()
        return self.tokenizer.token_bytes(token_id)

    def run(self) -> None:
        last_beat = time.monotonic()
        while self.running and not self.conn.closed:
            busy = self.engine.has_unfinished_requests()
            for msg in self.conn.poll(0.0 if busy else None):
                self.handle(msg)
            if self.running and self.engine.has_unfinished_requests():
                self.step()
                if time.monotonic() - last_beat >= HEARTBEAT_S:  # steps may send nothing (prefill chunks)
                    self.conn.send({"op": "beat"})
                    last_beat = time.monotonic()


def _load(init: dict[str, Any]):
    from kda_rt.llm import LLM

    return LLM(init["model"], progress=False, **init["settings"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kda_rt.server.engine_proc")
    ap.add_argument("--fd", type=int, required=True, help="inherited Unix socket to the HTTP process")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s kda_rt.engine_proc: %(message)s")
    conn = FrameSocket(socket.socket(fileno=args.fd))
    init = next(iter(conn.poll(None)), None)
    if init is None or init["op"] != "init":
        return 2
    try:
        llm = _load(init)
    except Exception as exc:
        conn.send({"op": "failed", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    cfg = llm.engine_config
    conn.send({"op": "ready", "backend": llm.backend, "max_model_len": cfg.max_model_len,
               "max_num_seqs": cfg.max_num_seqs, "vocab_size": llm.model_config.vocab_size,
               "has_tokenizer": llm.tokenizer is not None})
    worker = EngineWorker(llm, conn, init["max_waiting"])
    try:
        worker.run()
    except Exception as exc:
        logger.error("engine step failed: %s", "".join(traceback.format_exception(exc)).rstrip())
        try:
            conn.send({"op": "fatal", "error": f"{type(exc).__name__}: {exc}"})
        except OSError:
            pass
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
