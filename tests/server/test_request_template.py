"""A chat request's own `chat_template` (vLLM's field): refused by name unless the server runs with
`--trust-request-chat-template` (vLLM's flag), then rendered for that request alone, on chat completions and
/tokenize, in the same sandbox as the checkpoint's template."""

from __future__ import annotations

import httpx
import pytest

from helpers.server import ServerProc

TEMPLATE = ("{% for m in messages %}<|im_user|>{{ m.role }}:{{ m['content'] }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_assistant|>{% endif %}")
MESSAGES = [{"role": "user", "content": "Tell me about the lighthouse."}]


@pytest.fixture(scope="module")
def trusting_server(tmp_path_factory):
    srv = ServerProc(tmp_path_factory.mktemp("template") / "server.log", "--trust-request-chat-template")
    yield srv
    assert srv.stop() == 0, srv.log()


def _post(srv, path, body):
    return httpx.post(srv.url + path, headers=srv.headers, timeout=120.0, json={"model": "demo", **body})


def test_untrusted_server_refuses_a_requests_template(server):
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
                       ("/tokenize", {"messages": MESSAGES})):
        r = _post(server, path, {**body, "chat_template": TEMPLATE})
        assert r.status_code == 400, r.text
        assert "--trust-request-chat-template is not set" in r.json()["error"]["message"], r.text
        assert _post(server, path, {**body, "chat_template": None}).status_code == 200


def test_trusting_server_renders_the_requests_template(trusting_server):
    from kda_rt.demo import demo_path
    from kda_rt.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(demo_path())
    want = tok.encode_chat(MESSAGES, chat_template=TEMPLATE)
    assert want != tok.encode_chat(MESSAGES)
    r = _post(trusting_server, "/tokenize", {"messages": MESSAGES, "chat_template": TEMPLATE})
    assert r.status_code == 200 and r.json()["tokens"] == want, r.text
    assert _post(trusting_server, "/tokenize", {"messages": MESSAGES}).json()["tokens"] == tok.encode_chat(MESSAGES)
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    own = _post(trusting_server, "/v1/chat/completions", {**body, "chat_template": TEMPLATE})
    assert own.status_code == 200, own.text
    assert own.json()["usage"]["prompt_tokens"] == len(want)
    same = _post(trusting_server, "/v1/completions", {"prompt": want, "max_tokens": 4, "temperature": 0.0,
                                                      "ignore_eos": True})
    assert own.json()["choices"][0]["message"]["content"] == same.json()["choices"][0]["text"]
    plain = _post(trusting_server, "/v1/chat/completions", body)  # (the server's own template for the next request)
    assert plain.json()["usage"]["prompt_tokens"] == len(tok.encode_chat(MESSAGES))
    bad = _post(trusting_server, "/v1/chat/completions", {**body, "chat_template": "{% if %}"})
    assert bad.status_code == 400 and "chat_template (the request's) does not compile" in bad.json()["error"]["message"]
    escape = _post(trusting_server, "/v1/chat/completions",
                   {**body, "chat_template": "{{ ''.__class__.__mro__[1].__subclasses__() }}"})
    assert escape.status_code == 400, escape.text


@pytest.mark.parametrize(("template", "match"), [
    ("{{ " + "(" * 400 + "1" + ")" * 400 + " }}", "nested too deeply"),
    ("{{ (10 ** 4096) ** 4096 }}", "a power would be an integer over"),
    ("{# " + "x" * 70000 + " #}", "at most 65536"),
    ("{% for a in [1] %}" * 25 + "{% endfor %}" * 25, "nested too deeply"),  # (Python: too many nested blocks)
    ("{{ 'x'|center(300000000) }}", "widths or precisions over"),
])
def test_a_requests_template_past_the_bounds_is_a_400(trusting_server, template, match):
    """A request's template that nests past Python's recursion limit at compile time, builds a huge integer, or is
    over 64 KiB is a 400 naming the bound, on /tokenize and chat alike (was: the engine process died, or a 429
    "retry later"); the server stays healthy."""
    for path, body in (("/tokenize", {"messages": MESSAGES}),
                       ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})):
        r = _post(trusting_server, path, {**body, "chat_template": template})
        assert r.status_code == 400 and match in r.json()["error"]["message"], (path, r.text)
    assert httpx.get(trusting_server.url + "/health", timeout=10).status_code == 200
    assert "Traceback" not in trusting_server.log()
