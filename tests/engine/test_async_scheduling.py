"""Async scheduling (the next step, decodes and prefill chunks alike, scheduled and launched before this
step's tokens reach the host) changes nothing a user sees: tokens, logprobs, finish reasons and texts equal
those of the synchronous engine, through EOS / stop-token finishes in the middle of a batch, different
max_tokens, seeded sampling, prompts entering over chunked steps, arrivals and aborts between steps,
host-sampled rows and preemption.  Tiny checkpoint, NumPy backend (its runner implements the same launch /
collect contract as the CUDA runner, with the previous step's ids fed from its own samples), float64 so
batching cannot flip an argmax."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.engine import assert_no_leaks, greedy, make_llm, mixed_prompts
from kda_rt import SamplingParams
from kda_rt.engine.batch import ForwardBatch
from kda_rt.engine.runner import lead_ids_rows


@pytest.fixture(autouse=True)
def _async_prefill(monkeypatch):
    """Prefill and mixed steps launched ahead too (KDA_RT_ASYNC_PREFILL, default 0 until GPU-run)."""
    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", "1")


def _llms(tiny_dir, **kw):
    return make_llm(tiny_dir, async_scheduling=False, **kw), make_llm(tiny_dir, async_scheduling=True, **kw)


def _key(out):
    return [(o.token_ids, o.finish_reason, o.stop_reason, o.logprobs, o.cumulative_logprob) for o in out.outputs]


def _drive(eng) -> tuple[dict, int]:
    """Step `eng` until it is idle: each finished request's key, and how many steps raised the injected error."""
    finals, failed = {}, 0
    while eng.has_unfinished_requests():  # (true while a failed step's outputs are owed)
        try:
            outs = eng.step()
        except RuntimeError as exc:
            assert "injected" in str(exc)
            failed += 1
            continue
        finals.update({o.request_id: _key(o) for o in outs if o.finished})
    return finals, failed


def _run_failing(llm, method: str, every: int, prompts, params) -> tuple[dict, int]:
    """Run `prompts` on `llm` (final outputs, requests r0, r1, ...) with every `every`-th call of the runner's `method`
    raising after it did its work; returns `_drive`'s finals and failure count."""
    runner = llm.llm_engine.runner
    inner, calls = getattr(runner, method), [0]

    def flaky(*a, **k):
        out = inner(*a, **k)
        calls[0] += 1
        if calls[0] % every == 0:
            raise RuntimeError(f"injected failure after {method}")
        return out

    setattr(runner, method, flaky)
    try:
        for i, p in enumerate(prompts):
            llm.llm_engine.add_request(f"r{i}", {"prompt_token_ids": p}, params[i], output_kind="final")
        return _drive(llm.llm_engine)
    finally:
        delattr(runner, method)


def _run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [_key(o) for o in outs]


def test_same_outputs_with_finishes_in_the_middle(tiny_dir):
    sync, ahead = _llms(tiny_dir, max_num_seqs=8, max_model_len=128)
    prompts = mixed_prompts(8, seed=3, lo=3, hi=30)
    base = [greedy(10 + 3 * i) for i in range(8)]
    first = _run(sync, prompts, base)
    # stop on a token each request really produces at its 4th / 6th step, so rows finish mid-batch
    params = []
    for i, p in enumerate(base):
        if i % 3 == 0:
            stop = first[i][0][0][3]
            params.append(SamplingParams(temperature=0.0, max_tokens=p.max_tokens, stop_token_ids=[stop], logprobs=2))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0.9, top_p=0.8, seed=50 + i, max_tokens=p.max_tokens, n=2,
                                         ignore_eos=True))
        else:
            params.append(p)
    want = _run(sync, prompts, params)
    before = ahead.stats()["steps_launched_ahead"]
    got = _run(ahead, prompts, params)
    assert got == want
    assert any(r[0][1] == "stop" for r in want), "no request stopped early: the test lost its point"
    assert ahead.stats()["steps_launched_ahead"] - before > 10, "the pipelined path did not run"
    assert sync.stats()["steps_launched_ahead"] == 0
    assert_no_leaks(ahead)


