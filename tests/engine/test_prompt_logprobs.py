"""Offline scoring and tool-call history (issue 13 #1, #3): `SamplingParams(prompt_logprobs=N)`
equals log_softmax of `LLM.score` logits; `LLM.chat` takes content None and tool messages."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kda_rt import LLM, SamplingParams
from kda_rt.demo import demo_path


@pytest.fixture(scope="module")
def llm():
    return LLM(str(demo_path()), backend="numpy", max_model_len=256)


def test_prompt_logprobs_match_score(llm):
    ids = [5, 6, 7, 8, 9]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2, prompt_logprobs=3, seed=0))[0]
    logits = llm.score(ids).astype(np.float64)
    lp = logits - logits.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        entry = out.prompt_logprobs[i]
        top = set(np.argsort(-lp[i - 1])[:3].tolist())
        assert set(entry) == top | {ids[i]}
        for tok, value in entry.items():
            assert value == pytest.approx(lp[i - 1, tok], abs=1e-6)
    streamed = list(llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2, prompt_logprobs=0),
                                 stream=True))
    # with the first delta only, as vLLM's deltas (was: repeated in every delta)
    assert len(streamed) >= 2 and all(d.prompt_logprobs is None for d in streamed[1:])
    assert streamed[0].prompt_logprobs == [None] + [{ids[i]: out.prompt_logprobs[i][ids[i]]} for i in range(1, 5)]
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_chat_with_tool_history_and_none_content(llm):
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "functions.w:0", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "functions.w:0", "content": "sunny"}]
    out = llm.chat(msgs, SamplingParams(max_tokens=2, seed=0))[0]
    assert len(out.prompt_token_ids) == len(llm.tokenizer.encode_chat(msgs))
    assert llm.tokenizer.token_to_id("<|tool_call_begin|>") in out.prompt_token_ids


def test_generated_logprobs_match_score(llm):
    """The top-N of each generated token are the N most likely under score()'s logits of the position before it,
    ranked 1..N in order of likelihood, at their log-softmax within 2e-5 (the decode steps' float32 logits against
    one prefill's: other summation orders, 1.9e-6 apart at most here); the sampled token, drawn at temperature 1, is listed too, ranked when it is among the N (None outside
    them: test_vllm_logprobs_rank_rules).  (Before, only the entries' count was checked.)"""
    ids = [5, 6, 7, 8, 9]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=6, logprobs=3, seed=2,
                                                                   ignore_eos=True))[0].outputs[0]
    logits = llm.score(ids + out.token_ids[:-1]).astype(np.float64)
    lp = logits - logits.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    for k, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = lp[len(ids) - 1 + k]
        order = np.argsort(-row).tolist()
        assert set(entry) == set(order[:3]) | {token}
        for t, v in entry.items():
            rank = order.index(t) + 1
            assert v.logprob == pytest.approx(row[t], abs=2e-5) and v.rank == (rank if rank <= 3 else None)
    assert any(t not in order_top for t, order_top in ((t, set(np.argsort(-lp[len(ids) - 1 + k])[:3].tolist()))
                                                        for k, t in enumerate(out.token_ids)))  # one drawn outside


def test_logprobs_are_vllm_logprob_objects():
    """Offline logprobs are vLLM's Logprob (`.logprob`, `.rank`, `.decoded_token`) and still the floats they were:
    the top-N ranks are 1..N in order, the sampled token's rank is exact when it is among them (greedy: 1), the
    decoded token is the tokenizer's; prompt logprobs carry the ranks llm.prompt_logprobs computes."""
    from kda_rt import LLM, Logprob, SamplingParams
    from kda_rt.demo import demo_path

    llm = LLM(str(demo_path()), backend="numpy", max_model_len=64)
    tok = llm.get_tokenizer()
    out = llm.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2))[0]
    c = out.outputs[0]
    for token, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert all(isinstance(v, Logprob) and v.logprob == float(v) for v in entry.values())
        assert entry[token].rank == 1 and entry[token].decoded_token == tok.decode([token])
        assert sorted(v.rank for v in entry.values()) == list(range(1, len(entry) + 1))
    assert abs(sum(e[t] for t, e in zip(c.token_ids, c.logprobs, strict=True)) - c.cumulative_logprob) < 1e-6
    _, ranks = llm.prompt_logprobs(out.prompt_token_ids, 2)
    assert out.prompt_logprobs[0] is None
    for token, entry, rank in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], ranks[1:], strict=True):
        assert entry[token].rank == rank and isinstance(entry[token], Logprob)


def test_vllm_logprobs_rank_rules():
    """The sampled token first, then the top N: ranks from the order wherever every token above is listed; a sampled
    token outside the top N (N + 1 entries) has rank None unless the caller knows it."""
    from kda_rt.outputs import vllm_logprobs

    def name(t):
        return f"t{t}"

    inside = vllm_logprobs({5: -1.0, 7: -0.5, 9: -2.0}, 3, name)  # sampled 5 is the 2nd most likely
    assert [inside[t].rank for t in (5, 7, 9)] == [2, 1, 3] and inside[9].decoded_token == "t9"
    outside = vllm_logprobs({5: -3.0, 7: -0.5, 9: -2.0}, 2, name)
    assert [outside[t].rank for t in (5, 7, 9)] == [None, 1, 2]
    assert vllm_logprobs({5: -3.0, 7: -0.5, 9: -2.0}, 2, name, rank=40)[5].rank == 40
    assert vllm_logprobs({5: -3.0}, 0, name)[5].rank is None


def test_prompt_logprobs_over_the_context_length_names_it():
    """A prompt over max_model_len with prompt_logprobs fails in the scoring pass with the same "maximum context
    length" message as without them (LiteLLM / LangChain match the phrase)."""
    from kda_rt import LLM, SamplingParams
    from kda_rt.demo import demo_path

    llm = LLM(str(demo_path()), backend="numpy", max_model_len=64)
    with pytest.raises(ValueError, match="maximum context length is 64 tokens: prompt has 95 tokens"):
        llm.generate({"prompt_token_ids": list(range(5, 100))}, SamplingParams(max_tokens=1, prompt_logprobs=1))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))


def test_decoded_tokens_follow_detokenize(llm):
    """vLLM's output processor drops the request's tokenizer when detokenize=False, for the sample logprobs and the
    prompt logprobs alike: every decoded_token is None.  With it, a token holding part of a UTF-8 character decodes
    as tokenizer.decode([id]) does (U+FFFD), as vLLM's convert_ids_list_to_tokens.  (Was: prompt logprobs decoded
    their tokens under detokenize=False.)"""
    from kda_rt.async_llm import AsyncLLM

    tok = llm.get_tokenizer()
    ids = tok.encode("東京 x")  # byte tokens of 東 and 京: partial characters
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    for detok in (True, False):
        params = SamplingParams(max_tokens=2, prompt_logprobs=2, logprobs=2, seed=0, detokenize=detok)
        outs = [llm.generate([{"prompt_token_ids": ids}], params)[0]]

        async def run(p=params):
            gen = AsyncLLM(llm).generate({"prompt_token_ids": ids}, p, output_kind="cumulative")
            return [o async for o in gen][-1]

        outs.append(asyncio.run(run()))
        for out in outs:
            entries = [*out.prompt_logprobs[1:], *out.outputs[0].logprobs]
            for entry in entries:
                for token, lp in entry.items():
                    assert lp.decoded_token == (tok.decode([token]) if detok else None), (detok, token)
