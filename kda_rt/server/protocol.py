"""Request bodies of the OpenAI-compatible endpoints (msgspec schemas) and their translation into
engine payloads: prompt or chat messages plus `SamplingParams` keyword arguments.

Decoding rejects what JSON or the schema cannot carry (invalid UTF-8, NaN/Infinity literals,
numbers out of range, wrong types, unknown fields); `SamplingParams` then checks values.  Every
refusal is an `InvalidRequest` with a message naming the field, which the app sends as 400.
Fields beyond OpenAI's are vLLM's names: top_k, min_p, repetition_penalty, min_tokens,
stop_token_ids, ignore_eos, skip_special_tokens, include_stop_str_in_output.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from kda_rt.sampler.params import SamplingParams

__all__ = ["ChatCompletionRequest", "CompletionRequest", "InvalidRequest", "StreamOptions", "chat_payload",
           "completion_payload", "decode_body", "error_body"]

_INT32 = 2**31 - 1
_N_MAX = 128  # samples per request; each one is a running sequence
Int32 = Annotated[int, msgspec.Meta(ge=-_INT32, le=_INT32)]


class InvalidRequest(ValueError):
    """A request body the server refuses with 400 (the message names the field)."""


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _Sampling(msgspec.Struct, forbid_unknown_fields=True):
    model: str | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=_N_MAX)] = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, msgspec.Meta(ge=0, le=_INT32)]] | None = None
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=_INT32)] = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(_Sampling, forbid_unknown_fields=True):
    """POST /v1/completions.  `prompt`: a string, a list of token ids, or a one-element list of either."""

    prompt: str | list[Any] = ""
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=_INT32)] | None = 16
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    echo: bool = False
    best_of: Int32 | None = None
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None


class ChatCompletionRequest(_Sampling, forbid_unknown_fields=True):
    """POST /v1/chat/completions.  Message content is a string or a list of `{"type": "text"}` parts."""

    messages: list[dict[str, Any]] = []
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=_INT32)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1, le=_INT32)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    tools: list[dict[str, Any]] | None = None
    logit_bias: dict[str, float] | None = None


def decode_body(body: bytes, schema: type[msgspec.Struct]) -> Any:
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None


MAX_JSON_DEPTH = 64  # nesting of `messages` / `tools`: deeper is a 400, before any recursive code sees it


def check_depth(value: Any, what: str) -> None:
    """Raise InvalidRequest when `value` nests lists / objects deeper than MAX_JSON_DEPTH (iterative)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth > MAX_JSON_DEPTH:
                raise InvalidRequest(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels")
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))


def error_body(message: str, status: int, err_type: str | None = None, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope."""
    kinds = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "BadRequestError",
             413: "BadRequestError", 429: "RateLimitError", 503: "ServiceUnavailableError"}
    return {"error": {"message": message, "type": err_type or kinds.get(status, "InternalServerError"),
                      "param": param, "code": status}}


def _sampling_kwargs(req: _Sampling, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
    if req.logit_bias:
        raise InvalidRequest("logit_bias is not supported")
    kwargs: dict[str, Any] = {"n": req.n, "max_tokens": max_tokens, "logprobs": logprobs, "seed": req.seed,
                              "stop": req.stop, "stop_token_ids": req.stop_token_ids, "min_tokens": req.min_tokens,
                              "ignore_eos": req.ignore_eos, "skip_special_tokens": req.skip_special_tokens,
                              "include_stop_str_in_output": req.include_stop_str_in_output}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    if isinstance(kwargs["stop"], list) and not kwargs["stop"]:
        kwargs["stop"] = None
    try:
        SamplingParams(**kwargs)  # validated here so a bad value is a 400 before the engine sees it
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    return kwargs


def completion_payload(req: CompletionRequest) -> dict[str, Any]:
    """Engine payload {"prompt", "params"} of a completion request."""
    if req.echo:
        raise InvalidRequest("echo is not supported")
    if req.suffix:
        raise InvalidRequest("suffix is not supported")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequest(f"best_of must equal n ({req.n}) when given, got {req.best_of}")
    prompt: Any = req.prompt
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        elif prompt and all(isinstance(x, str) or isinstance(x, list) for x in prompt):
            raise InvalidRequest("batched prompts are not supported: send one request per prompt")
    if isinstance(prompt, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise InvalidRequest("prompt must be a string or a list of token ids (ints)")
    if isinstance(prompt, list) and not all(0 <= t <= _INT32 for t in prompt):
        bad = next(t for t in prompt if not 0 <= t <= _INT32)
        raise InvalidRequest(f"prompt token id {bad} is not a valid token id")
    if not prompt:
        raise InvalidRequest("prompt is empty")
    return {"prompt": prompt, "params": _sampling_kwargs(req, req.max_tokens, req.logprobs)}


def _content(i: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise InvalidRequest(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': str}}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts")


def chat_payload(req: ChatCompletionRequest) -> dict[str, Any]:
    """Engine payload {"messages", "tools", "params"} of a chat request (content flattened to text)."""
    if not req.messages:
        raise InvalidRequest("messages must be a non-empty list")
    check_depth(req.messages, "messages")
    check_depth(req.tools, "tools")
    messages = []
    for i, m in enumerate(req.messages):
        role = m.get("role")
        if not isinstance(role, str):
            raise InvalidRequest(f"messages[{i}].role must be a string")
        msg: dict[str, Any] = {"role": role, "content": _content(i, m.get("content"))}
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise InvalidRequest(f"messages[{i}].name must be a string")
            msg["name"] = m["name"]
        messages.append(msg)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return {"messages": messages, "tools": req.tools, "params": _sampling_kwargs(req, max_tokens, logprobs)}
