"""POST /v1/responses (OpenAI's Responses API, stateless text subset) with the `openai` client: the answer equals
the chat completion of the same conversation, streaming events arrive in the documented order and add up to the
same text, max_output_tokens gives `incomplete`, json_schema output validates, and what is not supported is a 400
naming the field."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai", reason="needs the test extra (openai)")


@pytest.fixture(scope="module")
def client(server):
    from helpers.server import API_KEY

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_create_equals_chat(client):
    chat = client.chat.completions.create(model="demo", max_tokens=8, seed=5, temperature=0.8, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}])
    resp = client.responses.create(model="demo", instructions="Be brief.", input="Name a prime.",
                                   max_output_tokens=8, temperature=0.8, extra_body={"seed": 5})
    assert resp.object == "response" and resp.id.startswith("resp-")
    assert resp.output_text == chat.choices[0].message.content
    want = "completed" if chat.choices[0].finish_reason == "stop" else "incomplete"
    assert resp.status == want
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    parts = client.responses.create(model="demo", input=[
        {"role": "system", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user", "content": "Name a prime."}], max_output_tokens=8, temperature=0.8,
        extra_body={"seed": 5})
    assert parts.output_text == resp.output_text


def test_length_is_incomplete_and_stream_events(client):
    resp = client.responses.create(model="demo", input="Count to a hundred.", max_output_tokens=5,
                                   extra_body={"ignore_eos": True, "seed": 1})
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    with client.responses.stream(model="demo", input="Count to a hundred.", max_output_tokens=5,
                                 extra_body={"ignore_eos": True, "seed": 1}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert final.output_text == resp.output_text and final.status == "incomplete"


def test_json_schema_format(client):
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    resp = client.responses.create(model="demo", input="A digit as JSON.", max_output_tokens=40, text={
        "format": {"type": "json_schema", "name": "digit", "schema": schema, "strict": True}})
    assert resp.status == "completed" and 0 <= json.loads(resp.output_text)["n"] <= 9


@pytest.mark.parametrize(("body", "needle"), [
    ({"input": "x", "previous_response_id": "resp-1"}, "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0] must be a function tool"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0] must be a message, reasoning, function_call"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, "input[0].encrypted_content"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "text", "text": "t"}]}]}, "input[0].summary[0] must be"),
    ({"input": "x", "include": ["message.output_text.logprobs", "usage.everything"]}, "include[1] must be one of"),
    ({"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0] (function_call) needs call_id"),
    ({"input": ""}, "input"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": {"a": 1}}]}, "input[0].output must be"),
])
def test_unsupported_is_named(server, body, needle):
    r = httpx.post(server.url + "/v1/responses", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_failed_response_names_the_cause():
    """An aborted or failed request gives status failed with a message (OpenAI's schema requires one) and an
    incomplete item; an incomplete one names max_output_tokens."""
    from kda_rt.server.responses_api import ResponsesRequest, response_body

    req = ResponsesRequest(input="x")
    for reason in ("abort", "error"):
        body = response_body("resp-1", 0, "demo", req, text="par", reason=reason, usage=None)
        assert body["status"] == "failed" and isinstance(body["error"]["message"], str) and body["error"]["message"]
        assert body["output"][0]["status"] == "incomplete"
    body = response_body("resp-1", 0, "demo", req, text="par", reason="length", usage=None)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["error"] is None and body["output"][0]["status"] == "incomplete"


def test_engine_refusal_names_responses_fields(server):
    """The engine's refusal of a prompt + max_output_tokens past max_model_len names max_output_tokens, the field the
    client sent (was: chat's max_tokens)."""
    from helpers.server import MAX_MODEL_LEN

    r = httpx.post(server.url + "/v1/responses", headers=server.headers, timeout=60,
                   json={"model": "demo", "input": "hi", "max_output_tokens": MAX_MODEL_LEN + 10})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "max_output_tokens" in message and "max_tokens" not in message, r.text


def _events(server, body):
    """The SSE events of a streamed request, each its JSON with its `event:` name checked."""
    with httpx.stream("POST", server.url + "/v1/responses", headers=server.headers, timeout=60,
                      json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        text = r.read().decode()
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert name == "event: " + events[-1]["type"]
    return events


def _same_answer(body: dict) -> dict:
    """A response body without what differs between two runs of one request: ids, time, prefix-cache hits."""
    body = json.loads(json.dumps(body).replace(body["id"], "ID"))
    body.pop("created_at")
    if body["usage"] is not None:
        body["usage"]["input_tokens_details"]["cached_tokens"] = 0
    return body


@pytest.mark.parametrize("extra", [{}, {"tools": [{"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}], "tool_choice": {"type": "function",
                                                                                     "name": "get_weather"}}],
                         ids=["message", "function_call"])
def test_bodies_and_events_are_the_clients_types(server, extra):
    """Every body and stream event validates as the openai client's own types (their required fields there: was
    usage.input_tokens_details without cache_write_tokens, which the client requires); sequence numbers count from
    0; the stream's final response equals the one answered without a stream."""
    import pydantic
    from openai.types.responses import Response, ResponseStreamEvent

    body = {"model": "demo", "input": "Weather in Paris?", "max_output_tokens": 12, "temperature": 0.0,
            "ignore_eos": True, **extra}
    r = httpx.post(server.url + "/v1/responses", headers=server.headers, timeout=60, json=body)
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())
    events = _events(server, body)
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    assert _same_answer(events[-1]["response"]) == _same_answer(r.json())


def test_tool_choice_auto_without_tools(client):
    """tool_choice "auto" (the Responses API's default, which clients send as such) with no tools is an answer
    without calls, not chat's 400 "tool_choice 'auto' needs tools"."""
    resp = client.responses.create(model="demo", input="Hi", max_output_tokens=2, tool_choice="auto")
    assert resp.tool_choice == "auto" and [item.type for item in resp.output] == ["message"]
    resp = client.responses.create(model="demo", input="Hi", max_output_tokens=2, tool_choice="auto", tools=[])
    assert resp.tools == [] and resp.output_text is not None


def test_sampling_values_are_echoed(server, tmp_path):
    """temperature and top_p are the values the engine sampled with: the request's, else the checkpoint's
    generation_config.json defaults, else 1.0 (as vLLM reports them; was: null), in every body of a stream too."""
    import shutil

    from openai.types.responses import Response

    from helpers.server import ServerProc
    from kda_rt.demo import demo_path

    def echoed(srv, **given):
        body = {"input": "Hi", "max_output_tokens": 2, **given}
        r = httpx.post(srv.url + "/v1/responses", headers=srv.headers, timeout=60, json=body)
        assert r.status_code == 200, r.text
        Response.model_validate(r.json())
        bodies = [e["response"] for e in _events(srv, body) if "response" in e]
        assert len(bodies) == 3 and all((b["temperature"], b["top_p"]) == (r.json()["temperature"], r.json()["top_p"])
                                        for b in bodies)
        return r.json()["temperature"], r.json()["top_p"]

    assert echoed(server, temperature=0.7, top_p=0.9) == (0.7, 0.9)
    assert echoed(server) == (1.0, 1.0)  # (the demo checkpoint has no generation_config.json)
    for f in demo_path().iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.8}))
    srv = ServerProc(tmp_path / "s.log", "--model", str(tmp_path))
    try:
        assert echoed(srv) == (0.6, 0.8)
        assert echoed(srv, temperature=0.0) == (0.0, 0.8)
    finally:
        assert srv.stop() == 0, srv.log()


