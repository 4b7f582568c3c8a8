"""`use_beam_search` (vLLM's request field) on completions and chat: `n` beams a prompt, answered at the end, equal
to the offline `LLM.beam_search` (itself tested against a float64 search that scores whole sequences,
tests/engine/test_beam_search.py); what a beam search cannot honour is a 400 naming it."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from kda_rt import BeamSearchParams
from kda_rt.beam_search import generated


def _post(srv, path, body):
    return httpx.post(srv.url + path, headers=srv.headers, timeout=120.0, json={"model": "demo", **body})


def _want(llm, prompt, width, max_tokens, **kw):
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, **kw)
    ids = llm.llm_engine.prompt_ids(prompt)[1]
    (out,) = llm.beam_search([prompt], params)
    return [generated(b, len(ids), llm.get_tokenizer(), params) for b in out.sequences]


def test_completion_beams_equal_the_offline_search(server, reference_llm):
    """Two prompts, 3 beams each: choices 0-2 the first prompt's beams best first, 3-5 the second's; usage counts
    the beams' tokens; a sampled request running beside the search keeps its own answer."""
    prompts = ["The lighthouse keeper", "In the winter of the comet"]
    body = {"prompt": prompts, "n": 3, "max_tokens": 6, "use_beam_search": True, "temperature": 0.0,
            "ignore_eos": True}
    beside = {"prompt": "A storm came in", "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    side = {}
    t = threading.Thread(target=lambda: side.update(r=_post(server, "/v1/completions", beside)))
    t.start()
    r = _post(server, "/v1/completions", body)
    t.join(120)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(6))
    for k, prompt in enumerate(prompts):
        want = _want(reference_llm, prompt, 3, 6, ignore_eos=True)
        assert [c["text"] for c in choices[3 * k:3 * k + 3]] == [text for _, text in want], (k, choices)
        assert all(c["finish_reason"] == "length" for c in choices[3 * k:3 * k + 3])
    assert r.json()["usage"]["completion_tokens"] == 6 * 6
    from kda_rt import SamplingParams

    alone = reference_llm.generate(beside["prompt"], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert side["r"].json()["choices"][0]["text"] == alone[0].outputs[0].text


def test_chat_beams_with_eos_and_length_penalty(server, reference_llm):
    """Chat: beams that end at EOS (their text without it) or at max_tokens, ranked with a length penalty (8 puts
    the longer beams first here, 1 the two that stop); streamed, the same beams come in the chunks before [DONE]."""
    messages = [{"role": "user", "content": "Tell me about the lighthouse."}]
    prompt = {"prompt_token_ids": reference_llm.get_tokenizer().encode_chat(messages)}
    body = {"messages": messages, "n": 4, "max_tokens": 8, "use_beam_search": True, "temperature": 0.0,
            "length_penalty": 8.0}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    got = [c["message"]["content"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    want = _want(reference_llm, prompt, 4, 8, length_penalty=8.0)
    assert got == [text for _, text in want]
    assert [c["finish_reason"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])] == ["length"] * 4
    plain = _post(server, "/v1/chat/completions", {**body, "length_penalty": 1.0}).json()["choices"]
    assert [c["finish_reason"] for c in sorted(plain, key=lambda c: c["index"])] == ["stop", "stop", "length", "length"]
    assert [c["message"]["content"] for c in sorted(plain, key=lambda c: c["index"])] == \
        [text for _, text in _want(reference_llm, prompt, 4, 8)]
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=server.headers, timeout=120.0,
                      json={"model": "demo", **body, "stream": True}) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    texts: dict[int, str] = {}
    for line in lines[:-1]:
        for c in json.loads(line[6:])["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
    assert [texts[i] for i in range(4)] == got


def test_a_client_gone_mid_search_leaves_nothing_in_the_engine(server):
    """The client gives up 1 s into a search that takes ~5 s alone (10 beams x 240 steps on the demo): within 3 s
    nothing of it runs or waits, and no later step is added (the prefix cache's query count stands still)."""
    body = {"model": "demo", "prompt": "The lighthouse keeper", "n": 10, "max_tokens": 240, "use_beam_search": True,
            "temperature": 0.0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", headers=server.headers, json=body, timeout=httpx.Timeout(1.0))
    deadline = time.monotonic() + 3.0
    while True:
        m = server.metrics()
        if m["kda_rt:num_requests_running"] == 0 and m["kda_rt:num_requests_waiting"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    queries = m["kda_rt:prefix_cache_queries_total"]
    time.sleep(0.5)
    m = server.metrics()
    assert m["kda_rt:prefix_cache_queries_total"] == queries and m["kda_rt:num_requests_running"] == 0, m
    assert "Traceback" not in server.log()


@pytest.mark.parametrize(("extra", "match"), [
    ({"n": 11}, "n is the beam width, at most 10"),
    ({"logprobs": 2}, "use_beam_search does not take logprobs"),
    ({"stop": ["."]}, "use_beam_search does not take stop"),
    ({"max_tokens": 0}, "use_beam_search needs max_tokens >= 1"),
    ({"echo": True}, "use_beam_search does not take echo"),
    ({"response_format": {"type": "json_object"}}, "does not take response_format"),
    ({"length_penalty": "long"}, "length_penalty"),
    ({"max_tokens": 300}, "maximum context length"),
    ({"stop_token_ids": [5]}, "does not take stop_token_ids"),
    ({"top_p": 0.5}, "does not take top_p"),
    ({"min_tokens": 2}, "does not take min_tokens"),
    ({"logit_bias": {"5": 1.0}}, "does not take logit_bias"),
    ({"repetition_penalty": 1.2}, "does not take repetition_penalty"),
])
def test_what_a_beam_search_cannot_honour_is_refused(server, extra, match):
    body = {"prompt": "Hello", "n": 2, "max_tokens": 4, "use_beam_search": True, **extra}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400 and match in r.json()["error"]["message"], r.text
    m = server.metrics()  # nothing of it left in the engine
    assert m["kda_rt:num_requests_running"] == 0 and m["kda_rt:num_requests_waiting"] == 0, m
    assert m["kda_rt:kv_cache_usage_perc"] == 0, m


@pytest.mark.parametrize("penalty", [400, -400, 1e300])
def test_extreme_length_penalties_are_answered(server, penalty):
    """A length_penalty whose power leaves a float's range ranks in log space (was: OverflowError /
    ZeroDivisionError in the engine process, which took the server down)."""
    body = {"prompt": "Hello", "n": 2, "max_tokens": 4, "use_beam_search": True, "temperature": 0.0,
            "length_penalty": penalty}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_seed_reaches_every_step_request(server):
    """temperature > 0 adds each step's sampled token as a candidate; a request's seed seeds it (the step requests
    carry it: checked in tests/engine/test_refusals.py), and a seeded search answers."""
    body = {"prompt": "The keeper", "n": 3, "max_tokens": 6, "use_beam_search": True, "temperature": 1.5,
            "seed": 7, "ignore_eos": True}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
