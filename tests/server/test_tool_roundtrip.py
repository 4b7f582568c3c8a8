"""Tool calling through the `openai` client (issue 13 #1 Done-when): declare -> call parsed ->
tool result in the history -> next turn, non-streaming and streaming.  The app runs in-process
over a fake engine that renders prompts with the real demo tokenizer and "generates" a scripted
output (the demo model has random weights, so a real one never calls a tool on purpose)."""

from __future__ import annotations

import asyncio
import json

import pytest

openai = pytest.importorskip("openai", reason="needs the test extra (openai)")
httpx = pytest.importorskip("httpx")

from kda_rt.demo import demo_path  # noqa: E402
from kda_rt.server.app import ServerState, build_app  # noqa: E402
from kda_rt.text.detokenizer import IncrementalDetokenizer  # noqa: E402
from kda_rt.text.tokenizer import Tokenizer  # noqa: E402
from kda_rt.text.tool_parser import tool_prefix_ids  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = ("I'll check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
ANSWER = "It is 22 C and sunny in Paris."
OPENING = ({"role": "developer", "content": "Use tools when needed."},
           {"role": "user", "content": "What is the weather in Paris?"})


class FakeEngine:
    """Stands in for `EngineClient`: the prompt goes through the real tokenizer exactly as the engine
    process does it; the output is the next scripted text, one token per delta."""

    alive, stalled, dead_reason, pid = True, False, None, 0
    info = {"max_model_len": 4096}

    def __init__(self) -> None:
        self.tok = Tokenizer.from_dir(demo_path())
        self.script: list[str] = []
        self.prompts: list[list[int]] = []
        self.payloads: list[dict] = []
        self.queues: dict = {}  # (EngineClient's requests being added or running: the server checks ids against it)
        self.finish = "stop"  # the last delta's finish_reason ("length": max_tokens cut the script)

    async def add(self, rid, payload):
        self.payloads.append(payload)
        ids = self.tok.encode_chat(payload["messages"], tools=payload["tools"],
                                   chat_template_kwargs=payload["chat_template_kwargs"])
        ids += tool_prefix_ids(self.tok, payload["tool_mode"])
        self.prompts.append(ids)
        out = self.tok.encode(self.script.pop(0), allow_special=True)
        params = payload["params"]
        detok = IncrementalDetokenizer(self.tok, skip_special_tokens=params["skip_special_tokens"],
                                       spaces_between_special_tokens=params["spaces_between_special_tokens"],
                                       prompt_token_ids=ids)
        queue: asyncio.Queue = asyncio.Queue()
        for k, token in enumerate(out):
            last = k == len(out) - 1
            text = detok.add([token]) + (detok.flush() if last else "")
            queue.put_nowait({"id": rid, "finished": last, "outputs": [
                {"index": 0, "text": text, "token_ids": [token], "logprobs": None,
                 "finish_reason": (self.finish if last else None), "stop_reason": None}]})
        queue.put_nowait(None)
        return queue, {"prompt_tokens": len(ids), "prompts": [{"num_tokens": len(ids)}]}

    async def wait(self, awaitable, what):
        return await awaitable

    def abort(self, rid):
        pass

    async def stats(self):
        return {}


def _client(engine: FakeEngine, auto_tools: bool = True):
    app = build_app(ServerState(engine, "demo", auto_tools=auto_tools))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kda-rt.test")
    return openai.AsyncOpenAI(base_url="http://kda-rt.test/v1", api_key="x", http_client=http, max_retries=0)


async def _turn(client, messages, stream: bool, **kw):
    if not stream:
        res = await client.chat.completions.create(model="demo", messages=messages, tools=TOOLS, **kw)
        choice = res.choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, reason = "", {}, None
    async for chunk in await client.chat.completions.create(model="demo", messages=messages, tools=TOOLS, stream=True,
                                                            **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, [None, None, ""])
                if tc.id:
                    entry[0], entry[1] = tc.id, tc.function.name
                entry[2] += tc.function.arguments or ""
            reason = choice.finish_reason or reason
    return content or None, [tuple(v) for _, v in sorted(calls.items())], reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_round_trip(stream):
    async def run():
        engine = FakeEngine()
        engine.script = [CALL, ANSWER]
        client = _client(engine)
        messages = [dict(m) for m in OPENING]
        content, calls, reason = await _turn(client, messages, stream)
        assert content == "I'll check."
        assert calls == [("functions.get_weather:0", "get_weather", '{"city": "Paris"}')]
        assert reason == "tool_calls"
        assert json.loads(calls[0][2]) == {"city": "Paris"}
        assert engine.payloads[0]["params"]["skip_special_tokens"] is False  # markers reach the parser
        # unspaced: no space after the prompt's <|im_middle|> in the content (vLLM skips that marker)
        assert engine.payloads[0]["params"]["spaces_between_special_tokens"] is False
        # the tool result goes back in the history, the model answers
        messages += [{"role": "assistant", "content": content, "tool_calls": [
                          {"id": calls[0][0], "type": "function",
                           "function": {"name": calls[0][1], "arguments": calls[0][2]}}]},
                     {"role": "tool", "tool_call_id": calls[0][0], "content": "22 C, sunny"}]
        content, calls, reason = await _turn(client, messages, stream)
        assert (content, calls, reason) == (ANSWER, [], "stop")
        # the second prompt holds the call (as control tokens) and the result (as text)
        tok, prompt = engine.tok, engine.prompts[1]
        expect = tok.encode_chat([{"role": "system", "content": "Use tools when needed."}, messages[1],
                                  {**messages[2], "content": "I'll check."}, messages[3]], tools=TOOLS)
        assert prompt == expect
        for marker in ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_end|>"):
            assert prompt.count(tok.token_to_id(marker)) == 1
        assert "## Return of functions.get_weather:0\n22 C, sunny" in tok.decode(prompt)
        assert len(prompt) > len(engine.prompts[0]) + 20
        await client.close()

    asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_cut_call_is_length_and_kept(stream):
    """max_tokens cutting the second call: both modes give the first call whole and the second as far as it got,
    with finish_reason "length" (was: not streamed, the cut call dropped; streamed, reported as "tool_calls")."""
    cut = CALL.replace("<|tool_calls_section_end|>", "") + ("<|tool_call_begin|>functions.get_weather:1"
                                                            '<|tool_call_argument_begin|>{"city":')

    async def run():
        engine = FakeEngine()
        engine.script, engine.finish = [cut], "length"
        client = _client(engine)
        content, calls, reason = await _turn(client, [dict(m) for m in OPENING], stream)
        assert (content, reason) == ("I'll check.", "length")
        assert calls == [("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
                         ("functions.get_weather:1", "get_weather", '{"city":')]
        await client.close()

    asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_call_without_end_markers_is_kept(stream):
    """The model stopping right after a call's arguments, with no `<|tool_call_end|>` nor section end: streamed or
    not, the call comes whole with finish_reason "tool_calls" (was: not streamed, no call and "stop", while the stream
    sent the call)."""
    async def run():
        engine = FakeEngine()
        engine.script = [CALL.replace("<|tool_call_end|><|tool_calls_section_end|>", "")]
        client = _client(engine)
        content, calls, reason = await _turn(client, [dict(m) for m in OPENING], stream)
        assert (content, calls, reason) == ("I'll check.", [("functions.get_weather:0", "get_weather",
                                                             '{"city": "Paris"}')], "tool_calls")
        await client.close()

    asyncio.run(run())


def test_special_tokens_spaced_without_tools():
    """A chat request with skip_special_tokens=False and no tool parsing gets vLLM's spaced text (its default
    spaces_between_special_tokens=True: the prompt ends in <|im_middle|>, so the content starts with a space);
    spaces_between_special_tokens=False joins them, and the default skip_special_tokens=True drops them."""
    async def run():
        engine = FakeEngine()
        engine.script = ["Hi<|im_user|>there"] * 3
        client = _client(engine, auto_tools=False)
        msgs = [{"role": "user", "content": "Say hi"}]

        async def text(**extra):
            res = await client.chat.completions.create(model="demo", messages=msgs, extra_body=extra)
            return res.choices[0].message.content

        assert await text(skip_special_tokens=False) == " Hi <|im_user|> there"
        assert await text(skip_special_tokens=False, spaces_between_special_tokens=False) == "Hi<|im_user|>there"
        assert await text() == "Hithere"
        assert [p["params"]["spaces_between_special_tokens"] for p in engine.payloads] == [True, False, True]
        await client.close()

    asyncio.run(run())


def test_named_function_and_none():
    async def run():
        engine = FakeEngine()
        engine.script = ['{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>', CALL]
        client = _client(engine, auto_tools=False)  # named and none need no --enable-auto-tool-choice
        msgs = [{"role": "user", "content": "Weather in Oslo?"}]
        named = {"type": "function", "function": {"name": "get_weather"}}
        content, calls, reason = await _turn(client, msgs, False, tool_choice=named)
        assert (content, calls, reason) == (None, [("functions.get_weather:0", "get_weather", '{"city": "Oslo"}')],
                                            "tool_calls")
        tok = engine.tok
        assert engine.prompts[0][-1] == tok.token_to_id("<|tool_call_argument_begin|>")  # the call was forced
        content, calls, reason = await _turn(client, msgs, False, tool_choice="none")
        assert calls == [] and reason == "stop" and content.startswith("I'll check.")  # no parsing, markers skipped
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            await _turn(client, msgs, False, tool_choice="auto")
        with pytest.raises(openai.BadRequestError, match="not in tools"):
            await _turn(client, msgs, False, tool_choice={"type": "function", "function": {"name": "nope"}})
        await client.close()

    asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_named_function_id_counts_the_history(stream):
    """A named function's forced header continues the conversation's call count, as Kimi numbers calls (vLLM's
    kimi_k2 ids: functions.NAME:<calls in the history>): after one call in the history the forced call is
    `functions.get_weather:1` (was: `:0` again, the same id as the earlier call whose result is in the prompt)."""
    async def run():
        engine = FakeEngine()
        engine.script = ['{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>']
        client = _client(engine, auto_tools=False)
        history = [dict(m) for m in OPENING] + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "functions.get_weather:0", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "22 C, sunny"},
            {"role": "user", "content": "And Rome?"}]
        named = {"type": "function", "function": {"name": "get_weather"}}
        content, calls, reason = await _turn(client, history, stream, tool_choice=named)
        assert (content, calls, reason) == (None, [("functions.get_weather:1", "get_weather", '{"city": "Rome"}')],
                                            "tool_calls")
        tok = engine.tok
        header = tok.encode("functions.get_weather:1") + [tok.token_to_id("<|tool_call_argument_begin|>")]
        assert engine.prompts[0][-len(header):] == header
        await client.close()

    asyncio.run(run())


