"""Continuous batching under memory pressure, and aborts (tiny checkpoint, numpy backend).

The claim: whatever the pool size, token budget or company, a request gets the tokens it gets
alone.  Preemption by recompute re-runs prompt + outputs so far and keeps sampling with the same
(seed, step) Philox stream, so even seeded random sampling is unchanged.
"""

from __future__ import annotations

import logging
import re

import pytest

from helpers.engine import assert_no_leaks, greedy, make_llm, mixed_prompts
from kda_rt import SamplingParams


@pytest.fixture(scope="module")
def roomy(tiny_dir):
    """Plenty of pages and slots: the reference for 'alone'."""
    return make_llm(tiny_dir, max_num_seqs=2, max_model_len=128, block_size=16)


def alone(llm, prompt, params):
    return llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids


@pytest.mark.parametrize("budget", [7, 64], ids=["budget7", "budget64"])
def test_batch_invariance_under_pressure(tiny_dir, roomy, budget, caplog):
    prompts = mixed_prompts(14, seed=1, lo=2, hi=40)
    params = [greedy(12 + (i % 5) * 4) if i % 2 else
              SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=20, ignore_eos=True)
              for i in range(len(prompts))]
    # 5 pages of 16 tokens: one request fits alone (<= 67 positions), six at once never do
    tight = make_llm(tiny_dir, max_num_seqs=6, max_model_len=80, block_size=16, num_blocks=5,
                     max_num_batched_tokens=budget)
    with caplog.at_level(logging.WARNING, logger="kda_rt.engine.scheduler"):
        outs = tight.generate([{"prompt_token_ids": p} for p in prompts], params)
    stats = tight.stats()
    assert stats["preemptions"] > 0, "the pool was meant to be too small to avoid preemption"
    pattern = r"preempted request (\d+) .*; (\d+) tokens will be computed again"
    victims = [(int(m[1]), int(m[2])) for r in caplog.records if (m := re.match(pattern, r.getMessage()))]
    # a seeded random sample lost generated tokens to preemption and still drew the same ones
    assert any(not params[i].greedy and n > len(prompts[i]) for i, n in victims), victims
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        assert out.outputs[0].token_ids == alone(roomy, prompt, p)
        assert len(out.outputs[0].token_ids) == p.max_tokens
    assert_no_leaks(tight)
    assert stats["generated_tokens"] == sum(p.max_tokens for p in params)


def test_pool_smaller_than_max_model_len(tiny_dir):
    """An explicit max_model_len the pool cannot hold is refused up front, naming both numbers; left
    unset it follows the pool, and a request over it is refused without disturbing others."""
    with pytest.raises(ValueError, match=r"max_model_len 128 does not fit.*holds 48 tokens \(3 pages of 16\)"):
        make_llm(tiny_dir, max_num_seqs=2, max_model_len=128, block_size=16, num_blocks=3)
    llm = make_llm(tiny_dir, max_num_seqs=2, block_size=16, num_blocks=3)
    assert llm.engine_config.max_model_len == 48
    with pytest.raises(ValueError, match=r"= 60 exceeds max_model_len 48"):
        llm.generate({"prompt_token_ids": [5] * 40}, greedy(20))
    out = llm.generate({"prompt_token_ids": [5] * 20}, greedy(20))[0]
    assert len(out.outputs[0].token_ids) == 20
    assert_no_leaks(llm)


def _run_until(engine, predicate, limit=200):
    for _ in range(limit):
        if predicate():
            return
        engine.step()
    raise AssertionError("condition never reached")


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_abort_returns_resources(tiny_dir, roomy, phase):
    llm = make_llm(tiny_dir, max_num_seqs=3, max_model_len=128, block_size=16, max_num_batched_tokens=8)
    engine = llm.llm_engine
    prompts = mixed_prompts(3, seed=5, lo=30, hi=40)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, greedy(10))
    victim = engine.requests["r1"][1][0]
    if phase == "prefill":
        _run_until(engine, lambda: 0 < victim.num_computed < len(victim.prompt_token_ids))
    else:
        _run_until(engine, lambda: len(victim.output_token_ids) >= 3)
    before = engine.stats()
    held = len(victim.blocks)
    assert held > 0 and victim.slot >= 0
    engine.abort("r1")
    after = engine.stats()
    assert after["pages_used"] == before["pages_used"] - held
    assert after["slots_used"] == before["slots_used"] - 1
    assert victim.finish_reason == "abort" and victim.slot == -1 and victim.blocks == []
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "r1"
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    assert set(final) == {"r0", "r2"}
    for rid, i in (("r0", 0), ("r2", 2)):
        assert final[rid] == alone(roomy, prompts[i], greedy(10))
    assert_no_leaks(llm)
    engine.abort("r1")  # twice, or unknown: a no-op
    engine.abort("nope")


def test_abort_waiting_request(tiny_dir):
    llm = make_llm(tiny_dir, max_num_seqs=1, max_model_len=64, block_size=16)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": [7, 8, 9]}, greedy(4))
    engine.add_request("b", {"prompt_token_ids": [7, 8]}, greedy(4))
    engine.step()
    assert engine.stats()["waiting"] == 1
    engine.abort("b")
    assert engine.stats()["waiting"] == 0
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(llm)


def test_stream_closed_early_aborts(tiny_dir):
    llm = make_llm(tiny_dir, max_num_seqs=2, max_model_len=64, block_size=16)
    stream = llm.generate([{"prompt_token_ids": [4, 5, 6]}, {"prompt_token_ids": [9]}], greedy(8), stream=True)
    next(stream)
    assert llm.stats()["slots_used"] > 0
    stream.close()
    assert_no_leaks(llm)
    assert llm.stats()["requests_aborted"] == 2
