"""Structured outputs and logit_bias through the server with the official `openai` client: chat
and completions, streaming and not; answers must parse and validate, seeded ones equal `LLM.generate`."""

from __future__ import annotations

import json
import re

import pytest

from kda_rt import SamplingParams

openai = pytest.importorskip("openai", reason="needs the test extra (openai)")
pytest.importorskip("llguidance", reason="needs the structured extra (llguidance)")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "population", "capital"],
          "properties": {"city": {"type": "string", "maxLength": 10},
                         "population": {"type": "integer", "minimum": 0, "maximum": 99999},
                         "capital": {"type": "boolean"}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]


@pytest.fixture(scope="module")
def client(server):
    from helpers.server import API_KEY

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_chat_json_schema(client, reference_llm):
    res = client.chat.completions.create(model="demo", messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                         max_tokens=80, temperature=1.0, seed=4, n=2)
    for choice in res.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    ref = reference_llm.chat(MESSAGES, SamplingParams(max_tokens=80, temperature=1.0, seed=4, n=2,
                                                      structured_outputs={"json": SCHEMA}))[0]
    assert [c.message.content for c in res.choices] == [c.text for c in ref.outputs]


def test_chat_json_schema_stream(client):
    kw = dict(model="demo", messages=MESSAGES, response_format=RESPONSE_FORMAT, max_tokens=80, temperature=0.7, seed=9)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    text, finish = "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text == whole and finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_constraints(client):
    res = client.completions.create(model="demo", prompt="A city:", max_tokens=80, temperature=0.0,
                                    extra_body={"response_format": RESPONSE_FORMAT})
    jsonschema.validate(json.loads(res.choices[0].text), SCHEMA)
    choices = ["alpha", "beta", "gamma"]
    res = client.completions.create(model="demo", prompt="Pick one:", max_tokens=10, temperature=1.0, seed=2, n=3,
                                    extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices and c.finish_reason == "stop" for c in res.choices)
    res = client.completions.create(model="demo", prompt="Code:", max_tokens=20, temperature=1.0, seed=1,
                                    extra_body={"guided_regex": "[A-Z]{2}[0-9]{3}"})
    assert re.fullmatch("[A-Z]{2}[0-9]{3}", res.choices[0].text)
    text = ""
    for chunk in client.completions.create(model="demo", prompt="JSON:", max_tokens=80, temperature=0.0, stream=True,
                                           extra_body={"guided_json": SCHEMA}):
        text += "".join(c.text for c in chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_chat_json_object(client, reference_llm):
    # a random model may write keys forever: tokens with a quote are banned, so the object must close
    tok = reference_llm.get_tokenizer()
    bias = {str(t): -100 for t in range(tok.vocab_size) if b'"' in tok.token_bytes(t)}
    res = client.chat.completions.create(model="demo", messages=MESSAGES, response_format={"type": "json_object"},
                                         max_tokens=60, temperature=0.0, logit_bias=bias)
    assert res.choices[0].finish_reason == "stop"
    assert json.loads(res.choices[0].message.content) == {}


def test_logit_bias(client, reference_llm):
    target = 300
    word = reference_llm.get_tokenizer().decode([target])
    res = client.completions.create(model="demo", prompt="Hello", max_tokens=3, temperature=0.0,
                                    logit_bias={str(target): 100}, extra_body={"ignore_eos": True})
    assert res.choices[0].text == word * 3
    first = client.completions.create(model="demo", prompt="Hello", max_tokens=1, temperature=0.0, logprobs=0)
    top = first.choices[0].logprobs.tokens[0]
    banned = reference_llm.get_tokenizer().encode(top)
    res = client.completions.create(model="demo", prompt="Hello", max_tokens=1, temperature=0.0,
                                    logit_bias={str(t): -100 for t in banned})
    assert res.choices[0].text != top


def test_invalid_schema_is_400(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "two"}}}
    with pytest.raises(openai.BadRequestError, match=r"response_format\.json_schema\.schema"):
        client.chat.completions.create(model="demo", messages=MESSAGES, response_format=bad, max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="demo", prompt="x", max_tokens=1, logit_bias={"1": 150})
