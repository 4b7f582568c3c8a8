"""Offline scoring and tool-call history (issue 13 #1, #3): `SamplingParams(prompt_logprobs=N)`
equals log_softmax of `LLM.score` logits; `LLM.chat` takes content None and tool messages."""

from __future__ import annotations

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
    assert streamed[-1].prompt_logprobs == [None] + [{ids[i]: out.prompt_logprobs[i][ids[i]]} for i in range(1, 5)]
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


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