def test_arrivals_and_aborts_between_steps(tiny_dir):
    """Drive the engines by hand: requests arrive after a few decode steps and one is aborted while a
    step holding its row is already queued; every surviving output equals the synchronous engine's."""
    results = []
    for llm in _llms(tiny_dir, max_num_seqs=6, max_model_len=128):
        eng = llm.llm_engine
        prompts = mixed_prompts(5, seed=9, lo=4, hi=20)
        for i in range(3):
            eng.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, greedy(14), output_kind="final")
        finals = {}
        launched_ahead_before_abort = None
        for step in range(200):
            if step == 6:
                eng.add_request("r3", {"prompt_token_ids": prompts[3]}, greedy(9), output_kind="final")
            if step == 9:
                launched_ahead_before_abort = eng.counters["steps_launched_ahead"]
                eng.abort("r1")
            if step == 12:
                eng.add_request("r4", {"prompt_token_ids": prompts[4]}, greedy(5), output_kind="final")
            for out in eng.step():
                if out.finished:
                    finals[out.request_id] = _key(out)
            if not eng.has_unfinished_requests() and step > 12:
                break
        results.append((finals, launched_ahead_before_abort))
        assert_no_leaks(llm)
    (want, sync_ahead), (got, ahead_count) = results
    assert got == want and set(got) == {"r0", "r2", "r3", "r4"}
    assert sync_ahead == 0 and ahead_count > 0  # the abort hit a step queued ahead


def test_host_rows_and_preemption_fall_back(tiny_dir):
    """Penalties (host-sampled rows) and a pool too small to grow every sequence: the engine launches
    ahead only where that is safe, and the outputs still match."""
    prompts = mixed_prompts(14, seed=1, lo=2, hi=40)
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3) if i == 0 else
              greedy(12 + (i % 5) * 4) for i in range(14)]
    # 5 pages of 16 tokens: one request fits alone, six at once never do (as tests/engine/test_preemption.py)
    kw = dict(max_num_seqs=6, max_model_len=80, block_size=16, num_blocks=5, max_num_batched_tokens=64)
    sync, ahead = _llms(tiny_dir, **kw)
    want = _run(sync, prompts, params)
    got = _run(ahead, prompts, params)
    assert got == want
    assert ahead.stats()["preemptions"] > 0, "the pool was meant to force preemption"
    assert ahead.stats()["steps_launched_ahead"] > 0
    assert_no_leaks(ahead)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_setting_is_a_bool(tiny_dir, value):
    with pytest.raises(ValueError, match="async_scheduling must be a bool"):
        make_llm(tiny_dir, async_scheduling=value)


def test_failed_launch_ahead_keeps_the_step_it_followed(tiny_dir):
    """A launch ahead that raises (e.g. a kernel that cannot be built) must not lose the step it was
    queued behind: that step's tokens are accepted before the error propagates, and stepping on gives
    the synchronous engine's outputs."""
    sync, ahead = _llms(tiny_dir, max_num_seqs=4, max_model_len=128)
    prompts = mixed_prompts(3, seed=11, lo=3, hi=12)
    want = _run(sync, prompts, [greedy(10)] * 3)
    eng = ahead.llm_engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, greedy(10), output_kind="final")
    launch, calls = eng.runner.launch, []

    def flaky(batch, sampling, **kw):
        calls.append(kw)
        if kw.get("ids_from_last") and len([c for c in calls if c.get("ids_from_last")]) == 2:
            raise RuntimeError("injected launch failure")
        return launch(batch, sampling, **kw)

    eng.runner.launch = flaky
    try:
        finals, failed = _drive(eng)
    finally:
        eng.runner.launch = launch
    assert failed == 1
    assert [finals[f"r{i}"] for i in range(3)] == want
    assert_no_leaks(ahead)


class _LaunchSpy:
    """Every launch's batch shape and ids_from_last, recorded on the runner instance."""

    def __init__(self, runner) -> None:
        self.calls: list[tuple[list[int], tuple[int, ...]]] = []
        inner = runner.launch

        def launch(batch, sampling, **kw):
            self.calls.append((batch.seq_lens.tolist(), tuple(kw.get("ids_from_last", ()))))
            return inner(batch, sampling, **kw)

        runner.launch = launch


