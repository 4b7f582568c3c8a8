"""AsyncLLM request ids (review): an abort mark of a call that failed before its add, a call cancelled while its add
runs, and a stream that ends inside an `abort()` of its id leave the id to a later call."""

import asyncio
import threading
import time

import pytest

from kda_rt import LLM, SamplingParams
from kda_rt.async_llm import AsyncLLM
from kda_rt.demo import demo_path


def test_abort_mark_of_a_failed_call_does_not_abort_a_later_call(monkeypatch):
    llm = LLM(str(demo_path()), backend="numpy", max_num_seqs=6, max_model_len=512)
    allm = AsyncLLM(llm)
    inside, release = threading.Event(), threading.Event()

    def failing(*a, **k):
        inside.set()
        release.wait(10)
        time.sleep(0.2)  # (the abort's thread waits on the lock this pass holds)
        raise ValueError("prompt refused")

    monkeypatch.setattr(llm, "_vllm_prompt_logprobs", failing)

    async def main():
        async def consume():
            async for _ in allm.generate("hello", SamplingParams(max_tokens=5, prompt_logprobs=1), "x"):
                pass
        task = asyncio.ensure_future(consume())
        await asyncio.to_thread(inside.wait, 10)
        aborting = asyncio.ensure_future(allm.abort("x"))
        await asyncio.sleep(0.05)
        release.set()
        with pytest.raises(ValueError):
            await task
        await aborting
        outs = []
        async for o in allm.generate("hello", SamplingParams(max_tokens=5, ignore_eos=True), "x"):
            outs.append(o)
        return outs[-1].outputs[0].finish_reason

    assert asyncio.run(main()) == "length"


class _HeldLookup(dict):
    """An AsyncLLM's open-call registry whose lookups off the event loop (abort's worker thread, under the engine lock)
    are held, their answer already taken, until the event loop has run `leave`: the stream found ends between the
    abort's lookup and its mark."""

    def __init__(self, calls: dict, loop: asyncio.AbstractEventLoop, looked_up: asyncio.Event) -> None:
        super().__init__(calls)  # (made on the event loop's thread)
        self.loop, self.loop_thread = loop, threading.get_ident()
        self.looked_up, self.left = looked_up, threading.Event()

    def _hold(self, found):
        if threading.get_ident() != self.loop_thread:
            self.loop.call_soon_threadsafe(self.looked_up.set)
            assert self.left.wait(10)
        return found

    def get(self, key, default=None):
        return self._hold(super().get(key, default))

    def __contains__(self, key) -> bool:
        return self._hold(super().__contains__(key))


def test_a_stream_ending_inside_an_abort_leaves_no_mark_for_a_later_call():
    """`abort("x")` finds the call of "x" open (its final output not yet read), and that stream ends before the abort
    marks it.  Before: the mark was the id's, set after the stream's end had cleared the id's marks, and it aborted
    the next call of "x" as its request landed ('abort' == 'length')."""
    llm = LLM(str(demo_path()), backend="numpy", max_num_seqs=6, max_model_len=512)
    allm = AsyncLLM(llm)

    async def main():
        first = allm.generate("hello", SamplingParams(max_tokens=2, ignore_eos=True), "x", output_kind="final")
        assert (await first.__anext__()).finished  # (its request has ended in the engine; its call is still open)
        looked_up = asyncio.Event()
        allm._calls = held = _HeldLookup(allm._calls, asyncio.get_running_loop(), looked_up)
        aborting = asyncio.ensure_future(allm.abort("x"))
        await looked_up.wait()
        with pytest.raises(StopAsyncIteration):
            await first.__anext__()  # the stream of "x" ends
        held.left.set()
        await aborting
        outs = [o async for o in allm.generate("hello", SamplingParams(max_tokens=5, ignore_eos=True), "x")]
        return outs[-1].outputs[0].finish_reason, sum(len(o.outputs[0].token_ids) for o in outs)

    assert asyncio.run(main()) == ("length", 5)
    assert llm.stats()["running"] == 0 and llm.stats()["slots_used"] == 0


