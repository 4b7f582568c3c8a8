"""The engine process: loads the model, then serves `add` / `abort` / `stats` / `reset_prefix_cache` / `shutdown`
frames from the HTTP process and streams back per-request deltas after every engine step.

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
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
import traceback
from typing import Any

from kda_rt import env
from kda_rt.log import configure as configure_logging
from kda_rt.server.stats_log import StatsLogger
from kda_rt.server.wire import FrameSocket
from kda_rt.text.tool_parser import tool_prefix_ids

__all__ = ["EngineWorker", "HEARTBEAT_S", "main"]

HEARTBEAT_S = 1.0  # while busy, a `beat` frame at least this often, so the HTTP side can tell busy from stuck

logger = logging.getLogger("kda_rt.engine_proc")


class _Open:
    """Per engine request in the engine process: one prompt of an HTTP request, whose choices are
    `offset` .. `offset + n - 1` of the HTTP request `parent`."""

    __slots__ = ("reported", "logprobs", "parent", "offset", "cached_sent", "as_ids")

    def __init__(self, logprobs: int | None, parent: str, offset: int, as_ids: bool = False) -> None:
        self.reported: set[int] = set()  # sample indices whose finish was already sent
        self.logprobs = logprobs
        self.parent = parent
        self.offset = offset
        self.cached_sent = False  # its prompt tokens resumed from the prefix cache were sent (with its first output)
        self.as_ids = as_ids  # its logprobs' tokens as "token_id:N" (vLLM's return_tokens_as_token_ids)


class _Beams:
    """A `use_beam_search` HTTP request in the engine process: its search over all its prompts (one
    `BeamStepper`), the prompts' ids, and the step under way: engine request id -> the beam's place in
    `search.requests()`, and what each finished one listed."""

    __slots__ = ("search", "starts", "salts", "params", "priority", "pending", "listed")

    def __init__(self, search, starts: list[list[int]], salts: list, params, priority: int) -> None:
        self.search, self.starts, self.salts, self.params, self.priority = search, starts, salts, params, priority
        self.pending: dict[str, int] = {}
        self.listed: dict[int, dict] = {}


class EngineWorker:
    def __init__(self, llm, conn: FrameSocket, max_waiting: int, log_stats_interval: float | None = None) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.tokenizer = llm.tokenizer
        self.conn = conn
        self.max_waiting = max_waiting
        self.open: dict[str, _Open] = {}  # engine request id -> its state
        self.children: dict[str, list[str]] = {}  # HTTP request id -> its engine request ids
        self.beams: dict[str, _Beams] = {}  # HTTP request id -> its beam search (use_beam_search)
        self.beam_of: dict[str, str] = {}  # engine request id of a beam's step -> its HTTP request id
        self.running = True
        self.log_stats = StatsLogger(self.engine, env.log_stats_interval() if log_stats_interval is None
                                     else log_stats_interval)

    # -- frames from the HTTP process -----------------------------------------------------------

    def handle(self, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "add":
            self._add(msg)
        elif op == "abort":
            self._abort(msg["id"])
        elif op == "stats":
            self.conn.send({"op": "stats", "id": msg["id"], "stats": self.engine.stats()})
        elif op in ("tokenize", "detokenize"):
            self._text_op(msg)
        elif op == "reset_prefix_cache":  # (between steps: running requests keep what they resumed from)
            self.conn.send({"op": "result", "id": msg["id"], "result": self.engine.reset_prefix_cache()})
        elif op == "shutdown":
            for rid in list(self.children):
                self._abort(rid)
            self.running = False
        else:
            logger.warning("engine process: unknown op %r ignored", op)

    def _abort(self, parent: str) -> None:
        for rid in self.children.pop(parent, []):
            self.open.pop(rid, None)
            self.beam_of.pop(rid, None)
            self.engine.abort(rid)
        self.beams.pop(parent, None)

    def _text_op(self, msg: dict[str, Any]) -> None:
        try:
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer files")
            if msg["op"] == "detokenize":
                result = {"prompt": self.tokenizer.decode([t for t in msg["tokens"]])}
            else:
                if msg.get("messages") is not None:
                    ids = self._chat_ids(msg)
                else:
                    ids = self.tokenizer.encode(msg.get("prompt") or "", allow_special=True)  # as a completion
                strs = [self._bytes(t).decode("utf-8", errors="replace") for t in ids] \
                    if msg.get("return_token_strs") else None
                result = {"count": len(ids), "max_model_len": self.engine.config.max_model_len, "tokens": ids,
                          "token_strs": strs}
        except (ValueError, TypeError, KeyError) as exc:
            self.conn.send({"op": "rejected", "id": msg["id"], "status": 400, "error": str(exc)})
            return
        except RecursionError:
            self.conn.send({"op": "rejected", "id": msg["id"], "status": 400, "error": "the request is nested too "
                            "deeply to render"})
            return
        except Exception as exc:  # (a bug here must not take the engine down)
            logger.exception("engine process: %s request %s failed", msg["op"], msg["id"])
            self.conn.send({"op": "rejected", "id": msg["id"], "status": 500, "error": f"{type(exc).__name__}: {exc}"})
            return
        self.conn.send({"op": "result", "id": msg["id"], "result": result})

    def _prompts(self, msg: dict[str, Any]) -> list[dict[str, Any]]:
        """Engine prompts of one `add` (each with the request's cache_salt, if any): chat messages through the
        template (plus the forced tool-call prefix of tool_choice required / named), or the completion prompts."""
        salt = {} if msg.get("cache_salt") is None else {"cache_salt": msg["cache_salt"]}
        if msg.get("messages") is None:
            return [{"prompt_token_ids": p, **salt} if isinstance(p, list) else {"prompt": p, **salt}
                    for p in msg["prompts"]]
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer files, so chat requests are unavailable")
        ids = self._chat_ids(msg)
        return [{"prompt_token_ids": ids + tool_prefix_ids(self.tokenizer, msg.get("tool_mode")), **salt}]

    def _chat_ids(self, msg: dict[str, Any]) -> list[int]:
        """The prompt ids of a frame's chat `messages` through the template, with the frame's template options (a
        chat request's `add` and a `/tokenize` of messages read them alike)."""
        return self.tokenizer.encode_chat(msg["messages"], tools=msg.get("tools"),
                                          add_generation_prompt=msg.get("add_generation_prompt", True),
                                          continue_final_message=msg.get("continue_final_message", False),
                                          chat_template_kwargs=msg.get("chat_template_kwargs"),
                                          chat_template=msg.get("chat_template"))

    def _add(self, msg: dict[str, Any]) -> None:
        from kda_rt.sampler.params import SamplingParams

        rid = msg["id"]
        waiting = self.engine.num_waiting()  # sequences: a request adds n of them
        n = msg["params"].get("n", 1)
        n = n if isinstance(n, int) and n > 0 else 1
        num = n * max(1, len(msg.get("prompts") or [1]))
        if num > self.max_waiting:
            self.conn.send({"op": "rejected", "id": rid, "status": 400,
                            "error": f"{num} sequences (n x prompts) exceed the server's max_waiting "
                                     f"{self.max_waiting} (--max-waiting)"})
            return
        if waiting + num > self.max_waiting:
            self.conn.send({"op": "rejected", "id": rid, "status": 429,
                            "error": f"the waiting queue is full ({waiting} sequences waiting + {num} new > max_waiting "
                                     f"{self.max_waiting}); retry later"})
            return
        added: list[str] = []
        try:
            given = {k: v for k, v in msg["params"].items() if v is not None or k not in self.llm.default_sampling}
            params = SamplingParams(**{**self.llm.default_sampling, **given})  # the checkpoint's defaults, then the request's
            cap = self.llm.max_tokens_override  # vLLM's serving cap (a --generation-config directory's max_new_tokens)
            if cap is not None and params.max_tokens is not None and params.max_tokens > cap:
                params = SamplingParams(**{**self.llm.default_sampling, **given, "max_tokens": cap})  # (min_tokens)
            priority, as_ids = msg.get("priority", 0), bool(msg.get("tokens_as_ids"))
            self.engine.check_priority(priority)  # (also for a scored prompt, which adds no request)
            prompts = self._prompts(msg)
            infos, starts, num_tokens = [], [], 0
            for prompt in prompts:
                text, ids = self.engine.request_prompt(prompt, params)
                starts.append(ids)
                num_tokens += len(ids)
                info: dict[str, Any] = {"num_tokens": len(ids)}
                if msg.get("echo"):
                    info["text"] = text if text is not None else self._decode(ids)
                if msg.get("prompt_logprobs") is not None:
                    info["logprobs"] = self._prompt_logprobs(ids, msg["prompt_logprobs"])
                if msg.get("return_token_ids"):
                    info["ids"] = ids
                infos.append(info)
            # a max_tokens from generation_config.json is capped to each prompt's room in the context, as vLLM caps
            # it (a client's own value is checked against the context instead)
            default_max = msg["params"].get("max_tokens") is None and "max_tokens" in self.llm.default_sampling
            if msg.get("beam") is not None:
                self._start_beams(rid, msg, params, prompts, starts, priority, default_max)
                added = self.children[rid]
            elif not msg.get("score_only"):
                for k, prompt in enumerate(prompts):
                    sub = rid if len(prompts) == 1 else f"{rid}/{k}"
                    self.engine.add_request(sub, prompt, params, output_kind="delta", fit_max_tokens=default_max,
                                            priority=priority)
                    added.append(sub)
                    self.open[sub] = _Open(params.logprobs, rid, k * n, as_ids)
        except RecursionError:  # (a RuntimeError, but no sign of a full engine: retrying would not help)
            self._undo(added, rid)
            self.conn.send({"op": "rejected", "id": rid, "status": 400, "error": "the request is nested too deeply "
                            "to render"})
            return
        except RuntimeError as exc:  # score() found no free slot / pages: the engine is full right now
            self._undo(added, rid)
            self.conn.send({"op": "rejected", "id": rid, "status": 429, "error": f"{exc}; retry later"})
            return
        except (ValueError, TypeError, KeyError) as exc:
            self._undo(added, rid)
            self.conn.send({"op": "rejected", "id": rid, "status": 400, "error": str(exc)})
            return
        except Exception as exc:  # a bug while preparing one request must not take the engine down
            self._undo(added, rid)
            logger.exception("engine process: request %s could not be prepared", rid)
            self.conn.send({"op": "rejected", "id": rid, "status": 500, "error": f"{type(exc).__name__}: {exc}"})
            return
        # (the temperature and top_p used, the checkpoint's defaults filled in: the Responses API echoes them, as vLLM)
        self.conn.send({"op": "added", "id": rid, "prompt_tokens": num_tokens, "prompts": infos,
                        "sampling": {"temperature": params.temperature, "top_p": params.top_p}})
        if added:
            self.children[rid] = added
        else:  # max_tokens 0: scored, nothing to generate
            outs = [{"index": i, "text": "", "token_ids": [], "logprobs": None, "finish_reason": "length",
                     "stop_reason": None} for i in range(n * len(prompts))]
            self.conn.send({"op": "outs", "items": [{"id": rid, "outputs": outs, "finished": True}]})

    def _undo(self, added: list[str], rid: str) -> None:
        for sub in added:
            self.open.pop(sub, None)
            self.engine.abort(sub)
        if rid in self.beams:
            self._abort(rid)

    # -- beam search (use_beam_search) ----------------------------------------------------------

    def _start_beams(self, rid: str, msg: dict[str, Any], params, prompts: list, starts: list[list[int]],
                     priority: int, default_max: bool) -> None:
        """A request's beam search (vLLM's `use_beam_search`, kda_rt/beam_search.py): `n` beams a prompt, each step
        one engine request a live beam with the top 2 x n logprobs (prefix caching resumes it after its parent's
        tokens); the beams are answered at the end, as vLLM's server does."""
        from kda_rt.beam_search import MAX_BEAM_WIDTH, BeamSearchParams, BeamStepper
        from kda_rt.engine.llm_engine import cache_salt_of

        if msg.get("score_only"):
            raise ValueError("use_beam_search needs max_tokens >= 1")
        own = msg["params"]  # (the request's own values: a checkpoint's default top_p does not refuse a search)
        mode = msg.get("tool_mode") or {}
        constraint = ("tool_choice 'required' / a named function" if mode.get("required") or mode.get("forced_name")
                      else "response_format / structured_outputs")
        refused = (("logprobs", own.get("logprobs") is not None), ("stop", bool(own.get("stop"))),
                   ("stop_token_ids", bool(own.get("stop_token_ids"))), ("bad_words", bool(own.get("bad_words"))),
                   ("allowed_token_ids", own.get("allowed_token_ids") is not None),
                   ("logit_bias", bool(own.get("logit_bias"))), ("min_tokens", bool(own.get("min_tokens"))),
                   ("top_p", own.get("top_p") not in (None, 1, 1.0)), ("top_k", own.get("top_k") not in (None, 0, -1)),
                   ("min_p", own.get("min_p") not in (None, 0, 0.0)),
                   ("presence_penalty", own.get("presence_penalty") not in (None, 0, 0.0)),
                   ("frequency_penalty", own.get("frequency_penalty") not in (None, 0, 0.0)),
                   ("repetition_penalty", own.get("repetition_penalty") not in (None, 1, 1.0)),
                   ("echo", bool(msg.get("echo"))), (constraint, params.structured_outputs is not None))
        for name, given in refused:
            if given:
                raise ValueError(f"use_beam_search does not take {name} (the beams are ranked by the model's own "
                                 "logprobs, before any filter or penalty, and stop at EOS or max_tokens alone)")
        if params.n > MAX_BEAM_WIDTH:
            raise ValueError(f"use_beam_search: n is the beam width, at most {MAX_BEAM_WIDTH} (each step lists the "
                             f"top 2 x n logprobs, at most 20), got {params.n}")
        room = self.engine.config.max_model_len - max(len(s) for s in starts)
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if default_max:  # (generation_config.json's max_new_tokens: capped to the room, as for sampled requests)
            max_tokens = min(max_tokens, room)
        if max_tokens > room:
            raise ValueError(f"This model's maximum context length is {self.engine.config.max_model_len} tokens: "
                             f"prompt ({max(len(s) for s in starts)} tokens) + max_tokens ({max_tokens}) exceeds it")
        beam = BeamSearchParams(beam_width=params.n, max_tokens=max_tokens, ignore_eos=params.ignore_eos,
                                temperature=params.temperature, length_penalty=msg["beam"]["length_penalty"],
                                include_stop_str_in_output=params.include_stop_str_in_output)
        search = BeamStepper(starts, beam, self.engine.eos_token_ids, self.engine.postprocessor.quiet_eos_ids)
        if own.get("seed") is not None:  # (each step's sampled candidate drawn from the request's seed: repeatable)
            search.step_params = dataclasses.replace(search.step_params, seed=own["seed"])
        job = _Beams(search, starts, [cache_salt_of(p) for p in prompts], beam, priority)
        self.beams[rid] = job
        self._beam_step(rid, job)

    def _beam_step(self, rid: str, job: _Beams) -> None:
        """Add the engine requests of the search's next step (one a live beam)."""
        job.pending, job.listed = {}, {}
        subs = self.children[rid] = []  # (filled as they are added: an abort or a refusal part way takes them all)
        from kda_rt.beam_search import step_prompts

        for k, prompt in enumerate(step_prompts(job.search, job.salts)):
            sub = f"{rid}#beam{job.search.steps}.{k}"
            self.engine.add_request(sub, prompt, job.search.step_params, output_kind="final", priority=job.priority)
            job.pending[sub], self.beam_of[sub] = k, rid
            subs.append(sub)

    def _beam_output(self, out, items: dict[str, dict[str, Any]]) -> None:
        """A finished engine request of a beam step; once the step's last is in, the search advances: the next
        step's requests, or the answer (each prompt's `n` best beams, choices `k * n ...`)."""
        rid = self.beam_of.pop(out.request_id)
        job = self.beams.get(rid)
        if job is None or out.request_id not in job.pending:
            return
        failed = None
        try:  # (nothing a search meets may take the engine process down: it ends that search alone)
            comp = out.outputs[0]
            if not comp.logprobs:  # (a step request that ended in error: NaN logits, say)
                raise RuntimeError(f"its step request ended with finish_reason {comp.finish_reason!r}")
            job.listed[job.pending[out.request_id]] = comp.logprobs[0]
            if len(job.listed) < len(job.pending):
                return
            job.search.advance([job.listed[k] for k in range(len(job.pending))])
            if not job.search.done:
                self._beam_step(rid, job)
                return
        except Exception as exc:
            logger.exception("beam search %s failed at step %d; its beams so far are answered with finish_reason "
                             "'abort'", rid, job.search.steps)
            failed = exc
        self._abort(rid)  # (the search is over: nothing of it is left in the engine)
        items[rid] = {"id": rid, "outputs": self._beam_answer(job, failed), "finished": True}

    def _beam_answer(self, job: _Beams, failed: Exception | None) -> list[dict[str, Any]]:
        """The choices of a finished search: each prompt's `n` best beams (choices `k * n ...`), best first; after a
        failure the beams so far, each with finish_reason "abort" (none at all if even those cannot be had)."""
        from kda_rt.beam_search import generated

        width = job.params.beam_width
        try:
            outputs = []
            for k, best in enumerate(job.search.outputs(None)):
                for i, b in enumerate(best):
                    ids, text = generated(b, len(job.starts[k]), self.tokenizer, job.params)
                    outputs.append({"index": k * width + i, "text": text, "token_ids": ids, "logprobs": None,
                                    "finish_reason": "abort" if failed else b.finish_reason,
                                    "stop_reason": None if failed else b.stop_reason})
            return outputs
        except Exception:
            logger.exception("beam search: its beams could not be read; answered with none")
            return [{"index": i, "text": "", "token_ids": [], "logprobs": None, "finish_reason": "abort",
                     "stop_reason": None} for i in range(width * len(job.starts))]

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        known = self.tokenizer.vocab_size
        return self.tokenizer.decode([i for i in ids if i < known])

    def _prompt_logprobs(self, ids: list[int], num: int) -> list:
        """Per prompt token: [token id, bytes, logprob or None, rank or None, [[id, bytes, logprob] x top num]] (the
        ids let the HTTP side name echoed tokens "token_id:N" while prompt_logprobs keeps their text, as vLLM's)."""
        dicts, ranks = self.llm.prompt_logprobs({"prompt_token_ids": ids}, num)
        out = []
        for tok, lps, rank in zip(ids, dicts, ranks, strict=True):
            if lps is None:
                out.append([tok, self._bytes(tok), None, None, []])
                continue
            top = sorted(lps.items(), key=lambda kv: -kv[1])[:num]
            out.append([tok, self._bytes(tok), lps[tok], rank, [[t, self._bytes(t), lp] for t, lp in top]])
        return out

    # -- one step -------------------------------------------------------------------------------

    def step(self) -> None:
        items: dict[str, dict[str, Any]] = {}
        for out in self.engine.step():
            state = self.open.get(out.request_id)
            if state is None:
                if out.finished and out.request_id in self.beam_of:
                    self._beam_output(out, items)
                continue
            delta = out  # the engine sends only what is new ("delta" requests)
            item = items.setdefault(state.parent, {"id": state.parent, "outputs": [], "finished": False})
            if not state.cached_sent:  # (prefix caching: the prompt tokens it resumed after, fixed by its first output;
                state.cached_sent = True  # usage's prompt_tokens_details)
                if out.num_cached_tokens:
                    item["cached_tokens"] = item.get("cached_tokens", 0) + out.num_cached_tokens
                m = out.metrics  # (for /metrics: this prompt's queue and prefill times, its earliest sample's)
                if m is not None and m.time_in_queue is not None:
                    prefill = None if m.first_token_time is None else m.first_token_time - m.first_scheduled_time
                    # [the prompt's first choice, queue s, prefill s or None]; each prompt's, not only the first's
                    item.setdefault("timing", []).append([state.offset, m.time_in_queue, prefill])
            for c in delta.outputs:
                new_finish = c.finish_reason is not None and c.index not in state.reported
                if not (c.token_ids or c.text or new_finish):
                    continue
                if new_finish:
                    state.reported.add(c.index)
                item["outputs"].append({"index": state.offset + c.index, "text": c.text, "token_ids": c.token_ids,
                                        "logprobs": self._logprobs(c, state.logprobs, state.as_ids),
                                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            if out.finished:
                self.open.pop(out.request_id, None)
                siblings = self.children.get(state.parent, [])
                if not any(sub in self.open for sub in siblings):
                    self.children.pop(state.parent, None)
                    item["finished"] = True
        sent = [item for item in items.values() if item["outputs"] or item["finished"]]
        if sent:
            self.conn.send({"op": "outs", "items": sent})

    def _logprobs(self, comp, num: int | None, as_ids: bool = False) -> list | None:
        """Per new token: [token bytes, logprob, [[bytes, logprob] x top `num`, most likely first]]."""
        if comp.logprobs is None or num is None:
            return None
        out = []
        for tok, lps in zip(comp.token_ids, comp.logprobs, strict=True):
            top = sorted(lps.items(), key=lambda kv: -kv[1])[:num]
            out.append([self._bytes(tok, as_ids), lps[tok], [[self._bytes(t, as_ids), lp] for t, lp in top]])
        return out

    def _bytes(self, token_id: int, as_id: bool = False) -> bytes:
        """A token as the logprobs show it: its bytes, or "token_id:N" (vLLM's return_tokens_as_token_ids)."""
        if as_id:
            return b"token_id:%d" % token_id
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
                self.log_stats.maybe_log()
                if time.monotonic() - last_beat >= HEARTBEAT_S:  # steps may send nothing (prefill chunks)
                    self.conn.send({"op": "beat"})
                    last_beat = time.monotonic()


def _load(init: dict[str, Any]):
    from kda_rt.llm import LLM

    return LLM(init["model"], progress=None, chat_template=init.get("chat_template"),
               generation_config=init.get("generation_config", "auto"), **init["settings"])


def _exit_with(parent: int) -> None:
    """Have the kernel kill this process when the HTTP process `parent` (the thread that started this one) exits
    (Linux's PR_SET_PDEATHSIG): the end of the socket tells it only when it next reads or writes, which it does not
    while loading the model (minutes) or while hung, so an HTTP process killed then (SIGKILL; SIGTERM before its
    drain handler is set) left it running, holding its memory."""
    try:
        import ctypes

        if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:  # PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):  # (not Linux)
        return
    if os.getppid() != parent:  # it exited before the call
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kda_rt.server.engine_proc")
    ap.add_argument("--fd", type=int, required=True, help="inherited Unix socket to the HTTP process")
    ap.add_argument("--parent", type=int, default=None, help="the HTTP process's pid: this process exits with it")
    args = ap.parse_args(argv)
    if args.parent is not None:
        _exit_with(args.parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = FrameSocket(socket.socket(fileno=args.fd))
    init = next(iter(conn.poll(None)), None)
    if init is None or init["op"] != "init":
        return 2
    configure_logging(init.get("log_level", "info"))
    logger.info("loading %s (backend %s)", init["model"], init["settings"]["backend"])
    start = time.monotonic()
    try:
        llm = _load(init)
    except Exception as exc:
        conn.send({"op": "failed", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    logger.info("model loaded in %.1f s", time.monotonic() - start)
    cfg = llm.engine_config
    conn.send({"op": "ready", "backend": llm.backend, "max_model_len": cfg.max_model_len,
               "max_num_seqs": cfg.max_num_seqs, "vocab_size": llm.model_config.vocab_size,
               "has_tokenizer": llm.tokenizer is not None})
    worker = EngineWorker(llm, conn, init["max_waiting"], 0.0 if init.get("disable_log_stats") else None)
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
