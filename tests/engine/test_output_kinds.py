"""Output kinds (vLLM's RequestOutputKind): "delta" outputs concatenate to the "cumulative" ones,
"final" gives one output per request; all three see the same tokens and text."""

from __future__ import annotations

import pytest

from helpers.engine import greedy, make_llm
from kda_rt import LLM, SamplingParams
from kda_rt.demo import demo_path


@pytest.fixture(scope="module")
def llm():
    return LLM(str(demo_path()), backend="numpy", max_num_seqs=4, max_model_len=256)


def run(engine, kind, prompts, params):
    outs: dict[str, list] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"{kind}-{i}", p, params, output_kind=kind)
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id.split("-")[1], []).append(o)
    return outs


def test_delta_and_final_match_cumulative(llm):
    engine = llm.llm_engine
    prompts = ["The quick brown fox", "Kimi Delta Attention", "naïve café 東京"]
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=1, stop=["zz"])
    cum = run(engine, "cumulative", prompts, params)
    delta = run(engine, "delta", prompts, params)
    final = run(engine, "final", prompts, params)
    for key in cum:
        assert len(final[key]) == 1 and final[key][0].finished
        last = cum[key][-1]
        assert [c.token_ids for c in final[key][0].outputs] == [c.token_ids for c in last.outputs]
        assert len(delta[key]) == len(cum[key])
        for j, c in enumerate(last.outputs):
            assert sum((d.outputs[j].token_ids for d in delta[key]), []) == c.token_ids
            assert "".join(d.outputs[j].text for d in delta[key]) == c.text
            assert sum((d.outputs[j].logprobs for d in delta[key]), []) == c.logprobs
            assert delta[key][-1].outputs[j].finish_reason == c.finish_reason


def test_prompt_ids_in_outputs_are_a_copy(llm):
    """The engine hands out one copy of the prompt per request; changing it never reaches the model."""
    engine = llm.llm_engine
    engine.add_request("p", [5, 6, 7], greedy(3), output_kind="cumulative")
    out = engine.step()[0]
    out.prompt_token_ids.append(999)
    seq = engine.requests["p"][1][0]
    assert seq.prompt_token_ids == [5, 6, 7]
    while engine.has_unfinished_requests():
        engine.step()


def test_unknown_output_kind(llm):
    with pytest.raises(ValueError, match="output_kind must be one of"):
        llm.llm_engine.add_request("x", [5, 6], greedy(2), output_kind="partial")


def test_request_metrics_time_the_queue(tiny_dir):
    """RequestOutput.metrics (vLLM's RequestMetrics, wall-clock stamps): with one seat, the second request waits
    while the first runs: arrival <= first scheduled <= first token <= last token, the queue time their gap, the
    second first scheduled after the first finished; the AsyncLLM's delta outputs keep metrics and num_cached_tokens
    (metrics on a request's first output and its last)."""
    import asyncio

    from kda_rt.async_llm import AsyncLLM

    llm = make_llm(tiny_dir, max_num_seqs=1, max_model_len=64, block_size=16)
    first, second = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}], greedy(6))
    for out in (first, second):
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
        assert m.finished_time == m.last_token_time and m.time_in_queue == m.first_scheduled_time - m.arrival_time
    # (the seat frees when the first is retired for its length, which a step launched ahead can do before the
    # first's last output is built: the second is scheduled after the first's first token, not its finish stamp)
    assert second.metrics.first_scheduled_time >= first.metrics.first_token_time
    assert second.metrics.time_in_queue > first.metrics.time_in_queue

    async def deltas():
        return [o async for o in AsyncLLM(llm).generate({"prompt_token_ids": [5, 6, 7]}, greedy(3))]

    outs = asyncio.run(deltas())  # (metrics on the first output and the last: vLLM's V1 gives none between)
    assert len(outs) == 3 and outs[0].metrics.finished_time is None and outs[1].metrics is None
    assert outs[-1].metrics.finished_time is not None and outs[-1].metrics.first_token_time is not None
