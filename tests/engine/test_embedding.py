"""The engine embedded in a service: `LLM.generate` from several threads, `AsyncLLM` beside it, request ids reused
after a stream is left, prompt logprobs under load, a progress bar that fails (a review's findings, each of which
corrupted the engine, hung a stream or leaked requests before)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kda_rt import LLM, SamplingParams
from kda_rt.async_llm import AsyncLLM
from kda_rt.demo import demo_path

PROMPTS = [[5 + i, 17, 29 + 3 * i, 4] * (1 + i % 3) for i in range(6)]


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=100 + i, max_tokens=12 + 3 * i, ignore_eos=True)


def _ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(demo_path()), backend="numpy", max_num_seqs=4, max_model_len=1024)


def test_generate_from_two_threads_takes_turns(llm):
    """Each thread's outputs are those of the same requests run alone (batch invariance on the NumPy backend; was:
    a "scheduler made no progress" error in one thread and wrong tokens in the other)."""
    want = _ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [_params(i) for i in range(6)]))
    got: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for _ in range(4):
                got[t].append(_ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                [_params(i) for i in range(6)])))
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    assert got[0] == [want] * 4 and got[1] == [want] * 4
    _assert_idle(llm)


def test_async_llm_and_generate_refuse_each_other_while_busy(llm):
    allm, other = AsyncLLM(llm), AsyncLLM(llm)

    async def main():
        stream = allm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=400, ignore_eos=True))
        first = await stream.__anext__()
        with pytest.raises(RuntimeError, match="AsyncLLM over this LLM has requests in flight"):
            llm.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=2))
        with pytest.raises(RuntimeError, match="requests open elsewhere"):
            await other.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=2)).__anext__()
        await stream.aclose()
        # once the first has nothing in flight the other serves, with its own ids
        outs = [o async for o in other.generate({"prompt_token_ids": PROMPTS[2]}, _params(2))]
        return first, outs

    first, outs = asyncio.run(main())
    assert first.request_id != outs[-1].request_id
    assert _ids([outs[-1]]) != [] and outs[-1].finished
    want = _ids(llm.generate({"prompt_token_ids": PROMPTS[2]}, _params(2)))
    assert [sum((list(o.outputs[0].token_ids) for o in outs), [])] == want


def test_a_reused_id_after_leaving_a_stream_runs_whole(llm, monkeypatch):
    """A stream left early has its abort applied before the same id is added again (was: the deferred abort hit the
    new request, whose stream then waited forever, or the id was refused as in use)."""
    import time

    allm = AsyncLLM(llm)
    step = llm.llm_engine.step

    def slow_step():  # a real model's step time: the window in which the retry used to come before the abort
        time.sleep(0.03)
        return step()

    monkeypatch.setattr(llm.llm_engine, "step", slow_step)

    async def main():
        busy = asyncio.create_task(_drain(allm.generate({"prompt_token_ids": PROMPTS[3]},
                                                        SamplingParams(max_tokens=300, ignore_eos=True))))
        results = []
        for _ in range(3):
            stream = allm.generate({"prompt_token_ids": PROMPTS[4]}, SamplingParams(max_tokens=200, ignore_eos=True),
                                   request_id="R")
            await stream.__anext__()
            await stream.aclose()  # left early: its abort is deferred to the stepping task
            outs = await asyncio.wait_for(_drain(allm.generate({"prompt_token_ids": PROMPTS[4]}, _params(4),
                                                               request_id="R")), 20)
            results.append(outs)
        await busy
        return results

    for outs in asyncio.run(main()):
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert sum(len(o.outputs[0].token_ids) for o in outs) == _params(4).max_tokens


def test_a_pending_abort_does_not_hit_the_next_request_of_its_id(llm):
    """The deterministic core of the case above: a left stream's abort still pending when its id comes again (its
    request had already finished in the engine, so the id was free there)."""
    allm = AsyncLLM(llm)

    async def main():
        allm._to_abort.append(("R2", None))  # what leaving a stream of id R2 leaves behind, its step not yet run
        return await asyncio.wait_for(_drain(allm.generate({"prompt_token_ids": PROMPTS[4]}, _params(4),
                                                           request_id="R2")), 20)

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert sum(len(o.outputs[0].token_ids) for o in outs) == _params(4).max_tokens


async def _drain(stream) -> list:
    return [o async for o in stream]


def _start(allm: AsyncLLM, count: int, max_tokens: int) -> list[asyncio.Task]:
    """`count` streams of PROMPTS' first prompts, each drained by its own task."""
    return [asyncio.create_task(_drain(allm.generate({"prompt_token_ids": PROMPTS[i]},
                                                     SamplingParams(max_tokens=max_tokens, ignore_eos=True))))
            for i in range(count)]