def test_mixed_steps_are_launched_ahead(tiny_dir):
    """Prompts that enter over chunked steps beside running decodes, finishing by length at different steps: every
    launch after the first is queued ahead (a prefill chunk beside decodes fed on the device included, and a
    sequence that the step in flight ends by length gets no row), and the outputs equal the synchronous engine's."""
    kw = dict(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=40)
    sync, ahead = _llms(tiny_dir, **kw)
    prompts = mixed_prompts(8, seed=21, lo=18, hi=60)
    params = [greedy(4 + 2 * i) if i % 3 else SamplingParams(temperature=0.0, max_tokens=5 + i, ignore_eos=True,
                                                              logprobs=2) for i in range(8)]
    want = _run(sync, prompts, params)
    spy = _LaunchSpy(ahead.llm_engine.runner)
    before = ahead.stats()["steps_launched_ahead"]
    got = _run(ahead, prompts, params)
    assert got == want
    launched_ahead = ahead.stats()["steps_launched_ahead"] - before
    assert len(spy.calls) - launched_ahead == 1, "a launch after the first waited for the host"
    mixed = [(lens, rows) for lens, rows in spy.calls if rows and max(lens) > 1]
    assert mixed, "no prefill chunk ran beside decodes fed from the device: the test lost its point"
    for lens, rows in mixed:
        assert lens[: len(rows)] == [1] * len(rows)
    assert_no_leaks(ahead)


def test_steady_decode_steps_only_with_the_switch_off(tiny_dir, monkeypatch):
    """KDA_RT_ASYNC_PREFILL=0 (the A/B's other arm): no step after a prefill or mixed step is launched ahead, steady
    decode steps still are, and the outputs are the synchronous engine's."""
    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", "0")
    kw = dict(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=40)
    sync, ahead = _llms(tiny_dir, **kw)
    prompts = mixed_prompts(8, seed=21, lo=18, hi=60)
    params = [greedy(4 + 2 * i) for i in range(8)]
    want = _run(sync, prompts, params)
    spy = _LaunchSpy(ahead.llm_engine.runner)
    got = _run(ahead, prompts, params)
    assert got == want
    fed = [lens for lens, rows in spy.calls if rows]
    assert fed and all(max(lens) == 1 for lens in fed), spy.calls
    assert_no_leaks(ahead)


@pytest.mark.parametrize("waiting", ["1", "0"])
def test_decode_steps_with_requests_waiting(tiny_dir, monkeypatch, waiting):
    """KDA_RT_ASYNC_PREFILL=0 with KDA_RT_ASYNC_WAITING: more prompts than seats and a page pool that preempts, so
    requests wait through many decode steps.  With 1 the steps after those decode steps are launched ahead, with 0
    none is while a request waits; the outputs equal the synchronous engine's either way: greedy rows that preempt
    one another, then half of them stopping on a token (finishes the host learns a step late).  A step launched ahead
    admits no waiting request in practice (a seat or pages free only at a finish, and the step after a finish is not
    launched ahead in this mode): each one is all decode rows."""
    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", "0")
    monkeypatch.setenv("KDA_RT_ASYNC_WAITING", waiting)
    kw = dict(max_num_seqs=6, max_model_len=80, block_size=16, num_blocks=5, max_num_batched_tokens=64)
    sync, ahead = _llms(tiny_dir, **kw)
    prompts = mixed_prompts(14, seed=1, lo=2, hi=40)
    plain = [greedy(12 + (i % 5) * 4) for i in range(14)]
    first = _run(sync, prompts, plain)
    stops = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens, stop_token_ids=[first[i][0][0][4]])
             if i % 2 else p for i, p in enumerate(plain)]
    eng = ahead.llm_engine
    spy, launch_next, waited = _LaunchSpy(eng.runner), eng._launch_next, []

    def spy_launch_next(cur):
        waiting_now = bool(eng.scheduler.waiting)
        out = launch_next(cur)
        if out is not None and waiting_now:
            waited.append(len(spy.calls) - 1)  # the launch made ahead while a request waited
        return out

    eng._launch_next = spy_launch_next
    preempted = ahead.stats()["preemptions"]
    assert _run(ahead, prompts, plain) == first
    assert ahead.stats()["preemptions"] > preempted
    want = _run(sync, prompts, stops)
    assert any(r[0][1] == "stop" for r in want)
    assert _run(ahead, prompts, stops) == want
    if waiting == "1":
        assert len(waited) >= 10, (waited, spy.calls)
        assert all(max(spy.calls[i][0]) == 1 and spy.calls[i][1] for i in waited), spy.calls
    else:
        assert not waited
    assert_no_leaks(ahead)


