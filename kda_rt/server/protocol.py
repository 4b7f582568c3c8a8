"""Request bodies of the OpenAI-compatible endpoints (msgspec schemas) and their translation into
engine payloads: prompts or chat messages plus `SamplingParams` keyword arguments.

Decoding rejects what JSON or the schema cannot carry (invalid UTF-8, NaN/Infinity literals,
numbers out of range, wrong types); `SamplingParams` then checks values.  Every refusal is an
`InvalidRequest` with a message naming the field, which the app sends as 400.  Unknown fields are
accepted, as vLLM does: `decode_body` returns their names, which the app logs (once per name, at
WARNING) and lists in the `x-kda-rt-ignored-fields` response header.  Fields beyond OpenAI's are
vLLM's names: top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos,
skip_special_tokens, spaces_between_special_tokens, include_stop_str_in_output, prompt_logprobs,
chat_template_kwargs, priority, structured_outputs and the legacy guided_json / guided_regex / guided_choice /
guided_grammar.
Output constraints (those and response_format json_object / json_schema) become one
`StructuredOutputsParams`, compiled here by llguidance so an invalid one is a 400 naming its field.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec

from kda_rt.sampler.params import SamplingParams, StructuredOutputsParams
from kda_rt.server import tools
from kda_rt.server.errors import InvalidRequest
from kda_rt.text.chat import REASONING_FIELDS, join_text_parts

__all__ = ["ChatCompletionRequest", "CompletionRequest", "DetokenizeRequest", "InvalidRequest", "StreamOptions",
           "TokenizeRequest", "chat_payload", "completion_payload", "decode_body", "error_body"]

_INT32 = 2**31 - 1
_N_MAX = 128  # samples per request; each one is a running sequence
MAX_PROMPTS = 256  # prompts in one batched completion request
Int32 = Annotated[int, msgspec.Meta(ge=-_INT32, le=_INT32)]
Logprobs = Annotated[int, msgspec.Meta(ge=0, le=20)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=_INT32)]


class StreamOptions(msgspec.Struct):
    """null is accepted and reads as false, as vLLM's Optional[bool] fields (`include_usage: null`: no usage)."""

    include_usage: bool | None = True  # (vLLM: present stream_options send usage unless told not to)
    continuous_usage_stats: bool | None = False  # usage in every chunk (vLLM)


class _Sampling(msgspec.Struct):
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
    stop_token_ids: list[TokenId] | None = None
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=_INT32)] = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # vLLM's (SamplingParams says what it changes)
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None  # accepted, not used
    store: bool | None = None  # accepted, nothing is stored
    prompt_logprobs: Logprobs | None = None  # vLLM: top-N logprobs of every prompt token
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1, le=_INT32)] | None = None  # vLLM: keep the last N
    priority: Int32 = 0  # vLLM: a server started with --scheduling-policy priority runs lower values first
    use_beam_search: bool = False  # vLLM: n beams a prompt (kda_rt/beam_search.py), answered at the end
    cache_salt: str | None = None  # vLLM: prefix-cache entries shared only with requests of the same salt
    return_token_ids: bool | None = False  # vLLM: prompt_token_ids and each choice's token_ids in the response
    return_tokens_as_token_ids: bool | None = None  # vLLM: logprobs name tokens "token_id:N" (None: the server's)
    length_penalty: float = 1.0  # vLLM: the beams' ranking, cum_logprob / length ** length_penalty
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[Annotated[int, msgspec.Meta(ge=0, le=_INT32)]] | None = None  # vLLM: only these
    bad_words: list[str] | None = None  # vLLM: words never generated
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[Any] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Sampling):
    """POST /v1/completions.  `prompt`: a string, a list of token ids, or a list of either (a batch:
    one choice per prompt and sample, in prompt order)."""

    prompt: str | list[Any] = ""
    max_tokens: Annotated[int, msgspec.Meta(ge=0, le=_INT32)] | None = 16  # 0: score the prompt only
    logprobs: Logprobs | None = None
    echo: bool = False
    best_of: Int32 | None = None
    suffix: str | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions.  Message content is a string, None, or a list of `{"type": "text"}` parts."""

    messages: list[dict[str, Any]] = []
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=_INT32)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1, le=_INT32)] | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None  # accepted, not used (the model has no reasoning mode)
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's: this request's Jinja template (--trust-request-chat-template)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the model continues the last message (Tokenizer.encode_chat)


class TokenizeRequest(msgspec.Struct):
    """POST /tokenize (vLLM): `prompt`, or chat `messages` rendered through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False  # vLLM's: each token's text beside its id
    add_special_tokens: bool = True  # accepted: the Kimi tokenizer adds none
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # (vLLM's; only with --trust-request-chat-template)