def test_output_text_logprobs(server, client):
    """include ["message.output_text.logprobs"] with top_logprobs: the output_text part's logprobs are chat's for the
    same conversation (one entry a token, each with top_logprobs entries), top_logprobs is echoed; streamed, the text
    deltas carry them in order (vLLM's event shape) and the final response equals the one answered without a stream.
    Without include: none (was: include and top_logprobs ignored)."""
    import pydantic
    from openai.types.responses import Response, ResponseStreamEvent

    include = ["message.output_text.logprobs"]
    body = {"model": "demo", "input": "Name a prime.", "max_output_tokens": 6, "temperature": 0.0, "ignore_eos": True,
            "include": include, "top_logprobs": 2}
    r = httpx.post(server.url + "/v1/responses", headers=server.headers, timeout=60, json=body)
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())
    part = r.json()["output"][0]["content"][0]
    chat = client.chat.completions.create(model="demo", max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=2,
                                          messages=[{"role": "user", "content": "Name a prime."}],
                                          extra_body={"ignore_eos": True})
    assert part["text"] == chat.choices[0].message.content and r.json()["top_logprobs"] == 2
    assert part["logprobs"] == [e.model_dump() for e in chat.choices[0].logprobs.content]
    assert len(part["logprobs"]) == 6 and all(len(e["top_logprobs"]) == 2 for e in part["logprobs"])
    short = [{"token": e["token"], "logprob": e["logprob"],
              "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
             for e in part["logprobs"]]
    events = _events(server, body)
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event)
    sent = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    assert sent == short[:len(sent)] and len(sent) >= 1  # (a last token that writes no text is in the done event)
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == short
    assert _same_answer(events[-1]["response"]) == _same_answer(r.json())
    resp = client.responses.create(model="demo", input="Name a prime.", max_output_tokens=3, include=include,
                                   top_logprobs=0, extra_body={"seed": 3})
    assert len(resp.output[0].content[0].logprobs) == 3 and resp.top_logprobs == 0
    assert all(e.top_logprobs == [] for e in resp.output[0].content[0].logprobs)
    with client.responses.stream(model="demo", input="Name a prime.", max_output_tokens=3, include=include,
                                 top_logprobs=1, extra_body={"seed": 3}) as stream:
        final = stream.get_final_response()
    assert len(final.output[0].content[0].logprobs) == 3 and final.top_logprobs == 1
    plain = httpx.post(server.url + "/v1/responses", headers=server.headers, timeout=60,
                       json={**body, "include": None}).json()
    assert "logprobs" not in plain["output"][0]["content"][0] and plain["top_logprobs"] is None
    events = _events(server, {**body, "include": []})
    assert all(e["logprobs"] == [] for e in events if e["type"] == "response.output_text.delta")


