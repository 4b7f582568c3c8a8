"""tool_choice `required` / a named function with the arguments constrained by the tools' JSON schemas
(`tool_call_grammar` through llguidance), on the demo model with random weights: whatever the model
prefers, the output parses into calls of declared functions whose arguments validate."""

from __future__ import annotations

import json

import pytest

from kda_rt import SamplingParams
from kda_rt.text.tool_parser import forced_prefix, parse_tool_calls, tool_call_grammar, tool_prefix_ids

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 8},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def llm():
    from helpers.engine import make_llm
    from kda_rt.demo import demo_path

    return make_llm(demo_path(), dtype="float32", max_model_len=640)


def _calls(llm, tool_mode, finish=("stop",), **sampling):
    tok = llm.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "What is the weather?"}], tools=TOOLS)
    prompt += tool_prefix_ids(tok, tool_mode)
    params = SamplingParams(max_tokens=200, skip_special_tokens=False,
                            structured_outputs={"grammar": tool_call_grammar(TOOLS, tool_mode)}, **sampling)
    out = []
    for req in llm.generate([{"prompt_token_ids": prompt}], params):
        for c in req.outputs:
            assert c.finish_reason in finish, c.text
            content, calls = parse_tool_calls(forced_prefix(tool_mode) + c.text)
            assert content is None and calls, c.text
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            out.append(calls)
    return out


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=4, n=4)], ids=["greedy", "n4"])
def test_named_function_arguments_follow_the_schema(llm, sampling):
    for calls in _calls(llm, {"forced_name": "get_time", "required": False, "max_calls": 1}, **sampling):
        assert [c.name for c in calls] == ["get_time"]


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_declared_functions(llm, parallel):
    mode = {"forced_name": None, "required": True, "max_calls": None if parallel else 1}
    # a random model may go on calling forever when parallel calls are allowed: complete calls must be valid
    for calls in _calls(llm, mode, ("stop", "length") if parallel else ("stop",), temperature=1.0, seed=7, n=4):
        assert all(c.name in SCHEMAS for c in calls)
        if not parallel:
            assert len(calls) == 1


def _payload(**body):
    from kda_rt.server.protocol import ChatCompletionRequest, chat_payload, decode_body

    return chat_payload(decode_body(json.dumps({"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                                                "tools": TOOLS, **body}).encode(), ChatCompletionRequest)[0],
                        auto_tools=True)


def test_server_payload_carries_the_grammar():
    pytest.importorskip("msgspec")  # the server extra
    from kda_rt.server.protocol import ChatCompletionRequest, InvalidRequest, chat_payload, decode_body

    named = _payload(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named["params"]["structured_outputs"]["grammar"].startswith("start: args")
    assert "get_time" in _payload(tool_choice="required")["params"]["structured_outputs"]["grammar"]
    assert _payload(tool_choice="auto")["params"]["structured_outputs"] is None  # auto: the model decides
    with pytest.raises(InvalidRequest, match="cannot be combined"):
        _payload(tool_choice="required", response_format={"type": "json_object"})
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}}}]
    with pytest.raises(InvalidRequest, match="parameters"):
        chat_payload(decode_body(json.dumps({"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                                             "tools": bad, "tool_choice": "required"}).encode(),
                                 ChatCompletionRequest)[0], auto_tools=True)


def test_without_llguidance_required_is_refused_and_named_is_prefix_forced(monkeypatch):
    """Without llguidance only the prompt prefix forces a call: it writes a named function's whole header, but for
    `required` it stops at "functions." and nothing makes the model name a declared tool (the answer could hold no
    call), so `required` is a 400 naming the missing package (was: a warning and, on the demo, `tool_calls: []`)."""
    pytest.importorskip("msgspec")  # the server extra
    from kda_rt.server.protocol import InvalidRequest

    monkeypatch.setitem(__import__("sys").modules, "llguidance", None)  # `import llguidance` raises ImportError
    with pytest.raises(InvalidRequest, match=r"tool_choice 'required' needs llguidance.*kda_rt\[structured\]"):
        _payload(tool_choice="required")
    named = _payload(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named["params"]["structured_outputs"] is None  # the prefix alone; the arguments unconstrained
    assert _payload(tool_choice="auto")["params"]["structured_outputs"] is None
