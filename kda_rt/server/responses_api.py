"""POST /v1/responses: OpenAI's Responses API, stateless, text in and text out (as clients built on it, such as
the OpenAI Agents SDK, call it first).

A request becomes a chat request (`instructions` the system message, `input` a string or message items whose
content is a string or `input_text` / `output_text` parts, `max_output_tokens`, `temperature`, `top_p`,
`text.format` text / json_object / json_schema) and runs as one; the answer is a `response` object with one
`message` output item.  `stream: true` sends the Responses events (`response.created`, `response.in_progress`,
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta` ..., the matching
`.done` events, then `response.completed`, whose status is `incomplete` when max_output_tokens cut it, or
`response.failed`).  Nothing is stored: `previous_response_id`
and `store: true` answers can't be fetched later, so the former is a 400 and the latter is answered with
`store: false`; tools, images and files are 400s naming the field.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from kda_rt.server import responses
from kda_rt.server.engine_client import EngineDeadError, EngineTimeoutError
from kda_rt.server.protocol import ChatCompletionRequest, InvalidRequest, error_body

if TYPE_CHECKING:
    from kda_rt.server.run import RequestRun

__all__ = ["ResponsesRequest", "chat_request", "events", "response_body"]

_INT32 = 2**31 - 1
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(msgspec.Struct):
    model: str | None = None
    input: str | list[Any] = ""
    instructions: str | None = None
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1, le=_INT32)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None  # (vLLM accepts it here too)
    ignore_eos: bool = False  # (vLLM's sampling extra, as in chat)
    stream: bool = False
    text: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None


def _content(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or a list of input_text parts")
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequest(f"{where}.content[{k}] must be {{'type': 'input_text', 'text': str}} (only text is "
                                 f"supported), got {kind!r}")
        texts.append(part["text"])
    return "".join(texts)


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest("text.format must be {'type': 'text' | 'json_object' | 'json_schema', ...}")
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest("text.format.schema must be a JSON schema object")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "output", "schema": fmt["schema"]}}
    return {"type": fmt["type"]}


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that answers `req` (InvalidRequest naming the field for what is not supported)."""
    if req.previous_response_id is not None:
        raise InvalidRequest("previous_response_id is not supported: this server stores no responses; send the whole "
                             "conversation in input")
    if req.tools:
        raise InvalidRequest("tools are not supported on /v1/responses; use /v1/chat/completions for tool calls")
    if req.truncation not in (None, "disabled"):
        raise InvalidRequest(f"truncation {req.truncation!r} is not supported (only 'disabled')")
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        if not req.input:
            raise InvalidRequest("input must be a non-empty string or a list of messages")
        messages.append({"role": "user", "content": req.input})
    else:
        if not req.input:
            raise InvalidRequest("input must be a non-empty string or a list of messages")
        for i, item in enumerate(req.input):
            where = f"input[{i}]"
            if not isinstance(item, dict) or item.get("type", "message") != "message":
                kind = item.get("type") if isinstance(item, dict) else type(item).__name__
                raise InvalidRequest(f"{where} must be a message item (role and content), got {kind!r}")
            if item.get("role") not in _ROLES:
                raise InvalidRequest(f"{where}.role must be one of {', '.join(_ROLES)}, got {item.get('role')!r}")
            messages.append({"role": item["role"], "content": _content(where, item.get("content"))})
    return ChatCompletionRequest(model=req.model, messages=messages, max_tokens=req.max_output_tokens,
                                 temperature=req.temperature, top_p=req.top_p, seed=req.seed, stream=req.stream,
                                 ignore_eos=req.ignore_eos, response_format=_response_format(req.text))


def _status(reason: str | None) -> tuple[str, dict[str, str] | None]:
    if reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if reason in ("abort", "error"):
        return "failed", None
    return "completed", None