def test_reasoning_items_become_the_assistant_turns_reasoning():
    """Reasoning items sent back (an earlier response's output) are the `reasoning` of their turn's assistant
    message, as vLLM renders them: joining the message before them, or starting one its text and calls join
    (was: a 400); the chat request keeps an assistant message's reasoning for the template (was: dropped)."""
    from kda_rt.server.protocol import ChatCompletionRequest, chat_payload
    from kda_rt.server.responses_api import ResponsesRequest, chat_request

    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    items = [{"role": "user", "content": "q"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "r1"}]},
             call, {"type": "function_call_output", "call_id": "c1", "output": "out"},
             {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "s2"},
                                                             {"type": "summary_text", "text": "s3"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
             {"type": "message", "role": "assistant", "content": "b"},
             {"type": "reasoning", "id": "rs_3", "summary": []}]
    messages = chat_request(ResponsesRequest(input=items)).messages
    fn = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert messages == [{"role": "user", "content": "q"},
                        {"role": "assistant", "content": None, "reasoning": "r1", "tool_calls": [fn]},
                        {"role": "tool", "tool_call_id": "c1", "content": "out"},
                        {"role": "assistant", "content": "a", "reasoning": "s2\ns3"},
                        {"role": "assistant", "content": "b", "reasoning": ""}]
    payload = chat_payload(chat_request(ResponsesRequest(input=items)))
    assert [m.get("reasoning") for m in payload["messages"]] == [None, "r1", None, "s2\ns3", ""]
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "q", "reasoning": "not a turn's"},
                                           {"role": "assistant", "content": "a", "reasoning_content": "r"}])
    assert chat_payload(chat)["messages"] == [{"role": "user", "content": "q"},
                                              {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    # a reasoning value that is no string is passed over, as before this reached the template (older clients)
    odd = ChatCompletionRequest(messages=[{"role": "assistant", "content": "a", "reasoning": ["r"], "thinking": "t"}])
    assert chat_payload(odd)["messages"] == [{"role": "assistant", "content": "a", "thinking": "t"}]


def test_reasoning_items_answer_as_chat(server, client):
    """A conversation with a reasoning item answers as chat answers the same messages, the reasoning on the
    assistant's message."""
    items = [{"role": "user", "content": "Name a prime."},
             {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Two is prime."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "2",
                                                                   "annotations": []}]},
             {"role": "user", "content": "Another."}]
    resp = client.responses.create(model="demo", input=items, max_output_tokens=6, temperature=0.0,
                                   extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(model="demo", max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True},
                                          messages=[items[0], {"role": "assistant", "content": "2",
                                                               "reasoning": "Two is prime."}, items[3]])
    assert resp.output_text == chat.choices[0].message.content
