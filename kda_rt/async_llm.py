"""`AsyncLLM`: asyncio streaming over one engine.

    llm = AsyncLLM(LLM(model_dir, backend="numpy"))
    async for delta in llm.generate("Hello", SamplingParams(max_tokens=32)):
        print(delta.outputs[0].text, end="")

Each `generate` call is one request; its outputs are deltas (see `postprocess.DeltaTracker`).
A background task steps the engine in a worker thread while any request is open, so the event
loop stays responsive during a model step.  Engine calls (add, step, abort) are serialised by a
lock.  Leaving the `async for` early (break then `aclose()`, cancellation, a timeout) aborts the request, as vLLM's
does: its slot and pages are free once the generator is closed or the task's cancellation is over.

An `AsyncLLM` shares its `LLM`'s engine lock; while it has requests in flight, `LLM.generate` and another `AsyncLLM`
over the same `LLM` raise RuntimeError, and the other way round (each driver hands out only its own outputs).  An `AsyncLLM` belongs to the event
loop of its first `generate`: a call from another loop while that one is still open raises RuntimeError (its stepping task and queues live on the first loop);
once the first loop is closed (e.g. after `asyncio.run`), the next loop takes it over.  A step the closed loop had
already handed to a worker thread then does nothing (each loop's steps carry its binding's number, checked under the
lock): run late, it would step the new loop's requests and hand their outputs to the dead loop, and a lost final
output leaves its stream waiting forever.

A step that raises fails the calls whose requests were in the engine when it began (each stream raises the step's
error and its request is aborted); a call whose add was still under way (waiting for the lock that step held, or its
prompt logprobs not yet in) goes on, and so do later calls.  vLLM's AsyncLLM instead takes a failed engine core for
dead (`errored`, every open and later call raising EngineDeadError), as kda_rt's server does with its engine process:
there the failure ends a process.  Here the engine is in-process and outlives the step: a failed step's sequences are
queued again, to be computed afresh (docs/engine_notes.md, Failures), so only `shutdown()` stops an AsyncLLM.

The `LLM` brings its engine settings: serving streams, pass `max_num_batched_tokens=8192` as the server
does (`SERVER_BATCHED_TOKENS`); left unset it takes the offline default, which may be 16384 (longer steps,
which every running stream waits out).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING

from kda_rt.engine.llm_engine import NoRoomToScore
from kda_rt.engine.postprocess import OUTPUT_KINDS, DeltaTracker
from kda_rt.sampler.params import SamplingParams

if TYPE_CHECKING:
    from kda_rt.llm import LLM
    from kda_rt.outputs import RequestOutput

__all__ = ["AsyncLLM"]


class _Call:
    """One `generate` call, from taking its request id to its end.  Abort marks and a failed step's error name the
    call, not the id: a later call may take the id as soon as this one ends, and what was meant for this one (a mark
    set just after it ended, on another thread) must not reach it."""

    __slots__ = ("rid", "queue", "abort", "added_at", "entry")

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.queue: asyncio.Queue | None = None  # its outputs: None before its add, and once the add failed
        self.abort = False  # abort() named it before its request was added: the add aborts it as it lands (_add)
        self.added_at: int | None = None  # steps begun when its request was added (set under the lock)
        self.entry: object = None  # its request's engine entry (engine.requests[rid]): a later abort of this call
        # touches the request of that id only while it is still this one (_abort_mine)


class AsyncLLM:
    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self._lock = llm._engine_lock  # (LLM.generate's own: its drivers and this one take turns on the engine)
        llm._asyncs.add(self)
        self._calls: dict[str, _Call] = {}  # the open generate calls by request id (changed on the event loop only)
        self._to_abort: list[tuple[str, object]] = []  # (request id, its call's entry or None: any request of it)
        self._num_steps = 0  # steps begun (under the lock): a failed one fails the calls added before it
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._binding = 0  # bumped (under the lock) each time a loop takes this AsyncLLM over
        self._shut = False
        with self._lock:  # (the counters as of this AsyncLLM's last engine call: what `stats` gives while one runs)
            self._stats: dict[str, int | list[int]] = self.engine.stats()

    async def generate(self, prompt: str | dict | list[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, output_kind: str = "delta",
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the new text / token ids of one request as they come; the last output has
        `finished=True`.  Invalid prompts raise ValueError before anything is yielded.  `output_kind` (vLLM's
        RequestOutputKind, whose AsyncLLM default is "cumulative"): "delta" (what is new), "cumulative" (each
        output holds everything so far) or "final" ("final_only": only the last output).  `priority`: as
        `LLMEngine.add_request`'s (an engine with `scheduling_policy="priority"`)."""
        output_kind = {"final_only": "final"}.get(output_kind, output_kind)  # vLLM's FINAL_ONLY
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {output_kind!r}")
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):  # (was: AttributeError)
            raise TypeError(f"sampling_params must be a SamplingParams or None, got {type(sampling_params).__name__}"
                            f"{'; for a dict d use SamplingParams(**d)' if isinstance(sampling_params, dict) else ''}")
        if self._shut:
            raise self.dead_error
        self._bind_loop()
        rid = self._new_id() if request_id is None else str(request_id)
        if rid in self._calls:
            raise ValueError(f"request_id {rid!r} is already in use")
        if self.llm._open or any(a is not self and a._streaming() for a in self.llm._asyncs):
            raise RuntimeError("this LLM has requests open elsewhere (LLM.generate's, in another thread or a stream "
                               "not finished or closed, or another AsyncLLM's): its engine runs one driver's "
                               "requests at a time")
        # the id is taken from here on: a second call with it while this one awaits its prompt logprobs would
        # otherwise pass the check, and its refused add drop this stream's queue (was: this stream waited forever)
        call = self._calls[rid] = _Call(rid)
        try:
            if any(r == rid for r, _ in self._to_abort):  # an earlier stream of this id was left: its abort first
                await asyncio.to_thread(self._locked, self._apply_aborts)
            # the defaults: a max_tokens of theirs fits the prompt's room (add_request)
            fit = sampling_params is None and "max_tokens" in self.llm.default_sampling
            sampling_params = sampling_params or self.llm.get_default_sampling_params()
            prompt_lps = None  # vLLM's prompt_logprobs: one score() pass before the request is added (LLM.generate's)
            if sampling_params.prompt_logprobs is not None:
                prompt_lps = await self._prompt_logprobs(prompt, sampling_params)
            queue: asyncio.Queue = asyncio.Queue()
            call.queue = queue  # before adding: the stepping task may produce output at once
        except BaseException:
            self._release(call)
            raise
        add = asyncio.ensure_future(asyncio.to_thread(self._locked, functools.partial(
            self._add, call, prompt, sampling_params, fit_max_tokens=fit, priority=priority)))
        try:
            final = await asyncio.shield(add)  # a cancellation must not orphan a request the thread still adds
            if final is not None:  # abort() came before the add: the stream ends with its final output at once
                queue.put_nowait(final)
        except BaseException as exc:
            call.queue = None
            if isinstance(exc, asyncio.CancelledError) and not add.done():
                # the add still runs in its thread: the id stays taken (a later call with it would reach the engine
                # while this request is there) and _add aborts the request as it lands; the cancellation is over
                # once it has, as a left stream's (a second cancellation leaves it to the callback)
                call.abort = True
                add.add_done_callback(lambda f: self._landed(call, f))
                with contextlib.suppress(BaseException):
                    await asyncio.shield(add)
            else:
                self._release(call)
                if isinstance(exc, asyncio.CancelledError) and not add.cancelled() and add.exception() is None:
                    self._abort_later(call)
            raise
        self._ensure_task()
        tracker, finished, converted = DeltaTracker(), False, {}
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if output_kind == "delta":  # (prompt logprobs with the first delta only, as vLLM's)
                    yield self._vllm(tracker.delta(item), sampling_params, None, prompt_lps)
                    prompt_lps = None
                elif finished or output_kind == "cumulative":
                    yield self._vllm(item, sampling_params, converted, prompt_lps)
        finally:
            self._release(call)
            if not finished:
                await self._abort_left(call)

    async def beam_search(self, prompt: str | dict | list[int], request_id: str | None = None,
                          params=None) -> AsyncIterator[RequestOutput]:
        """vLLM's `EngineClient.beam_search`: one `RequestOutput` (finished) whose outputs are the prompt's best
        `params.beam_width` beams, best first: `token_ids` the generated ids, `text` theirs (a final EOS left out,
        kept with `include_stop_str_in_output`), `cumulative_logprob`, `logprobs`, `finish_reason`.  Each step runs
        one request a beam (`request_id` and the step and beam numbers name them) through `generate`, concurrently
        with other requests (kda_rt/beam_search.py)."""
        from kda_rt.beam_search import BeamStepper, _check, generated, prompt_token_ids, step_prompts
        from kda_rt.outputs import CompletionOutput, RequestOutput

        _check(params, None)
        self._bind_loop()
        (ids,), salts = await asyncio.to_thread(self._locked, lambda: prompt_token_ids(self.engine, [prompt], params))
        rid = f"beam-{next(self.llm._async_ids)}" if request_id is None else str(request_id)
        search = BeamStepper([ids], params, self.engine.eos_token_ids, self.engine.postprocessor.quiet_eos_ids)

        async def one(k: int, step_prompt: dict):
            last = None
            async for out in self.generate(step_prompt, search.step_params,
                                           f"{rid}-{search.steps}-{k}", output_kind="final"):
                last = out
            return last.outputs[0].logprobs[0]

        while not search.done:
            search.advance(list(await asyncio.gather(*(one(k, p) for k, p in enumerate(step_prompts(search, salts))))))
        tokenizer = self.llm.get_tokenizer()
        outputs = []
        for i, b in enumerate(search.outputs(tokenizer)[0]):
            gen, text = generated(b, len(ids), tokenizer, params)
            outputs.append(CompletionOutput(i, text, gen, b.cum_logprob, b.logprobs, b.finish_reason, b.stop_reason))
        text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
        yield RequestOutput(rid, text, ids, outputs, finished=True)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort a request, or each of several (vLLM's signature); each stream ends with a final output whose
        finish_reason is "abort".  Unknown ids are passed over."""
        self._bind_loop()
        for rid in [request_id] if isinstance(request_id, str) else [str(r) for r in request_id]:
            call, final = await asyncio.to_thread(self._locked, self._abort_one, rid)
            if final is not None and call is not None and call.queue is not None:
                call.queue.put_nowait(final)

    async def _prompt_logprobs(self, prompt, params: SamplingParams) -> list:
        """vLLM's prompt logprobs from one score() pass, which borrows a free state slot and pages: while running
        requests hold them all it waits for some to end, as a queued request would (was: RuntimeError under load)."""
        while True:
            try:
                return await asyncio.to_thread(self._locked, lambda: self.llm._vllm_prompt_logprobs(
                    self.engine.request_prompt(prompt, params)[1], params.prompt_logprobs, params.detokenize))
            except NoRoomToScore:
                if not self._streaming() and not self.engine.has_unfinished_requests():
                    raise  # nothing running to free room: the pool itself is too small for this prompt
                self._ensure_task()
                await asyncio.sleep(0.01)

    def shutdown(self) -> None:
        """vLLM's: every request in flight is aborted (its stream ends with finish_reason "abort") and later
        `generate` calls raise RuntimeError; the LLM stays usable (its own generate, another AsyncLLM).  Callable
        from any thread; it waits for a step in progress to end."""
        self._shut = True
        with self._lock:
            self._apply_aborts()
            finals = [(call.queue, self.engine.abort(call.rid)) for call in list(self._calls.values())]
        loop = self._loop
        for queue, final in finals:
            if final is not None and queue is not None and loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, final)

    # -- vLLM's EngineClient state (kda_rt's engine outlives a failed step, unlike vLLM's engine core: the module
    # docstring; only shutdown() stops an AsyncLLM) -----------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return not self._shut

    @property
    def is_stopped(self) -> bool:
        return self._shut

    @property
    def errored(self) -> bool:
        return self._shut

    @property
    def dead_error(self) -> BaseException:
        return RuntimeError("this AsyncLLM is shut down (shutdown()): create another over the LLM")

    async def check_health(self) -> None:
        """vLLM's: raises `dead_error` once shut down."""
        if self.errored:
            raise self.dead_error

    def get_tokenizer(self):
        """The LLM's tokenizer (None for a checkpoint without tokenizer files)."""
        return self.llm.get_tokenizer()

    def _add(self, call: _Call, *args, **kwargs) -> RequestOutput | None:
        """`engine.add_request`, refused once `shutdown()` began: under the lock, so a request is either added before
        shutdown's aborts (and aborted by them) or not at all (was: one added after them ran to its end).  A request
        `abort()` named before this (while its call computed prompt logprobs) is aborted as it lands: its final output
        returned (was: the abort found nothing to abort and the request ran to its end)."""
        if self._shut:
            raise self.dead_error
        self.engine.add_request(call.rid, *args, **kwargs)
        call.added_at = self._num_steps
        call.entry = self.engine.requests.get(call.rid)
        return self.engine.abort(call.rid) if call.abort else None

    def _landed(self, call: _Call, add: asyncio.Future) -> None:
        """The add of a call cancelled while it ran has ended: the id is free; a request added before the abort mark
        came (`_add` returned no final output) is aborted before the next step."""
        self._release(call)
        if not add.cancelled() and add.exception() is None and add.result() is None:
            self._abort_later(call)

    def _release(self, call: _Call) -> None:
        """The call has ended: its id is free (unless a later call holds it already, after a loop takeover)."""
        if self._calls.get(call.rid) is call:
            del self._calls[call.rid]

    def _streaming(self) -> bool:
        """Whether a call of this AsyncLLM has a stream open (its request added, or on its way); any thread."""
        return any(call.queue is not None for call in list(self._calls.values()))

    def _abort_one(self, rid: str) -> tuple[_Call | None, RequestOutput | None]:
        """`engine.abort` under the lock: the call holding the id and the request's final output.  A call whose
        request is not added yet is marked instead, so that its add aborts it (`_add`).  The lookup runs on a worker
        thread while the call may end on the event loop: a mark set on a call that ended meanwhile ends with it (was:
        the mark was the id's, and one set just after the call's end aborted the next call of that id)."""
        call = self._calls.get(rid)
        final = self.engine.abort(rid)
        if call is not None and call.added_at is None:
            call.abort = True
            return call, None  # (a final found is a left stream's request of this id, not this call's)
        return call, final

    def _new_id(self) -> str:
        """The next "async-N" that no open request holds (was: one a caller had passed as its own request_id made
        a call without an id fail with "already in use")."""
        while True:
            rid = f"async-{next(self.llm._async_ids)}"
            if rid not in self._calls and rid not in self.engine.requests:
                return rid

    async def _abort_left(self, call: _Call) -> None:
        """Abort the request of a stream its consumer left (break then aclose, cancellation, an error), as vLLM's
        generate does: its slot and pages are free when this returns (was: only at the stepping task's next step,
        never where the loop ended first: `asyncio.run` returning right after a break left the request running).
        The job is handed to a worker thread at once and shielded, so a second cancellation cannot drop it.  The id
        is free already: the job aborts the request of that id only while it is still this call's (`_abort_mine`;
        was: a later call that took the id, its add ahead of this job on the lock, had its own request aborted)."""
        try:
            job = asyncio.get_running_loop().run_in_executor(None, self._locked, self._abort_mine, call.rid,
                                                              call.entry)
        except RuntimeError:  # the loop's executor is shut down: the next step or loop binding applies it
            self._to_abort.append((call.rid, call.entry))
            return
        await asyncio.shield(job)

    def _abort_later(self, call: _Call) -> None:
        self._to_abort.append((call.rid, call.entry))  # applied under the lock before the next step
        self._ensure_task()

    def _abort_mine(self, rid: str, entry: object) -> None:
        """`engine.abort(rid)` (under the lock) unless `entry` is given and the engine's request of that id is another
        one: its call's request finished and a later call's request took the id."""
        if entry is None or self.engine.requests.get(rid) is entry:
            self.engine.abort(rid)

    def _vllm(self, out: RequestOutput, params: SamplingParams | None, done: dict | None = None,
              prompt_lps: list | None = None) -> RequestOutput:
        """Logprobs as vLLM's {token: Logprob} (LLM._vllm_output; `done` keeps a cumulative request's conversions),
        and the prompt logprobs attached."""
        if params is None or params.logprobs is None:
            return out if prompt_lps is None else dataclasses.replace(out, prompt_logprobs=prompt_lps)
        return self.llm._vllm_output(out, params, prompt_lps, done)

    def stats(self) -> dict[str, int | list[int]]:
        """The engine's counters (`LLM.stats`).  It never waits for a step in progress, so it can be called on the
        event loop (a metrics scrape would otherwise stall every stream for a step): while the engine is busy, the
        counters as this AsyncLLM's last step, add or abort left them."""
        if not self._lock.acquire(blocking=False):
            return dict(self._stats)
        try:
            return self.engine.stats()
        finally:
            self._lock.release()

    async def reset_prefix_cache(self) -> bool:
        """Drop every kept prefix (`enable_prefix_caching`; vLLM's name); True.  Waits for a step in progress on a
        worker thread, not on the event loop."""
        return await asyncio.to_thread(self._locked, self.engine.reset_prefix_cache)

    # -- internals ----------------------------------------------------------------------------

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None and not self._loop.is_closed():
            raise RuntimeError("this AsyncLLM is bound to another event loop that is still open: an LLM's engine "
                               "serves one event loop at a time; close the first loop before using another, or "
                               "create another LLM (and its AsyncLLM) for this loop")
        with self._lock:  # a step of the old loop's still in a thread finishes first, or sees the new number
            self._binding += 1
        self._loop, self._task = loop, None
        # streams left open on the closed loop: nobody reads them (calls suspended there before their add never resume)
        self._to_abort.extend((call.rid, call.entry) for call in self._calls.values() if call.queue is not None)
        self._calls.clear()

    def _locked(self, fn, *args):
        with self._lock:
            out = fn(*args)
            self._stats = self.engine.stats()  # (after adds and aborts too: what `stats` gives while a step runs)
            return out

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(self._binding))

    def _step(self, binding: int) -> list[RequestOutput]:
        with self._lock:
            if binding != self._binding:  # left by a closed loop: its outputs would go nowhere
                return []
            self._num_steps += 1
            self._apply_aborts()
            outs = self.engine.step() if self.engine.has_unfinished_requests() else []
            self._stats = self.engine.stats()
            return outs

    def _apply_aborts(self) -> None:
        while self._to_abort:
            self._abort_mine(*self._to_abort.pop())

    async def _run(self, binding: int) -> None:
        while True:
            began = self._num_steps
            try:
                outputs = await asyncio.to_thread(self._step, binding)
            except Exception as exc:  # a model error: the calls added before the step see it (the module docstring)
                if self._num_steps == began:  # the step never ran (the loop's executor is shut down): nothing steps
                    for call in list(self._calls.values()):  # these calls again, so each gets the error now
                        if call.queue is not None:
                            call.queue.put_nowait(exc)
                    return
                failed = self._num_steps  # (this task is the only one stepping: no step began since)
                for call in list(self._calls.values()):
                    if call.queue is not None and call.added_at is not None and call.added_at < failed:
                        call.queue.put_nowait(exc)
                        self._to_abort.append((call.rid, call.entry))  # (requeued: aborted before the next step)
                outputs = []
            for out in outputs:
                call = self._calls.get(out.request_id)
                if call is not None and call.queue is not None:
                    call.queue.put_nowait(out)
            if not self._to_abort and not self.engine.has_unfinished_requests():
                return
            await asyncio.sleep(0)
