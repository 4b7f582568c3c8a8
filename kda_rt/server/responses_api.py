"""POST /v1/responses: OpenAI's Responses API (clients built on it, such as the OpenAI Agents SDK, call it first),
stateless unless the server keeps responses (below).

A request becomes a chat request and runs as one: `instructions` the system message; `input` a string or items:
messages (content a string or `input_text` / `output_text` parts), `reasoning` items (an earlier answer's, sent back:
the `reasoning` of that turn's assistant message, as vLLM renders them), `function_call` items (the assistant's earlier
calls) and `function_call_output` items (their results, as `tool` messages); `max_output_tokens`, `temperature`,
`top_p` (the response echoes the values the engine used, as vLLM's), `include` "message.output_text.logprobs" with
`top_logprobs` (chat's logprobs, on the output_text part and the stream's text deltas), `text.format` text /
json_object / json_schema; function `tools` with `tool_choice` and
`parallel_tool_calls`, as chat's tool calling (auto needs the server's --enable-auto-tool-choice and
--tool-call-parser).  The answer is a `response` whose output holds the assistant's message (when it wrote text or
called nothing) and one `function_call` item per call.  `stream: true` sends the Responses events: `response.created`,
`response.in_progress`, then per output item `response.output_item.added`, its content (`response.content_part.added`,
`response.output_text.delta` ..., `.done`; or `response.function_call_arguments.delta` ..., `.done`) and
`response.output_item.done`, and last `response.completed` (its status `incomplete` when max_output_tokens cut the
answer, as vLLM's streams end and the openai client's helper waits for) or `response.failed`.  Other tool types,
images and files are 400s naming the field.

Stored responses (`--enable-responses-store`, or vLLM's `VLLM_ENABLE_RESPONSES_API_STORE=1`): a response with `store`
true (the default then, as OpenAI's) gets a random id and is kept in the HTTP process (`ResponseStore`: the items of
its own input and output and a link to the response it continued, at most `--responses-store-size` responses and
`--responses-store-max-mib` MiB of their JSON, least recently used out first), retrievable by `GET
/v1/responses/{id}` and removable by `DELETE`, its input items listed by `GET /v1/responses/{id}/input_items`
(`item_page`: the conversation it continued and its own input, each item with an id); a request's
`previous_response_id` continues that conversation: the chain's items come before its own input, read as one input
list (the earlier `instructions` are not carried over, as
OpenAI's).  `background: true` (with the store) answers at once with status "queued" and runs the request; the
store keeps it "in_progress" for GET to poll until the finished response replaces it, and `POST
/v1/responses/{id}/cancel` stops it ("cancelled").  Without the store, `previous_response_id` is a 400 and `store:
true` is answered with `store: false`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from kda_rt.server import responses
from kda_rt.server.engine_client import EngineDeadError, EngineTimeoutError, StreamBacklogError
from kda_rt.server.protocol import ChatCompletionRequest, InvalidRequest, Logprobs, error_body
from kda_rt.server.protocol import chat_payload as _chat_payload

if TYPE_CHECKING:
    from kda_rt.server.run import RequestRun

__all__ = ["ResponseNotFound", "ResponseStore", "ResponsesRequest", "chat_payload", "chat_request", "events", "input_items",
           "item_page", "response_body", "shape"]

_INT32 = 2**31 - 1
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
OUTPUT_LOGPROBS = "message.output_text.logprobs"
# the spec's `include` values (the openai client's ResponseIncludable): the others name what this server never
# answers with (tool results, images, encrypted reasoning), so they are accepted and add nothing
_INCLUDABLE = (OUTPUT_LOGPROBS, "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
               "web_search_call.action.sources", "message.input_image.image_url",
               "computer_call_output.output.image_url", "code_interpreter_call.outputs")


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
    parallel_tool_calls: bool | None = True  # (null: the default, as OpenAI's schema allows)
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    priority: Annotated[int, msgspec.Meta(ge=-_INT32, le=_INT32)] = 0  # (vLLM's, as in chat)
    background: bool = False  # run after answering (needs the store): GET /v1/responses/{id} polls it
    cache_salt: str | None = None  # (vLLM's, as in chat)
    include: list[str] | None = None  # OUTPUT_LOGPROBS: the output text's logprobs (its only one that adds anything)
    top_logprobs: Logprobs | None = None  # with OUTPUT_LOGPROBS: the most likely tokens listed at each position


def _content(where: str, content: Any, field: str = "content") -> str:
    """The text of a message's `content` (or a function_call_output's `output`): a string or text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.{field} must be a string or a list of input_text parts")
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequest(f"{where}.{field}[{k}] must be {{'type': 'input_text', 'text': str}} (only text is "
                                 f"supported), got {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)  # (a message's text parts joined as the chat route and vLLM join them)


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


def _reasoning(where: str, item: dict[str, Any]) -> str:
    """The text of a reasoning item (an earlier response's output, sent back): its reasoning_text parts, else its
    summary_text parts, as vLLM reads them (vLLM keeps the first part alone; joined here, none is dropped).  Encrypted
    reasoning cannot be read (vLLM's 400 too)."""
    if item.get("encrypted_content"):
        raise InvalidRequest(f"{where}.encrypted_content is not supported (this server cannot read encrypted "
                             "reasoning): send the item's content or summary instead")
    texts: dict[str, list[str]] = {}
    for field, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(field) or []
        if not isinstance(parts, list):
            raise InvalidRequest(f"{where}.{field} must be a list of {{'type': '{kind}', 'text': str}} parts")
        for k, part in enumerate(parts):
            if not isinstance(part, dict) or part.get("type") != kind or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{where}.{field}[{k}] must be {{'type': '{kind}', 'text': str}}")
        texts[field] = [part["text"] for part in parts]
    return "\n".join(texts["content"] or texts["summary"])


def _tools(req: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, Any]:
    """Chat's tools and tool_choice of the Responses API's function tools (flat: name, description, parameters)."""
    tools = None
    if req.tools:
        tools = []
        for k, tool in enumerate(req.tools):
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
                kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
                raise InvalidRequest(f"tools[{k}] must be a function tool {{'type': 'function', 'name': str, "
                                     f"'parameters': {{...}}}} (others are not supported), got {kind!r}")
            if not tool["name"] or any(t["function"]["name"] == tool["name"] for t in tools):
                raise InvalidRequest(f"tools[{k}].name must be a non-empty name of its own, got {tool['name']!r}")
            if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
                raise InvalidRequest(f"tools[{k}].parameters must be a JSON schema object, got "
                                     f"{type(tool['parameters']).__name__}")
            fn = {"name": tool["name"], **{key: tool[key] for key in ("description", "parameters")
                                           if tool.get(key) is not None}}
            tools.append({"type": "function", "function": fn})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': str}")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice == "auto" and not tools:  # (the Responses API's default, sent as such by clients: no tools, no calls)
        choice = None
    return tools, choice