def test_parallel_tool_calls_false():
    async def run():
        engine = FakeEngine()
        two = CALL.replace("<|tool_calls_section_end|>", "<|tool_call_begin|>functions.get_weather:1"
                           '<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>')
        engine.script = [two, two, two]
        client = _client(engine)
        msgs = [{"role": "user", "content": "Paris and Rome?"}]
        assert len((await _turn(client, msgs, False))[1]) == 2
        assert [c[2] for c in (await _turn(client, msgs, False, parallel_tool_calls=False))[1]] == ['{"city": "Paris"}']
        assert [c[2] for c in (await _turn(client, msgs, True, parallel_tool_calls=False))[1]] == ['{"city": "Paris"}']
        await client.close()

    asyncio.run(run())



@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_responses_api_round_trip(stream):
    """The same round trip over /v1/responses: flat function tools; the call comes back as a function_call item
    after the message; the message, function_call and function_call_output input items give the chat round trip's
    prompt (the calls join the assistant message before them, one turn)."""
    flat = [{"type": "function", **TOOLS[0]["function"]}]

    async def turn(client, items):
        if not stream:
            return await client.responses.create(model="demo", input=items, tools=flat)
        async with client.responses.stream(model="demo", input=items, tools=flat) as s:
            kinds = [e.type async for e in s]
            final = await s.get_final_response()
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        if final.output and final.output[-1].type == "function_call":
            assert "response.function_call_arguments.delta" in kinds
            assert "response.function_call_arguments.done" in kinds
        return final

    async def run():
        engine = FakeEngine()
        engine.script = [CALL, ANSWER]
        client = _client(engine)
        items = [dict(m) for m in OPENING]
        first = await turn(client, items)
        assert [o.type for o in first.output] == ["message", "function_call"]
        assert first.output[0].content[0].text == "I'll check."
        call = first.output[1]
        assert (call.call_id, call.name, json.loads(call.arguments)) == ("functions.get_weather:0", "get_weather",
                                                                         {"city": "Paris"})
        items += [{"role": "assistant", "content": "I'll check."},
                  {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                  {"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"}]
        second = await turn(client, items)
        assert second.output_text == ANSWER and [o.type for o in second.output] == ["message"]
        chat = [{"role": "system", "content": "Use tools when needed."}, items[1],
                {"role": "assistant", "content": "I'll check.", "tool_calls": [
                    {"id": call.call_id, "type": "function", "function": {"name": "get_weather",
                                                                         "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "22 C, sunny"}]
        assert engine.prompts[1] == engine.tok.encode_chat(chat, tools=TOOLS)  # the chat round trip's prompt
        await client.close()

    asyncio.run(run())



@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_responses_api_cut_call_is_incomplete(stream):
    """max_output_tokens cutting a call: the response is incomplete, and its last item (the cut call) is incomplete
    while the ones before it are completed, streamed or not (was: the cut call dropped when not streamed); streamed,
    each item's done events come before the next item opens."""
    flat = [{"type": "function", **TOOLS[0]["function"]}]
    cut = ("I'll check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
           '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1'
           '<|tool_call_argument_begin|>{"city":')

    async def run():
        engine = FakeEngine()
        engine.script, engine.finish = [cut], "length"
        client = _client(engine)
        if not stream:
            resp = await client.responses.create(model="demo", input="Paris and Rome?", tools=flat)
        else:
            async with client.responses.stream(model="demo", input="Paris and Rome?", tools=flat) as s:
                events = [e async for e in s]
                resp = await s.get_final_response()
            order = [(e.type, getattr(e, "output_index", None)) for e in events
                     if e.type in ("response.output_item.added", "response.output_item.done")]
            assert order == [("response.output_item.added", 0), ("response.output_item.done", 0),
                             ("response.output_item.added", 1), ("response.output_item.done", 1),
                             ("response.output_item.added", 2), ("response.output_item.done", 2)]
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
        statuses = [o.status for o in resp.output]
        assert statuses == ["completed", "completed", "incomplete"]
        assert [o.arguments for o in resp.output[1:]] == ['{"city": "Paris"}', '{"city":']
        await client.close()

    asyncio.run(run())


def test_responses_api_tool_fields_named():
    """Responses tools are flat: their errors name Responses fields (chat's checks too: text.format, not
    response_format); parallel_tool_calls may be null."""
    async def run():
        engine = FakeEngine()
        engine.script = [ANSWER]
        client = _client(engine)
        ok = await client.responses.create(model="demo", input="hi", extra_body={"parallel_tool_calls": None})
        assert ok.parallel_tool_calls is True
        for tools, needle in (([{"type": "function", "name": "f", "parameters": "x"}], "tools[0].parameters"),
                              ([{"type": "function", "name": "f"}] * 2, "tools[1].name"),
                              ([{"type": "function", "name": ""}], "tools[0].name")):
            with pytest.raises(openai.BadRequestError, match=needle.replace("[", "\\[").replace("]", "\\]")):
                await client.responses.create(model="demo", input="hi", tools=tools)
        with pytest.raises(openai.BadRequestError, match="cannot be combined with text.format"):
            await client.responses.create(model="demo", input="hi", tools=[{"type": "function", "name": "f"}],
                                          tool_choice="required", text={"format": {"type": "json_object"}})
        await client.close()

    asyncio.run(run())


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
