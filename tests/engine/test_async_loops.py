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
