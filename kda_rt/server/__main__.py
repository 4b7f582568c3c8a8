"""`python -m kda_rt.serve` (or `python -m kda_rt.server`): the OpenAI-compatible HTTP server.

    python -m kda_rt.serve --model DIR [--host 0.0.0.0] [--port 8000] [--api-key KEY]

Flags follow vLLM's names.  Startup: the engine process loads the model, then uvicorn listens.
SIGTERM or SIGINT: stop admitting (new requests and /health get 503), let in-flight requests
finish for up to `--shutdown-timeout` seconds, abort the rest, stop the engine process, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import re
import signal
import socket
import ssl
import sys
import time

import uvicorn

from kda_rt import env
from kda_rt.cli import model_dir_problem
from kda_rt.engine.config import SERVER_BATCHED_TOKENS, EngineConfig
from kda_rt.log import configure as configure_logging
from kda_rt.server.engine_client import MAX_STREAM_BACKLOG

__all__ = ["build_parser", "main", "serve"]

logger = logging.getLogger("kda_rt.server")


MAX_WAITING = 4096  # a bound on the waiting queue's host memory (prompt ids), far past what load tools send at once


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kda_rt.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: the bundled tiny demo checkpoint)")
    ap.add_argument("--served-model-name", nargs="+", default=None,
                    help="model id(s) in the API, the first one in responses (default: the directory name; the "
                         "--model argument as given is accepted too)")
    ap.add_argument("--chat-template", default=None,
                    help="a Jinja chat template file (or the template itself) in place of the checkpoint's")
    ap.add_argument("--trust-request-chat-template", action="store_true",
                    help="let a chat request bring its own chat_template (vLLM's flag; rendered in the same "
                         "sandbox, within the same time and size bounds); without it such a request is a 400")
    ap.add_argument("--enable-responses-store", action="store_true",
                    help="keep Responses API responses (store: true, the default then) for previous_response_id and "
                         "GET/DELETE /v1/responses/{id} (default: $KDA_RT_ENABLE_RESPONSES_API_STORE, else vLLM's "
                         "$VLLM_ENABLE_RESPONSES_API_STORE)")
    ap.add_argument("--responses-store-size", type=int, default=1024,
                    help="responses the store keeps, least recently used out first (default 1024)")
    ap.add_argument("--responses-store-max-mib", type=float, default=256.0,
                    help="MiB of JSON the store keeps at most (default 256), least recently used out first")
    ap.add_argument("--metrics-prefix", default="kda_rt:",
                    help='the prefix of every /metrics name (default kda_rt:; "vllm:" lets vLLM\'s dashboards, '
                         "autoscalers and routers read them)")
    ap.add_argument("--enable-server-load-tracking", action="store_true",
                    help="accepted for vLLM's command lines: GET /load always reports the requests in flight")
    ap.add_argument("--return-tokens-as-token-ids", action="store_true",
                    help='logprobs name every token "token_id:N" (vLLM\'s flag; a request\'s '
                         "return_tokens_as_token_ids does it for that request)")
    ap.add_argument("--generation-config", default="auto",
                    help="auto: default sampling settings from the checkpoint's generation_config.json (as vLLM); "
                         "vllm: none; or a directory holding a generation_config.json")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="accepted for vLLM's command lines; kda_rt never runs code from a checkpoint")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    EngineConfig.add_cli_args(ap, max_num_batched_tokens=SERVER_BATCHED_TOKENS)  # streams feel long steps
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="reserved; only 1 is supported")
    ap.add_argument("--max-waiting", type=int, default=MAX_WAITING,
                    help="sequences allowed in the engine's waiting queue; beyond it requests get 429 "
                         f"(default {MAX_WAITING}: vLLM queues without a bound, and its benchmark sends 1000 at once)")
    ap.add_argument("--allowed-origins", nargs="*", default=["*"],
                    help="CORS: origins browsers may call from (vLLM's default: any); none: no CORS headers")
    ap.add_argument("--allowed-methods", nargs="+", default=["*"], help="CORS: allowed methods")
    ap.add_argument("--allowed-headers", nargs="+", default=["*"], help="CORS: allowed request headers")
    ap.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies, auth)")
    ap.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="request bodies over this get 413")
    ap.add_argument("--api-key", default=env.api_key(),
                    help="require 'Authorization: Bearer KEY' on the /v1 routes, /tokenize, /detokenize, /invocations and "
                         "/reset_prefix_cache "
                         "(default: $KDA_RT_API_KEY, else $VLLM_API_KEY; an empty variable counts as unset, as in "
                         "vLLM, while an empty --api-key is refused)")
    ap.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds in-flight requests may run after SIGTERM before they are aborted")
    ap.add_argument("--engine-timeout", type=float, default=60.0,
                    help="seconds a busy engine may stay silent before /health is 503 and requests fail")
    ap.add_argument("--header-timeout", type=float, default=30.0,
                    help="seconds a new connection may take to send its request headers (else 408 and close)")
    ap.add_argument("--body-timeout", type=float, default=30.0, help="seconds to receive a request body (else 408)")
    ap.add_argument("--max-stream-backlog", type=int, default=MAX_STREAM_BACKLOG,
                    help="token entries (a token and its top logprobs) of one request that may wait for a client "
                         "reading its stream slowly; beyond it the request is aborted and the waiting output dropped "
                         f"(default {MAX_STREAM_BACKLOG}, about 200 MB; 0: no bound, as vLLM)")
    ap.add_argument("--engine-start-timeout", type=float, default=None, help="seconds to wait for the model to load")
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                    help="for the HTTP and the engine process alike")
    ap.add_argument("--disable-log-stats", action="store_true",
                    help="no periodic throughput / usage log line (else every $KDA_RT_LOG_STATS_INTERVAL s, 10)")
    ap.add_argument("--uvicorn-log-level", default=None, choices=("critical", "error", "warning", "info", "debug",
                                                                  "trace"),
                    help="uvicorn's own log level (default: --log-level)")
    ap.add_argument("--root-path", default="", help="ASGI root_path, behind a proxy that serves the API under a prefix")
    ap.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key (and --ssl-certfile)")
    ap.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (and --ssl-keyfile)")
    ap.add_argument("--enable-log-requests", action="store_true",
                    help="log each request (id, prompt tokens, sampling parameters) and its end at INFO")
    ap.add_argument("--enable-prompt-tokens-details", action="store_true",
                    help="usage.prompt_tokens_details.cached_tokens in responses: the prompt tokens resumed from the "
                         "prefix cache (on by default; --no-enable-prefix-caching turns it off)")
    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help='allow tool_choice "auto": the model decides when to call tools (needs --tool-call-parser)')
    ap.add_argument("--tool-call-parser", default=None, choices=("kimi_k2",),
                    help="parse the model's tool-call markers into message.tool_calls (Kimi K2 family format)")
    return ap


async def start_state(args: argparse.Namespace, settings: EngineConfig):
    """Start the engine process and make the app's state from the flags; None when the engine failed to start (its
    error logged).  `serve` and `run_batch` share it."""
    from kda_rt.server.app import ServerState
    from kda_rt.server.engine_client import EngineClient
    from kda_rt.server.responses_api import ResponseStore

    model = args.model
    if model is None:
        from kda_rt.demo import demo_path

        model = str(demo_path())
        logger.warning("no --model given: serving the bundled demo checkpoint (random weights)")
    init = {"model": model, "settings": settings.to_dict(), "max_waiting": args.max_waiting,
            "log_level": args.log_level, "chat_template": args.chat_template,
            "disable_log_stats": args.disable_log_stats, "generation_config": args.generation_config}
    client = EngineClient(init, engine_timeout=args.engine_timeout, max_stream_backlog=args.max_stream_backlog)
    try:
        await client.start(args.engine_start_timeout)
    except RuntimeError as exc:
        logger.error("%s", exc)
        return None
    if args.served_model_name:
        name, *others = args.served_model_name
    else:  # the directory's name, and the --model argument as given (vLLM's default name), not listed
        name, others = os.path.basename(os.path.normpath(model)), [model, os.path.normpath(model)]
    aliases = tuple(dict.fromkeys(a for a in others if a != name))
    state = ServerState(client, name, aliases=aliases, listed_aliases=aliases if args.served_model_name else (),
                        api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                        body_timeout=args.body_timeout, log_requests=args.enable_log_requests,
                        prompt_tokens_details=args.enable_prompt_tokens_details,
                        auto_tools=args.enable_auto_tool_choice and args.tool_call_parser is not None,
                        trust_request_chat_template=args.trust_request_chat_template,
                        tokens_as_ids=args.return_tokens_as_token_ids, metrics_prefix=args.metrics_prefix,
                        responses_store=ResponseStore(args.responses_store_size,
                                                      int(args.responses_store_max_mib * 2**20))
                        if args.enable_responses_store else None,
                        cors={"allow_origins": args.allowed_origins, "allow_methods": args.allowed_methods,
                              "allow_headers": args.allowed_headers, "allow_credentials": args.allow_credentials}
                        if args.allowed_origins else None)
    return state


async def serve(args: argparse.Namespace, settings: EngineConfig) -> int:
    from kda_rt.server.app import build_app
    from kda_rt.server.http import header_timeout_protocol

    state = await start_state(args, settings)
    if state is None:
        return 1
    client = state.client

    config = uvicorn.Config(build_app(state), host=args.host, port=args.port,
                            log_level=args.uvicorn_log_level or args.log_level, root_path=args.root_path,
                            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                            timeout_graceful_shutdown=5, access_log=False, log_config=None,
                            http=header_timeout_protocol(args.header_timeout))
    server = _Server(config)
    loop = asyncio.get_running_loop()
    drain_task: list[asyncio.Task] = []

    def on_signal(sig: signal.Signals) -> None:
        if drain_task:
            logger.warning("second %s: aborting in-flight requests now", sig.name)
            state.abort_all()
            return
        logger.info("%s received: draining %d in-flight requests (up to %.0fs)", sig.name, len(state.open),
                    args.shutdown_timeout)
        drain_task.append(loop.create_task(_drain(state, server, args.shutdown_timeout)))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await server.serve()
    finally:
        state.draining = True
        state.abort_all()
        await client.close()
    return 0 if server.started else 1


async def _drain(state, server, timeout: float) -> None:
    state.draining = True
    deadline = time.monotonic() + timeout
    while state.open and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if state.open:
        logger.warning("shutdown timeout: aborting %d requests still running", len(state.open))
        state.abort_all()
        for _ in range(100):  # let the aborted streams send their last chunk
            if not state.open:
                break
            await asyncio.sleep(0.02)
    else:
        logger.info("drained: every in-flight request finished")
    server.should_exit = True


class _Server(uvicorn.Server):
    """uvicorn.Server that leaves signal handling to `serve` (which drains first)."""

    @contextlib.contextmanager
    def capture_signals(self):  # uvicorn >= 0.29
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


def _host_problem(host: str, port: int) -> str | None:
    """Why uvicorn could not listen on `--host` (an empty host would mean every interface to asyncio), or None."""
    if not host.strip():
        return "--host is empty (0.0.0.0 listens on every interface)"
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        return f"--host {host!r}: cannot resolve it ({getattr(exc, 'strerror', None) or exc})"
    return None


def _ssl_problem(certfile: str, keyfile: str) -> str | None:
    """Why uvicorn could not load the HTTPS certificate and key, or None.  An encrypted key is left to uvicorn
    (OpenSSL asks for its pass phrase)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_verify_locations(cafile=certfile)  # the certificate alone first, to name the file at fault
    except ssl.SSLError:
        return f"--ssl-certfile {certfile!r}: not a PEM certificate"
    except OSError as exc:
        return f"--ssl-certfile {certfile!r}: cannot read ({exc.strerror or exc})"
    encrypted: list[bool] = []
    try:
        context.load_cert_chain(certfile, keyfile, password=lambda: encrypted.append(True) or b"")
    except ssl.SSLError as exc:
        if encrypted:
            return None
        if exc.reason == "KEY_VALUES_MISMATCH":
            return f"--ssl-keyfile {keyfile!r} is not the key of --ssl-certfile {certfile!r}"
        return f"--ssl-keyfile {keyfile!r}: not a PEM private key"
    except OSError as exc:
        return f"--ssl-keyfile {keyfile!r}: cannot read ({exc.strerror or exc})"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    settings = checked_settings(args)
    return settings if isinstance(settings, int) else asyncio.run(serve(args, settings))