@pytest.mark.parametrize("ending", ["1", "0"])
def test_decode_steps_where_sequences_end_by_length(tiny_dir, monkeypatch, ending):
    """KDA_RT_ASYNC_PREFILL=0 with KDA_RT_ASYNC_ENDING: requests ending by length at different steps (max_tokens 3 to
    31, one without max_tokens, to max_model_len, n = 2 seeded samples, some stopping on a token the host learns a step late), nothing
    waiting.  With 1 the step after one whose tokens end sequences is launched ahead (they are retired: no row), with
    0 never; the outputs equal the synchronous engine's either way, and nothing leaks (the prefix cache on, so the
    retired sequences' states are kept).  A prompt arriving later waits for a seat: with it waiting, no step where a
    sequence ends goes ahead (its room would admit the prompt ahead)."""
    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", "0")
    monkeypatch.setenv("KDA_RT_ASYNC_ENDING", ending)
    kw = dict(max_num_seqs=10, max_model_len=64, enable_prefix_caching=True)
    sync, ahead = _llms(tiny_dir, **kw)
    prompts = mixed_prompts(9, seed=5, lo=4, hi=30)
    plain = [greedy(3 + 4 * i) for i in range(8)] + [SamplingParams(temperature=0.0, max_tokens=None)]
    plain[3] = SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=17)
    first = _run(sync, prompts, plain)
    assert first[8][0][1] == "length" and len(first[8][0][0]) == 64 - len(prompts[8])
    stops = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens, stop_token_ids=[first[i][0][0][2]])
             if i in (2, 6) else p for i, p in enumerate(plain)]
    eng = ahead.llm_engine
    launch_next, seen = eng._launch_next, []

    def spy_launch_next(cur):
        ends = any(not s.finished and len(s.output_token_ids) + 1 >= s.max_tokens for s in cur.sampled)
        waits = bool(eng.scheduler.waiting)
        out = launch_next(cur)
        seen.append((ends, waits, out is not None))
        return out

    eng._launch_next = spy_launch_next
    for params in (plain, stops):
        assert _run(ahead, prompts, params) == _run(sync, prompts, params)
    ended_ahead = [s for s in seen if s[0] and s[2]]
    if ending == "1":
        assert len(ended_ahead) >= 6, seen
    else:
        assert not ended_ahead, seen
    assert_no_leaks(ahead)
    # a prompt waiting for a seat (max_num_seqs 10: the eleventh) keeps such steps waiting for the host
    seen.clear()
    late = mixed_prompts(11, seed=9, lo=4, hi=12)
    assert _run(ahead, late, [greedy(4 + i) for i in range(11)]) == _run(sync, late, [greedy(4 + i) for i in range(11)])
    assert not [s for s in seen if s[0] and s[1] and s[2]], seen
    assert_no_leaks(ahead)


@pytest.mark.parametrize("name", ["KDA_RT_ASYNC_PREFILL", "KDA_RT_ASYNC_WAITING", "KDA_RT_ASYNC_ENDING",
                                  "KDA_RT_ASYNC_GRAMMAR"])
def test_async_switch_values_refused_at_start(tiny_dir, monkeypatch, name):
    """The async switches are read at every step; a value other than 0 / 1 is refused when the engine is built,
    naming the variable (it used to raise at the first step that read it, mid-run: generate's requests aborted)."""
    monkeypatch.setenv(name, "yes")
    with pytest.raises(ValueError, match=f"{name} must be 0 or 1, got 'yes'"):
        make_llm(tiny_dir)


