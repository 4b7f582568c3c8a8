"""AsyncLLM as a service embeds it (a helper's hunt against vLLM's AsyncLLM): a stream its consumer leaves (break then
aclose, a `wait_for` timeout, a TaskGroup's cancellation, `asyncio.run` returning right after a break) has its request
aborted and its slot and pages free by the time the leaving is over; a request id is one stream's from the call on; a
call without an id never takes one a caller chose; a shutdown racing an add leaves nothing running; vLLM's EngineClient
state (`is_running`, `errored`, `check_health`, ...); sampling params of the wrong type named; a failed step fails the
streams whose requests it could have run and frees them, and spares a call whose add waited on it; 40 concurrent
streams of mixed settings equal the same requests run alone."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from helpers.engine import assert_no_leaks
from kda_rt import LLM, SamplingParams
from kda_rt.async_llm import AsyncLLM
from kda_rt.demo import demo_path
from kda_rt.sampler.params import StructuredOutputsParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(demo_path()), backend="numpy", max_num_seqs=6, max_model_len=512, scheduling_policy="priority")


def _long() -> SamplingParams:
    return SamplingParams(max_tokens=400, ignore_eos=True)


def _busy(llm: LLM) -> dict[str, int]:
    s = llm.stats()
    return {k: s[k] for k in ("running", "waiting", "slots_used", "pages_used")}


async def _tokens(allm: AsyncLLM, prompt, params, request_id=None) -> list[int]:
    ids: list[int] = []
    async for out in allm.generate(prompt, params, request_id):
        ids += out.outputs[0].token_ids
    return ids


IDLE = {"running": 0, "waiting": 0, "slots_used": 0, "pages_used": 0}


@pytest.mark.parametrize("how", ["aclose", "wait_for", "task_group", "cancel"])
def test_a_left_stream_is_aborted_when_leaving_ends(llm, how):
    """Before: the abort waited for the stepping task's next step, so right after `aclose()` / the timeout / the
    cancellation the request still held its slot and pages (and kept running where the loop ended first)."""
    if how == "task_group" and not hasattr(asyncio, "TaskGroup"):
        pytest.skip("asyncio.TaskGroup: Python 3.11+")
    allm = AsyncLLM(llm)

    async def main() -> dict[str, int]:
        other = asyncio.ensure_future(_tokens(allm, "beside", SamplingParams(max_tokens=12, ignore_eos=True)))
        if how == "aclose":
            agen = allm.generate("hello", _long())
            await agen.__anext__()
            await agen.aclose()
        elif how in ("wait_for", "cancel"):
            started = asyncio.Event()

            async def consume() -> None:
                async for _ in allm.generate("hello", _long()):
                    started.set()

            if how == "wait_for":
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(consume(), 0.3)
            else:
                task = asyncio.ensure_future(consume())
                await started.wait()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
        else:  # (asyncio.TaskGroup: Python 3.11+)
            async def fail_soon() -> None:
                await asyncio.sleep(0.3)
                raise KeyError("a sibling failed")

            async def consume() -> None:
                async for _ in allm.generate("hello", _long()):
                    pass

            with pytest.raises(BaseException, match="unhandled errors in a TaskGroup"):
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(consume())
                    tg.create_task(fail_soon())
        busy = _busy(llm)
        assert len(await asyncio.wait_for(other, 30)) == 12  # (a stream beside it is unaffected)
        return busy

    busy = asyncio.run(main())
    assert busy["running"] + busy["waiting"] <= 1 and busy["slots_used"] <= 1, busy  # only the stream beside it
    assert_no_leaks(llm)


def test_asyncio_run_returning_after_a_break_leaves_nothing_running(llm):
    """Before: the left stream's abort was queued for a stepping task that `asyncio.run` cancelled, so the request
    kept its slot and pages after the loop closed (until the AsyncLLM was used again on another loop)."""
    allm = AsyncLLM(llm)

    async def main() -> None:
        async for _ in allm.generate("hello", _long()):
            break

    asyncio.run(main())
    assert _busy(llm) == IDLE


def test_one_request_id_twice_at_once(llm):
    """vLLM refuses a request id in use.  Before: two calls with one id that both awaited their prompt logprobs both
    passed the check, the second's refused add dropped the first's queue, and the first stream waited forever."""
    allm = AsyncLLM(llm)
    params = SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=1)

    async def main():
        return await asyncio.wait_for(asyncio.gather(_tokens(allm, "hello", params, "same"),
                                                     _tokens(allm, "hello", params, "same"),
                                                     return_exceptions=True), 30)

    first, second = asyncio.run(main())
    assert len(first) == 6
    assert isinstance(second, ValueError) and "'same' is already in use" in str(second)
    assert_no_leaks(llm)


def test_a_call_without_an_id_skips_ids_callers_chose(llm):
    """Before: a caller's own "async-N" made the call that drew N fail with "request_id 'async-N' is already in use"."""
    allm = AsyncLLM(llm)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    n = next(llm._async_ids)

    async def main():
        return await asyncio.gather(_tokens(allm, "hello", params, f"async-{n + 1}"), _tokens(allm, "hi", params))

    assert [len(ids) for ids in asyncio.run(main())] == [4, 4]
    assert_no_leaks(llm)