def _input_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Chat messages of the input items: messages, reasoning (an assistant turn's reasoning, as vLLM renders it: the
    `reasoning` of the assistant message it joins, the one right before it or a new one the turn's text and calls
    then join), function_call (an assistant turn's calls: they join the assistant message right before them, as one
    chat turn holds its text and its calls) and function_call_output (a tool message)."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
        last = messages[-1] if messages else None
        if kind == "message":
            if item.get("role") not in _ROLES:
                raise InvalidRequest(f"{where}.role must be one of {', '.join(_ROLES)}, got {item.get('role')!r}")
            content = _content(where, item.get("content"))
            if (item["role"] == "assistant" and last is not None and last["role"] == "assistant"
                    and last["content"] is None and "tool_calls" not in last):  # the text after the turn's reasoning
                last["content"] = content
            else:
                messages.append({"role": item["role"], "content": content})
        elif kind == "reasoning":
            reasoning = _reasoning(where, item)
            if last is not None and last["role"] == "assistant" and "reasoning" not in last:
                last["reasoning"] = reasoning
            else:
                messages.append({"role": "assistant", "content": None, "reasoning": reasoning})
        elif kind == "function_call":
            if not all(isinstance(item.get(key), str) for key in ("call_id", "name", "arguments")) or not item["name"]:
                raise InvalidRequest(f"{where} (function_call) needs call_id, name (non-empty) and arguments as "
                                     "strings")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if last is not None and last["role"] == "assistant":  # the same turn: its text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequest(f"{where} (function_call_output) needs call_id as a string")
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else _content(where, output, "output")})
        else:
            raise InvalidRequest(f"{where} must be a message, reasoning, function_call or function_call_output "
                                 f"item, got {kind!r}")
    return messages


