"""Standing property test: a request's tokens do not depend on how the engine schedules it.

Hypothesis draws a whole run: pool size (num_blocks down to one request's worth, so preemption by recompute
happens), state slots (max_num_seqs 1-4), token budget down to 1 (chunked prefill), prompt tail, block size,
async scheduling on or off, fcfs or priority scheduling (random priorities), and requests (some with a cache
salt) (greedy or seeded, n of 1-2) that arrive at random steps and may be
aborted at random steps: before they are scheduled, mid-prefill, while decoding or while preempted.  Every
request that is not aborted ends with the tokens, finish reasons and logprobs it gets alone, and afterwards every
state slot and page is free.  Tiny checkpoint, NumPy backend, float64 (no argmax flips by rounding)."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.engine import assert_no_leaks, greedy, make_llm
from kda_rt import SamplingParams

MAX_MODEL_LEN = 48


@pytest.fixture(scope="module")
def roomy(tiny_dir):
    return make_llm(tiny_dir, max_num_seqs=2, max_model_len=MAX_MODEL_LEN, block_size=16)


def _key(out):
    return [(o.token_ids, o.finish_reason, o.logprobs) for o in out.outputs]


def _same(got, want) -> bool:
    """Tokens and finish reasons equal, each logprob within 1e-9 relative: float64 sums in another order where the
    schedule chunks a prompt otherwise (token budget 1: ~1e-12 relative, hypothesis seed 7) are not a difference."""
    if [(t, f, None if lp is None else [list(d) for d in lp]) for t, f, lp in got] != \
            [(t, f, None if lp is None else [list(d) for d in lp]) for t, f, lp in want]:
        return False
    return all(math.isclose(a[k], b[k], rel_tol=1e-9, abs_tol=1e-12)
               for (_, _, la), (_, _, lb) in zip(got, want, strict=True) if la is not None
               for a, b in zip(la, lb, strict=True) for k in a)


@st.composite
def runs(draw):
    block_size = draw(st.sampled_from([16, 16, 32]))
    budget = draw(st.sampled_from([1, 2, 5, 16, 64]))
    kw = dict(max_num_seqs=draw(st.integers(1, 4)), max_model_len=MAX_MODEL_LEN, block_size=block_size,
              num_blocks=-(-MAX_MODEL_LEN // block_size) + draw(st.sampled_from([0, 0, 1])), max_num_batched_tokens=budget,
              prefill_tail_tokens=draw(st.sampled_from([0, budget])), async_scheduling=draw(st.booleans()),
              scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])))
    requests = []
    for i in range(draw(st.integers(2, 5))):
        length = draw(st.integers(1, 20))
        prompt = draw(st.lists(st.integers(3, 511), min_size=length, max_size=length))
        room = MAX_MODEL_LEN - length  # all of it often: sequences that grow to the pool's size evict each other
        max_tokens = draw(st.sampled_from([room, room, draw(st.integers(1, room))]))
        if draw(st.booleans()):
            params = greedy(max_tokens)
        else:
            params = SamplingParams(temperature=0.9, top_p=0.9, seed=draw(st.integers(0, 99)), max_tokens=max_tokens,
                                    ignore_eos=True, n=draw(st.integers(1, 2)), logprobs=draw(st.sampled_from([None, 2])))
        arrive = draw(st.integers(0, 6))
        abort = draw(st.sampled_from([None, None, draw(st.integers(arrive, arrive + 40))]))
        priority = draw(st.integers(-2, 2)) if kw["scheduling_policy"] == "priority" else 0
        salt = draw(st.sampled_from([None, None, "a", "b"]))  # (prefix caching is on: salts part what it shares)
        requests.append((f"r{i}", prompt, params, arrive, abort, priority, salt))
    return kw, requests


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(run=runs())
def test_outputs_do_not_depend_on_the_schedule(tiny_dir, roomy, run):
    kw, requests = run
    llm = make_llm(tiny_dir, **kw)
    eng = llm.llm_engine
    finals, aborted, step = {}, set(), 0
    while step <= 6 or eng.has_unfinished_requests():
        for rid, prompt, params, arrive, abort, priority, salt in requests:
            if step == arrive:
                given = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
                eng.add_request(rid, given, params, output_kind="final", priority=priority)
            if step == abort and eng.abort(rid) is not None:
                aborted.add(rid)
        finals.update({o.request_id: _key(o) for o in eng.step() if o.finished})
        step += 1
        assert step < 3000, eng.stats()
    assert_no_leaks(llm)
    for rid, prompt, params, *_ in requests:
        if rid not in aborted:
            want = _key(roomy.generate({"prompt_token_ids": prompt}, params)[0])
            assert _same(finals[rid], want), (rid, kw, finals[rid], want)
