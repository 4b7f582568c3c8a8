"""Error statuses and the OpenAI error envelope: 400 (naming the numbers), 401, 404, 413, 429."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from helpers.server import MAX_MODEL_LEN, ServerProc


def _post(server, path, body=None, content=None, headers=None):
    return httpx.post(server.url + path, json=body, content=content, headers=server.headers if headers is None else headers, timeout=60)


def _envelope(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == status and isinstance(err["type"], str)
    return err["message"]


def test_prompt_over_max_model_len_names_both_numbers(server):
    msg = _envelope(_post(server, "/v1/completions", {"prompt": list(range(300)), "max_tokens": 4}), 400)
    assert "300" in msg and str(MAX_MODEL_LEN) in msg
    msg = _envelope(_post(server, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1000}), 400)
    assert "1000" in msg and str(MAX_MODEL_LEN) in msg
    # OpenAI's and vLLM's phrase, which LiteLLM and LangChain match to tell a context overflow from other 400s
    assert msg.startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens")


@pytest.mark.parametrize("body, word", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "seed": 2**70}, "seed"),
    ({"prompt": "x", "metadata": 3}, "metadata"),
    ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, "include_usage"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [99999]}, "99999"),
    ({"prompt": ""}, "empty"),
    ({"prompt": ["a", ""]}, "prompt[1]"),
    ({"prompt": "x", "logit_bias": {"5": 101.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"a": 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999": 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias"),
    ({"prompt": "x", "stop_token_ids": [5, 99999]}, "stop_token_ids holds 99999, outside the vocabulary [0, "),
    ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
    ({"prompt": "x", "response_format": {"json_schema": {"schema": {}}}}, "response_format.type is required"),
    ({"prompt": "x", "response_format": {"type": "json_schema",
                                         "json_schema": {"name": "s", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "s"}}},
     "response_format.json_schema.schema"),
    ({"prompt": "x", "guided_regex": "[a-"}, "guided_regex"),
    ({"prompt": "x", "guided_choice": []}, "choice"),
    ({"prompt": "x", "structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar"),
    ({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"xml": "a"}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"json_object": 1}}, "structured_outputs.json_object must be a bool"),
    ({"prompt": "x", "structured_outputs": {"regex": "a", "json_object": 0}}, "structured_outputs.json_object"),
    ({"prompt": "x", "guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format, guided_regex"),
], ids=["type", "range", "n", "max_tokens", "seed", "known-field-bad-value", "nested-bad-value", "mixed-prompt",
        "token-id", "empty", "empty-in-batch", "logit-bias-range", "logit-bias-key", "logit-bias-vocab",
        "logit-bias-count", "stop-token-id-vocab", "response-format-type", "response-format-no-type",
        "json-schema-invalid", "json-schema-missing", "guided-regex", "guided-choice-empty", "grammar-invalid",
        "two-kinds", "unknown-kind", "json-object-int", "json-object-zero", "two-sources"])
def test_invalid_completion_is_400(server, body, word):
    assert word in _envelope(_post(server, "/v1/completions", body), 400)


def test_lone_surrogate_escape_is_named(server):
    """A high-surrogate escape with no low one after it is a 400 saying so (was: msgspec's "Input data was
    truncated" or "unexpected end of hex escape"); an escaped backslash before `ud800` is text, and a truncated body
    still says truncated."""
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/invocations"):
        for body in (rb'{"prompt": "a\ud800b", "messages": []}', rb'{"messages": [], "prompt": "a\uD83D"}'):
            msg = _envelope(_post(server, path, content=body), 400)
            assert "invalid unicode escape \\u" in msg and "(a lone surrogate" in msg, (path, body, msg)
    assert _post(server, "/v1/completions", {"prompt": "a\\ud800", "max_tokens": 1}).status_code == 200
    assert "truncated" in _envelope(_post(server, "/v1/completions", content=rb'{"prompt": "a\\ud800'), 400)


def test_null_max_tokens_fills_the_context(server):
    """A completion's `"max_tokens": null` generates up to the context, as vLLM's (was: the default 16, and a prompt of
    max_model_len - 4 tokens a 400 naming a max_tokens (16) the client never sent)."""
    prompt = list(range(40, 40 + MAX_MODEL_LEN - 4))
    r = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4 and r.json()["choices"][0]["finish_reason"] == "length"
    r = _post(server, "/v1/completions", {"prompt": "ab", "ignore_eos": True})  # left out: still OpenAI's 16
    assert r.json()["usage"]["completion_tokens"] == 16, r.text


def test_min_tokens_past_the_room_is_400(server):
    """min_tokens over the room the prompt leaves, with max_tokens left out, is a 400 naming both, as vLLM's (was: a
    200 that stopped at the context with fewer tokens than min_tokens asked for)."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 900}
    msg = _envelope(_post(server, "/v1/chat/completions", chat), 400)
    assert "min_tokens (900)" in msg and str(MAX_MODEL_LEN) in msg
    msg = _envelope(_post(server, "/v1/completions", {"prompt": [7] * 200, "max_tokens": None, "min_tokens": 57}), 400)
    assert "min_tokens (57)" in msg and "max_tokens (56" in msg
    r = _post(server, "/v1/completions", {"prompt": [7] * 200, "max_tokens": None, "min_tokens": 56})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 56, r.text