@pytest.mark.parametrize("case", ["arrivals", "priority"])
def test_no_prompt_launched_ahead_while_requests_wait(tiny_dir, monkeypatch, case):
    """KDA_RT_ASYNC_PREFILL=0 with KDA_RT_ASYNC_WAITING=1: a decode step goes ahead while requests wait only where the
    step launched ahead admits nobody, so no prompt chunk is ever launched ahead in this mode.  "arrivals": requests
    added between steps while others decode (a serving load; each used to be admitted by a step launched ahead);
    "priority": a page pool that preempts, under the priority policy, where the room a preemption frees lets a more
    urgent waiting prompt in at the next step (its schedule skipped admission).  The outputs equal the synchronous
    engine's."""
    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", "0")
    monkeypatch.setenv("KDA_RT_ASYNC_WAITING", "1")
    if case == "arrivals":
        kw = dict(max_num_seqs=8, max_model_len=80)
        prompts = mixed_prompts(10, seed=1, lo=5, hi=30)
        reqs = [(4 * i, p, greedy(20), 0) for i, p in enumerate(prompts)]  # (arrival step, prompt, params, priority)
    else:
        kw = dict(max_num_seqs=2, max_model_len=64, block_size=16, num_blocks=4, scheduling_policy="priority")
        prompts = mixed_prompts(8, seed=18, lo=1, hi=20)
        shape = [(32, -1), (19, -2), (35, 2), (35, -2), (34, -1), (33, -1), (16, -1), (48, -3)]
        reqs = [(0, p, greedy(n), prio) for p, (n, prio) in zip(prompts, shape, strict=True)]
    results = []
    for llm in _llms(tiny_dir, **kw):
        eng = llm.llm_engine
        spy, finals, step = _LaunchSpy(eng.runner), {}, 0
        while step <= reqs[-1][0] or eng.has_unfinished_requests():
            for i, (at, prompt, params, prio) in enumerate(reqs):
                if at == step:
                    eng.add_request(f"r{i}", {"prompt_token_ids": prompt}, params, output_kind="final", priority=prio)
            finals.update({o.request_id: _key(o) for o in eng.step() if o.finished})
            step += 1
        assert_no_leaks(llm)
        results.append((finals, spy.calls, eng.counters["steps_launched_ahead"]))
    (want, _, _), (got, calls, ahead) = results
    assert got == want and len(got) == len(reqs)
    assert ahead > 0
    fed = [lens for lens, rows in calls if rows]  # (a step launched ahead is fed the previous step's samples)
    assert all(max(lens) == 1 for lens in fed), fed


def test_preemption_in_a_step_scheduled_ahead(tiny_dir):
    """A page pool too small for every sequence, greedy rows only: steps scheduled ahead preempt, some of them a
    sequence whose token is still on the device (it goes back to the queue and gets that token when the step in
    flight is collected), and the outputs equal the synchronous engine's."""
    prompts = mixed_prompts(14, seed=1, lo=2, hi=40)
    params = [greedy(12 + (i % 5) * 4) for i in range(14)]
    kw = dict(max_num_seqs=6, max_model_len=80, block_size=16, num_blocks=5, max_num_batched_tokens=64)
    sync, ahead = _llms(tiny_dir, **kw)
    want = _run(sync, prompts, params)
    eng, seen = ahead.llm_engine, []
    launch_next, preempt = eng._launch_next, eng.scheduler._preempt
    ahead_now = [False]

    def spy_launch_next(cur):
        ahead_now[0] = True
        try:
            return launch_next(cur)
        finally:
            ahead_now[0] = False

    def spy_preempt(seq):
        seen.append((ahead_now[0], seq.pending))
        return preempt(seq)

    eng._launch_next, eng.scheduler._preempt = spy_launch_next, spy_preempt
    got = _run(ahead, prompts, params)
    assert got == want
    assert (True, 1) in seen, f"no step scheduled ahead preempted a sequence with a pending token: {seen}"
    assert_no_leaks(ahead)


def test_lead_ids_rows_refuses_what_the_previous_launch_cannot_feed():
    """The runners' check of ids_from_last: previous sample rows for the batch's first sequences, one token each."""
    batch = ForwardBatch.build([[0], [0], [5, 6, 7]], [4, 9, 0], [0, 1, 2], [[0], [1], [2]])
    assert lead_ids_rows(batch, (2, 0), 3) == (2, 0)
    assert lead_ids_rows(batch, np.array([1]), 2) == (1,)
    assert lead_ids_rows(batch, (-1, 0), 1) == (-1, 0)  # -1: the sequence keeps its own input id
    with pytest.raises(ValueError, match="sampled None rows"):
        lead_ids_rows(batch, (0,), None)
    with pytest.raises(ValueError, match="rows \\[0, 3\\]"):
        lead_ids_rows(batch, (0, 3), 3)
    with pytest.raises(ValueError, match="rows \\[-2\\]"):
        lead_ids_rows(batch, (-2,), 3)
    with pytest.raises(ValueError, match="one token each"):
        lead_ids_rows(batch, (0, 1, 2), 3)
    with pytest.raises(ValueError, match="sampled 2 rows, this batch has 3"):
        lead_ids_rows(batch, True, 2)
    decode = ForwardBatch.build([[0], [0]], [4, 9], [0, 1], [[0], [1]])
    assert lead_ids_rows(decode, True, 2) == (0, 1)


