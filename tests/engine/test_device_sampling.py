"""Rows sampled as the CUDA runner samples them with KDA_RT_GPU_SAMPLING_EXTRAS (run on a NumPy runner:
tests/helpers/penalties.use_device_extras): penalties from per-sequence device counts (sampler/penalties.PenaltyRows),
min_tokens bans and allowed_token_ids as bitmasks (SamplingBatch.device_masks) give the tokens and logprobs of the
host sampler's rows, which penalise from each row's history and apply the bans in turn: through chunked prompts,
n > 1 samples, stop-token finishes mid-batch, preemption and async scheduling, where such a row's next step is
launched before the host has its token (the device counts it).  Tiny checkpoint, NumPy backend, float64."""

from __future__ import annotations

import dataclasses

import pytest

from helpers.engine import assert_no_leaks, make_llm, mixed_prompts
from helpers.penalties import use_device_extras
from kda_rt import SamplingParams


@pytest.fixture(autouse=True)
def _async_prefill(monkeypatch):
    """Prefill and mixed steps launched ahead too (KDA_RT_ASYNC_PREFILL, default 0 until GPU-run)."""
    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", "1")


def _key(out):
    return [(o.token_ids, o.finish_reason, o.logprobs, o.cumulative_logprob) for o in out.outputs]


def _params(n: int) -> list[SamplingParams]:
    kinds = [dict(repetition_penalty=1.4), dict(frequency_penalty=0.6, presence_penalty=0.4),
             dict(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.1), {}]
    out = []
    for i in range(n):
        kw = dict(max_tokens=6 + 3 * (i % 4), ignore_eos=True, **kinds[i % 4])
        if i % 3 == 1:
            kw.update(temperature=0.9, top_p=0.9, seed=40 + i, n=2, logprobs=2)
        else:
            kw.update(temperature=0.0)
        out.append(SamplingParams(**kw))
    return out


def _run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [_key(o) for o in outs]


def test_device_counts_give_the_host_samplers_tokens(tiny_dir):
    kw = dict(max_num_seqs=6, max_model_len=96, max_num_batched_tokens=48)
    host = make_llm(tiny_dir, async_scheduling=False, **kw)
    prompts = mixed_prompts(8, seed=13, lo=5, hi=50)
    params = _params(8)
    want = _run(host, prompts, params)
    dev = make_llm(tiny_dir, **kw)
    pool = use_device_extras(dev)
    launches, inner = [], dev.llm_engine.runner.launch

    def spy(batch, sampling, **k):
        launches.append((bool(k.get("ids_from_last")), bool(sampling.penalty_rows.any()), bool(sampling.host_rows.any())))
        return inner(batch, sampling, **k)

    dev.llm_engine.runner.launch = spy
    got = _run(dev, prompts, params)
    assert got == want
    assert not any(h for *_, h in launches), "a penalised row was sampled on the host"
    assert any(fed and pen for fed, pen, _ in launches), "no penalised step was launched ahead of its tokens"
    assert pool.capacity >= 4  # (rows grew from 2)
    assert_no_leaks(dev)


def test_device_counts_through_preemption_and_stops(tiny_dir):
    """A pool that forces preemption (a recomputed sequence keeps its counts: its outputs are kept) and stop tokens
    each request produces mid-run."""
    kw = dict(max_num_seqs=6, max_model_len=80, block_size=16, num_blocks=5, max_num_batched_tokens=64)
    host = make_llm(tiny_dir, async_scheduling=False, **kw)
    prompts = mixed_prompts(12, seed=2, lo=2, hi=40)
    base = [SamplingParams(temperature=0.0, max_tokens=14 + (i % 3) * 4, ignore_eos=True,
                           **(dict(frequency_penalty=0.7) if i % 2 else dict(repetition_penalty=1.3)))
            for i in range(12)]
    first = _run(host, prompts, base)
    params = [dataclasses.replace(p, stop_token_ids=[first[i][0][0][4]]) if i % 4 == 0 else p
              for i, p in enumerate(base)]
    want = _run(host, prompts, params)
    dev = make_llm(tiny_dir, **kw)
    use_device_extras(dev)
    got = _run(dev, prompts, params)
    assert got == want
    assert any(r[0][1] == "stop" and len(r[0][0]) < 14 for r in want), "no request stopped early"
    assert dev.stats()["preemptions"] > 0, "the pool was meant to force preemption"
    assert dev.stats()["steps_launched_ahead"] > 0
    assert_no_leaks(dev)


def test_bans_and_allowed_ids_as_device_masks(tiny_dir):
    """min_tokens (its stop id and EOS banned for the first tokens), allowed_token_ids, both with penalties, and a
    logit_bias row: the tokens and logprobs of the host sampler, every row sampled as the GPU would (the bias from the
    device rows' third array), and their steps launched ahead."""
    kw = dict(max_num_seqs=6, max_model_len=96, max_num_batched_tokens=48)
    host = make_llm(tiny_dir, async_scheduling=False, **kw)
    prompts = mixed_prompts(6, seed=31, lo=4, hi=30)
    plain = _run(host, prompts, [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 6)
    allowed = sorted({t for r in plain for t in r[0][0]} | set(range(40, 60)))
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, min_tokens=6, stop_token_ids=[plain[0][0][0][2]], logprobs=3),
        SamplingParams(temperature=0.9, seed=5, max_tokens=9, allowed_token_ids=allowed[:25], logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=9, allowed_token_ids=allowed[5:40], frequency_penalty=0.7),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=4, stop_token_ids=[plain[3][0][0][1]],
                       repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=7, logit_bias={int(plain[4][0][0][1]): -50.0, 3: 2.5}),
        SamplingParams(temperature=0.7, top_p=0.8, seed=9, max_tokens=11, ignore_eos=True),
    ]
    want = _run(host, prompts, params)
    assert want[0][0][0] != plain[0][0][0][:10]  # the ban moved the first request off its plain tokens
    dev = make_llm(tiny_dir, **kw)
    use_device_extras(dev)
    launches, inner = [], dev.llm_engine.runner.launch

    def spy(batch, sampling, **k):
        launches.append((bool(k.get("ids_from_last")), sampling.host_rows.tolist(),
                         [p.logit_bias is not None and bool(p.logit_bias) for p in sampling.params]))
        return inner(batch, sampling, **k)

    dev.llm_engine.runner.launch = spy
    got = _run(dev, prompts, params)
    assert got == want
    assert not any(any(hosts) for _, hosts, _ in launches), "a row was sampled on the host"
    assert any(any(biased) and fed for fed, _, biased in launches)  # a biased row's step went ahead
    assert sum(fed for fed, *_ in launches) >= 5
    assert_no_leaks(dev)