class DetokenizeRequest(msgspec.Struct):
    """POST /detokenize (vLLM)."""

    model: str | None = None
    tokens: list[TokenId] = []


def decode_body(body: bytes, schema: type[msgspec.Struct]) -> tuple[Any, list[str]]:
    """(request, names of the fields it ignores): unknown top-level fields and unknown
    `stream_options` fields (as `stream_options.NAME`).  A top-level null is the field's default, as vLLM's Optional
    fields take it (clients send `"n": null`, `"stream": null`), except where None means something else: a
    completion's `"max_tokens": null` is as many tokens as fit in the context (vLLM's), not the default 16."""
    try:
        raw = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
        if any(bytes(v) == b"null" for v in raw.values()):
            body = msgspec.json.encode({k: v for k, v in raw.items() if bytes(v) != b"null" or k in _NULL_KEPT})
        req = _decode_whole_floats(body, schema)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise _not_json(body, exc) from None
    ignored = sorted(set(raw) - set(schema.__struct_fields__))
    for name in ignored:  # fields that would change the output: refused rather than passed over
        if name in _UNSUPPORTED and msgspec.json.decode(raw[name]) not in _UNSUPPORTED[name][0]:
            raise InvalidRequest(f"{name} is not supported by this server ({_UNSUPPORTED[name][1]})")
    if getattr(req, "stream_options", None) is not None:
        inner = msgspec.json.decode(raw["stream_options"], type=dict[str, msgspec.Raw])
        ignored += sorted(f"stream_options.{k}" for k in set(inner) - set(StreamOptions.__struct_fields__))
    return req, ignored


_NULL_KEPT = frozenset({"max_tokens"})  # fields whose null is None, not the default (decode_body)
_FLOAT_FOR_INT = re.compile(r"Expected `(?:[^`]* \| )?int(?: \| [^`]*)?`, got `float` - at "
                            r"`\$((?:\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\])*)`$")
_PATH_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")
_WHOLE_FLOAT_PASSES = 64  # more than the integer fields and lists of integers of any request schema


def _decode_whole_floats(body: bytes, schema: type[msgspec.Struct]) -> Any:
    """msgspec.json.decode(body, type=schema), except that a whole-number float where an integer goes (`"max_tokens":
    16.0`, `"n": 2.0`, `"seed": 1e3`) is that integer: JSON has one number type (JSON Schema's "integer" takes 16.0),
    and vLLM's pydantic models take such a float too.  A fraction (16.5) stays a 400 naming the field.  Each pass
    fixes the field msgspec names (an element of a list: every whole-number float of that list), so a body with
    several of them decodes after as many passes, at most _WHOLE_FLOAT_PASSES; strings stay strings (vLLM's lax mode
    would take "16", which is no number at all)."""
    for _ in range(_WHOLE_FLOAT_PASSES):  # (each pass changes floats of the body into integers for good)
        try:
            return msgspec.json.decode(body, type=schema)
        except msgspec.ValidationError as exc:
            found = _FLOAT_FOR_INT.search(str(exc))
            if found is None:
                raise
            obj = msgspec.json.decode(body)
            *parents, leaf = [int(i) if i else name for name, i in _PATH_STEP.findall(found[1])] or [None]
            holder = obj
            for step in parents:
                holder = holder[step]
            if leaf is None or not isinstance(holder[leaf], float) or not holder[leaf].is_integer():
                raise
            # an element of a list of integers: its whole-number siblings too, in this one pass (one pass an element
            # re-decoded the whole body each time: quadratic, 6 s of the event loop for 8,000 ids)
            for k in range(len(holder)) if isinstance(holder, list) else (leaf,):
                if isinstance(holder[k], float) and holder[k].is_integer():
                    holder[k] = int(holder[k])
            body = msgspec.json.encode(obj)
    return msgspec.json.decode(body, type=schema)  # (passes spent: the error that is left, naming its field)


