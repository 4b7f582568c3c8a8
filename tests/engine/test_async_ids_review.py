"""AsyncLLM request ids (review): an abort mark of a call that failed before its add, and a call cancelled while its add runs, leave the id to a later call."""

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
        return outs[-1].outputs[0].finish_reason, allm._abort_pending

    reason, pending = asyncio.run(main())
    assert reason == "length", (reason, pending)


def test_id_reused_after_a_cancel_during_add():
    llm = LLM(str(demo_path()), backend="numpy", max_num_seqs=6, max_model_len=512)
    allm = AsyncLLM(llm)
    inside, release = threading.Event(), threading.Event()
    real = llm.engine.add_request if hasattr(llm, "engine") else allm.engine.add_request
    calls = []

    def held(rid, *a, **k):
        calls.append(rid)
        if len(calls) == 1:
            inside.set(); release.wait(10)
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