def response_body(rid: str, created: int, model: str, req: ResponsesRequest, *, text: str | None,
                  reason: str | None, usage: dict[str, int] | None, item_id: str, error: str | None = None,
                  status: str | None = None) -> dict[str, Any]:
    """A `response` object: one assistant message holding `text` (None: no output item yet)."""
    state, incomplete = _status(reason)
    state = status or state
    if state == "failed" and not error:
        error = ("the request was aborted (the client disconnected or the server is shutting down)"
                 if reason == "abort" else "the request failed")
    output = []
    if text is not None:
        output.append({"type": "message", "id": item_id, "status": "completed" if state == "completed" else
                       "incomplete", "role": "assistant",
                       "content": [{"type": "output_text", "text": text, "annotations": []}]})
    body = {"id": rid, "object": "response", "created_at": created, "status": state, "model": model,
            "output": output, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": [], "store": False, "text": req.text or {"format": {"type": "text"}},
            "metadata": req.metadata or {}, "incomplete_details": incomplete,
            "error": {"code": "server_error", "message": error} if state == "failed" else None, "usage": None}
    if usage is not None:
        body["usage"] = {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                         "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                         "total_tokens": usage["total_tokens"]}
    return body


def shape(rid: str, req: ResponsesRequest):
    """The body transform for `RequestRun.collect`: the chat completion's one choice as a response."""
    item_id = f"msg_{uuid.uuid4().hex}"

    def to_response(chat: dict[str, Any]) -> dict[str, Any]:
        choice = chat["choices"][0]
        reason = choice["finish_reason"]
        error = choice.get("stop_reason") if reason == "error" else None
        return response_body(rid, chat["created"], chat["model"], req, text=choice["message"]["content"] or "",
                             reason=reason, usage=chat["usage"], item_id=item_id, error=error)

    return to_response


def _event(seq: list[int], kind: str, **fields: Any) -> bytes:
    body = {"type": kind, "sequence_number": seq[0], **fields}
    seq[0] += 1
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(body) + b"\n\n"


async def events(run: RequestRun, req: ResponsesRequest) -> AsyncIterator[bytes]:
    """The Responses API's stream for one running request."""
    seq, item_id, model = [0], f"msg_{uuid.uuid4().hex}", run.state.model_name
    stream = responses.StreamChoices(1, True, **run.shape)
    text, reason, stop_reason, outcome = "", None, None, "aborted"

    def body(status: str | None = None, final: bool = False) -> dict[str, Any]:
        return response_body(run.rid, run.created, model, req, text=text if final else None, reason=reason,
                             usage=run._usage() if final else None, item_id=item_id, status=status,
                             error=stop_reason if reason == "error" else None)

    part = {"type": "output_text", "text": "", "annotations": []}
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    try:
        yield _event(seq, "response.created", response=body("in_progress"))
        yield _event(seq, "response.in_progress", response=body("in_progress"))
        yield _event(seq, "response.output_item.added", output_index=0,
                     item={"type": "message", "id": item_id, "status": "in_progress", "role": "assistant",
                           "content": []})
        yield _event(seq, "response.content_part.added", part=part, **where)
        async for item in run.items():
            for choice in stream.choices(item):
                delta = choice["delta"].get("content") or ""
                if delta:
                    text += delta
                    yield _event(seq, "response.output_text.delta", delta=delta, logprobs=[], **where)
                if choice["finish_reason"] is not None:
                    reason = choice["finish_reason"]
            for c in item["outputs"]:
                if c["finish_reason"] == "error":
                    stop_reason = c.get("stop_reason")
        done = {**part, "text": text}
        yield _event(seq, "response.output_text.done", text=text, logprobs=[], **where)
        yield _event(seq, "response.content_part.done", part=done, **where)
        final = body(final=True)
        yield _event(seq, "response.output_item.done", output_index=0, item=final["output"][0])
        # an incomplete answer (max_output_tokens) ends with response.completed too, its status saying so, as vLLM's
        # streams do: the openai client's stream helper waits for that event
        kind = "response.failed" if final["status"] == "failed" else "response.completed"
        outcome = "finished"
        yield _event(seq, kind, response=final)
    except (EngineDeadError, EngineTimeoutError) as exc:
        outcome = "error"
        err = error_body(f"the engine failed while serving this request: {exc}", 503)["error"]
        yield _event(seq, "error", code="server_error", message=err["message"], param=None)
    finally:
        run._end(outcome)