def test_id_reused_after_a_cancel_during_add():
    llm = LLM(str(demo_path()), backend="numpy", max_num_seqs=6, max_model_len=512)
    allm = AsyncLLM(llm)
    inside, release = threading.Event(), threading.Event()
    real = llm.engine.add_request if hasattr(llm, "engine") else allm.engine.add_request
    calls = []

    def held(rid, *a, **k):
        calls.append(rid)
        if len(calls) == 1:
            inside.set()
            release.wait(10)
        return real(rid, *a, **k)

    allm.engine.add_request = held

    async def main():
        async def consume():
            out = []
            async for o in allm.generate("hello", SamplingParams(max_tokens=5, ignore_eos=True), "x"):
                out.append(o)
            return out
        a = asyncio.ensure_future(consume())
        await asyncio.to_thread(inside.wait, 10)
        threading.Timer(0.3, release.set).start()  # (the add lands while A's cancellation is under way)
        a.cancel()
        try:
            await a
        except asyncio.CancelledError:
            pass
        b = asyncio.ensure_future(consume())   # same id, A's stream is gone
        outs = await asyncio.wait_for(b, 30)
        return outs[-1].outputs[0].finish_reason, sum(len(o.outputs[0].token_ids) for o in outs)

    reason, n = asyncio.run(main())
    assert (reason, n) == ("length", 5)
    assert llm.stats()["running"] == 0 and llm.stats()["slots_used"] == 0


def test_abort_of_a_request_no_call_holds():
    """`abort(id)` of a request that no open call holds (a left stream's, its abort not yet applied) aborts it; its
    final output goes to no stream."""
    llm = LLM(str(demo_path()), backend="numpy", max_num_seqs=6, max_model_len=512)
    allm = AsyncLLM(llm)
    with llm._engine_lock:
        allm.engine.add_request("left", "hello", SamplingParams(max_tokens=5))
    asyncio.run(allm.abort("left"))
    assert "left" not in allm.engine.requests
    assert llm.stats()["waiting"] == 0 and llm.stats()["running"] == 0


def test_a_left_streams_abort_spares_a_later_call_of_its_id(monkeypatch):
    """A stream left after its request finished in the engine but before it read the final output: its abort job
    (`_abort_left`, on a worker thread) and a later call with the same id race for the lock; here the later call's
    add is made to win.  The job aborts the id's request only while it is still the left call's (`_abort_mine`), so
    the later call runs to its length (was: its own request was aborted by the job, whose final output went to no
    stream: the later call waited forever)."""
    llm = LLM(str(demo_path()), backend="numpy", max_num_seqs=6, max_model_len=512)
    allm = AsyncLLM(llm)
    real_locked = allm._locked
    b_added, adds = threading.Event(), []

    def locked(fn, *args, **kwargs):
        if getattr(fn, "__name__", "") in ("_abort_mine", "abort") and args[:1] == ("x",):
            assert b_added.wait(10)  # (the left stream's abort job: after the later call's add)
        out = real_locked(fn, *args, **kwargs)
        if getattr(getattr(fn, "func", None), "__name__", "") == "_add":
            adds.append(1)
            if len(adds) == 2:  # the later call's
                b_added.set()
        return out

    monkeypatch.setattr(allm, "_locked", locked)

    async def main():
        first = allm.generate("hello", SamplingParams(max_tokens=2, ignore_eos=True), "x")
        await first.__anext__()  # one output read; the request then finishes in the engine, unread
        for _ in range(200):
            if "x" not in llm.llm_engine.requests:
                break
            await asyncio.sleep(0.01)
        assert "x" not in llm.llm_engine.requests

        async def later():
            outs = [o async for o in allm.generate("hello", SamplingParams(max_tokens=5, ignore_eos=True), "x",
                                                   output_kind="cumulative")]
            return outs[-1].outputs[0]

        await asyncio.sleep(0)
        closing = asyncio.ensure_future(first.aclose())  # releases the id, then queues its abort job
        await asyncio.sleep(0.05)
        out = await asyncio.wait_for(later(), timeout=20)
        await closing
        return out

    out = asyncio.run(main())
    assert (out.finish_reason, len(out.token_ids)) == ("length", 5)
