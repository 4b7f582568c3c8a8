"""vLLM's `return_token_ids` (the prompt's ids and each choice's generated ids in the response; streamed: the prompt's
in the first chunk, each chunk's own ids) and `return_tokens_as_token_ids` (logprobs name tokens "token_id:N"), on
completions and chat, checked against the tokenizer and the in-process engine."""

from __future__ import annotations

import json

import httpx

from kda_rt import SamplingParams

MESSAGES = [{"role": "user", "content": "Tell me about the storm."}]


def _post(srv, path, body):
    return httpx.post(srv.url + path, headers=srv.headers, timeout=120.0, json={"model": "demo", **body})


def _stream(srv, path, body):
    with httpx.stream("POST", srv.url + path, headers=srv.headers, timeout=120.0,
                      json={"model": "demo", **body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def _greedy_ids(llm, prompt, n=6):
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
    return out.prompt_token_ids, out.outputs[0].token_ids


def test_completion_token_ids(server, reference_llm):
    prompts = ["The lighthouse", "A comet over the sea"]
    body = {"prompt": prompts, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for prompt, c in zip(prompts, choices, strict=True):
        assert (c["prompt_token_ids"], c["token_ids"]) == _greedy_ids(reference_llm, prompt)
    chunks = _stream(server, "/v1/completions", body)
    for k in range(len(prompts)):
        mine = [c for ch in chunks for c in ch["choices"] if c["index"] == k]
        assert mine[0]["prompt_token_ids"] == choices[k]["prompt_token_ids"]
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == choices[k]["token_ids"]
    plain = _post(server, "/v1/completions", {**body, "return_token_ids": False}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_chat_token_ids(server, reference_llm):
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    want_prompt = reference_llm.get_tokenizer().encode_chat(MESSAGES)
    assert r.json()["prompt_token_ids"] == want_prompt
    assert r.json()["choices"][0]["token_ids"] == _greedy_ids(reference_llm, {"prompt_token_ids": want_prompt})[1]
    chunks = _stream(server, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == want_prompt and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for ch in chunks[1:] for c in ch["choices"] for t in c["token_ids"]] == \
        r.json()["choices"][0]["token_ids"]
    plain = _post(server, "/v1/chat/completions", {**body, "return_token_ids": None}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_tokens_as_token_ids_in_logprobs(server):
    body = {"prompt": "The lighthouse", "max_tokens": 5, "temperature": 0.0, "ignore_eos": True, "logprobs": 2,
            "return_tokens_as_token_ids": True, "return_token_ids": True}
    c = _post(server, "/v1/completions", body).json()["choices"][0]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(len(top) >= 2 and all(k.startswith("token_id:") for k in top) for top in c["logprobs"]["top_logprobs"])
    echo = _post(server, "/v1/completions", {**body, "echo": True, "max_tokens": 1, "prompt_logprobs": 1}).json()
    echo = echo["choices"][0]
    assert echo["logprobs"]["tokens"][:len(c["prompt_token_ids"])] == [f"token_id:{t}" for t in c["prompt_token_ids"]]
    assert all(k.startswith("token_id:") for top in echo["logprobs"]["top_logprobs"][1:] for k in top)
    # vLLM's prompt_logprobs field keeps each token's text (its decoded_token) either way
    decoded = [e for entry in echo["prompt_logprobs"][1:] for e in entry.values()]
    assert decoded and not any(e["decoded_token"].startswith("token_id:") for e in decoded)
    chat = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "temperature": 0.0,
                                                  "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True,
                                                  "return_token_ids": True, "ignore_eos": True}).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)
    assert all(t["token"].startswith("token_id:") for e in content for t in e["top_logprobs"])
    text_form = _post(server, "/v1/completions", {**body, "return_tokens_as_token_ids": False}).json()["choices"][0]
    assert not any(t.startswith("token_id:") for t in text_form["logprobs"]["tokens"])


def test_server_flag_names_every_requests_tokens_by_id(tmp_path_factory):
    """--return-tokens-as-token-ids (vLLM's flag): logprobs of every request name tokens "token_id:N", but of one that
    says return_tokens_as_token_ids: false (vLLM's rule)."""
    from helpers.server import ServerProc

    srv = ServerProc(tmp_path_factory.mktemp("ids") / "server.log", "--return-tokens-as-token-ids")
    try:
        c = _post(srv, "/v1/completions", {"prompt": "The lighthouse", "max_tokens": 3, "temperature": 0.0,
                                           "ignore_eos": True, "logprobs": 1, "return_token_ids": True}).json()
        c = c["choices"][0]
        assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
        own = _post(srv, "/v1/completions", {"prompt": "The lighthouse", "max_tokens": 3, "temperature": 0.0,
                                             "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": False})
        assert not any(t.startswith("token_id:") for t in own.json()["choices"][0]["logprobs"]["tokens"])
    finally:
        assert srv.stop() == 0, srv.log()
