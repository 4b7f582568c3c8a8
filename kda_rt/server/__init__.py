"""OpenAI-compatible HTTP server (`python -m kda_rt.serve`): Starlette + uvicorn in front, the
engine in its own process behind msgpack frames.  Needs the `server` extra (`kda_rt[server]`).

    app.py            routes, auth, body cap and timeouts, drain state
    run.py            one admitted request: delta queue -> JSON response or SSE stream, metrics, abort
    http.py           uvicorn's HTTP protocol with a header read timeout
    protocol.py       request schemas (msgspec) -> engine payloads; the OpenAI error envelope
    tools.py          tool calling: history tool_calls, tool_choice, the forced-call grammar
    errors.py         InvalidRequest (a 400), shared by protocol and tools
    responses.py      response bodies and stream chunks from engine deltas
    responses_api.py  POST /v1/responses: the Responses API as a chat request, its bodies and stream events
    engine_client.py  HTTP side of the engine process: spawn, frames, per-request queues
    engine_proc.py    the engine process: frames in, LLMEngine.step(), deltas out
    wire.py           msgpack frame format
    metrics.py        Prometheus metrics (prometheus_client; vLLM's names under `kda_rt:`, model_name label)
    stats_log.py      the engine process's periodic throughput / usage log line
    __main__.py       CLI, uvicorn, SIGTERM drain
    run_batch.py      an OpenAI batch file through the same app, offline (`python -m kda_rt.run_batch`)
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the server CLI (see `kda_rt.server.__main__`)."""
    try:
        from kda_rt.server.__main__ import main as _main
    except ImportError as exc:
        print(f"error: the server needs the 'server' extra: pip install 'kda_rt[server]' ({exc})")
        return 2

    return _main(argv)