def _assert_idle(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["running"] == stats["waiting"] == 0 and not llm._open and not llm._parked


def test_prompt_logprobs_wait_for_a_free_slot():
    """With every state slot held by running requests, a request with prompt_logprobs waits for one (was:
    RuntimeError "score() needs 1 state slot")."""
    small = LLM(str(demo_path()), backend="numpy", max_num_seqs=2, max_model_len=1024)
    allm = AsyncLLM(small)

    async def main():
        running = _start(allm, 2, 60)
        await asyncio.sleep(0.05)
        assert small.stats()["slots_free"] == 0
        scored = await asyncio.wait_for(_drain(allm.generate({"prompt_token_ids": PROMPTS[5]},
                                                             SamplingParams(max_tokens=2, prompt_logprobs=1))), 60)
        await asyncio.gather(*running)
        return scored

    scored = asyncio.run(main())
    assert scored[0].prompt_logprobs is not None and len(scored[0].prompt_logprobs) == len(PROMPTS[5])


def test_generate_prompt_logprobs_steps_for_an_unread_stream():
    """LLM.generate with prompt_logprobs while an unread stream (another driver) holds every state slot: this call
    steps the engine for it, its outputs parked, until a slot frees (was: NoRoomToScore); the stream then yields
    the same tokens as the requests run alone."""
    small = LLM(str(demo_path()), backend="numpy", max_num_seqs=2, max_model_len=1024)
    prompts, params = [{"prompt_token_ids": p} for p in PROMPTS[:2]], [_params(i) for i in range(2)]
    want = _ids(small.generate(prompts, params))
    stream = small.generate(prompts, params, stream=True)
    first = next(stream)  # both requests admitted: no slot free
    assert small.stats()["slots_free"] == 0
    scored = small.generate({"prompt_token_ids": PROMPTS[5]}, SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert scored[0].prompt_logprobs is not None and len(scored[0].prompt_logprobs) == len(PROMPTS[5])
    got: dict[str, list[int]] = {}
    for out in [first, *stream]:
        got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert [got[rid] for rid in sorted(got, key=int)] == want
    _assert_idle(small)


def test_a_failing_progress_bar_leaves_no_request(llm, monkeypatch):
    import kda_rt.llm as llm_module

    def broken(total):
        raise OSError("no terminal")

    monkeypatch.setattr(llm_module, "_progress_bar", broken)
    with pytest.raises(OSError, match="no terminal"):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], SamplingParams(max_tokens=4), use_tqdm=True)
    _assert_idle(llm)


def test_shutdown_ends_the_streams_and_refuses_new_requests(llm):
    """vLLM's AsyncLLM.shutdown(): the streams in flight end with "abort", a later generate raises, and the LLM
    serves its own generate again."""
    allm = AsyncLLM(llm)

    async def main():
        streams = _start(allm, 3, 900)
        await asyncio.sleep(0.1)
        allm.shutdown()
        outs = await asyncio.wait_for(asyncio.gather(*streams), 20)
        with pytest.raises(RuntimeError, match="shut down"):
            await allm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=2)).__anext__()
        return outs

    for outs in asyncio.run(main()):
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    stats = llm.stats()
    assert stats["running"] == stats["waiting"] == stats["slots_used"] == 0
    assert _ids(llm.generate({"prompt_token_ids": PROMPTS[1]}, _params(1)))[0]