def checked_settings(args: argparse.Namespace) -> EngineConfig | int:
    """The engine settings of parsed flags, or 2 after an error line naming the bad flag (checked before the model
    loads, which can take minutes).  `run_batch` checks its flags with it too."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        print("error: --enable-auto-tool-choice needs --tool-call-parser kimi_k2", file=sys.stderr)
        return 2
    if args.tensor_parallel_size != 1:
        print("error: --tensor-parallel-size is reserved; only 1 is supported", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"error: --port must be in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    try:
        args.enable_responses_store = args.enable_responses_store or env.responses_store()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.responses_store_size < 1:
        print(f"error: --responses-store-size must be >= 1, got {args.responses_store_size}", file=sys.stderr)
        return 2
    if not 0 < args.responses_store_max_mib < math.inf:
        print(f"error: --responses-store-max-mib must be a number > 0, got {args.responses_store_max_mib}",
              file=sys.stderr)
        return 2
    if not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", args.metrics_prefix):
        print(f"error: --metrics-prefix {args.metrics_prefix!r} is not a Prometheus name start "
              "([a-zA-Z_:][a-zA-Z0-9_:]*, e.g. vllm:)", file=sys.stderr)
        return 2
    timeouts = {"--engine-timeout": args.engine_timeout, "--body-timeout": args.body_timeout,
                "--header-timeout": args.header_timeout, "--engine-start-timeout": args.engine_start_timeout}
    for flag, value in timeouts.items():  # (not value > 0 also refuses NaN)
        if value is not None and not (0 < value < math.inf):
            print(f"error: {flag} must be a finite number of seconds > 0, got {value}", file=sys.stderr)
            return 2
    if not 0 <= args.shutdown_timeout < math.inf:
        print(f"error: --shutdown-timeout must be a finite number of seconds >= 0, got {args.shutdown_timeout}",
              file=sys.stderr)
        return 2
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        print("error: --ssl-keyfile and --ssl-certfile go together", file=sys.stderr)
        return 2
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile)):
        if path is not None and not os.path.isfile(path):
            print(f"error: {flag} {path!r}: no such file", file=sys.stderr)
            return 2
    if args.api_key == "":  # (an empty $KDA_RT_API_KEY is None already: env.api_key)
        print("error: --api-key is empty (leave it out to serve without a key)", file=sys.stderr)
        return 2
    if args.served_model_name and not all(name.strip() for name in args.served_model_name):
        print(f"error: --served-model-name: an empty name in {args.served_model_name}", file=sys.stderr)
        return 2
    problem = (model_dir_problem(args.model) or _host_problem(args.host, args.port)
               or (_ssl_problem(args.ssl_certfile, args.ssl_keyfile) if args.ssl_certfile is not None else None))
    if problem is not None:  # checked before the model loads, which can take minutes
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.allow_credentials and "*" in (args.allowed_origins or []):
        print("error: --allow-credentials needs the origins named in --allowed-origins (with '*' any web page could "
              "make credentialed calls)", file=sys.stderr)
        return 2
    if args.max_stream_backlog < 0:
        print(f"error: --max-stream-backlog must be >= 0 (0: no bound), got {args.max_stream_backlog}", file=sys.stderr)
        return 2
    if args.max_waiting < 1 or args.max_body_bytes < 1:
        print("error: --max-waiting and --max-body-bytes must be >= 1", file=sys.stderr)
        return 2
    try:
        return EngineConfig.from_cli_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
