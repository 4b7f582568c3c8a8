"""The runner contract (kda_rt/engine/runner.py): the engine hands a runner flat arrays only and
has no backend-specific branch; a runner that implements the four methods drives it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from helpers.engine import assert_no_leaks, make_llm
from kda_rt import SamplingParams
from kda_rt.engine import EngineConfig, LLMEngine
from kda_rt.engine.batch import ForwardBatch
from kda_rt.engine.pools import plan_pools
from kda_rt.engine.runner import Runner
from kda_rt.loader.config import load_config
from kda_rt.sampler.batch import SamplingBatch, StepOutput


class FakeRunner:
    """Returns token 100 + row for every sampled row; fails row 0 when `fail_at` steps have run."""

    name = "fake"

    def __init__(self, config, settings, fail_at: int | None = None) -> None:
        self.plan = plan_pools(config, settings, itemsize=4, memory_bytes=2**34, cap_to_sequences=True)
        self.calls: list[tuple[ForwardBatch, SamplingBatch]] = []
        self.fail_at = fail_at

    def execute(self, batch: ForwardBatch, sampling: SamplingBatch) -> StepOutput:
        history = tuple(None if h is None else (list(h[0]), list(h[1])) for h in sampling.history)
        self.calls.append((batch, dataclasses.replace(sampling, history=history)))  # history: views, valid now
        n = sampling.num_rows
        assert n == batch.logits_indices.shape[0]
        out = StepOutput([100 + i for i in range(n)], [None] * n, [None] * n)
        if self.fail_at is not None and len(self.calls) > self.fail_at and n:
            out.token_ids[0], out.errors[0] = None, "boom"
        return out

    def score(self, batch):
        return np.zeros((batch.logits_indices.shape[0], 8), np.float32)

    def report(self) -> str:
        return "fake"

    def peak_memory_bytes(self) -> int:
        return 0


def engine_with(tiny_dir, **kw):
    config = load_config(tiny_dir)
    # (no copy_slots / copy_pages: prefix caching, on by default, is turned off, as such a runner must)
    settings = EngineConfig(max_num_seqs=4, max_model_len=256, block_size=16, max_num_batched_tokens=16,
                            enable_prefix_caching=False)
    runner = FakeRunner(config, settings, **kw)
    assert isinstance(runner, Runner)
    plan = runner.plan
    engine = LLMEngine(config, runner, None, dataclasses.replace(settings, max_model_len=plan.max_model_len),
                       num_slots=plan.engine_slots, num_blocks=plan.engine_blocks, extra_eos_ids=[5])
    return engine, runner


def test_engine_sends_flat_arrays_only(tiny_dir):
    engine, runner = engine_with(tiny_dir)
    engine.add_request("a", [7] * 20, SamplingParams(temperature=0.5, top_k=3, top_p=0.8, min_p=0.1, seed=11,
                                                     max_tokens=3, ignore_eos=True, logprobs=2))
    engine.add_request("b", [8] * 3, SamplingParams(temperature=0, repetition_penalty=1.3, min_tokens=2, max_tokens=3))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert len(outs["a"].outputs[0].token_ids) == 3 and len(outs["b"].outputs[0].token_ids) == 3
    def walk(value, where):  # arrays, SamplingParams, ids and their containers, at any depth: never a Sequence
        assert type(value).__name__ != "Sequence", where
        if isinstance(value, (tuple, list)):
            for k, item in enumerate(value):
                walk(item, f"{where}[{k}]")

    for batch, sampling in runner.calls:
        for f in dataclasses.fields(batch):  # the model's input: flat NumPy arrays only (snapshot: or None)
            value = getattr(batch, f.name)
            assert isinstance(value, np.ndarray) or (f.name == "snapshot" and value is None), f.name
        for f in dataclasses.fields(sampling):
            walk(getattr(sampling, f.name), f.name)
    # first step: a's first chunk (16 tokens, no row) + nothing else fits; b joins later
    first_rows = [s for _, s in runner.calls if s.num_rows]
    s = first_rows[0]
    i = [p.seed for p in s.params].index(11)
    assert (s.temperature[i], s.top_k[i], s.min_p[i], s.seeds[i], s.steps[i]) == (np.float32(0.5), 3, np.float32(0.1),
                                                                                   11, 0)
    assert abs(s.top_p[i] - 0.8) < 1e-7 and s.num_logprobs[i] == 2 and not s.host_rows[i]
    b_rows = [(s, k) for _, s in runner.calls for k, p in enumerate(s.params) if p.repetition_penalty == 1.3]
    s, k = b_rows[0]
    assert s.host_rows[k] and s.temperature[k] == 0 and s.num_logprobs[k] == -1
    assert s.history[k] == ([8, 8, 8], []) and 5 in s.banned[k]  # min_tokens bans EOS (extra_eos_ids)
    s, k = b_rows[-1]
    assert s.steps[k] == 2 and s.banned[k] == ()  # min_tokens reached: no ban


def test_runner_error_finishes_request(tiny_dir):
    engine, _ = engine_with(tiny_dir, fail_at=2)
    engine.add_request("a", [7] * 3, SamplingParams(max_tokens=8, ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            final = o
    c = final.outputs[0]
    assert c.finish_reason == "error" and c.stop_reason == "boom" and len(c.token_ids) == 2
    assert engine.stats()["slots_used"] == 0 and engine.stats()["pages_used"] == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_numpy_runner_is_a_runner(tiny_dir, dtype):
    llm = make_llm(tiny_dir, dtype=dtype, max_num_seqs=2, max_model_len=64, block_size=16)
    assert isinstance(llm.runner, Runner)
    assert "NumPy" in llm.runner.report()
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=4, seed=1))[0]
    assert len(out.outputs[0].token_ids) == 4
    assert_no_leaks(llm)


def test_settings_reject_unknown_names(tiny_dir):
    with pytest.raises(TypeError, match=r"unknown engine setting\(s\) \['max_num_sequences'\]"):
        make_llm(tiny_dir, max_num_sequences=2)


@pytest.mark.parametrize("copies", [False, True])
def test_prefix_caching_off_where_it_cannot_run(tiny_dir, caplog, copies):
    """Prefix caching is on by default; where it cannot run (a runner without copy_slots / copy_pages, or a pool plan
    with no snapshot slot: too little memory) the engine runs without it, says why in one warning, and its config
    says it is off."""
    config = load_config(tiny_dir)
    settings = EngineConfig(max_num_seqs=4, max_model_len=256, block_size=16, max_num_batched_tokens=16)
    assert settings.enable_prefix_caching
    runner = FakeRunner(config, settings)
    if copies:  # copies, but the plan's snapshots not handed over: none fit
        runner.copy_slots = runner.copy_pages = lambda src, dst: None
    plan = runner.plan
    with caplog.at_level("WARNING", logger="kda_rt.engine.llm_engine"):
        engine = LLMEngine(config, runner, None, dataclasses.replace(settings, max_model_len=plan.max_model_len),
                           num_slots=plan.engine_slots, num_blocks=plan.engine_blocks)
    why = ("the pool plan has no state slots for its snapshots (too little memory after the KV pages)" if copies
           else "the fake runner has no copy_slots / copy_pages")
    assert [r.getMessage() for r in caplog.records] == [f"prefix caching off: {why}"]
    assert not engine.config.enable_prefix_caching and engine.scheduler.cache is None
    engine.add_request("a", [7] * 20, SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert "pages_cached" not in engine.stats() and engine.stats()["pages_used"] == 0
