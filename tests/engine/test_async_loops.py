"""AsyncLLM and event loops (issue 10 #7): a second loop while the first is open gets a clear
RuntimeError instead of hanging forever; after the first loop is closed, a new loop works."""

from __future__ import annotations

import asyncio

import pytest

from helpers.engine import assert_no_leaks, greedy, make_llm
from kda_rt.async_llm import AsyncLLM


async def _collect(engine: AsyncLLM, prompt, params) -> list[int]:
    ids: list[int] = []
    async for out in engine.generate(prompt, params):
        ids += out.outputs[0].token_ids
    return ids


def test_second_event_loop_is_refused_then_allowed_after_close(tiny_dir):
    llm = make_llm(tiny_dir, max_num_seqs=2, max_model_len=64)
    engine = AsyncLLM(llm)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    ref = llm.generate(prompt, greedy(4))[0].outputs[0].token_ids

    first = asyncio.new_event_loop()
    agen = engine.generate(prompt, greedy(4))
    first.run_until_complete(agen.__anext__())  # a stream left open on the first loop

    async def other_loop() -> None:
        # before the fix this waited forever on a task of the other loop: the timeout fails the test
        await asyncio.wait_for(_collect(engine, prompt, greedy(4)), timeout=10)

    with pytest.raises(RuntimeError, match="bound to another event loop"):
        asyncio.run(other_loop())
    first.run_until_complete(agen.aclose())
    first.close()

    assert asyncio.run(asyncio.wait_for(_collect(engine, prompt, greedy(4)), timeout=10)) == ref
    assert asyncio.run(asyncio.wait_for(_collect(engine, prompt, greedy(4)), timeout=10)) == ref
    assert_no_leaks(llm)


def test_a_step_left_by_a_closed_loop_does_nothing(tiny_dir):
    """A step the first loop handed to a worker thread, run only after a new loop took over (a loaded machine), must
    not step the engine: it would take the new loop's requests a step on and give their outputs to the dead loop (a
    final one lost leaves its stream waiting forever: the likely cause of one CI run's timeout in the test above, not
    reproduced there, as it needs the worker thread held back).  Here the late step is called by hand between the new
    loop's add and its own steps: the request still takes as many steps of its own as without it."""
    llm = make_llm(tiny_dir, max_num_seqs=2, max_model_len=64)
    engine = AsyncLLM(llm)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    ref = llm.generate(prompt, greedy(4))[0].outputs[0].token_ids

    first = asyncio.new_event_loop()
    assert first.run_until_complete(_collect(engine, prompt, greedy(4))) == ref
    stale = engine._binding
    first.close()

    async def steps_to_finish(late_step: bool) -> tuple[int, list[int]]:
        engine._bind_loop()
        rid = f"late-{late_step}"
        await asyncio.to_thread(engine._locked, llm.llm_engine.add_request, rid, prompt, greedy(4))
        if late_step:
            assert await asyncio.to_thread(engine._step, stale) == []
        steps, ids = 0, []
        while llm.llm_engine.has_unfinished_requests():
            steps += 1
            ids = [o for o in await asyncio.to_thread(engine._step, engine._binding) if o.request_id == rid][-1:] or ids
        return steps, ids[0].outputs[0].token_ids

    assert asyncio.run(steps_to_finish(False)) == asyncio.run(steps_to_finish(True)) == (4, ref)
    assert_no_leaks(llm)


def test_stats_does_not_wait_for_a_step(tiny_dir):
    """AsyncLLM.stats() on the event loop while a step runs in its worker thread returns at once (the counters the
    last step left) instead of blocking the loop, and every stream, until the step ends; once the engine is free it
    reads the engine's own counters."""
    import threading
    import time

    llm = make_llm(tiny_dir, max_num_seqs=2, max_model_len=64)
    engine = AsyncLLM(llm)
    sched = llm.llm_engine.scheduler
    inside, release, schedule = threading.Event(), threading.Event(), sched.schedule

    def slow_schedule(*a, **k):
        if not release.is_set():
            inside.set()
            release.wait(10)
        return schedule(*a, **k)

    async def main() -> tuple[float, dict, list[int]]:
        task = asyncio.ensure_future(_collect(engine, {"prompt_token_ids": [5, 6, 7]}, greedy(4)))
        await asyncio.to_thread(inside.wait, 10)
        timer = threading.Timer(2.0, release.set)  # (the code before waited here for the step: ~2 s)
        timer.start()
        t0 = time.perf_counter()
        stats = engine.stats()
        took = time.perf_counter() - t0
        release.set()
        timer.cancel()
        return took, stats, await asyncio.wait_for(task, 10)

    sched.schedule = slow_schedule
    try:
        took, stats, ids = asyncio.run(main())
    finally:
        del sched.schedule
    assert took < 0.5, f"stats() waited {took:.2f} s for the step in progress"
    assert stats["running"] == 0 and stats["waiting"] == 1  # (as before that first step: the request queued)
    assert len(ids) == 4
    assert engine.stats() == llm.llm_engine.stats() and engine.stats()["running"] == 0
    assert_no_leaks(llm)


def test_a_step_that_never_runs_fails_the_calls_instead_of_spinning(tiny_dir, monkeypatch):
    """When the loop's executor cannot run the step at all (asyncio.to_thread raising before `_step` began, as after
    `loop.shutdown_default_executor()`), the stepping task gives every open call that error and ends (was: a call
    added at step 0 was not "added before the failed step", so the task looped forever without stepping and the call
    hung); the engine is usable afterwards."""
    import kda_rt.async_llm as mod

    llm = make_llm(tiny_dir, max_num_seqs=2, max_model_len=64)
    engine = AsyncLLM(llm)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    real = mod.asyncio.to_thread
    broken = [True]

    async def to_thread(fn, *args, **kwargs):
        if getattr(fn, "__name__", "") == "_step" and broken[0]:
            raise RuntimeError("cannot schedule new futures after shutdown")
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(mod.asyncio, "to_thread", to_thread)
    with pytest.raises(RuntimeError, match="cannot schedule new futures"):
        asyncio.run(asyncio.wait_for(_collect(engine, prompt, greedy(4)), timeout=10))
    broken[0] = False
    ref = llm.generate(prompt, greedy(4))[0].outputs[0].token_ids
    assert asyncio.run(asyncio.wait_for(_collect(engine, prompt, greedy(4)), timeout=10)) == ref
    assert_no_leaks(llm)