# a high-surrogate escape (after an even run of backslashes) with no `\u` escape after it
_LONE_SURROGATE = re.compile(rb"(?<!\\)(?:\\\\)*(\\u[dD][89abAB][0-9a-fA-F]{2})(?!\\u)")


def _not_json(body: bytes, exc: msgspec.DecodeError) -> InvalidRequest:
    """The 400 of a body msgspec cannot decode.  msgspec reports a lone high surrogate (`"\\ud800"`) as whatever it
    finds where the low one should be ("Input data was truncated", "unexpected end of hex escape"): when the body
    decodes with each one replaced by `\\ufffd` (as long), the 400 names the first one instead."""
    found = _LONE_SURROGATE.search(body)
    if found:
        try:
            msgspec.json.decode(_LONE_SURROGATE.sub(lambda m: m[0][:-6] + rb"\ufffd", body))
        except msgspec.DecodeError:
            pass
        else:
            return InvalidRequest(f"request body is not valid JSON: invalid unicode escape {found[1].decode()} (a lone "
                                  "surrogate: a high surrogate must be followed by a low one, \\udc00-\\udfff)")
    return InvalidRequest(f"request body is not valid JSON: {exc}")


def invocation_kind(body: bytes) -> bool:
    """/invocations (vLLM's SageMaker entry point): True for a chat request (it has `messages`), False for a
    completion (it has `prompt`); InvalidRequest for anything else."""
    try:
        raw = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError:
        raise InvalidRequest("invalid request body: expected a JSON object") from None
    except msgspec.DecodeError as exc:
        raise _not_json(body, exc) from None
    if "messages" in raw:
        return True
    if "prompt" in raw:
        return False
    raise InvalidRequest("/invocations takes a chat completion request (with 'messages') or a completion request "
                         "(with 'prompt')")


# vLLM request fields kda_rt does not implement, whose values other than these change the output: a 400 naming the
# field instead of an answer made without it (other unknown fields are accepted and listed, issue 13)
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "echo": ((False, None), "echo is a completions field"),
}

# vLLM's answer to a request's own chat template on a server that does not take them
UNTRUSTED_TEMPLATE = ("chat_template is passed with the request, but --trust-request-chat-template is not set: "
                      "refused (the server renders with its own template)")

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
             408: "BadRequestError", 413: "BadRequestError", 429: "RateLimitError", 503: "ServiceUnavailableError"}
    return {"error": {"message": message, "type": err_type or kinds.get(status, "InternalServerError"),
                      "param": param, "code": status}}


_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))