def input_items(req: ResponsesRequest) -> list[Any]:
    """`req`'s own input as items (a string: one user message)."""
    if not req.input:
        raise InvalidRequest("input must be a non-empty string or a list of items")
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return list(req.input)


def wants_logprobs(req: ResponsesRequest) -> bool:
    """Whether `include` asks for the output text's logprobs (vLLM's rule: `top_logprobs` alone asks for none)."""
    return OUTPUT_LOGPROBS in (req.include or ())


def chat_request(req: ResponsesRequest, history: list[Any] | None = None) -> ChatCompletionRequest:
    """The chat request that answers `req` (InvalidRequest naming the field for what is not supported); `history`:
    the items of the stored conversation it continues (previous_response_id: each response's input and output items),
    None when it continues none.  The history's items and the input's read as one input list would."""
    if req.previous_response_id is not None and history is None:
        raise InvalidRequest("previous_response_id needs stored responses: this server stores none (start it with "
                             "--enable-responses-store), so send the whole conversation in input")
    if req.truncation not in (None, "disabled"):
        raise InvalidRequest(f"truncation {req.truncation!r} is not supported (only 'disabled')")
    for k, value in enumerate(req.include or ()):
        if value not in _INCLUDABLE:
            raise InvalidRequest(f"include[{k}] must be one of {', '.join(_INCLUDABLE)}, got {value!r}")
    logprobs = wants_logprobs(req)
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    own = input_items(req)
    own_messages = _input_messages(own)  # (checked alone first: its errors name its own input[i])
    messages += _input_messages(history + own) if history else own_messages
    tools, choice = _tools(req)
    return ChatCompletionRequest(model=req.model, messages=messages, max_tokens=req.max_output_tokens,
                                 temperature=req.temperature, top_p=req.top_p, seed=req.seed, stream=req.stream,
                                 ignore_eos=req.ignore_eos, response_format=_response_format(req.text), tools=tools,
                                 tool_choice=choice, parallel_tool_calls=req.parallel_tool_calls is not False,
                                 priority=req.priority, cache_salt=req.cache_salt, logprobs=logprobs,
                                 top_logprobs=req.top_logprobs if logprobs else None)


# chat's field names in its errors -> the Responses API's (the request was written with these)
_FIELD_NAMES = (("response_format", "text.format"), ("max_completion_tokens", "max_output_tokens"),
                ("max_tokens", "max_output_tokens"), (".function.", "."))


def field_names(message: str) -> str:
    """An error message about the chat request, in the Responses request's field names."""
    for chat, ours in _FIELD_NAMES:
        message = message.replace(chat, ours)
    return message


def chat_payload(req: ChatCompletionRequest, auto_tools: bool) -> dict[str, Any]:
    """protocol.chat_payload for the chat request of a Responses request; its errors name Responses fields."""
    try:
        return _chat_payload(req, auto_tools)
    except InvalidRequest as exc:
        message = str(exc)
        raise InvalidRequest(field_names(message)) from None


def _status(reason: str | None) -> tuple[str, dict[str, str] | None]:
    if reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if reason in ("abort", "error"):
        return "failed", None
    return "completed", None