def _hold_prompt_logprobs(llm: LLM, monkeypatch) -> tuple[threading.Event, threading.Event, object]:
    """Hold a call's prompt-logprobs pass (the window before its request is added): `inside` set once it is in
    there, it goes on at `release`; the real pass returned to put back."""
    inside, release = threading.Event(), threading.Event()
    real = llm._vllm_prompt_logprobs

    def held(*args, **kwargs):
        inside.set()
        release.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(llm, "_vllm_prompt_logprobs", held)
    return inside, release, real


def test_shutdown_while_a_request_waits_to_be_added(llm, monkeypatch):
    """A shutdown between a call's checks and its add (here: while its prompt logprobs are computed) refuses the add.
    Before: the request was added after shutdown's aborts and ran to its end on a shut-down AsyncLLM."""
    allm = AsyncLLM(llm)
    inside, release, real = _hold_prompt_logprobs(llm, monkeypatch)

    async def main():
        task = asyncio.ensure_future(_tokens(allm, "hello", SamplingParams(max_tokens=300, ignore_eos=True,
                                                                            prompt_logprobs=1)))
        await asyncio.to_thread(inside.wait, 10)
        allm.shutdown()
        release.set()
        with pytest.raises(RuntimeError, match="shut down"):
            await asyncio.wait_for(task, 30)
        return _busy(llm)

    assert asyncio.run(main()) == IDLE
    assert not allm.is_running and allm.errored and allm.is_stopped
    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(allm.check_health())
    allm.shutdown()  # (twice: nothing more to do)



def test_abort_before_the_add_ends_the_stream(llm, monkeypatch):
    """`abort(id)` while the call of that id computes its prompt logprobs (its request not yet added) aborts the
    request as it lands: the stream ends with finish_reason "abort", nothing runs after.  Before: the abort found no
    request, and the request then ran to its end (300 tokens).  A later call with the same id runs whole."""
    allm = AsyncLLM(llm)
    inside, release, real = _hold_prompt_logprobs(llm, monkeypatch)

    async def main():
        outs = []

        async def consume():
            async for out in allm.generate("hello", SamplingParams(max_tokens=300, ignore_eos=True, prompt_logprobs=1),
                                           "early"):
                outs.append(out)

        task = asyncio.ensure_future(consume())
        await asyncio.to_thread(inside.wait, 10)
        aborting = asyncio.ensure_future(allm.abort("early"))
        await asyncio.sleep(0.05)  # (the abort waits for the lock the prompt-logprobs pass holds)
        release.set()
        await asyncio.wait_for(asyncio.gather(task, aborting), 30)
        busy = _busy(llm)
        monkeypatch.setattr(llm, "_vllm_prompt_logprobs", real)
        again = await _tokens(allm, "hello", SamplingParams(max_tokens=5, ignore_eos=True), "early")
        return outs, busy, again

    outs, busy, again = asyncio.run(main())
    assert outs and outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in outs) < 300
    assert busy == IDLE and _busy(llm) == IDLE
    assert len(again) == 5

def test_engine_client_state_and_bad_params(llm):
    """vLLM's EngineClient members a service checks (was: AttributeError), and sampling params of the wrong type named
    (was: AttributeError "'dict' object has no attribute 'prompt_logprobs'")."""
    allm = AsyncLLM(llm)
    assert allm.is_running and not allm.errored and not allm.is_stopped
    asyncio.run(allm.check_health())
    assert allm.get_tokenizer() is llm.get_tokenizer()
    assert isinstance(allm.dead_error, RuntimeError)

    async def first(params):
        async for out in allm.generate("hello", params):
            return out

    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams .*SamplingParams\(\*\*d\)"):
        asyncio.run(first({"max_tokens": 3}))
    with pytest.raises(TypeError, match="got list"):
        asyncio.run(first([SamplingParams(max_tokens=3)]))
    assert_no_leaks(llm)


def test_a_failed_step_fails_the_open_streams_and_frees_them(llm, monkeypatch):
    """A step that raises once, the three streams' requests all in the engine: each stream raises that error and its
    request is gone when the error reaches the caller (before the abort-on-leaving fix they stayed queued until the next
    step); the AsyncLLM keeps running (kda_rt's engine requeues a failed step's sequences) and a later request runs
    whole."""
    allm, runner, failed = AsyncLLM(llm), llm.llm_engine.runner, []
    real = runner.launch

    def fails_once(*args, **kwargs):
        if not failed and len(llm.llm_engine.requests) == 3:  # (none of them can end first: 400 tokens each)
            failed.append(True)
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "launch", fails_once)

    async def main():
        got = await asyncio.wait_for(asyncio.gather(
            *(_tokens(allm, f"hello {i}", _long()) for i in range(3)), return_exceptions=True), 60)
        return got, _busy(llm), await _tokens(allm, "later", SamplingParams(max_tokens=5, ignore_eos=True))

    got, busy, later = asyncio.run(main())
    assert all(isinstance(g, RuntimeError) and str(g) == "boom" for g in got), got
    assert busy == IDLE and len(later) == 5
    assert allm.is_running and not allm.errored
    assert_no_leaks(llm)