def _structured_outputs(req: _Sampling) -> dict[str, Any] | None:
    """The one output constraint of a request as a `StructuredOutputsParams` dict, from
    response_format (json_object / json_schema), structured_outputs or a legacy guided_* field;
    the grammar is compiled here, so an invalid one is a 400 naming the field it came from."""
    from kda_rt.engine.structured import grammar_of

    sources: list[tuple[str, Any]] = []
    fmt = req.response_format
    if fmt is not None:
        if "type" not in fmt:  # (OpenAI's and vLLM's schemas require it; a default of "text" dropped a schema)
            raise InvalidRequest("response_format.type is required: 'text', 'json_object' or 'json_schema'")
        kind = fmt["type"]
        if kind == "json_object":
            sources.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise InvalidRequest("response_format.json_schema.schema must be a JSON schema object")
            sources.append(("response_format.json_schema.schema", {"json": spec["schema"]}))
        elif kind != "text":
            raise InvalidRequest(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    if req.structured_outputs is not None:
        sources.append(("structured_outputs", req.structured_outputs))
    sources += [(name, {key: getattr(req, name)}) for name, key in _GUIDED if getattr(req, name) is not None]
    if len(sources) > 1:
        raise InvalidRequest(f"give at most one output constraint; got {', '.join(name for name, _ in sources)}")
    if not sources:
        return None
    field, spec = sources[0]
    try:
        params = StructuredOutputsParams.from_dict(spec)
        grammar_of(params, field)
    except (ValueError, TypeError) as exc:
        named = field == "structured_outputs" or field in str(exc)
        raise InvalidRequest(str(exc) if named else f"{field}: {exc}") from None
    return params.to_dict()


def _sampling_kwargs(req: _Sampling, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
    if req.stream_options is not None and not req.stream:  # as vLLM answers it
        raise InvalidRequest("stream_options can only be given with stream: true")
    kwargs: dict[str, Any] = {"logit_bias": req.logit_bias or None, "structured_outputs": _structured_outputs(req),
                              "n": req.n, "max_tokens": max_tokens, "logprobs": logprobs, "seed": req.seed,
                              "stop": req.stop, "stop_token_ids": req.stop_token_ids, "min_tokens": req.min_tokens,
                              "ignore_eos": req.ignore_eos, "skip_special_tokens": req.skip_special_tokens,
                              "spaces_between_special_tokens": req.spaces_between_special_tokens,
                              "include_stop_str_in_output": req.include_stop_str_in_output,
                              "truncate_prompt_tokens": req.truncate_prompt_tokens,
                              "allowed_token_ids": req.allowed_token_ids, "bad_words": req.bad_words or None}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    if isinstance(kwargs["stop"], list) and not kwargs["stop"]:
        kwargs["stop"] = None
    try:
        checked = SamplingParams(**kwargs)  # validated here so a bad value is a 400 before the engine sees it
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    kwargs["logit_bias"] = checked.logit_bias  # int keys on the wire
    return kwargs


def _beam(req: _Sampling) -> dict[str, Any] | None:
    """The beam search of a `use_beam_search` request ({"length_penalty"}; the width is `n`), else None."""
    return {"length_penalty": req.length_penalty} if req.use_beam_search else None


def _salt(req: _Sampling) -> str | None:
    if req.cache_salt is not None and not req.cache_salt:  # (vLLM's check)
        raise InvalidRequest("cache_salt must be a non-empty string if given")
    return req.cache_salt


def _ids(req: _Sampling) -> dict[str, bool]:
    """vLLM's return_token_ids / return_tokens_as_token_ids as payload flags."""
    return {"return_token_ids": bool(req.return_token_ids), "tokens_as_ids": req.return_tokens_as_token_ids}


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completion request: a string, token ids, or a non-empty list of either."""
    if isinstance(prompt, str) or (_is_ids(prompt) and prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise InvalidRequest("prompt must be a string, a list of token ids (ints), or a list of either")
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequest(f"prompt holds {len(prompts)} prompts; at most {MAX_PROMPTS} per request")
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if not p:
            raise InvalidRequest(f"{where} is empty")
        if isinstance(p, list) and not all(0 <= t <= _INT32 for t in p):
            bad = next(t for t in p if not 0 <= t <= _INT32)
            raise InvalidRequest(f"{where}: token id {bad} is not a valid token id")
    return prompts


def completion_payload(req: CompletionRequest) -> dict[str, Any]:
    """Engine payload {"prompts", "params", "echo", "prompt_logprobs", "score_only"} of a completion
    request.  `max_tokens: 0` scores the prompt without generating (with echo: lm-eval's loglikelihood)."""
    if req.suffix:
        raise InvalidRequest("suffix is not supported")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequest(f"best_of must equal n ({req.n}) when given, got {req.best_of}")
    prompts = _prompts(req.prompt)
    score_only = req.max_tokens == 0
    params = _sampling_kwargs(req, 1 if score_only else req.max_tokens, req.logprobs)
    # prompt logprobs: for echo (the legacy logprobs object then covers the prompt too) and/or vLLM's field
    wanted = [v for v in (req.logprobs if req.echo else None, req.prompt_logprobs) if v is not None]
    return {"prompts": prompts, "params": params, "echo": req.echo, "score_only": score_only,
            "prompt_logprobs": max(wanted) if wanted else None, "priority": req.priority, "beam": _beam(req),
            "cache_salt": _salt(req), **_ids(req)}


def _content(i: int, content: Any) -> str | list:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # kept as parts: the template layer keeps or joins them (`normalize_messages`)
        try:
            join_text_parts(i, content)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        return content
    raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts")


def chat_payload(req: ChatCompletionRequest, auto_tools: bool = False, trust_template: bool = False) -> dict[str, Any]:
    """Engine payload {"messages", "tools", "chat_template_kwargs", "chat_template", "params", "tool_mode", ...} of a
    chat request (content a string or text parts; `developer` is read as `system` by the template layer).
    With tool parsing on, special tokens are kept in the text (as vLLM does), else the markers are lost."""
    if not req.messages:
        raise InvalidRequest("messages must be a non-empty list")
    check_depth(req.messages, "messages")
    check_depth(req.tools, "tools")
    check_depth(req.chat_template_kwargs, "chat_template_kwargs")
    messages = []
    for i, m in enumerate(req.messages):
        role = m.get("role")
        if not isinstance(role, str):
            raise InvalidRequest(f"messages[{i}].role must be a string")
        msg: dict[str, Any] = {"role": role, "content": _content(i, m.get("content"))}
        for name in ("name", "tool_call_id"):
            if m.get(name) is not None:
                if not isinstance(m[name], str):
                    raise InvalidRequest(f"messages[{i}].{name} must be a string")
                msg[name] = m[name]
        if role == "assistant":  # its reasoning reaches the template, which may render it, as vLLM passes it on;
            # a value that is no string is passed over as before (clients that echo a structured reasoning object)
            msg.update((name, m[name]) for name in REASONING_FIELDS if isinstance(m.get(name), str))
        if m.get("tool_calls"):
            msg["tool_calls"] = tools.history_calls(i, m["tool_calls"])
        messages.append(msg)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = _sampling_kwargs(req, max_tokens, logprobs)
    tool_mode = tools.tool_mode(req.tools, req.tool_choice, req.parallel_tool_calls, auto_tools,
                                sum(len(m.get("tool_calls", ())) for m in messages))
    if tool_mode is not None:
        # the markers kept for the parser alone, unspaced: vLLM's Kimi output keeps the tool-call markers (no special
        # tokens of the Kimi class) and skips the chat markers, so a space after the prompt's <|im_middle|> would be
        # text vLLM never sends (vLLM's Kimi K3 parsers turn the spacing off the same way)
        params["skip_special_tokens"] = params["spaces_between_special_tokens"] = False
        forced = tools.forced_calls_spec(req.tools, tool_mode)
        if forced is not None:  # required / a named function: the arguments follow each schema
            if params["structured_outputs"] is not None:
                raise InvalidRequest("tool_choice 'required' or a named function constrains the output itself; "
                                     "it cannot be combined with response_format or structured_outputs")
            params["structured_outputs"] = forced
    if req.chat_template is not None and not trust_template:  # (vLLM's refusal)
        raise InvalidRequest(UNTRUSTED_TEMPLATE)
    return {"messages": messages, "tools": req.tools, "chat_template_kwargs": req.chat_template_kwargs,
            "chat_template": req.chat_template,
            "add_generation_prompt": req.add_generation_prompt, "continue_final_message": req.continue_final_message,
            "params": params, "tool_mode": tool_mode,
            "prompt_logprobs": req.prompt_logprobs, "priority": req.priority, "beam": _beam(req),
            "cache_salt": _salt(req), **_ids(req)}