def _message_item(item_id: str, text: str, status: str, logprobs: list | None = None) -> dict[str, Any]:
    """The assistant's message; `logprobs` (include OUTPUT_LOGPROBS): chat's logprobs content, one entry a token."""
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def _event_logprobs(logprobs: list) -> list[dict[str, Any]]:
    """Logprob entries in the text events' shape (vLLM's): no bytes, the top ones {token, logprob}."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in logprobs]


def _call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def output_items(rid: str, text: str, calls: list[dict[str, Any]], state: str,
                 logprobs: list | None = None) -> list[dict[str, Any]]:
    """The response's output: the assistant's message (when it wrote text or called nothing; `logprobs` on its
    text), then one function_call item per call (chat's tool_calls); when the answer did not complete, its last item
    is `incomplete`."""
    items = [_message_item(f"msg_{rid}", text, "completed", logprobs)] if text or not calls else []
    items += [_call_item(f"fc_{rid}_{k}", call, "completed") for k, call in enumerate(calls)]
    if state != "completed":  # the answer stopped in its last item; the ones before it were finished
        items[-1]["status"] = "incomplete"
    return items


def response_body(rid: str, created: int, model: str, req: ResponsesRequest, *, reason: str | None,
                  usage: dict[str, int] | None, text: str | None = None, calls: list[dict[str, Any]] | None = None,
                  error: str | None = None, status: str | None = None, cached: int = 0,
                  sampling: dict[str, float] | None = None, logprobs: list | None = None) -> dict[str, Any]:
    """A `response` object; `text` None: no output yet (the stream's first events); `cached`: the prompt tokens the
    prefix cache served; `sampling`: the temperature and top_p the engine used (`RequestRun.sampling`: the
    checkpoint's defaults where the request gave none, as vLLM reports them), None: the request's own."""
    state, incomplete = _status(reason)
    state = status or state
    if state == "failed" and not error:
        error = ("the request was aborted (the client disconnected or the server is shutting down)"
                 if reason == "abort" else "the request failed")
    output = [] if text is None else output_items(rid, text, calls or [], state, logprobs)
    used = sampling or {"temperature": req.temperature, "top_p": req.top_p}
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
    body = {"id": rid, "object": "response", "created_at": created, "status": state, "model": model,
            "output": output, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": used["temperature"], "top_p": used["top_p"],
            "top_logprobs": (req.top_logprobs or 0) if wants_logprobs(req) else None,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": choice, "tools": req.tools or [], "store": False,
            "previous_response_id": req.previous_response_id,
            "text": req.text or {"format": {"type": "text"}}, "metadata": req.metadata or {},
            "incomplete_details": incomplete,
            "error": {"code": "server_error", "message": error} if state == "failed" else None, "usage": None}
    if usage is not None:
        # (cache_write_tokens: the openai client's type requires it; the prefix cache keeps prompts unasked, so
        # nothing is billed as written, as OpenAI's automatic caching reports 0)
        details = {"cached_tokens": cached, "cache_write_tokens": 0}
        body["usage"] = {"input_tokens": usage["prompt_tokens"], "input_tokens_details": details,
                         "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                         "total_tokens": usage["total_tokens"]}
    return body


def shape(run: RequestRun, req: ResponsesRequest, on_done=None):
    """The body transform for `RequestRun.collect`: the chat completion's one choice as a response, its status from
    the engine's finish reason (chat reports a call cut by max_tokens as "tool_calls"); `on_done(body)` may change
    the finished body (the store keeps it and says so)."""
    def to_response(chat: dict[str, Any]) -> dict[str, Any]:
        choice = chat["choices"][0]
        reason = run.choices.finish[0][0]
        error = choice.get("stop_reason") if reason == "error" else None
        message = choice["message"]
        logprobs = (choice["logprobs"] or {"content": []})["content"] if wants_logprobs(req) else None
        body = response_body(run.rid, chat["created"], chat["model"], req, text=message["content"] or "",
                             calls=message.get("tool_calls") or [], reason=reason, usage=chat["usage"], error=error,
                             cached=run.cached_tokens, sampling=run.sampling, logprobs=logprobs)
        if on_done is not None:
            on_done(body)
        return body

    return to_response


_ID_PREFIX = {"message": "msg", "reasoning": "rs", "function_call": "fc", "function_call_output": "fco"}


def _with_ids(items: list[Any], rid: str) -> list[Any]:
    """A response's own input items, each with an id (the client's, else one of this response's): the item list
    (GET /v1/responses/{id}/input_items) names and pages them by it."""
    return [item if item.get("id") else {**item, "id": f"{_ID_PREFIX[item.get('type', 'message')]}_{rid}_in{k}"}
            for k, item in enumerate(items)]


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    """A stored input or output item in the item list's shape: a message's content as text parts (input_text, or
    output_text with annotations for the assistant's), every item with a status."""
    kind, status = item.get("type", "message"), item.get("status") or "completed"
    if kind == "message":
        content = item["content"]
        texts = [content] if isinstance(content, str) else [part["text"] for part in content]
        parts = ([{"type": "output_text", "text": t, "annotations": []} for t in texts] if item["role"] == "assistant"
                 else [{"type": "input_text", "text": t} for t in texts])
        return {"id": item["id"], "type": "message", "role": item["role"], "content": parts, "status": status}
    if kind == "reasoning":  # (as sent: checked by _reasoning; the spec requires a summary, [] when left out)
        return {"id": item["id"], "type": kind, "summary": item.get("summary") or [],
                **({"content": item["content"]} if item.get("content") is not None else {}),
                "status": status}
    keys = ("call_id", "name", "arguments") if kind == "function_call" else ("call_id", "output")
    return {"id": item["id"], "type": kind, **{key: item[key] for key in keys}, "status": status}


def item_page(items: list[dict[str, Any]], *, limit: int = 20, order: str = "desc", after: str | None = None,
              before: str | None = None) -> dict[str, Any]:
    """One page of the item list, as OpenAI's (`order` "desc": newest first, its default; `after` / `before`: the
    items past / before the one of that id, in that order)."""
    ordered = items[::-1] if order == "desc" else items
    ids = [item["id"] for item in ordered]
    for cursor, name in ((after, "after"), (before, "before")):
        if cursor is not None and cursor not in ids:
            raise InvalidRequest(f"{name}: no item {cursor!r} in this response's input items")
    start = ids.index(after) + 1 if after is not None else 0
    stop = ids.index(before) if before is not None else len(ordered)
    page = ordered[start:stop][:limit] if before is None else ordered[start:stop][-limit:]
    more = start + len(page) < stop if before is None else stop - len(page) > start
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": more}


class ResponseNotFound(KeyError):
    """previous_response_id (or an earlier link of its chain) is not stored."""


class ResponseStore:
    """Responses kept for `GET /v1/responses/{id}` and `previous_response_id` (the module docstring): per id its
    body, the items of its own input and output, and the id it continued; at most `capacity`, least recently used
    out first (a conversation's chain is used whenever it is continued: its links stay)."""

    def __init__(self, capacity: int, max_bytes: int = 256 << 20) -> None:
        from collections import OrderedDict

        self.capacity, self.max_bytes, self.bytes = capacity, max_bytes, 0
        # id -> (body, its input and output items, the id it continued, its size as JSON)
        self._items: OrderedDict[str, tuple[dict[str, Any], list[Any], str | None, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, rid: object) -> bool:
        return rid in self._items

    def get(self, rid: str) -> dict[str, Any] | None:
        entry = self._items.get(rid)
        if entry is None:
            return None
        self._items.move_to_end(rid)
        return entry[0]

    def delete(self, rid: str) -> bool:
        entry = self._items.pop(rid, None)
        if entry is not None:
            self.bytes -= entry[3]
        return entry is not None

    def _chain(self, rid: str) -> list[tuple[str, tuple[dict[str, Any], list[Any], str | None, int]]]:
        """Response `rid` and the ones it continued, newest first, each used (least recently used order);
        ResponseNotFound naming the first link not stored (never stored, deleted or evicted)."""
        chain, at, seen = [], rid, set()
        while at is not None:
            entry = self._items.get(at)
            if entry is None or at in seen:  # (a link back into the chain cannot be made; refused all the same)
                raise ResponseNotFound(at)
            seen.add(at)
            self._items.move_to_end(at)
            chain.append((at, entry))
            at = entry[2]
        return chain

    def history(self, rid: str) -> list[Any]:
        """The conversation up to and including response `rid` as items, oldest first; ResponseNotFound naming the
        missing link when `rid` or an earlier response of its chain is not stored (never stored, deleted or evicted)."""
        chain = self._chain(rid)
        for at, entry in chain:
            if entry[0]["status"] in ("queued", "in_progress", "failed", "cancelled"):
                raise InvalidRequest(f"previous_response_id: response {at!r} is {entry[0]['status']} (a background "
                                     "response is continued once it has completed)")
        return [m for _, entry in reversed(chain) for m in entry[1]]

    def input_items(self, rid: str) -> list[dict[str, Any]]:
        """The items response `rid` was generated from, oldest first, in the shapes of the Responses API's item list
        (each with an id): the conversation it continued (each earlier response's input and output) and its own
        input, its instructions not among them; ResponseNotFound naming a missing link."""
        chain = self._chain(rid)
        body, items = chain[0][1][0], chain[0][1][1]
        own = items[:max(len(items) - len(body["output"]), 0)]  # (its output follows its input in the store)
        return [_listed(item) for _, entry in reversed(chain[1:]) for item in entry[1]] + [_listed(i) for i in own]

    def put_running(self, body: dict[str, Any], own: list[Any], previous: str | None) -> None:
        """Keep a background response while it runs (GET shows it, `put` replaces it); not counted in the byte bound
        until it is finished."""
        body["store"] = True
        self.delete(body["id"])
        self._items[body["id"]] = (body, _with_ids(own, body["id"]), previous, 0)
        self._evict()

    def running(self, rid: str) -> bool:
        entry = self._items.get(rid)
        return entry is not None and entry[0]["status"] in ("queued", "in_progress")

    def _evict(self) -> None:
        """The least recently used finished responses out while the bounds are passed (a running one stays: it is
        polled, and its end replaces it)."""
        while len(self._items) > self.capacity or self.bytes > self.max_bytes:
            victim = next((rid for rid in self._items if not self.running(rid)), None)
            if victim is None:
                return
            self.delete(victim)

    def put(self, body: dict[str, Any], own: list[Any], previous: str | None) -> None:
        """Keep a finished response: `own` its input's items (its instructions not among them), its output's added;
        the least recently used go while more than `capacity` responses or `max_bytes` (their JSON) are kept.  A
        failed response, or one larger than `max_bytes` alone, is not kept (its body says `store: false`)."""
        items = _with_ids(own, body["id"]) + body["output"]
        size = len(msgspec.json.encode(items)) + len(msgspec.json.encode(body))
        if body.get("background") and (body["status"] == "failed" or size > self.max_bytes):
            # (a background response stays findable, its status saying why; it cannot be continued)
            if size > self.max_bytes:
                body.update(status="failed", output=[], error={"code": "server_error", "message": (
                    f"the response is over the store's {self.max_bytes >> 20} MiB bound (--responses-store-max-mib)")})
            items, size = [], len(msgspec.json.encode(body))
        elif body["status"] == "failed" or size > self.max_bytes:
            body["store"] = False
            return
        body["store"] = True
        self.delete(body["id"])
        self._items[body["id"]] = (body, items, previous, size)
        self.bytes += size
        self._evict()


def _event(seq: list[int], kind: str, **fields: Any) -> bytes:
    body = {"type": kind, "sequence_number": seq[0], **fields}
    seq[0] += 1
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(body) + b"\n\n"


async def events(run: RequestRun, req: ResponsesRequest, on_done=None) -> AsyncIterator[bytes]:
    """The Responses API's stream for one running request: an output item opens when its first piece arrives (the
    message at its first text, a function_call at its call's header) and closes when the next one opens (finished)
    or the answer ends (with the answer's state).  With OUTPUT_LOGPROBS each text delta carries the logprobs of the
    tokens it holds (and of any before it that wrote no text), the done events all of them."""
    seq, model, rid = [0], run.state.model_name, run.rid
    stream = responses.StreamChoices(1, True, **run.shape)
    text, calls, reason, stop_reason, outcome = "", [], None, None, "aborted"
    with_logprobs = wants_logprobs(req)
    logprobs: list[dict[str, Any]] = []  # every token's so far
    unsent = 0  # how many of them no text delta has carried yet
    opened: list[tuple[str, int]] = []  # ("message", 0) / ("call", k) in output order; the last may be open
    closed: list[dict[str, Any]] = []  # the items closed so far, as sent

    def body(status: str | None = None, final: bool = False) -> dict[str, Any]:
        out = response_body(rid, run.created, model, req, text=text if final else None, calls=calls, reason=reason,
                            usage=run._usage() if final else None, status=status, cached=run.cached_tokens,
                            error=stop_reason if reason == "error" else None, sampling=run.sampling,
                            logprobs=logprobs if with_logprobs else None)
        if on_done is not None and not final:  # (to be kept: the store says so of the final body once it is)
            out["store"] = True
        return out

    def close(status: str) -> list[bytes]:
        """The done events of the open item (the last opened)."""
        index, key = len(opened) - 1, opened[-1]
        if key[0] == "message":
            item = _message_item(f"msg_{rid}", text, status, logprobs if with_logprobs else None)
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out = [_event(seq, "response.output_text.done", text=text, logprobs=_event_logprobs(logprobs), **where),
                   _event(seq, "response.content_part.done", part=item["content"][0], **where)]
        else:
            item = _call_item(f"fc_{rid}_{key[1]}", calls[key[1]], status)
            out = [_event(seq, "response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          arguments=item["arguments"])]
        closed.append(item)
        return out + [_event(seq, "response.output_item.done", output_index=index, item=item)]

    def open_item(key: tuple[str, int]) -> list[bytes]:
        out = close("completed") if len(closed) < len(opened) else []
        opened.append(key)
        index = len(opened) - 1
        if key[0] == "message":
            item_id = f"msg_{rid}"
            return out + [
                _event(seq, "response.output_item.added", output_index=index,
                       item={**_message_item(item_id, "", "in_progress"), "content": []}),
                _event(seq, "response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                       part=_message_item(item_id, "", "in_progress", [] if with_logprobs else None)["content"][0])]
        return out + [_event(seq, "response.output_item.added", output_index=index,
                             item=_call_item(f"fc_{rid}_{key[1]}", calls[key[1]], "in_progress"))]

    try:
        yield _event(seq, "response.created", response=body("in_progress"))
        yield _event(seq, "response.in_progress", response=body("in_progress"))
        async for item in run.items():
            for choice in stream.choices(item):
                if with_logprobs and choice["logprobs"] is not None:
                    logprobs += choice["logprobs"]["content"]
                delta = choice["delta"].get("content") or ""
                if delta:
                    if ("message", 0) not in opened:
                        for event in open_item(("message", 0)):
                            yield event
                    text += delta
                    yield _event(seq, "response.output_text.delta", delta=delta,
                                 logprobs=_event_logprobs(logprobs[unsent:]), item_id=f"msg_{rid}",
                                 output_index=opened.index(("message", 0)), content_index=0)
                    unsent = len(logprobs)
                for tc in choice["delta"].get("tool_calls") or []:
                    k = tc["index"]
                    if k >= len(calls):  # a call's header: id and name first
                        calls.append({"id": tc.get("id"), "type": "function",
                                      "function": {"name": tc["function"].get("name"), "arguments": ""}})
                        for event in open_item(("call", k)):
                            yield event
                    piece = tc["function"].get("arguments") or ""
                    if piece:
                        calls[k]["function"]["arguments"] += piece
                        yield _event(seq, "response.function_call_arguments.delta", item_id=f"fc_{rid}_{k}",
                                     output_index=opened.index(("call", k)), delta=piece)
            for c in item["outputs"]:  # the engine's own reason (chat turns a cut call's "length" into "tool_calls")
                if c["finish_reason"] is not None:
                    reason = c["finish_reason"]
                if c["finish_reason"] == "error":
                    stop_reason = c.get("stop_reason")
        if not opened:  # nothing written and nothing called: the message is there, empty
            for event in open_item(("message", 0)):
                yield event
        final = body(final=True)
        for event in close("completed" if final["status"] == "completed" else "incomplete"):
            yield event
        final["output"] = closed  # as the stream sent them
        if on_done is not None:
            on_done(final)
        kind = "response.failed" if final["status"] == "failed" else "response.completed"
        outcome = "finished"
        yield _event(seq, kind, response=final)
    except (EngineDeadError, EngineTimeoutError) as exc:
        outcome = "error"
        err = error_body(f"the engine failed while serving this request: {exc}", 503)["error"]
        yield _event(seq, "error", code="server_error", message=err["message"], param=None)
    except StreamBacklogError as exc:  # (aborted for a client that stopped reading: run.sse says the same)
        yield _event(seq, "error", code="stream_backlog", message=str(exc), param=None)
    finally:
        run._end(outcome)
