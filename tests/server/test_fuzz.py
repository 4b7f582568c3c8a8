"""Fuzzed request bodies: wrong types, NaN/Infinity, huge numbers, invalid UTF-8, unknown fields,
truncated JSON, 10 MB bodies.  Every answer is 2xx or 4xx with the error envelope, never 5xx,
and the server stays healthy."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations"]
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "n", "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "stream", "stream_options",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "echo",
          "best_of", "logit_bias", "suffix", "user", "tools", "skip_special_tokens", "include_stop_str_in_output",
          "spaces_between_special_tokens", "input", "instructions", "max_output_tokens", "text", "tool_choice",
          "parallel_tool_calls", "previous_response_id", "truncation", "store", "priority", "use_beam_search",
          "length_penalty", "cache_salt", "return_token_ids", "return_tokens_as_token_ids", "chat_template"]

scalars = (st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.integers(-3, 40)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12) | st.sampled_from(["demo", "user"]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=10)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | json_values},
    optional={"content": st.text(max_size=20) | json_values, "name": json_values}), max_size=3)
bodies = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), json_values, max_size=8)
valid_ish = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=20) | st.lists(st.integers(-5, 1100), max_size=6)},
    optional={"max_tokens": st.integers(-1, 300) | json_values, "temperature": st.floats(-1, 3) | json_values,
              "n": st.integers(-1, 4), "stream": st.booleans(), "logprobs": st.integers(-1, 25),
              "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=2), "seed": json_values,
              "top_p": json_values, "extra": json_values})
items = st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning"]) | json_values},
    optional={"role": st.sampled_from(["user", "assistant", "developer", "x"]) | json_values,
              "content": st.text(max_size=20) | json_values, "call_id": json_values, "name": json_values,
              "arguments": json_values, "output": json_values}), max_size=3)
responses_ish = st.fixed_dictionaries({"input": st.text(max_size=20) | items},
                                      optional={"max_output_tokens": st.integers(-1, 8) | json_values,
                                                "instructions": json_values, "stream": st.booleans(),
                                                "text": json_values, "tools": json_values,
                                                "tool_choice": json_values, "parallel_tool_calls": json_values})
beam_ish = st.fixed_dictionaries(  # beam searches with what they take and what they refuse
    {"prompt": st.text(min_size=1, max_size=20) | st.lists(st.integers(-5, 1100), max_size=6),
     "use_beam_search": st.just(True) | json_values},
    optional={"n": st.integers(-1, 12) | json_values, "max_tokens": st.integers(-1, 300), "stream": st.booleans(),
              "temperature": st.floats(-1, 3) | json_values, "length_penalty": st.floats(allow_nan=True) | json_values,
              "logprobs": st.integers(-1, 3), "stop": st.text(max_size=3), "echo": st.booleans(),
              "ignore_eos": st.booleans(), "priority": st.integers(-3, 3) | json_values,
              "cache_salt": st.text(max_size=4) | json_values, "return_token_ids": json_values,
              "return_tokens_as_token_ids": json_values, "prompt_logprobs": st.integers(-1, 3)})
chat_ish = st.fixed_dictionaries({"messages": messages},
                                 optional={"max_tokens": st.integers(-1, 8), "logprobs": json_values,
                                           "top_logprobs": json_values, "stream": st.booleans(), "tools": json_values,
                                           "use_beam_search": st.booleans(), "n": st.integers(1, 3),
                                           "chat_template": st.text(max_size=30) | st.just("{{ messages }}"),
                                           "return_token_ids": st.booleans(), "cache_salt": json_values})


def _encode(body: object, how: str, data: st.DataObject) -> bytes:
    raw = json.dumps(body, allow_nan=True).encode()  # may contain NaN / Infinity literals
    if how == "truncate" and raw:
        return raw[: data.draw(st.integers(0, len(raw) - 1))]
    if how == "bad-utf8":
        at = data.draw(st.integers(0, len(raw)))
        return raw[:at] + data.draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80"])) + raw[at:]
    return raw


def _check(server, http: httpx.Client, path: str, content: bytes) -> None:
    r = http.post(server.url + path, content=content, headers={**server.headers, "Content-Type": "application/json"})
    assert r.status_code < 500, f"{r.status_code} for {content[:300]!r}: {r.text[:500]}"
    if r.status_code >= 400:
        assert r.json()["error"]["code"] == r.status_code
    else:
        assert r.status_code == 200 and r.content


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=120) as client:
        yield client


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(ENDPOINTS), body=bodies | valid_ish | beam_ish | chat_ish | responses_ish | json_values,
       how=st.sampled_from(["json", "json", "truncate", "bad-utf8"]), data=st.data())
def test_fuzzed_bodies_never_5xx(server, http, path, body, how, data):
    _check(server, http, path, _encode(body, how, data))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(ENDPOINTS), raw=st.binary(max_size=200))
def test_random_bytes_never_5xx(server, http, path, raw):
    _check(server, http, path, raw)


@pytest.mark.parametrize("content", [
    b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}', b'{"prompt": "x", "n": 1e999}',
    b'{"prompt": "x", "max_tokens": 123456789012345678901234567890}', b'{"prompt": "\xff\xfe"}',
    b'{"prompt": "x", "store": "yes"}', b'{"prompt": "x",', b"", b"[]", b"null",
    b'{"prompt": "x", "n": 100000}', b'{"prompt": "x", "top_k": 99999999999}',
], ids=["nan", "inf", "huge-float", "huge-int", "non-utf8", "known-field-wrong-type", "truncated", "empty", "array", "null",
        "huge-n", "huge-top-k"])
def test_named_bad_bodies_are_400(server, http, content):
    r = http.post(server.url + "/v1/completions", content=content, headers=server.headers)
    assert r.status_code == 400, r.text


def test_ten_megabyte_bodies_are_413(server, http):
    for body in (b"x" * (10 * 1024 * 1024), b'{"messages": [{"role": "user", "content": "' + b"a" * (10 << 20) + b'"}]}'):
        for path in ENDPOINTS:
            r = http.post(server.url + path, content=body, headers=server.headers)
            assert r.status_code == 413, r.text


def test_still_healthy_afterwards(server, http):
    assert http.get(server.url + "/health").status_code == 200
    r = http.post(server.url + "/v1/completions", json={"prompt": "still alive", "max_tokens": 3, "ignore_eos": True}, headers=server.headers)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert "ENGINE PROCESS DIED" not in server.log()
    assert "Traceback" not in server.log(), server.log()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