def _batches(llm, prompts, params):
    """(cu_seqlens, context_lens, slots) of every forward the runner runs for `prompts`, and the outputs."""
    runner, shapes = llm.llm_engine.runner, []
    inner = runner.forward

    def forward(batch):
        shapes.append((batch.cu_seqlens.tolist(), batch.context_lens.tolist(), batch.state_slots.tolist()))
        return inner(batch)

    runner.forward = forward
    try:
        return shapes, _run(llm, prompts, params)
    finally:
        del runner.forward


def test_batches_are_the_synchronous_engines(tiny_dir):
    """Without finishes the ahead engine cannot foresee (no EOS or stop: lengths only), its steps are the synchronous
    engine's step for step, rows in the same order and slots: also where a prompt that arrived first completes after
    later, shorter ones (the rows fed on the device then are not the batch's first in the previous step's order), and
    where waiting prompts take the seats of sequences that the step in flight ends by length (retired early)."""
    prompts = [mixed_prompts(1, seed=40 + n, lo=n, hi=n)[0] for n in (5, 40, 6, 33, 2, 17, 9, 28)]
    params = [greedy(6 + 3 * (i % 3)) for i in range(8)]
    kw = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=24)
    (want_b, want), (got_b, got) = (_batches(llm, prompts, params) for llm in _llms(tiny_dir, **kw))
    assert got == want
    assert got_b == want_b
    assert any(lens[-1] > 1 and ctx[0] > 0 for lens, ctx, _ in want_b)  # mixed steps happened


def test_a_launch_that_fails_after_running_loses_nothing(tiny_dir):
    """Every fourth launch raises after the runner ran its forward (its KDA state already holds the step's
    tokens): the call raises once, the step's sequences are computed again from the start, a step collected on the
    way out returns its outputs with the next call, and the finals equal the synchronous engine's."""
    prompts = mixed_prompts(6, seed=17, lo=3, hi=40)
    params = [greedy(5 + 2 * i) for i in range(6)]
    kw = dict(max_num_seqs=6, max_model_len=96, max_num_batched_tokens=32)
    sync, ahead = _llms(tiny_dir, **kw)
    want = _run(sync, prompts, params)
    for llm in (ahead, make_llm(tiny_dir, async_scheduling=False, **kw)):
        finals, failed = _run_failing(llm, "launch", 4, prompts, params)
        assert failed >= 3
        assert [finals[f"r{i}"] for i in range(6)] == want
        assert_no_leaks(llm)


@pytest.mark.parametrize("ahead", [False, True])
def test_a_collect_that_fails_loses_nothing(tiny_dir, ahead):
    """Every fifth collect raises (the forward ran, its tokens never reach the host): the step's sequences (those
    retired for ending by length and those whose token was pending in a step scheduled early, preempted or not)
    are computed again, a step launched ahead is dropped and recomputed too, outputs owed come with the next call,
    and the finals equal the synchronous engine's: with async scheduling and without (where the uncommitted step
    used to be folded into the KDA state twice)."""
    prompts = mixed_prompts(8, seed=23, lo=2, hi=40)
    params = [greedy(6 + 3 * (i % 4)) for i in range(8)]
    kw = dict(max_num_seqs=6, max_model_len=80, block_size=16, num_blocks=7, max_num_batched_tokens=32)
    want = _run(make_llm(tiny_dir, async_scheduling=False, **kw), prompts, params)
    llm = make_llm(tiny_dir, async_scheduling=ahead, **kw)
    finals, failed = _run_failing(llm, "collect", 5, prompts, params)
    assert failed >= 3
    assert [finals[f"r{i}"] for i in range(8)] == want
    assert_no_leaks(llm)


