"""`python -m kda_rt.run_batch -i requests.jsonl -o results.jsonl [server flags]`: OpenAI's batch file format run
offline, as vLLM's `run_batch` runs it.

Each input line is `{"custom_id": str, "method": "POST", "url": "/v1/chat/completions" | "/v1/completions" |
"/v1/responses", "body": {...}}`; each output line, in input order, `{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}`: the body the server would have answered (200), or `response.body` null and `error`
the server's error object (its status code in `status_code`).  The requests go through the server's own app in this
process (same validation, same answers) and its engine process, up to `--max-concurrency` at once, so continuous
batching packs them; a line that is not such a request gets its own error line, and the others still run.  The
engine and server flags are `serve`'s (`--model`, `--max-num-seqs`, `--chat-template`, ...).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import uuid
from typing import Any

__all__ = ["main", "run_batch"]

logger = logging.getLogger("kda_rt.run_batch")

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MAX_QUEUE_RETRIES = 12_000  # a request the engine's full queue refuses (429) is sent again every 50 ms for 10 min


def _parser():
    from kda_rt.server.__main__ import build_parser

    ap = build_parser()
    ap.prog = "python -m kda_rt.run_batch"
    ap.description = "Run an OpenAI batch file (JSON lines) through the server's app, offline."
    ap.add_argument("-i", "--input-file", required=True, help="the batch file: one request a line (JSON)")
    ap.add_argument("-o", "--output-file", required=True, help="where the results go, one a line in input order")
    ap.add_argument("--max-concurrency", type=int, default=256,
                    help="requests in flight at once (default 256; the engine's waiting queue holds --max-waiting)")
    return ap


def _line_error(custom_id: Any, message: str, status: int = 400) -> dict[str, Any]:
    return {"id": f"kda-rt-{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"kda-rt-batch-{uuid.uuid4().hex}", "body": None},
            "error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}


def _parse(k: int, line: bytes) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(request, None) of input line k (1-based), or (None, its error line)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:  # (was: the whole batch a traceback, before any line ran)
        return None, _line_error(None, f"line {k}: not UTF-8 text ({exc})")
    try:
        item = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, _line_error(None, f"line {k}: not JSON ({exc})")
    if not isinstance(item, dict):
        return None, _line_error(None, f"line {k}: not a JSON object")
    cid = item.get("custom_id")
    if not isinstance(cid, str):
        return None, _line_error(cid, f"line {k}: custom_id must be a string")
    if item.get("method", "POST") != "POST":
        return None, _line_error(cid, f"line {k}: method must be POST, got {item.get('method')!r}")
    if item.get("url") not in URLS:
        return None, _line_error(cid, f"line {k}: url must be one of {', '.join(URLS)}, got {item.get('url')!r}")
    if not isinstance(item.get("body"), dict):
        return None, _line_error(cid, f"line {k}: body must be a JSON object")
    if item["body"].get("stream"):
        return None, _line_error(cid, f"line {k}: stream is not supported in a batch")
    if item["body"].get("background"):
        return None, _line_error(cid, f"line {k}: background is not supported in a batch (every line runs anyway)")
    return item, None


async def run_batch(args, settings) -> int:
    """Run the batch file of `args`; 0 when every line was answered (errors included), 1 when the engine failed."""
    import httpx
    from tqdm.auto import tqdm

    from kda_rt.server.__main__ import start_state
    from kda_rt.server.app import build_app

    with open(args.input_file, "rb") as f:  # (bytes: each line is decoded by itself, a bad one is its own error)
        lines = [(k, line) for k, line in enumerate(f, 1) if line.strip()]
    out = open(args.output_file, "w", encoding="utf-8")  # (now: a path that cannot be written loses no work)  # noqa: SIM115
    args.api_key = None  # (requests made here, to the app itself)
    state = await start_state(args, settings)
    if state is None:
        out.close()
        return 1
    results: list[dict[str, Any] | None] = [None] * len(lines)
    retries = [0]
    gate = asyncio.Semaphore(args.max_concurrency)
    bar = tqdm(total=len(lines), desc="batch", unit="req", disable=None)
    # (the app's own errors become 500 answers, not exceptions here)
    transport = httpx.ASGITransport(app=build_app(state), raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://kda-rt", timeout=None) as http:
            async def send(item: dict[str, Any]) -> dict[str, Any]:
                # the body as its line had it (NaN or a lone surrogate included: the server answers those with a 400)
                content = json.dumps(item["body"], ensure_ascii=True, allow_nan=True).encode()
                headers = {"Content-Type": "application/json"}
                async with gate:
                    for _ in range(MAX_QUEUE_RETRIES):
                        r = await http.post(item["url"], content=content, headers=headers)
                        if r.status_code != 429:  # (the engine's queue is full: wait and send it again)
                            break
                        retries[0] += 1
                        await asyncio.sleep(0.05)
                try:
                    body = r.json()
                except ValueError:
                    body = {"error": {"message": r.text[:2000], "type": "InternalServerError", "code": r.status_code}}
                ok = r.status_code == 200
                return {"id": f"kda-rt-{uuid.uuid4().hex}", "custom_id": item["custom_id"],
                        "response": {"status_code": r.status_code,
                                     "request_id": r.headers.get("x-request-id", f"kda-rt-batch-{uuid.uuid4().hex}"),
                                     "body": body if ok else None},
                        "error": None if ok else body.get("error", body)}

            async def one(i: int, k: int, line: bytes) -> None:
                item, result = _parse(k, line)
                if result is None:
                    try:
                        result = await send(item)
                    except Exception as exc:  # (one line's failure is its own error line; the others still run)
                        result = _line_error(item["custom_id"], f"line {k}: {type(exc).__name__}: {exc}", 500)
                results[i] = result
                bar.update(1)

            await asyncio.gather(*(one(i, k, line) for i, (k, line) in enumerate(lines)))
            died = None if state.client.alive else state.client.dead_reason or "unknown"
    finally:
        bar.close()
        state.draining = True
        state.abort_all()
        await state.client.close()
        with out:  # (what was answered is written whatever happened: a line not answered says so)
            for i, result in enumerate(results):
                if result is None:
                    result = _line_error(None, f"line {lines[i][0]}: not answered (the batch was stopped)", 500)
                    results[i] = result
                out.write(json.dumps(result, ensure_ascii=False) + "\n")
    if died is not None:
        logger.error("the engine process died: %s (its requests' lines say so)", died)
        return 1
    failed = sum(1 for r in results if r["error"] is not None)
    logger.info("batch done: %d requests, %d answered with an error, %d sent again after a full queue (429) -> %s",
                len(results), failed, retries[0], args.output_file)
    return 0


def main(argv: list[str] | None = None) -> int:
    from kda_rt.log import configure as configure_logging
    from kda_rt.server.__main__ import checked_settings

    args = _parser().parse_args(argv)
    configure_logging(args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (a line a request otherwise)
    if args.max_concurrency < 1:
        print(f"error: --max-concurrency must be >= 1, got {args.max_concurrency}", file=sys.stderr)
        return 2
    try:
        with open(args.input_file, encoding="utf-8"):
            pass
    except OSError as exc:
        print(f"error: --input-file {args.input_file!r}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    folder = os.path.dirname(os.path.abspath(args.output_file))
    if os.path.isdir(args.output_file) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        print(f"error: --output-file {args.output_file!r}: cannot be written (a folder, or its folder is missing or "
              "read-only)", file=sys.stderr)
        return 2
    settings = checked_settings(args)
    if isinstance(settings, int):
        return settings
    return asyncio.run(run_batch(args, settings))


if __name__ == "__main__":
    raise SystemExit(main())
