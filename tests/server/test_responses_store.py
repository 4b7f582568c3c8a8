"""Stored responses (`--enable-responses-store`, vLLM's VLLM_ENABLE_RESPONSES_API_STORE): `previous_response_id`
continues a conversation exactly as sending its whole history would (checked against the chat completion of the
same messages, greedy), streamed or not, with function calls and their outputs; GET and DELETE
/v1/responses/{id}; `store: false`; the store's bound; what is missing is a 404 naming it."""

from __future__ import annotations

import json

import httpx
import pytest

from helpers.server import ServerProc

openai = pytest.importorskip("openai", reason="needs the test extra (openai)")


@pytest.fixture(scope="module")
def store_server(tmp_path_factory):
    srv = ServerProc(tmp_path_factory.mktemp("store") / "server.log", "--enable-responses-store",
                     "--responses-store-size", "4")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(store_server):
    from helpers.server import API_KEY

    return openai.OpenAI(base_url=store_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _chat(client, messages, n=6):
    return client.chat.completions.create(model="demo", max_tokens=n, temperature=0.0, messages=messages,
                                          extra_body={"ignore_eos": True}).choices[0].message.content


def test_a_chain_of_responses_equals_the_whole_conversation(client, store_server):
    kw = dict(model="demo", max_output_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
    first = client.responses.create(instructions="Be brief.", input="Name a prime.", **kw)
    assert first.store is True and first.previous_response_id is None
    history = [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": first.output_text}]
    assert first.output_text == _chat(client, [{"role": "system", "content": "Be brief."}, history[0]])
    second = client.responses.create(previous_response_id=first.id, instructions="Be kind.", input="Another.", **kw)
    assert second.previous_response_id == first.id
    # (the earlier instructions are not carried over, as OpenAI's: only this request's)
    want = _chat(client, [{"role": "system", "content": "Be kind."}, *history, {"role": "user", "content": "Another."}])
    assert second.output_text == want
    history += [{"role": "user", "content": "Another."}, {"role": "assistant", "content": second.output_text}]
    with client.responses.stream(previous_response_id=second.id, input="And a third.", **kw) as stream:
        third = stream.get_final_response()
    assert third.output_text == _chat(client, [*history, {"role": "user", "content": "And a third."}])
    got = httpx.get(f"{store_server.url}/v1/responses/{second.id}", headers=store_server.headers, timeout=10)
    assert got.status_code == 200 and got.json()["output"][0]["content"][0]["text"] == second.output_text
    assert client.responses.retrieve(third.id).output_text == third.output_text


def test_function_calls_and_their_outputs_carry_over(client, store_server):
    """An earlier turn's function_call item, then its function_call_output (by call_id alone) in a later request: the
    answer is the one to the whole conversation sent as one input list (the stored items read as that list would)."""
    kw = dict(model="demo", temperature=0.0, extra_body={"ignore_eos": True})
    first = client.responses.create(input="What is the weather?", max_output_tokens=4, **kw)
    call = {"type": "function_call", "call_id": "call_7", "name": "get_weather", "arguments": "{}"}
    second = client.responses.create(previous_response_id=first.id, input=[call], max_output_tokens=2, **kw)
    result = {"type": "function_call_output", "call_id": "call_7", "output": "sunny"}
    third = client.responses.create(previous_response_id=second.id, input=[result], max_output_tokens=6, **kw)
    items = [{"type": "message", "role": "user", "content": "What is the weather?"},
             {"type": "message", "role": "assistant", "content": first.output_text}, call,
             {"type": "message", "role": "assistant", "content": second.output_text}, result]
    whole = httpx.post(store_server.url + "/v1/responses", headers=store_server.headers, timeout=60,
                       json={"model": "demo", "input": items, "max_output_tokens": 6, "temperature": 0.0,
                             "ignore_eos": True, "store": False})
    assert third.output_text == whole.json()["output"][0]["content"][0]["text"]
    bad = httpx.post(store_server.url + "/v1/responses", headers=store_server.headers, timeout=60,
                     json={"model": "demo", "previous_response_id": third.id, "input": [{"type": "function_call"}]})
    assert bad.status_code == 400 and "input[0] (function_call)" in bad.json()["error"]["message"]  # (its own index)


def test_store_false_missing_ids_delete_and_the_bound(client, store_server):
    url, headers = store_server.url, store_server.headers
    unstored = client.responses.create(model="demo", input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    assert httpx.get(f"{url}/v1/responses/{unstored.id}", headers=headers, timeout=10).status_code == 404
    r = httpx.post(f"{url}/v1/responses", headers=headers, timeout=60,
                   json={"model": "demo", "input": "x", "previous_response_id": unstored.id})
    assert r.status_code == 404 and f"response {unstored.id!r} is not stored" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "previous_response_id"
    kept = [client.responses.create(model="demo", input=f"Hi {i}", max_output_tokens=2) for i in range(5)]
    assert httpx.get(f"{url}/v1/responses/{kept[0].id}", headers=headers, timeout=10).status_code == 404  # (4 kept)
    assert client.responses.retrieve(kept[-1].id).id == kept[-1].id
    gone = httpx.delete(f"{url}/v1/responses/{kept[-1].id}", headers=headers, timeout=10)
    assert gone.status_code == 200 and gone.json() == {"id": kept[-1].id, "object": "response", "deleted": True}
    assert httpx.delete(f"{url}/v1/responses/{kept[-1].id}", headers=headers, timeout=10).status_code == 404
    assert httpx.get(f"{url}/v1/responses/{kept[1].id}", timeout=10).status_code == 401  # (the API key guards it)


def test_without_the_store(server):
    """The default server: previous_response_id is a 400 naming the flag, store: true is answered store: false, and
    GET /v1/responses/{id} is a 404 saying why."""
    r = httpx.post(server.url + "/v1/responses", headers=server.headers, timeout=60,
                   json={"model": "demo", "input": "x", "max_output_tokens": 1, "previous_response_id": "resp-1"})
    assert r.status_code == 400 and "--enable-responses-store" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/responses", headers=server.headers, timeout=60,
                   json={"model": "demo", "input": "x", "max_output_tokens": 1, "store": True})
    assert r.status_code == 200 and r.json()["store"] is False
    got = httpx.get(f"{server.url}/v1/responses/{r.json()['id']}", headers=server.headers, timeout=10)
    assert got.status_code == 404 and "--enable-responses-store" in json.dumps(got.json())


def test_a_repeated_request_id_header_never_replaces_a_stored_response(store_server):
    """A response to be stored gets a random id (as OpenAI's and vLLM's), whatever X-Request-Id says: a header used
    twice, or naming a response stored before and deleted or evicted since, never replaces or continues another's."""
    headers = {**store_server.headers, "X-Request-Id": "same-id"}
    ids = []
    for text in ("First.", "Second."):
        r = httpx.post(store_server.url + "/v1/responses", headers=headers, timeout=60,
                       json={"model": "demo", "input": text, "max_output_tokens": 2})
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
        assert r.headers["x-request-id"] == ids[-1]
    assert ids[0] != ids[1] and not any("same-id" in i for i in ids)
    for rid in ids:
        assert httpx.get(f"{store_server.url}/v1/responses/{rid}", headers=store_server.headers,
                         timeout=10).json()["id"] == rid


def test_streamed_responses_say_store_throughout(client):
    with client.responses.stream(model="demo", input="Hi", max_output_tokens=2) as stream:
        events = list(stream)
    bodies = [e.response for e in events if hasattr(e, "response") and e.response is not None]
    assert len(bodies) >= 3 and all(b.store is True for b in bodies)


def test_the_store_alone():
    """ResponseStore: at most `capacity` responses and `max_bytes` of JSON, least recently used out first (a chain
    continued stays); a failed response or one over the byte bound alone is not kept and says store: false; a chain
    with a missing link names it."""
    from kda_rt.server.responses_api import ResponseNotFound, ResponseStore

    def body(rid, text="x", status="completed"):
        return {"id": rid, "status": status, "output": [{"type": "message", "role": "assistant",
                                                         "content": [{"type": "output_text", "text": text}]}]}

    store = ResponseStore(capacity=3, max_bytes=2000)
    own = [{"type": "message", "role": "user", "content": "hi"}]
    store.put(body("a"), own, None)
    store.put(body("b"), own, "a")
    store.put(body("c"), own, None)
    assert len(store.history("b")) == 4  # (a's input and output, then b's: a is used, c is the oldest now)
    store.put(body("d"), own, None)
    assert "c" not in store and "a" in store and "b" in store
    failed = body("e", status="failed")
    store.put(failed, own, None)
    assert failed["store"] is False and "e" not in store
    big = body("f", text="y" * 5000)
    store.put(big, own, None)
    assert big["store"] is False and "f" not in store
    for k in range(6):  # ~300 bytes each: the byte bound evicts before the count does
        store.put(body(f"g{k}", text="z" * 200), own, None)
    assert store.bytes <= 2000 and len(store) <= 3
    with pytest.raises(ResponseNotFound) as missing:
        store.history("b")  # (b's link a, or b itself, is gone)
    assert missing.value.args[0] in ("a", "b")
    store._items["g5"] = (*store._items["g5"][:2], "g5", store._items["g5"][3])  # a link back to itself
    with pytest.raises(ResponseNotFound):
        store.history("g5")
    running = {**body("bg"), "status": "in_progress", "background": True}
    store.put_running(running, own, None)
    for k in range(5):  # (finished ones come and go; the running one, polled, stays)
        store.put(body(f"h{k}"), own, None)
    assert "bg" in store and store.running("bg") and len(store) <= 3
    huge = {**body("bg", text="w" * 5000), "background": True}
    store.put(huge, own, None)  # (its end over the byte bound: kept as failed, saying why, not continuable)
    assert store.get("bg")["status"] == "failed" and "bound" in store.get("bg")["error"]["message"]


def _wait_status(srv, rid, statuses, timeout=60):
    import time

    deadline = time.monotonic() + timeout
    while True:
        body = httpx.get(f"{srv.url}/v1/responses/{rid}", headers=srv.headers, timeout=10).json()
        if body["status"] in statuses or time.monotonic() > deadline:
            return body
        time.sleep(0.02)


def test_background_responses_poll_and_cancel(store_server):
    """background: true (OpenAI's): answered at once with status "queued", polled by GET until it ends with the
    answer a foreground request gets (here "incomplete": max_output_tokens cuts it); a running one cannot be continued yet, and POST .../cancel stops one (status
    "cancelled", nothing left running)."""
    url, headers = store_server.url, store_server.headers
    body = {"model": "demo", "input": "Tell me about the lighthouse.", "max_output_tokens": 6, "temperature": 0.0,
            "ignore_eos": True}
    r = httpx.post(url + "/v1/responses", headers=headers, timeout=60, json={**body, "background": True})
    assert r.status_code == 200 and r.json()["status"] == "queued" and r.json()["background"] is True, r.text
    assert r.json()["store"] is True
    done = _wait_status(store_server, r.json()["id"], ("completed", "incomplete", "failed"))
    fore = httpx.post(url + "/v1/responses", headers=headers, timeout=60, json={**body, "store": False}).json()
    assert done["status"] == fore["status"] == "incomplete" and done["output"] == [
        {**item, "id": item["id"].replace(fore["id"], done["id"])} for item in fore["output"]]
    long = httpx.post(url + "/v1/responses", headers=headers, timeout=60,
                      json={**body, "max_output_tokens": 200, "background": True}).json()
    running = httpx.post(url + "/v1/responses", headers=headers, timeout=60,
                         json={**body, "previous_response_id": long["id"]})
    assert running.status_code == 400 and "is in_progress" in running.json()["error"]["message"], running.text
    gone = httpx.delete(f"{url}/v1/responses/{long['id']}", headers=headers, timeout=60)
    assert gone.status_code == 400 and "cancel it first" in gone.json()["error"]["message"]
    cancelled = httpx.post(f"{url}/v1/responses/{long['id']}/cancel", headers=headers, timeout=60)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
    assert cancelled.json()["usage"]["output_tokens"] < 200  # (stopped, not labelled after it ended)
    assert _wait_status(store_server, long["id"], ("cancelled",))["status"] == "cancelled"
    again = httpx.post(f"{url}/v1/responses/{long['id']}/cancel", headers=headers, timeout=60)
    assert again.status_code == 200 and again.json()["status"] == "cancelled"  # (harmless, as OpenAI's)
    assert httpx.post(f"{url}/v1/responses/resp-none/cancel", headers=headers, timeout=60).status_code == 404
    m = store_server.metrics()
    assert m["kda_rt:num_requests_running"] == 0 and m["kda_rt:num_requests_waiting"] == 0, m
    for bad in ({"background": True, "stream": True}, {"background": True, "store": False}):
        r = httpx.post(url + "/v1/responses", headers=headers, timeout=60, json={**body, **bad})
        assert r.status_code == 400 and "background needs stored responses" in r.json()["error"]["message"]


def test_input_items_list(client, store_server):
    """GET /v1/responses/{id}/input_items (`client.responses.input_items.list`): the items a response was generated
    from, as the client's item types, each with an id, newest first by default: the conversation it continued (the
    earlier input and output) and its own input (its instructions not among them); pages by `after` / `before`
    (the client's auto-pagination walks them all); a response not stored, or one whose chain lost a link, is a 404
    (was: no route, 404 for every response)."""
    from openai.types.responses import ResponseInputMessageItem, ResponseOutputMessage

    kw = dict(model="demo", max_output_tokens=2, temperature=0.0)
    first = client.responses.create(instructions="Be brief.", input=[
        {"role": "developer", "content": "Rule."},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}], **kw)
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    result = {"type": "function_call_output", "call_id": "call_1", "output": "42"}
    second = client.responses.create(previous_response_id=first.id, input=[call, result], **kw)
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [(item.type, getattr(item, "role", None)) for item in items] == [
        ("message", "developer"), ("message", "user"), ("message", "assistant"), ("function_call", None),
        ("function_call_output", None)]
    assert isinstance(items[0], ResponseInputMessageItem) and isinstance(items[2], ResponseOutputMessage)
    assert [part.text for part in items[1].content] == ["a", "b"] and items[2].id == first.output[0].id
    assert items[3].call_id == "call_1" and items[4].output == "42" and len({item.id for item in items}) == 5
    assert [item.id for item in client.responses.input_items.list(second.id).data] == [i.id for i in items[::-1]]
    page = client.responses.input_items.list(second.id, limit=2)
    assert [i.id for i in page.data] == [items[4].id, items[3].id] and page.has_more is True
    assert [i.id for i in page] == [i.id for i in items[::-1]]  # (auto-pagination: `after` the last id)
    url, headers = store_server.url, store_server.headers
    before = httpx.get(f"{url}/v1/responses/{second.id}/input_items", headers=headers, timeout=10,
                       params={"before": items[1].id, "limit": 2, "order": "asc"}).json()
    assert [i["id"] for i in before["data"]] == [items[0].id] and before["has_more"] is False
    assert [i.id for i in client.responses.input_items.list(first.id).data] == [items[1].id, items[0].id]
    for params in ({"limit": 0}, {"limit": 101}, {"order": "up"}, {"after": "nope"}):
        r = httpx.get(f"{url}/v1/responses/{second.id}/input_items", headers=headers, timeout=10, params=params)
        assert r.status_code == 400, (params, r.text)
    assert httpx.get(f"{url}/v1/responses/resp-none/input_items", headers=headers, timeout=10).status_code == 404
    assert httpx.get(f"{url}/v1/responses/{second.id}/input_items", timeout=10).status_code == 401
    client.responses.delete(first.id)
    r = httpx.get(f"{url}/v1/responses/{second.id}/input_items", headers=headers, timeout=10)
    assert r.status_code == 404 and first.id in r.json()["error"]["message"], r.text


def test_retrieve_with_stream_is_refused(client):
    """GET /v1/responses/{id}?stream=true (`client.responses.retrieve(id, stream=True)`) is a 400 naming stream: a
    stored response is not streamed again (was: its JSON body, which the client read as a stream of no events)."""
    resp = client.responses.create(model="demo", input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as refused:
        list(client.responses.retrieve(resp.id, stream=True))
    assert refused.value.body["param"] == "stream"
    assert client.responses.retrieve(resp.id).id == resp.id


def test_reasoning_items_are_stored_and_listed(client, store_server):
    """A reasoning item in a stored response's input is kept (an id of its own when it came without one), listed as
    the client's ResponseItem type, and carried over by previous_response_id (was: a 400)."""
    import pydantic
    from openai.types.responses import ResponseItem

    items = [{"role": "user", "content": "Name a prime."},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Two is prime."}]},
             {"type": "message", "role": "assistant", "content": "2"}, {"role": "user", "content": "Another."}]
    kw = dict(model="demo", max_output_tokens=4, temperature=0.0, extra_body={"ignore_eos": True})
    first = client.responses.create(input=items, **kw)
    listed = httpx.get(f"{store_server.url}/v1/responses/{first.id}/input_items", headers=store_server.headers,
                       params={"order": "asc"}, timeout=10).json()["data"]
    adapter = pydantic.TypeAdapter(ResponseItem)
    for item in listed:
        adapter.validate_python(item)
    assert listed[1]["type"] == "reasoning" and listed[1]["id"].startswith("rs_")
    assert listed[1]["summary"] == items[1]["summary"]
    second = client.responses.create(previous_response_id=first.id, input="And one more.", **kw)
    whole = client.responses.create(input=[*items, {"role": "assistant", "content": first.output_text},
                                           {"role": "user", "content": "And one more."}], store=False, **kw)
    assert second.output_text == whole.output_text