def test_outputs_owed_after_a_failed_step_are_not_lost(tiny_dir):
    """Stops in the middle of a batch with every third launch raising after its forward: a launch ahead that fails
    after the step before it finished the last requests leaves their outputs owed; `has_unfinished_requests()` stays
    true until a `step()` returns them (a driver looping on it lost them before), and the finals equal the
    synchronous engine's."""
    prompts = mixed_prompts(8, seed=41, lo=20, hi=40)
    kw = dict(max_num_seqs=8, max_model_len=96)
    sync, ahead = _llms(tiny_dir, **kw)
    answers = [o.outputs[0].token_ids for o in sync.generate([{"prompt_token_ids": p} for p in prompts], greedy(12))]
    params = [greedy(12, stop_token_ids=[a[3 + i % 5]]) for i, a in enumerate(answers)]
    want = _run(sync, prompts, params)
    finals, failed = _run_failing(ahead, "launch", 3, prompts, params)
    assert failed >= 2
    assert [finals[f"r{i}"] for i in range(8)] == want
    assert_no_leaks(ahead)


def test_a_failed_launch_ahead_then_a_failed_collect_loses_no_request(tiny_dir):
    """A sticky device error: the launch ahead raises, and so does collecting the step before it in the handler; that
    step's sequences (one retired for its length among them) are computed again and every request finishes."""
    llm = make_llm(tiny_dir, async_scheduling=True, max_num_seqs=2, max_model_len=128, block_size=16)
    eng, runner = llm.llm_engine, llm.llm_engine.runner
    prompts = {"a": (list(range(3, 20)), greedy(2)), "b": (list(range(30, 40)), greedy(6))}
    want = {r: o.outputs[0].token_ids for r, o in zip(prompts, make_llm(tiny_dir, async_scheduling=False, **dict(
        max_num_seqs=2, max_model_len=128, block_size=16)).generate([{"prompt_token_ids": p} for p, _ in
                                                                     prompts.values()],
                                                                    [q for _, q in prompts.values()]), strict=True)}
    for rid, (p, q) in prompts.items():
        eng.add_request(rid, {"prompt_token_ids": p}, q, output_kind="final")
    launch, collect, n = runner.launch, runner.collect, [0]

    def bad_launch(*a, **k):
        n[0] += 1
        out = launch(*a, **k)
        if n[0] == 3:  # the step launched ahead after a's first decode
            raise RuntimeError("injected device error")
        return out

    def bad_collect(h):
        if n[0] == 3:
            raise RuntimeError("injected device error")
        return collect(h)

    runner.launch, runner.collect = bad_launch, bad_collect
    done, failed = {}, 0
    for _ in range(40):
        if not eng.has_unfinished_requests():
            break
        try:
            done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        except RuntimeError as exc:
            assert "injected" in str(exc)
            failed += 1
            n[0] += 1  # (the error passes)
    del runner.launch, runner.collect
    assert failed == 1 and done == want
    assert_no_leaks(llm)


def test_a_stream_sees_its_finish_after_another_streams_failed_step(tiny_dir, monkeypatch):
    """Two streams; a step of one fails at its launch ahead, so the next step returns the outputs that step owed and
    its own, two of the other stream's request among them (the second its finish): the stream gets every token and
    its finish."""
    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", "0")
    llm = make_llm(tiny_dir, max_num_seqs=4, max_model_len=128, block_size=16, async_scheduling=True)
    runner, fail = llm.llm_engine.runner, [False]
    inner = runner.launch

    def launch(*a, **k):
        out = inner(*a, **k)
        if fail[0] and k.get("ids_from_last"):
            fail[0] = False
            raise RuntimeError("injected failure of a launch ahead")
        return out

    runner.launch = launch
    short = llm.generate({"prompt_token_ids": list(range(3, 30))}, greedy(8), stream=True)
    long = llm.generate({"prompt_token_ids": list(range(40, 70))}, greedy(40), stream=True)
    seen = []
    for out in short:
        seen.append((len(out.outputs[0].token_ids), out.finished))
        if sum(n for n, _ in seen) == 6:
            break
    fail[0] = True
    with pytest.raises(RuntimeError, match="injected"):
        next(long), next(long)
    seen += [(len(out.outputs[0].token_ids), out.finished) for out in short]
    del runner.launch
    assert sum(n for n, _ in seen) == 8 and seen[-1][1], seen