class _WatchedLock:
    """The engine lock, telling `entered` once a thread asks for it after `watch` is set."""

    def __init__(self, lock) -> None:
        self.lock, self.watch, self.entered = lock, threading.Event(), threading.Event()

    def acquire(self, *args, **kwargs) -> bool:
        if self.watch.is_set():
            self.entered.set()
        return self.lock.acquire(*args, **kwargs)

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> _WatchedLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def test_a_failed_step_spares_a_call_whose_add_waits_on_it(llm, monkeypatch):
    """A step fails while another call's add waits for the engine lock that step holds: that request never was in the
    engine while the step ran, and kda_rt's engine requeues a failed step (docs/engine_notes.md, Failures), so the
    call runs whole; the stream open before the step gets the error.  Before: the error went to every call with a
    stream, that one too ("boom" instead of 5 tokens)."""
    allm, runner, calls = AsyncLLM(llm), llm.llm_engine.runner, [0]
    real, lock = runner.launch, _WatchedLock(allm._lock)
    allm._lock, in_step = lock, {}

    def fails_third(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            lock.watch.set()
            in_step["loop"].call_soon_threadsafe(in_step["event"].set)
            assert lock.entered.wait(10)  # (the other call's add waits for this step's lock)
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "launch", fails_third)

    async def main():
        in_step.update(loop=asyncio.get_running_loop(), event=asyncio.Event())
        open_before = asyncio.ensure_future(_tokens(allm, "hello", SamplingParams(max_tokens=30, ignore_eos=True)))
        await in_step["event"].wait()
        added_during = asyncio.ensure_future(_tokens(allm, "later", SamplingParams(max_tokens=5, ignore_eos=True)))
        got = await asyncio.wait_for(asyncio.gather(open_before, added_during, return_exceptions=True), 60)
        return got, _busy(llm)

    (before, during), busy = asyncio.run(main())
    assert isinstance(before, RuntimeError) and str(before) == "boom", before
    assert not isinstance(during, BaseException) and len(during) == 5, during
    assert busy == IDLE and allm.is_running and not allm.errored
    assert_no_leaks(llm)


def _mixed(i: int) -> SamplingParams:
    kind = i % 5
    if kind == 0:
        return SamplingParams(temperature=0, max_tokens=4 + i % 5, ignore_eos=True)
    if kind == 1:
        return SamplingParams(temperature=0.9, seed=i, n=2, max_tokens=5, ignore_eos=True)
    if kind == 2:
        return SamplingParams(temperature=0.7, seed=i, logprobs=2, max_tokens=5, ignore_eos=True)
    if kind == 3:
        return SamplingParams(temperature=0.8, seed=i, stop=["e", "a"], max_tokens=8)
    return SamplingParams(temperature=0.8, seed=i, max_tokens=6,
                          structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]))


def test_forty_concurrent_mixed_streams_equal_each_alone(llm):
    """n > 1, logprobs, stop strings, a grammar, priorities and all three output kinds from 40 tasks reading at random
    paces: each request's samples equal the same request run alone (already so; kept as a guard)."""
    pytest.importorskip("llguidance")
    prompts = [f"prompt number {i} " * (1 + i % 4) for i in range(40)]

    def samples(out) -> list:
        return sorted((c.index, list(c.token_ids), c.text, c.finish_reason) for c in out.outputs)

    alone = [samples(llm.generate(p, _mixed(i))[0]) for i, p in enumerate(prompts)]
    allm, kinds, rng = AsyncLLM(llm), ("delta", "cumulative", "final"), random.Random(0)
    pauses = [[rng.random() * 0.002 for _ in range(20)] for _ in prompts]

    async def one(i: int) -> list:
        outs = []
        async for out in allm.generate(prompts[i], _mixed(i), output_kind=kinds[i % 3], priority=i % 3):
            await asyncio.sleep(pauses[i][len(outs) % 20])
            outs.append(out)
        if kinds[i % 3] == "final":
            assert len(outs) == 1
        if kinds[i % 3] != "delta":
            return samples(outs[-1])
        merged: dict[int, list] = {}
        for out in outs:
            for c in out.outputs:
                m = merged.setdefault(c.index, [[], "", None])
                m[0] += c.token_ids
                m[1] += c.text
                m[2] = c.finish_reason
        return sorted((k, *m) for k, m in merged.items())

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(40))), 120)

    t0 = time.perf_counter()
    got = asyncio.run(main())
    assert [i for i in range(40) if got[i] != alone[i]] == [], f"{time.perf_counter() - t0:.1f} s"
    assert_no_leaks(llm)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v"]))
