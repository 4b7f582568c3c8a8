"""Streaming (LLM.generate(stream=True) and AsyncLLM) yields what non-streaming returns, on the
demo checkpoint whose byte-level vocabulary splits multi-byte characters across tokens."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from kda_rt import LLM, SamplingParams
from kda_rt.async_llm import AsyncLLM
from kda_rt.demo import demo_path

PROMPTS = ["naïve café — 東京 🙂", "Hello", "日本語のテキスト", "x"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    # a small token budget so prompts arrive in chunks and requests interleave; float64: seeded samples of one
    # request compared across different batch mixes (float32 logprobs move by ~3e-6 with the mix, enough to flip a
    # draw near a boundary once in ~1e3-1e4 runs)
    return LLM(str(demo_path()), backend="numpy", dtype="float64", max_num_seqs=3, max_model_len=256, block_size=16,
               max_num_batched_tokens=8)


def params(**kw) -> SamplingParams:
    base = dict(temperature=1.0, seed=5, max_tokens=30, ignore_eos=True)
    return SamplingParams(**{**base, **kw})


def collect(stream) -> dict[str, dict[int, tuple[str, list[int], str | None]]]:
    acc: dict[str, dict[int, tuple[str, list[int], str | None]]] = {}
    seen_finished: set[str] = set()
    for out in stream:
        assert out.request_id not in seen_finished, "output after the final one"
        for c in out.outputs:
            text, ids, _ = acc.setdefault(out.request_id, {}).get(c.index, ("", [], None))
            acc[out.request_id][c.index] = (text + c.text, ids + c.token_ids, c.finish_reason)
        if out.finished:
            seen_finished.add(out.request_id)
    return acc


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, {"n": 2, "logprobs": 1}, {"stop": None}], ids=["plain", "n2", "stop"])
def test_stream_equals_non_stream(llm, kw):
    if "stop" in kw:  # stop strings cut from a reference output (multi-byte where possible)
        ref = llm.generate(PROMPTS, params())
        kw = {"stop": [o.outputs[0].text[10:12] for o in ref if len(o.outputs[0].text) > 12]}
    p = params(**kw)
    final = llm.generate(PROMPTS, p)
    assert any(any(ord(ch) > 127 for ch in o.outputs[0].text) for o in final)
    streamed = collect(llm.generate(PROMPTS, p, stream=True))
    # request ids count on across calls (vLLM's LLM): the stream's are the next len(PROMPTS), in prompt order
    ids = [o.request_id for o in final]
    assert sorted(streamed, key=int) == [str(int(ids[-1]) + 1 + i) for i in range(len(PROMPTS))]
    for out, rid in zip(final, sorted(streamed, key=int), strict=True):
        for c in out.outputs:
            assert streamed[rid][c.index] == (c.text, c.token_ids, c.finish_reason)
    if "stop" in kw:
        assert any(o.outputs[0].finish_reason == "stop" for o in final)
    assert llm.stats()["slots_used"] == 0 and llm.stats()["pages_used"] == 0


def test_stream_deltas_are_incremental(llm):
    chunks = [o for o in llm.generate("Hello", params(max_tokens=12), stream=True)]
    assert len(chunks) == 12 and chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert all(len(c.outputs[0].token_ids) == 1 for c in chunks)


@pytest.mark.slow
def test_async_generate_matches(llm):
    p = params(max_tokens=20)
    final = llm.generate(PROMPTS, p)

    async def one(engine: AsyncLLM, prompt: str) -> tuple[str, list[int]]:
        text, ids = "", []
        async for out in engine.generate(prompt, p):
            text += out.outputs[0].text
            ids += out.outputs[0].token_ids
        return text, ids

    async def main() -> list[tuple[str, list[int]]]:
        engine = AsyncLLM(llm)
        results = await asyncio.gather(*(one(engine, prompt) for prompt in PROMPTS))
        with pytest.raises(ValueError, match="empty"):
            async for _ in engine.generate({"prompt_token_ids": []}, p):
                pass
        agen = engine.generate("abandoned", p)  # leaving early aborts the request
        await agen.__anext__()
        await agen.aclose()
        async for _ in engine.generate("x", params(max_tokens=2)):  # runs the pending abort
            pass
        return results

    results = asyncio.run(main())
    for out, (text, ids) in zip(final, results, strict=True):
        assert (text, ids) == (out.outputs[0].text, out.outputs[0].token_ids)
    stats = llm.stats()
    assert stats["slots_used"] == 0 and stats["pages_used"] == 0 and stats["running"] == 0


@pytest.mark.slow
def test_interleaved_streams_and_generate(llm):
    """Open streams keep their outputs while another call drives the engine."""
    p = params(max_tokens=10)
    ref = llm.generate(["Hello", "日本語のテキスト", "x"], p)
    s1 = llm.generate("Hello", p, stream=True)
    first = next(s1)
    mid = llm.generate("x", p)[0]  # runs s1's request to the end too; its outputs are parked
    s2 = llm.generate("日本語のテキスト", p, stream=True)
    got1, got2 = collect(itertools.chain([first], s1)), collect(s2)
    assert got1[first.request_id][0][:2] == (ref[0].outputs[0].text, ref[0].outputs[0].token_ids)
    assert next(iter(got2.values()))[0][:2] == (ref[1].outputs[0].text, ref[1].outputs[0].token_ids)
    assert mid.outputs[0].token_ids == ref[2].outputs[0].token_ids
    assert llm.stats()["slots_used"] == 0 and not llm._parked and not llm._open


def test_async_output_kinds(llm):
    """AsyncLLM.generate(output_kind=...): "cumulative" (vLLM's AsyncLLM default) yields outputs that each hold
    everything so far, the last equal to the non-streaming result; "final" yields only that one; deltas add up to it."""
    p = params(max_tokens=8)
    want = llm.generate("Hello", p)[0].outputs[0]

    async def run(kind):
        return [out async for out in AsyncLLM(llm).generate("Hello", p, output_kind=kind)]

    cum = asyncio.run(run("cumulative"))
    assert len(cum) == 8 and [len(o.outputs[0].token_ids) for o in cum] == list(range(1, 9))
    assert cum[-1].finished and cum[-1].outputs[0].token_ids == want.token_ids and cum[-1].outputs[0].text == want.text
    final = asyncio.run(run("final_only"))
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].token_ids == want.token_ids
    deltas = asyncio.run(run("delta"))
    assert "".join(o.outputs[0].text for o in deltas) == want.text
    with pytest.raises(ValueError, match="output_kind"):
        asyncio.run(run("everything"))


def test_async_cumulative_logprobs_converted_once(llm):
    """Cumulative outputs with logprobs: each step converts only its new entries to Logprob (an earlier step's
    entries are the same objects later: re-converting the whole history every step made long outputs slow), and
    greedy sampled tokens rank 1 even with logprobs=0."""
    from kda_rt import Logprob

    p = params(max_tokens=6, logprobs=0, temperature=0.0)

    async def run():
        return [out async for out in AsyncLLM(llm).generate("Hello", p, output_kind="cumulative")]

    outs = asyncio.run(run())
    last = outs[-1].outputs[0]
    for k, out in enumerate(outs):
        for j, entry in enumerate(out.outputs[0].logprobs):
            assert entry is last.logprobs[j], (k, j)
    for token, entry in zip(last.token_ids, last.logprobs, strict=True):
        assert isinstance(entry[token], Logprob) and entry[token].rank == 1
