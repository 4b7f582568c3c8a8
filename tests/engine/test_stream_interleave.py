"""Standing property test (issue 10 #1): streams read in any interleaving give exactly the tokens
and text of each request run alone, for `LLM.generate(stream=True)` and for `AsyncLLM`.

Before the fix, a driver suspended at a yield parked an older cumulative output over a newer one
and the delta tracker moved backwards, so tokens were repeated (`[369, 392, 392, 184, ...]`)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kda_rt import LLM, SamplingParams
from kda_rt.async_llm import AsyncLLM
from kda_rt.demo import demo_path

PROMPTS = ["Hello", "naïve café", "日本語", "x", "onion soup", "🙂 ok"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def llm() -> LLM:
    # float64: batch composition cannot flip a draw by rounding, so "alone" is a sharp reference
    return LLM(str(demo_path()), backend="numpy", dtype="float64", max_num_seqs=4, max_model_len=128,
               block_size=16, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def alone(llm) -> dict[int, tuple[str, list[int]]]:
    ref = {}
    for i, prompt in enumerate(PROMPTS):
        out = llm.generate(prompt, params(i))[0].outputs[0]
        ref[i] = (out.text, out.token_ids)
    return ref


def params(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_two_streams_read_alternately(llm, alone):
    """The probe's case: two streams, one output from each in turn."""
    streams = {i: llm.generate(PROMPTS[i], params(i), stream=True) for i in (0, 1)}
    got = {i: ("", []) for i in streams}
    live = dict(streams)
    while live:
        for i in list(live):
            out = next(live[i], None)
            if out is None:
                del live[i]
                continue
            text, ids = got[i]
            got[i] = (text + out.outputs[0].text, ids + out.outputs[0].token_ids)
    assert got == {i: alone[i] for i in streams}
    assert not llm._open and not llm._parked


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_interleaving_of_streams(llm, alone, data):
    chosen = data.draw(st.lists(st.sampled_from(range(len(PROMPTS))), min_size=1, max_size=5, unique=True))
    streams = {i: llm.generate(PROMPTS[i], params(i), stream=True) for i in chosen}
    got = {i: ("", []) for i in chosen}
    while streams:
        i = data.draw(st.sampled_from(sorted(streams)))
        out = next(streams[i], None)
        if out is None:
            del streams[i]
            continue
        assert out.request_id is not None
        text, ids = got[i]
        got[i] = (text + out.outputs[0].text, ids + out.outputs[0].token_ids)
    assert got == {i: alone[i] for i in chosen}
    s = llm.stats()
    assert s["slots_used"] == 0 and s["pages_used"] == 0 and not llm._open and not llm._parked


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chosen=st.lists(st.sampled_from(range(len(PROMPTS))), min_size=1, max_size=5, unique=True),
       delays=st.lists(st.integers(0, 3), min_size=30, max_size=30))
def test_async_streams_any_pace(llm, alone, chosen, delays):
    """AsyncLLM consumers that each yield to the loop a random number of times between reads."""
    async def one(engine: AsyncLLM, i: int) -> tuple[str, list[int]]:
        text, ids, k = "", [], i
        async for out in engine.generate(PROMPTS[i], params(i)):
            text += out.outputs[0].text
            ids += out.outputs[0].token_ids
            for _ in range(delays[k % len(delays)]):
                await asyncio.sleep(0)
            k += 1
        return text, ids

    async def main() -> list[tuple[str, list[int]]]:
        engine = AsyncLLM(llm)
        return await asyncio.gather(*(one(engine, i) for i in chosen))

    assert dict(zip(chosen, asyncio.run(main()), strict=True)) == {i: alone[i] for i in chosen}
