"""`scheduling_policy="priority"` (vLLM's --scheduling-policy priority) on the tiny checkpoint, NumPy backend: requests
start in (priority, arrival) order, the least urgent running one is preempted, every request still gets the tokens it
gets alone; "fcfs" (the default) refuses a priority other than 0 by name and queues nothing."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest

from helpers.engine import assert_no_leaks, greedy, make_llm, mixed_prompts
from kda_rt import SamplingParams
from kda_rt.async_llm import AsyncLLM


@pytest.fixture(scope="module")
def roomy(tiny_dir):
    return make_llm(tiny_dir, max_num_seqs=2, max_model_len=128, block_size=16, enable_prefix_caching=False)


def alone(llm, prompt, params):
    return llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids


def test_requests_start_in_priority_order(tiny_dir):
    """One seat: after the request that holds it, the queue runs lowest priority value first, ties by arrival."""
    llm = make_llm(tiny_dir, max_num_seqs=1, max_model_len=64, block_size=16, scheduling_policy="priority")
    engine = llm.llm_engine
    prompts = mixed_prompts(6, seed=3, lo=3, hi=12)
    priorities = [0, 5, -3, 5, 0, -3]
    for i, (p, prio) in enumerate(zip(prompts, priorities, strict=True)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, greedy(3), priority=prio)
        if i == 0:
            engine.step()  # r0 takes the seat before the others arrive
    started = []
    while engine.has_unfinished_requests():
        engine.step()
        running = [s.request_id for s in engine.scheduler.running]
        started += [r for r in running if r not in started]
    assert started == ["r0", "r2", "r5", "r4", "r1", "r3"]
    assert_no_leaks(llm)


@pytest.mark.parametrize("budget", [7, 64], ids=["budget7", "budget64"])
def test_batch_invariance_under_pressure_with_priorities(tiny_dir, roomy, budget, caplog):
    """A pool that forces preemption, random priorities: each request's tokens are the ones it gets alone (seeded
    sampling too), and every preemption took the least urgent running request."""
    prompts = mixed_prompts(12, seed=11, lo=2, hi=40)
    params = [greedy(10 + (i % 4) * 4) if i % 2 else
              SamplingParams(temperature=0.8, top_p=0.9, seed=50 + i, max_tokens=18, ignore_eos=True)
              for i in range(len(prompts))]
    priorities = [(i * 7) % 5 - 2 for i in range(len(prompts))]
    tight = make_llm(tiny_dir, max_num_seqs=6, max_model_len=80, block_size=16, num_blocks=5,
                     max_num_batched_tokens=budget, scheduling_policy="priority", enable_prefix_caching=False)
    engine = tight.llm_engine
    seen_victims = []
    preempt = engine.scheduler._preempt

    def checked(seq):  # the victim is the last running one in (priority, arrival)
        assert engine.scheduler.order(seq) == max(engine.scheduler.order(s) for s in engine.scheduler.running)
        seen_victims.append(seq.priority)
        preempt(seq)

    engine.scheduler._preempt = checked
    with caplog.at_level(logging.WARNING, logger="kda_rt.engine.scheduler"):
        outs = tight.generate([{"prompt_token_ids": p} for p in prompts], params, priority=priorities)
    assert seen_victims, "the pool was meant to be too small to avoid preemption"
    assert any(re.match(r"preempted request \d+ ", r.getMessage()) for r in caplog.records)
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        assert out.outputs[0].token_ids == alone(roomy, prompt, p)
    assert_no_leaks(tight)


def test_fcfs_refuses_a_priority_and_queues_nothing(tiny_dir):
    llm = make_llm(tiny_dir, max_num_seqs=2, max_model_len=64, block_size=16)
    assert llm.engine_config.scheduling_policy == "fcfs"
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    with pytest.raises(ValueError, match=r"priority 2: priority scheduling is not enabled .*scheduling_policy"):
        llm.generate(prompts, greedy(2), priority=[0, 2])
    assert_no_leaks(llm)  # (the first prompt, added before the second was refused, was aborted)
    outs = llm.generate(prompts, greedy(2), priority=[0, 0])  # 0 is every request's priority under fcfs
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
    with pytest.raises(ValueError, match=r"priority must be a list of one int a prompt \(2\)"):
        llm.generate(prompts, greedy(2), priority=[0])
    prio = make_llm(tiny_dir, max_num_seqs=2, max_model_len=64, block_size=16, scheduling_policy="priority")
    with pytest.raises(TypeError, match=r"priority must be an int, got float 1.5"):
        prio.generate(prompts, greedy(2), priority=[0, 1.5])
    with pytest.raises(TypeError, match=r"priority must be an int, got bool True"):
        prio.llm_engine.add_request(None, [5, 6], greedy(2), priority=True)
    assert_no_leaks(prio)
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of \('fcfs', 'priority'\), got 'sjf'"):
        make_llm(tiny_dir, max_num_seqs=2, max_model_len=64, block_size=16, scheduling_policy="sjf")


def test_async_generate_takes_a_priority(tiny_dir):
    """AsyncLLM.generate(priority=...): with one seat taken, the urgent request queued last finishes first."""
    llm = make_llm(tiny_dir, max_num_seqs=1, max_model_len=64, block_size=16, scheduling_policy="priority")
    alm, order = AsyncLLM(llm), []

    async def one(name, prio, n):
        async for out in alm.generate({"prompt_token_ids": [5, 6, 7]}, greedy(n), name, priority=prio):
            if out.finished:
                order.append(name)

    async def main():
        first = asyncio.ensure_future(one("holder", 0, 50))  # (50 steps: the other two are queued long before)
        while not llm.llm_engine.scheduler.running:
            await asyncio.sleep(0.001)
        await asyncio.gather(first, one("late", 3, 2), one("urgent", -1, 2))

    asyncio.run(main())
    assert order == ["holder", "urgent", "late"]
    assert_no_leaks(llm)


def test_chat_passes_the_priorities_on():
    """LLM.chat(priority=[...]): one a conversation, to generate (the demo checkpoint: it has a tokenizer)."""
    from pathlib import Path

    import kda_rt.demo

    llm = make_llm(Path(kda_rt.demo.__file__).parent, max_num_seqs=1, max_model_len=128, scheduling_policy="priority")
    seen = []
    add = llm.llm_engine.add_request
    llm.llm_engine.add_request = lambda *a, **kw: seen.append(kw["priority"]) or add(*a, **kw)
    convs = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]]
    outs = llm.chat(convs, greedy(2), priority=[4, -2])
    assert seen == [4, -2] and [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
    with pytest.raises(ValueError, match=r"priority must be a list of one int a prompt \(2\)"):
        llm.chat(convs, greedy(2), priority=[1])
    assert_no_leaks(llm)
