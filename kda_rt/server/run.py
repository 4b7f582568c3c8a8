"""One admitted request in the HTTP process (`RequestRun`): drain its delta queue into a JSON
response or an SSE stream, record metrics and the request log line, and abort it in the engine when
it ends any other way than finished.  Also the JSON / error response helpers the routes share."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from kda_rt.server import protocol, responses
from kda_rt.server.engine_client import EngineDeadError, EngineTimeoutError, StreamBacklogError
from kda_rt.server.metrics import ChoiceTimes

if TYPE_CHECKING:
    from kda_rt.server.app import ServerState

__all__ = ["ABORTED", "RequestRun", "endpoint_name", "error_response", "json_response"]

logger = logging.getLogger(__name__)

ABORTED = object()  # put into a request's queue when the server aborts it at the end of a drain


def json_response(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


DISCONNECT_POLL_S = 1.0  # how often a non-streaming request looks for its client's disconnect (seconds)
RETRY_AFTER_S = 1  # the Retry-After of a 429: the waiting queue drains at the engine's pace (seconds)


def error_response(message: str, status: int, param: str | None = None) -> Response:
    response = json_response(protocol.error_body(message, status, param=param), status)
    if status == 429:  # the openai client's retries honour it
        response.headers["retry-after"] = str(RETRY_AFTER_S)
    return response


class RequestRun:
    """One admitted request: drains its delta queue into a response or an SSE stream, and aborts
    it in the engine if it ends any other way than finished (disconnect, cancellation, error)."""

    def __init__(self, state: ServerState, rid: str, req: Any, chat: bool, queue: asyncio.Queue,
                 added: dict[str, Any], payload: dict[str, Any], start: float) -> None:
        self.state, self.rid, self.req, self.chat, self.queue = state, rid, req, chat, queue
        self.prompt_tokens, self.start = added["prompt_tokens"], start
        self.prompts = added["prompts"]
        # {"temperature", "top_p"} the engine samples with, its defaults filled in (the Responses API echoes them; an
        # answer without them reads as the request's own)
        self.sampling: dict[str, float] | None = added.get("sampling")
        # the max_tokens the client asked for (a score-only request's 0 too), None when it left it out
        self.max_tokens = next((v for v in (getattr(req, "max_completion_tokens", None), getattr(req, "max_tokens", None))
                                if v is not None), None)
        self.num_choices = req.n * len(self.prompts)
        # a choice's first / latest token and finish (vLLM counts a request's n choices as n child requests)
        self.times = [ChoiceTimes() for _ in range(self.num_choices)]
        self.cached_tokens = 0  # prompt tokens the engine's prefix cache served (usage's prompt_tokens_details)
        self.timing: dict[int, tuple[float, float | None]] = {}  # prompt -> queue s, prefill s the engine measured
        self.created = int(time.time())  # the response's and every chunk's "created"
        self.server_aborted = False
        self.shape = {"num_choices": self.num_choices, "prompts": self.prompts, "echo": payload.get("echo", False),
                      "tool_mode": payload.get("tool_mode"), "logprobs": payload["params"]["logprobs"] is not None,
                      "num_logprobs": payload["params"]["logprobs"],
                      "token_ids": bool(payload.get("return_token_ids")), "as_ids": bool(payload.get("tokens_as_ids"))}
        self.choices = responses.Choices(req.n, chat, keep_output=not req.stream, **self.shape)
        state.open[rid] = queue
        state.metrics.started()

    async def items(self) -> AsyncIterator[dict[str, Any]]:
        """Delta items until the request finishes; raises EngineDeadError if the engine dies."""
        while True:
            item = await self.state.client.wait(self.queue.get(), "serving this request")
            if item is None:
                return
            if item is ABORTED:
                self.server_aborted = True
                done = {i for i, (reason, _) in enumerate(self.choices.finish) if reason is not None}
                item = {"id": self.rid, "finished": True, "outputs": [
                    {"index": i, "text": "", "token_ids": [], "logprobs": None, "finish_reason": "abort",
                     "stop_reason": None} for i in range(self.num_choices) if i not in done]}
            if isinstance(item, BaseException):
                raise item
            self._observe(item)
            self.choices.add(item)
            yield item
            if item["finished"]:
                return

    def _observe(self, item: dict[str, Any]) -> None:
        """Per choice with new tokens: its first token (TTFT, its prompt's tokens) or its gap since its last, as
        vLLM observes each child request; then the item's tokens, cached prompt tokens and engine timings."""
        metrics, now, num_tokens, n = self.state.metrics, time.perf_counter(), 0, self.req.n
        for c in item["outputs"]:
            t = self.times[c["index"]]
            if c["token_ids"]:
                num_tokens += len(c["token_ids"])
                if t.first is None:
                    t.first = now
                    metrics.first_token(now - self.start, self.prompts[c["index"] // n]["num_tokens"])
                else:
                    metrics.token_gap(now - t.last)
                t.last = now
            if c["finish_reason"] is not None and t.end is None:
                t.end = now
        if num_tokens:
            metrics.tokens(num_tokens)
        self.cached_tokens += item.get("cached_tokens", 0)
        for offset, queue_s, prefill_s in item.get("timing", ()):
            self.timing.setdefault(offset // n, (queue_s, prefill_s))

    def _end(self, outcome: str) -> None:
        outcome = "aborted" if self.server_aborted else outcome
        self.state.open.pop(self.rid, None)
        if outcome != "finished":
            self.state.client.abort(self.rid)
        end = time.perf_counter()
        self.state.metrics.finish(outcome, [p["num_tokens"] for p in self.prompts], self.choices.num_tokens,
                                  [reason for reason, _ in self.choices.finish], self.times, n=self.req.n,
                                  start=self.start, end=end, max_tokens=self.max_tokens, timing=self.timing)
        if self.state.log_requests:
            logger.info("request %s %s in %.3f s: %d completion tokens, finish %s", self.rid, outcome, end - self.start,
                        self.choices.completion_tokens, [f for f, _ in self.choices.finish])

    def _usage(self) -> dict[str, Any]:
        out = responses.usage(self.prompt_tokens, self.choices.completion_tokens)
        if self.state.prompt_tokens_details:  # (vLLM's --enable-prompt-tokens-details)
            out["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return out

    async def collect(self, request: Request, shape=None) -> Response:
        """The whole answer once the request ends (a client disconnect aborts it); `shape(body)` turns the chat
        body into another API's (the Responses API)."""
        outcome = "aborted"
        try:
            it = self.items()
            checked = time.monotonic()
            while True:
                nxt = asyncio.ensure_future(it.__anext__())
                while not nxt.done():
                    await asyncio.wait([nxt], timeout=DISCONNECT_POLL_S)
                    # every DISCONNECT_POLL_S whether or not deltas come (the engine sends one a step, so a check
                    # made only when none came never ran while a request generated)
                    if not nxt.done() or time.monotonic() - checked >= DISCONNECT_POLL_S:
                        checked = time.monotonic()
                        if request is not None and await request.is_disconnected():  # (None: a background run)
                            nxt.cancel()
                            return Response(status_code=499)
                try:
                    nxt.result()
                except StopAsyncIteration:
                    break
            outcome = "finished"
        except (EngineDeadError, EngineTimeoutError) as exc:
            outcome = "error"
            return error_response(f"the engine failed while serving this request: {exc}", 503)
        except StreamBacklogError as exc:  # (the server fell behind its own queue: not the client's doing here)
            return error_response(str(exc), 503)
        finally:
            self._end(outcome)
        body = {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.state.model_name, "choices": self.choices.build(),
                "usage": self._usage()}
        if self.chat and self.prompts and "logprobs" in self.prompts[0]:
            body["prompt_logprobs"] = responses.prompt_logprobs_field(self.prompts[0]["logprobs"])
        if self.chat and self.shape["token_ids"] and self.prompts:  # (vLLM's return_token_ids)
            body["prompt_token_ids"] = self.prompts[0].get("ids")
        return json_response(body if shape is None else shape(body))

    async def sse(self) -> AsyncIterator[bytes]:
        outcome, model, chat = "aborted", self.state.model_name, self.chat
        chunk = functools.partial(responses.chunk, self.rid, model, chat, created=self.created)
        stream = responses.StreamChoices(self.req.n, chat, **self.shape)
        options = self.req.stream_options
        continuous = options is not None and options.include_usage and options.continuous_usage_stats
        try:
            if chat:
                first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(self.num_choices)]
                body = chunk(first, self._usage() if continuous else None)
                if self.prompts and "logprobs" in self.prompts[0]:
                    body["prompt_logprobs"] = responses.prompt_logprobs_field(self.prompts[0]["logprobs"])
                if self.shape["token_ids"] and self.prompts:
                    body["prompt_token_ids"] = self.prompts[0].get("ids")
                yield _event(body)
            elif self.shape["echo"] or any("logprobs" in p for p in self.prompts):
                yield _event(chunk(stream.echo_choices(), self._usage() if continuous else None))
            async for item in self.items():
                choices = stream.choices(item)
                if choices:
                    yield _event(chunk(choices, self._usage() if continuous else None))
            if options is not None and options.include_usage:
                yield _event(chunk([], self._usage()))
            outcome = "finished"
            yield b"data: [DONE]\n\n"
        except (EngineDeadError, EngineTimeoutError) as exc:
            outcome = "error"
            yield _event(protocol.error_body(f"the engine failed while serving this request: {exc}", 503))
            yield b"data: [DONE]\n\n"  # a stream always ends so, as vLLM's do after an error event
        except StreamBacklogError as exc:  # (aborted: what was not read is gone; this ends the stream if it is read)
            yield _event(protocol.error_body(str(exc), 408))
            yield b"data: [DONE]\n\n"
        finally:
            self._end(outcome)


def endpoint_name(chat: bool) -> str:
    return "chat" if chat else "completions"


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"