def test_invalid_chat_is_400(server):
    _envelope(_post(server, "/v1/chat/completions", {"messages": []}), 400)
    _envelope(_post(server, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}), 400)
    _envelope(_post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image"}]}]}), 400)
    _envelope(_post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}), 400)


def test_auth(server):
    _envelope(_post(server, "/v1/completions", {"prompt": "x"}, headers={}), 401)
    _envelope(_post(server, "/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer nope"}), 401)
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [7]}), ("/invocations", {"prompt": "x"})):
        _envelope(_post(server, path, body, headers={}), 401)  # (guarded too: more than vLLM's /v1 only, as documented)
    assert httpx.get(server.url + "/health").status_code == 200  # health, load, version and metrics need no key
    for path in ("/metrics", "/load", "/version"):
        assert httpx.get(server.url + path).status_code == 200, path


def test_unknown_model_is_404(server):
    assert "gpt-9" in _envelope(_post(server, "/v1/completions", {"prompt": "x", "model": "gpt-9"}), 404)


def test_body_over_cap_is_413(server):
    big = b'{"prompt": "' + b"a" * (10 * 1024 * 1024) + b'"}'
    _envelope(_post(server, "/v1/completions", content=big), 413)
    assert httpx.get(server.url + "/health").status_code == 200


def test_waiting_queue_full_is_429(tmp_path):
    srv = ServerProc(tmp_path / "server.log", "--max-num-seqs", "1", "--max-waiting", "1")
    try:
        long = {"prompt": "a", "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True, "temperature": 0.0}
        started = threading.Event()
        results = []

        def run_stream():
            with httpx.stream("POST", srv.url + "/v1/completions", json={**long, "stream": True}, headers=srv.headers,
                              timeout=120) as r:
                for _ in r.iter_lines():
                    started.set()
            results.append(r.status_code)

        def run_plain():
            results.append(httpx.post(srv.url + "/v1/completions", json=long, headers=srv.headers, timeout=120).status_code)

        running = threading.Thread(target=run_stream)
        running.start()
        assert started.wait(60)  # the first request runs (one slot)
        waiting = threading.Thread(target=run_plain)
        waiting.start()
        deadline = time.monotonic() + 30
        while srv.metrics().get("kda_rt:num_requests_waiting", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert time.monotonic() < deadline, "the second request never showed as waiting"
        full = httpx.post(srv.url + "/v1/completions", json=long, headers=srv.headers, timeout=60)
        assert "max_waiting 1" in _envelope(full, 429) and full.headers["retry-after"] == "1"
        running.join(120)
        waiting.join(120)
        assert results == [200, 200]
    finally:
        assert srv.stop() == 0, srv.log()


def test_vllm_command_line_and_model_names(tmp_path):
    """vLLM's serve line runs (--trust-remote-code, --dtype auto, --chat-template FILE); --served-model-name takes
    aliases, all listed, the first in responses; any other name is 404.  Without the flag the directory's name is listed and the --model
    argument as given is accepted too (vLLM's default name), e.g. a client copying the launch line."""
    from kda_rt.demo import demo_path

    srv = ServerProc(tmp_path / "a.log", "--served-model-name", "kimi", "org/Kimi-Linear", "--trust-remote-code",
                     "--dtype", "auto", "--allowed-origins", "https://ui.example")
    try:
        pre = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization,content-type"}
        r = httpx.options(srv.url + "/v1/chat/completions", headers=pre, timeout=10)  # a browser's preflight
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
        r = httpx.options(srv.url + "/v1/chat/completions", headers={**pre, "Origin": "https://evil.example"},
                          timeout=10)
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = httpx.get(srv.url + "/v1/models", headers=srv.headers, timeout=10).json()
        assert [m["id"] for m in r["data"]] == ["kimi", "org/Kimi-Linear"]
        for name in ("kimi", "org/Kimi-Linear", None):
            body = {"prompt": "a", "max_tokens": 1, **({"model": name} if name else {})}
            r = httpx.post(srv.url + "/v1/completions", json=body, headers=srv.headers, timeout=60)
            assert r.status_code == 200 and r.json()["model"] == "kimi", r.text
        bad = {"prompt": "a", "max_tokens": 1, "model": "demo"}
        assert "'demo' does not exist" in _envelope(httpx.post(srv.url + "/v1/completions", json=bad,
                                                               headers=srv.headers, timeout=60), 404)
    finally:
        assert srv.stop() == 0, srv.log()
    path = str(demo_path())
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<|im_user|>{{ m['content'] }}<|im_end|>{% endfor %}")
    srv = ServerProc(tmp_path / "b.log", "--model", path, "--chat-template", str(template))
    try:
        r = httpx.post(srv.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]},
                       headers=srv.headers, timeout=10).json()
        from kda_rt.text.tokenizer import Tokenizer

        want = Tokenizer.from_dir(path).encode("<|im_user|>hi<|im_end|>", allow_special=True)
        assert r["tokens"] == want  # the given template, not the checkpoint's
        r = httpx.get(srv.url + "/v1/models", headers=srv.headers, timeout=10).json()
        assert [m["id"] for m in r["data"]] == [os.path.basename(path)]
        r = httpx.post(srv.url + "/v1/chat/completions", headers=srv.headers, timeout=60,
                       json={"model": path, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == os.path.basename(path), r.text
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize(("fn", "needle"), [
    ({"name": "f", "parameters": "x"}, "parameters must be a JSON schema object"),
    ({"name": "f", "parameters": 5}, "parameters must be a JSON schema object"),
    ({"name": "f", "parameters": [["type", "string"]]}, "parameters must be a JSON schema object"),
    ({"name": ""}, "non-empty name"),
    ({"name": "List<int>"}, "must not contain '<'"),
])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}, "none"])
def test_bad_tool_definitions_are_400(server, fn, needle, choice):
    """A tool whose parameters are not a schema object, or whose name is empty, is a 400 naming the field with any
    tool_choice (was: a 500 from the grammar builder under required / a named function, and a list of pairs
    silently read as a schema); a duplicate name too.  A name with '<' cannot end a call header (was: every call to
    it, forced ones included, dropped: content null and tool_calls [])."""
    body = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1, "tools": [{"type": "function",
                                                                                           "function": fn}]}
    assert needle in _envelope(_post(server, "/v1/chat/completions", {**body, "tool_choice": choice}), 400)
    twice = {**body, "tools": [{"type": "function", "function": {"name": "g"}}] * 2}
    assert "name of its own" in _envelope(_post(server, "/v1/chat/completions", twice), 400)
    assert _post(server, "/v1/chat/completions", {"messages": body["messages"], "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "bad"}}])
def test_bad_tool_schema_names_the_tool(server, choice):
    """A tool's `parameters` schema that does not compile is a 400 naming its index and function (was:
    `tools[].function.parameters`, which of them not said)."""
    pytest.importorskip("llguidance")
    tools = [{"type": "function", "function": {"name": n, "parameters": p}}
             for n, p in (("ok", {"type": "object"}), ("bad", {"type": "foo"}))]
    body = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1, "tools": tools, "tool_choice": choice}
    msg = _envelope(_post(server, "/v1/chat/completions", body), 400)
    assert msg.startswith("tools[1].function.parameters (function 'bad') is invalid"), msg


def test_operational_flags(tmp_path, monkeypatch):
    """--disable-log-stats silences the periodic throughput line (here due every 0.05 s; test_scoring's log test sees
    it without the flag), --uvicorn-log-level warning drops uvicorn's INFO start line (which that test sees at
    info); $VLLM_API_KEY sets the key as $KDA_RT_API_KEY does.  --root-path only changes the URLs the app builds
    (a proxy strips the prefix before the request arrives): the API answers as before, and a 404 names the path
    as sent, not the root path put in front again."""
    monkeypatch.setenv("KDA_RT_LOG_STATS_INTERVAL", "0.05")
    monkeypatch.delenv("KDA_RT_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "vk")
    srv = ServerProc(tmp_path / "a.log", "--disable-log-stats", "--root-path", "/api", "--uvicorn-log-level", "warning",
                     api_key=None)
    try:
        body = {"prompt": "a", "max_tokens": 30, "ignore_eos": True}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 401
        r = httpx.post(srv.url + "/v1/completions", json=body, headers={"Authorization": "Bearer vk"}, timeout=60)
        assert r.status_code == 200, r.text
        assert _envelope(httpx.get(srv.url + "/nope", timeout=10), 404) == "no route /nope"
    finally:
        assert srv.stop() == 0, srv.log()
    assert "prompt throughput" not in srv.log() and "Uvicorn running" not in srv.log()



def test_generation_config_defaults_served(tmp_path):
    """The checkpoint's generation_config.json sets the server's defaults (vLLM's --generation-config auto): a chat
    without max_tokens stops at max_new_tokens; a request's own value wins; --generation-config vllm ignores them."""
    import json
    import shutil

    from kda_rt.demo import demo_path

    for f in demo_path().iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 2, "temperature": 0.0}))
    chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    for extra, want in (((), 2), (("--generation-config", "vllm"), None)):
        srv = ServerProc(tmp_path / "s.log", "--model", str(tmp_path), *extra)
        try:
            r = httpx.post(srv.url + "/v1/chat/completions", json=chat, headers=srv.headers, timeout=60).json()
            if want is None:
                assert r["usage"]["completion_tokens"] > 2
            else:
                assert r["usage"]["completion_tokens"] == want
                r = httpx.post(srv.url + "/v1/chat/completions", json={**chat, "max_tokens": 4}, headers=srv.headers,
                               timeout=60).json()
                assert r["usage"]["completion_tokens"] == 4
        finally:
            assert srv.stop() == 0, srv.log()
    # --generation-config DIR: its max_new_tokens caps a request's own max_tokens too (vLLM's override_max_tokens);
    # a min_tokens past the cap is refused
    gen_dir = tmp_path / "gen"
    gen_dir.mkdir()
    (gen_dir / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "temperature": 0.0}))
    srv = ServerProc(tmp_path / "s.log", "--model", str(tmp_path), "--generation-config", str(gen_dir))
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", json={**chat, "max_tokens": 5}, headers=srv.headers,
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        r = httpx.post(srv.url + "/v1/chat/completions", json={**chat, "max_tokens": 5, "min_tokens": 5},
                       headers=srv.headers, timeout=60)
        assert r.status_code == 400 and "min_tokens" in r.text, r.text
    finally:
        assert srv.stop() == 0, srv.log()
    # a max_new_tokens past the context is capped to each prompt's room (was: every such request a 400)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 100000, "temperature": 0.0}))
    srv = ServerProc(tmp_path / "s.log", "--model", str(tmp_path))
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", json=chat, headers=srv.headers, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] <= 256, r.text
        r = httpx.post(srv.url + "/v1/responses", json={"input": "hi"}, headers=srv.headers, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        assert srv.stop() == 0, srv.log()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
