"""The Starlette app: OpenAI-compatible routes over an `EngineClient`.

    POST /v1/completions, /v1/chat/completions   (stream: true -> SSE chunks, then `data: [DONE]`)
    POST /tokenize, /detokenize                  (vLLM's shapes)
    GET  /v1/models, /version, /health (503 while draining or with the engine gone), /metrics (Prometheus)

Unknown request fields are accepted, logged once per field name at WARNING and listed in the
`x-kda-rt-ignored-fields` response header.
Errors use OpenAI's envelope `{"error": {"message", "type", "param", "code"}}`: 400 invalid body or
parameters, 401 wrong API key (the /v1 routes and /tokenize, /detokenize, /invocations, /reset_prefix_cache: more
than vLLM, which guards /v1 only; /health, /load, /version and /metrics stay open), 404 unknown model, 413 body over the cap,
429 engine waiting queue full, 503 draining or engine gone.  A client that disconnects has its
request aborted, which frees its KDA slot and MLA pages at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kda_rt import env
from kda_rt.server import protocol, responses_api
from kda_rt.server.engine_client import EngineClient, EngineDeadError, EngineTimeoutError, RequestRejected
from kda_rt.server.metrics import CONTENT_TYPE, Metrics
from kda_rt.server.run import ABORTED as _ABORTED
from kda_rt.server.run import RequestRun, endpoint_name
from kda_rt.server.run import error_response as _error
from kda_rt.server.run import json_response as _json

__all__ = ["IGNORED_HEADER", "ServerState", "build_app"]

logger = logging.getLogger(__name__)

IGNORED_HEADER = "x-kda-rt-ignored-fields"
_MAX_WARNED = 1024  # distinct names remembered (a client can invent any number of them)
_MAX_HEADER_CHARS = 2048
_warned_fields: set[str] = set()  # ignored field names already logged by this process


def _safe_name(name: str) -> str:
    """A field name as printable ASCII without spaces (JSON escapes; ',' and ' ' escaped too, so a
    header value never starts or ends with whitespace, which HTTP forbids), for a header and a log line."""
    return json.dumps(name[:200])[1:-1].replace(",", "\\u002c").replace(" ", "\\u0020")


def _note_ignored(response: Response, fields: list[str]) -> None:
    """Log each new ignored field name once at WARNING and list them in the response header."""
    names = [_safe_name(f) for f in fields]
    new = [n for n in names if n not in _warned_fields]
    if new and len(_warned_fields) < _MAX_WARNED:
        _warned_fields.update(new)
        logger.warning("request fields ignored (not supported; logged once per name): %s", ", ".join(new))
    value = ", ".join(names)
    if len(value) > _MAX_HEADER_CHARS:
        value = value[:_MAX_HEADER_CHARS].rsplit(", ", 1)[0] + ", ..."
    response.headers[IGNORED_HEADER] = value

# an X-Request-Id the server takes into its ids ('/' is left out: the engine names a request's prompts `{id}/{k}`)
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:=+-]{1,128}")


def _request_id(request: Request, prefix: str, *taken: Mapping[str, Any]) -> str:
    """The request's id: `{prefix}-{X-Request-Id}` when the client sends a plain one (vLLM's rule), with a random
    suffix when that id is in any of `taken` (in flight, or being added: the caller adds it before its next await);
    else `{prefix}-{random hex}`."""
    client = request.headers.get("x-request-id", "")
    if _CLIENT_ID.fullmatch(client):
        rid = f"{prefix}-{client}"
        return rid if not any(rid in t for t in taken) else f"{rid}-{uuid.uuid4().hex[:8]}"
    return f"{prefix}-{uuid.uuid4().hex}"


_DRAIN_READ_FACTOR = 8  # an oversized body is read (and dropped) up to this many caps, so the 413 arrives


@dataclass
class ServerState:
    client: EngineClient
    model_name: str
    # other names a request's "model" may use: the rest of --served-model-name's names (listed by /v1/models too),
    # and, without that flag, the model argument as given (a path or a Hugging Face id, vLLM's default name)
    aliases: tuple[str, ...] = ()
    listed_aliases: tuple[str, ...] = ()
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    body_timeout: float = 30.0  # seconds to receive a whole request body
    draining: bool = False
    log_requests: bool = False  # --enable-log-requests
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens
    auto_tools: bool = False  # --enable-auto-tool-choice with a --tool-call-parser
    trust_request_chat_template: bool = False  # --trust-request-chat-template: a chat request may bring its template
    tokens_as_ids: bool = False  # --return-tokens-as-token-ids: logprobs name tokens "token_id:N" in every response
    metrics: Metrics | None = None
    cors: dict[str, Any] | None = None  # CORSMiddleware's arguments (--allowed-origins ...); None: no CORS headers
    created: int = field(default_factory=lambda: int(time.time()))  # /v1/models' "created": when the server started
    open: dict[str, asyncio.Queue] = field(default_factory=dict)  # in-flight request id -> its queue

    metrics_prefix: str = "kda_rt:"  # --metrics-prefix
    responses_store: responses_api.ResponseStore | None = None  # --enable-responses-store
    background: dict[str, asyncio.Future] = field(default_factory=dict)  # background responses running -> their task
    cancelled: set[str] = field(default_factory=set)  # background responses a cancel stopped

    def __post_init__(self) -> None:
        if self.metrics is None:
            info = getattr(self.client, "info", None) or {}
            self.metrics = Metrics(self.model_name, self.metrics_prefix, info.get("max_model_len"))

    def serves(self, name: str | None) -> bool:
        """Whether a request's "model" names this server's model (None: the field left out)."""
        return name is None or name == self.model_name or name in self.aliases

    def abort_all(self) -> None:
        """End every in-flight request now (finish_reason "abort") and free its engine resources."""
        for rid, queue in list(self.open.items()):
            self.client.abort(rid)
            queue.put_nowait(_ABORTED)


class _TooLarge(Exception):
    pass


async def _read_body(request: Request, cap: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > cap):  # answered from the header alone
        raise _TooLarge(f"request body of {declared[:24]} bytes exceeds the {cap}-byte limit (--max-body-bytes)")
    body, total = bytearray(), 0
    too_large = False
    async for chunk in request.stream():
        total += len(chunk)
        if total > cap:
            too_large = True
        if too_large:
            if total > cap * _DRAIN_READ_FACTOR:
                break
            continue
        body += chunk
    if too_large:
        raise _TooLarge(f"request body of {declared or 'more than ' + str(cap)} bytes exceeds the {cap}-byte limit")
    return bytes(body)


def build_app(state: ServerState) -> Starlette:
    metrics = state.metrics

    def authorized(request: Request) -> bool:
        if state.api_key is None:
            return True
        given = request.headers.get("authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        return secrets.compare_digest(token.encode(), state.api_key.encode())

    async def health(request: Request) -> Response:
        if state.draining:
            return _json({"status": "draining"}, 503)
        if not state.client.alive:
            return _json({"status": "engine unavailable", "reason": state.client.dead_reason}, 503)
        if state.client.stalled:
            try:  # a stats round trip tells whether it answers again
                await asyncio.wait_for(state.client.stats(), 1.0)
            except (asyncio.TimeoutError, EngineDeadError, EngineTimeoutError):
                pass
        if state.client.stalled:
            return _json({"status": "engine not responding", "silent_s": round(state.client.stalled_for(), 1)}, 503)
        return _json({"status": "ok", "engine_pid": state.client.pid})

    async def models(request: Request) -> Response:
        if not authorized(request):
            return _error("invalid or missing API key", 401)
        cards = [{"id": name, "object": "model", "created": state.created, "owned_by": "kda_rt",
                  "root": state.model_name, "max_model_len": state.client.info.get("max_model_len")}
                 for name in (state.model_name, *state.listed_aliases)]
        return _json({"object": "list", "data": cards})

    async def prometheus(request: Request) -> Response:
        stats = None
        if state.client.alive and not state.client.stalled:
            try:
                stats = await state.client.stats()
            except (EngineDeadError, EngineTimeoutError):
                stats = None
        return Response(metrics.render(stats, state.client.alive, state.draining), media_type=CONTENT_TYPE)

    async def stored_response(request: Request) -> Response:
        """GET / DELETE /v1/responses/{response_id}: a stored response (--enable-responses-store), or its removal."""
        if not authorized(request):
            return _error("invalid or missing API key", 401)
        rid = request.path_params["response_id"]
        store = state.responses_store
        if store is None:
            return _error("this server stores no responses (start it with --enable-responses-store)", 404)
        if request.method == "DELETE":
            if rid in state.background:
                return _error(f"response {rid!r} is running in the background: cancel it first "
                              f"(POST /v1/responses/{rid}/cancel)", 400)
            if not store.delete(rid):
                return _error(f"response {rid!r} is not stored", 404)
            return _json({"id": rid, "object": "response", "deleted": True})
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            # (a JSON body to a client reading events would be an empty stream, no error)
            return _error("stream: a stored response is not streamed again; GET it without stream (poll a "
                          "background one until its status is final)", 400, "stream")
        body = store.get(rid)
        return _json(body) if body is not None else _error(f"response {rid!r} is not stored", 404)

    async def stored_input_items(request: Request) -> Response:
        """GET /v1/responses/{response_id}/input_items: the items a stored response was generated from, a page at a
        time (`limit` 1-100, default 20; `order` desc (the default) or asc; `after` / `before` an item id)."""
        if not authorized(request):
            return _error("invalid or missing API key", 401)
        rid, query = request.path_params["response_id"], request.query_params
        store = state.responses_store
        if store is None:
            return _error("this server stores no responses (start it with --enable-responses-store)", 404)
        limit, order = query.get("limit", "20"), query.get("order", "desc")
        if not (limit.isdigit() and 1 <= int(limit) <= 100):
            return _error(f"limit must be an integer from 1 to 100, got {limit!r:.40}", 400, "limit")
        if order not in ("asc", "desc"):
            return _error(f"order must be 'asc' or 'desc', got {order!r:.40}", 400, "order")
        try:
            items = store.input_items(rid)
            page = responses_api.item_page(items, limit=int(limit), order=order, after=query.get("after"),
                                           before=query.get("before"))
        except responses_api.ResponseNotFound as exc:
            missing = exc.args[0]
            return _error(f"response {rid!r} is not stored" if missing == rid else
                          f"response {rid!r} continues response {missing!r}, which is not stored (deleted or evicted)",
                          404)
        except protocol.InvalidRequest as exc:
            return _error(str(exc), 400)
        return _json(page)

    async def load(request: Request) -> Response:
        """vLLM's GET /load: the generation requests in flight (always tracked; vLLM's
        --enable-server-load-tracking is accepted)."""
        return _json({"server_load": len(state.open)})

    async def version(request: Request) -> Response:
        from kda_rt import __version__

        return _json({"version": __version__})

    async def text_op(request: Request, op: str) -> Response:
        """POST /tokenize and /detokenize, answered by the engine process's tokenizer."""
        if not authorized(request):
            return _error("invalid or missing API key", 401)
        try:
            body = await asyncio.wait_for(_read_body(request, state.max_body_bytes), state.body_timeout)
            schema = protocol.TokenizeRequest if op == "tokenize" else protocol.DetokenizeRequest
            req, ignored = protocol.decode_body(body, schema)
            if op == "tokenize":
                protocol.check_depth(req.messages, "messages")
                protocol.check_depth(req.tools, "tools")
                protocol.check_depth(req.chat_template_kwargs, "chat_template_kwargs")
                if (req.prompt is None) == (req.messages is None):
                    raise protocol.InvalidRequest("give exactly one of prompt and messages")
                payload = {"prompt": req.prompt, "add_generation_prompt": req.add_generation_prompt,
                           "continue_final_message": req.continue_final_message,
                           "return_token_strs": bool(req.return_token_strs),
                           "tools": req.tools, "chat_template_kwargs": req.chat_template_kwargs,
                           "chat_template": req.chat_template}
                if req.chat_template is not None and not state.trust_request_chat_template:
                    raise protocol.InvalidRequest(protocol.UNTRUSTED_TEMPLATE)
                if req.messages is not None:
                    payload["messages"] = protocol.chat_payload(protocol.ChatCompletionRequest(
                        messages=req.messages, tools=req.tools, tool_choice="none"))["messages"]
            else:
                payload = {"tokens": req.tokens}
        except _TooLarge as exc:
            return _error(str(exc), 413)
        except asyncio.TimeoutError:
            return _error(f"request body not received within {state.body_timeout:g} s (--body-timeout)", 408)
        except protocol.InvalidRequest as exc:
            return _error(str(exc), 400)
        except RecursionError:  # msgspec's decoder on a body nested past Python's limit (an ignored field's too)
            return _error("request body is nested too deeply", 400)
        except ClientDisconnect:  # (as the generation routes: not a server error)
            logger.info("client disconnected while sending its request body (%s %s)", request.method, request.url.path)
            return Response(status_code=499)
        if not state.serves(req.model):
            return _error(f"the model {req.model!r} does not exist; this server serves {state.model_name!r}", 404, "model")
        try:
            result = await state.client.call(op, payload)
        except RequestRejected as exc:
            return _error(exc.message, exc.status)
        except (EngineDeadError, EngineTimeoutError) as exc:
            return _error(f"the engine is unavailable: {exc}", 503)
        response = _json(result)
        if ignored:
            _note_ignored(response, ignored)
        return response

    async def reset_prefix_cache(request: Request) -> Response:
        """POST /reset_prefix_cache (KDA_RT_SERVER_DEV_MODE=1, as vLLM's dev mode): every kept prefix dropped;
        200 with an empty body, as vLLM answers."""
        if not authorized(request):
            return _error("invalid or missing API key", 401)
        try:
            await state.client.call("reset_prefix_cache", {})
        except (EngineDeadError, EngineTimeoutError) as exc:
            return _error(f"the engine is unavailable: {exc}", 503)
        return Response(status_code=200)

    async def tokenize(request: Request) -> Response:
        return await text_op(request, "tokenize")

    async def detokenize(request: Request) -> Response:
        return await text_op(request, "detokenize")

    async def generate(request: Request, chat: bool, api: str | None = None) -> Response:
        """Completions, chat, or (api="responses", chat=True) the Responses API over a chat request."""
        endpoint = api or ("chat" if chat else "completions")
        ignored: list[str] = []
        try:
            response = await _generate(request, chat, ignored, api)
        except RecursionError:  # a nesting check missed a path: still the client's input, still counted
            response = _error("request body is nested too deeply", 400)
        except ClientDisconnect:
            logger.info("client disconnected while sending its request body (%s %s)", request.method, request.url.path)
            response = Response(status_code=499)
        except Exception:
            metrics.http(endpoint, 500)
            raise
        metrics.http(endpoint, response.status_code)
        if ignored:
            _note_ignored(response, ignored)
        return response

    async def _generate(request: Request, chat: bool, ignored: list[str], api: str | None) -> Response:
        if not authorized(request):
            return _error("invalid or missing API key", 401)
        if state.draining:
            return _error("the server is shutting down", 503)
        try:
            body = await asyncio.wait_for(_read_body(request, state.max_body_bytes), state.body_timeout)
            outer = None  # the Responses API's own request, around the chat request it runs as
            on_done = None  # (the Responses API with the store: keeps the finished response)
            if api == "invocations":  # chat or completion, as the body says
                chat, api = protocol.invocation_kind(body), None
            if api == "responses":
                outer, names = protocol.decode_body(body, responses_api.ResponsesRequest)
                ignored += names
                store = state.responses_store
                history = None
                if outer.previous_response_id is not None and store is not None:
                    history = store.history(outer.previous_response_id)
                req = responses_api.chat_request(outer, history)
                payload = responses_api.chat_payload(req, state.auto_tools)
                if outer.background and (store is None or outer.store is False or outer.stream):
                    raise protocol.InvalidRequest("background needs stored responses (--enable-responses-store, "
                                                  "store not false) and no stream")
                if store is not None and outer.store is not False:  # (stored by default then, as OpenAI's)
                    own, previous = responses_api.input_items(outer), outer.previous_response_id
                    on_done = lambda body: store.put(body, own, previous)  # noqa: E731
            elif chat:
                req, names = protocol.decode_body(body, protocol.ChatCompletionRequest)
                ignored += names
                payload = protocol.chat_payload(req, state.auto_tools, state.trust_request_chat_template)
            else:
                req, names = protocol.decode_body(body, protocol.CompletionRequest)
                ignored += names
                payload = protocol.completion_payload(req)
        except _TooLarge as exc:
            response = _error(str(exc), 413)
            response.headers["Connection"] = "close"  # the rest of the body is never read
            return response
        except asyncio.TimeoutError:
            response = _error(f"request body not received within {state.body_timeout:g} s (--body-timeout)", 408)
            response.headers["Connection"] = "close"
            return response
        except protocol.InvalidRequest as exc:
            return _error(str(exc), 400)
        except responses_api.ResponseNotFound as exc:
            return _error(f"previous_response_id: response {exc.args[0]!r} is not stored (never, deleted, or evicted: "
                          f"the store keeps at most {state.responses_store.capacity} responses and "
                          f"{state.responses_store.max_bytes >> 20} MiB, the least recently used out first)", 404,
                          param="previous_response_id")
        if not state.serves(req.model):
            return _error(f"the model {req.model!r} does not exist; this server serves {state.model_name!r}", 404, "model")
        if state.draining:
            return _error("the server is shutting down", 503)
        if state.tokens_as_ids and payload.get("tokens_as_ids") is None:  # (--return-tokens-as-token-ids: every
            payload["tokens_as_ids"] = True  # request's logprobs so, but one that says false: vLLM's rule)
        prefix = "resp" if api == "responses" else "chatcmpl" if chat else "cmpl"
        if on_done is not None:  # (a response to be kept gets a random id, as OpenAI's and vLLM's: a client's own
            rid = f"resp-{uuid.uuid4().hex}"  # X-Request-Id could name one stored before, evicted or deleted since)
        else:
            rid = _request_id(request, prefix, state.open, state.client.queues)
        start = time.perf_counter()
        try:
            queue, added = await state.client.add(rid, payload)
        except RequestRejected as exc:
            metrics.rejected()
            if state.log_requests:
                logger.info("request %s rejected (%d): %s", rid, exc.status, exc.message)
            # (the engine names chat's fields; a Responses client sent its own: max_output_tokens, text.format)
            message = responses_api.field_names(exc.message) if api == "responses" else exc.message
            return _error(message, exc.status)
        except (EngineDeadError, EngineTimeoutError) as exc:
            return _error(f"the engine is unavailable: {exc}", 503)
        if state.log_requests:
            logger.info("request %s: %s, %d prompt tokens in %d prompt(s), params %s%s", rid, endpoint_name(chat),
                        added["prompt_tokens"], len(added["prompts"]), payload["params"],
                        f", tools {payload['tool_mode']}" if chat and payload.get("tool_mode") else "")
        run = RequestRun(state, rid, req, chat, queue, added, payload, start)
        if api == "responses" and outer.background:
            return _background(run, outer, own, previous)
        if req.stream:
            events = responses_api.events(run, outer, on_done) if api == "responses" else run.sse()
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        response = await run.collect(request, responses_api.shape(run, outer, on_done) if api == "responses" else None)
        response.headers["X-Request-Id"] = rid
        return response

    def _background(run: RequestRun, outer, own: list, previous: str | None) -> Response:
        """A background response (OpenAI's `background: true`): answered now with status "queued", kept in the store
        while it runs (GET polls it; POST .../cancel stops it), replaced there by the finished response."""
        store, rid = state.responses_store, run.rid
        body = responses_api.response_body(rid, run.created, state.model_name, outer, reason=None, usage=None,
                                           status="queued", sampling=run.sampling)
        body.update(background=True, store=True)
        store.put_running({**body, "status": "in_progress"}, own, previous)

        def finished(final: dict[str, Any]) -> None:
            final["background"] = True
            if rid in state.cancelled and final["status"] == "failed":  # (stopped by the cancel, not ended before it)
                final.update(status="cancelled", error=None)
            if rid in store:  # (a DELETE is refused while it runs; an eviction cannot take a running one)
                store.put(final, own, previous)

        async def go() -> None:
            try:
                await run.collect(None, responses_api.shape(run, outer, finished))
            except Exception:  # (the store then says it failed, below)
                logger.exception("background response %s failed", rid)
            finally:
                state.background.pop(rid, None)
                state.cancelled.discard(rid)
                current = store.get(rid)
                if current is not None and current["status"] == "in_progress":  # (the engine failed: no answer)
                    store.put({**current, "status": "failed", "error": {"code": "server_error", "message":
                               "the engine failed while serving this request"}}, own, previous)

        state.background[rid] = asyncio.ensure_future(go())
        response = _json(body)
        response.headers["X-Request-Id"] = rid
        return response

    async def cancel_response(request: Request) -> Response:
        """POST /v1/responses/{response_id}/cancel: stop a background response; answers it, status "cancelled"."""
        if not authorized(request):
            return _error("invalid or missing API key", 401)
        rid = request.path_params["response_id"]
        task = state.background.get(rid)
        if task is None:
            stored = state.responses_store.get(rid) if state.responses_store is not None else None
            if stored is not None and stored.get("background"):  # (ended already: cancelling it again is harmless)
                return _json(stored)
            return _error(f"response {rid!r} is not running in the background", 400 if stored is not None else 404)
        state.cancelled.add(rid)
        with contextlib.suppress(EngineDeadError, OSError):  # (a dead engine ends the run anyway)
            state.client.abort(rid)
        queue = state.open.get(rid)
        if queue is not None:  # (its run ends now, finish_reason "abort", as a shutdown's abort_all ends it)
            queue.put_nowait(_ABORTED)
        await asyncio.wait([task], timeout=30)
        body = state.responses_store.get(rid)
        return _json(body) if body is not None else _error(f"response {rid!r} is not stored", 404)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def responses_create(request: Request) -> Response:
        return await generate(request, chat=True, api="responses")

    async def invocations(request: Request) -> Response:
        return await generate(request, chat=False, api="invocations")

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),  # vLLM's (SageMaker's) name for the same check
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/load", load, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/responses", responses_create, methods=["POST"]),
        Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
        Route("/v1/responses/{response_id}/input_items", stored_input_items, methods=["GET"]),
        Route("/invocations", invocations, methods=["POST"]),  # vLLM's SageMaker entry: chat or completion
    ]
    if env.server_dev_mode():
        routes.append(Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]))
    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return _error(f"internal server error ({type(exc).__name__})", 500)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        """404 unknown route, 405 wrong method: the OpenAI envelope instead of Starlette's plain text."""
        path, root = request.scope.get("path", ""), request.scope.get("root_path", "")
        path = path[len(root):] if root and path.startswith(root) else path  # as sent (uvicorn adds --root-path)
        message = {404: f"no route {path}", 405: f"method {request.method} is not allowed on {path}"}
        response = _error(message.get(exc.status_code, str(exc.detail)), exc.status_code)
        response.headers.update(exc.headers or {})
        return response

    middleware = []
    if state.cors is not None:  # browser front ends calling the server directly (vLLM installs the same middleware)
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware

        middleware.append(Middleware(CORSMiddleware, **state.cors))
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={Exception: internal_error, HTTPException: http_error})
