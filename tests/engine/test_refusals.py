"""Refusals and non-finite values (issue 10 #2, #4, #12, #13): parameters where the math breaks
are refused, NaN logits end a request with finish_reason "error" (never text), stop lists are
capped, refused prompts leave no request id behind, and API misuse gets clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.engine import assert_no_leaks, greedy, make_llm
from kda_rt import SamplingParams
from kda_rt.sampler.params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from kda_rt.server.engine_proc import EngineWorker

PROMPT = {"prompt_token_ids": [5, 6, 7]}


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return make_llm(tiny_dir, max_num_seqs=4, max_model_len=64)


@pytest.mark.parametrize("value", [1e-40, 0.001, 1e40])
def test_repetition_penalty_bounded(value):
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=value, logprobs=1)


def test_nan_logits_finish_with_error(llm, monkeypatch):
    runner = llm.llm_engine.runner
    real = runner.forward
    calls = {"n": 0}

    def poisoned(batch):
        logits = real(batch)
        calls["n"] += 1
        if calls["n"] == 3:  # the third step: two good tokens, then NaN
            logits = logits.copy()
            logits[0, 7] = np.nan
        return logits

    monkeypatch.setattr(runner, "forward", poisoned)
    out = llm.generate(PROMPT, greedy(8, logprobs=1))[0].outputs[0]
    assert out.finish_reason == "error" and "non-finite logits" in out.stop_reason
    assert len(out.token_ids) == 2 and len(out.logprobs) == 2
    assert all(np.isfinite(lp) for d in out.logprobs for lp in d.values())
    assert_no_leaks(llm)


def test_stop_list_capped():
    with pytest.raises(ValueError, match="MAX_STOP_STRINGS"):
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    with pytest.raises(ValueError, match="MAX_STOP_CHARS"):
        SamplingParams(stop=["x" * (MAX_STOP_CHARS + 1)])
    SamplingParams(stop=["ab"] * MAX_STOP_STRINGS)  # at the limit: fine


def test_refused_prompts_leave_no_ids(llm):
    for _ in range(20):
        with pytest.raises(ValueError, match="empty"):
            llm.generate({"prompt_token_ids": []}, greedy(2))
        with pytest.raises(ValueError, match="1000000000 is outside the vocabulary"):
            llm.generate([PROMPT, {"prompt_token_ids": [10**9]}], greedy(2))
    assert not llm._open and not llm._parked
    stream = llm.generate(PROMPT, greedy(3), stream=True)  # takes id "0": must not be parked forever
    assert [len(o.outputs[0].token_ids) for o in stream] == [1, 1, 1]
    assert not llm._open
    assert_no_leaks(llm)


def test_stop_strings_without_a_tokenizer_refused(llm):
    # tiny_dir has no tokenizer files: no output text, so a stop string could never match (was: silently ignored)
    with pytest.raises(ValueError, match="stop strings need the checkpoint's tokenizer"):
        llm.generate(PROMPT, greedy(2, stop=["x"]))
    with pytest.raises(ValueError, match="stop strings need the checkpoint's tokenizer"):
        llm.generate([PROMPT, PROMPT], [greedy(2), SamplingParams(max_tokens=2, stop="x")])
    assert not llm._open
    out = llm.generate(PROMPT, greedy(2, stop_token_ids=[1]))[0].outputs[0]  # token ids still stop it
    assert len(out.token_ids) <= 2 and out.text == ""


def test_multimodal_prompt_keys_refused(llm):
    """vLLM's multi_modal_data / mm_processor_kwargs on a text-only model: refused by name (was: ignored, the prompt
    run as text alone); empty ones are nothing to refuse, and nothing is left queued."""
    ids = {"prompt_token_ids": [5, 6, 7]}
    for key, value in (("multi_modal_data", {"image": object()}), ("mm_processor_kwargs", {"num_crops": 4})):
        with pytest.raises(ValueError, match=f"'{key}' is not supported: Kimi Linear takes text only"):
            llm.generate([ids, {**ids, key: value}], greedy(2))
    assert not llm._open
    assert len(llm.generate({**ids, "multi_modal_data": None}, greedy(2))[0].outputs[0].token_ids) == 2


def test_sampling_params_dict_is_a_type_error(llm):
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate(PROMPT, {"max_tokens": 2})
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate([PROMPT], [{"max_tokens": 2}])
    assert not llm._open


def test_chat_with_empty_conversation_refused(demo_llm):
    with pytest.raises(ValueError, match="conversation 0"):
        demo_llm.chat([[]])
    with pytest.raises(ValueError, match="conversation 1"):
        demo_llm.chat([[{"role": "user", "content": "hi"}], []])


@pytest.fixture(scope="module")
def demo_llm():
    from kda_rt import LLM
    from kda_rt.demo import demo_path

    return LLM(str(demo_path()), backend="numpy", max_num_seqs=2, max_model_len=128)


class _Conn:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    def send(self, msg: dict) -> None:
        self.sent.append(msg)


def test_max_waiting_counts_every_sample(llm):
    conn = _Conn()
    worker = EngineWorker(llm, conn, max_waiting=2)
    worker.handle({"op": "add", "id": "a", "prompts": [[5, 6]], "params": {"max_tokens": 2}})
    worker.handle({"op": "add", "id": "b", "prompts": [[5, 6]], "params": {"max_tokens": 2, "n": 2}})
    worker.handle({"op": "add", "id": "c", "prompts": [[5, 6]], "params": {"max_tokens": 2, "n": 3}})
    assert [m["op"] for m in conn.sent] == ["added", "rejected", "rejected"]
    assert conn.sent[1]["status"] == 429 and "1 sequences waiting + 2 new > max_waiting 2" in conn.sent[1]["error"]
    assert conn.sent[2]["status"] == 400 and "max_waiting" in conn.sent[2]["error"]
    assert len(llm.llm_engine.scheduler.waiting) <= 2
    worker.handle({"op": "shutdown"})
    assert_no_leaks(llm)


def test_worker_sends_each_prompts_timing(llm):
    """Each prompt's first output carries its queue and prefill times, keyed by its first choice, so /metrics
    observes a choice with its own prompt's, as vLLM's child requests (was: only the first prompt's, sent once)."""
    conn = _Conn()
    worker = EngineWorker(llm, conn, max_waiting=64)
    worker.handle({"op": "add", "id": "t", "prompts": [[5, 6], [7, 8, 9]],
                   "params": {"max_tokens": 2, "n": 2, "temperature": 0.0, "ignore_eos": True}})
    _run(worker, llm)
    timing = [t for m in conn.sent if m["op"] == "outs" for item in m["items"] for t in item.get("timing", ())]
    assert sorted(first for first, _, _ in timing) == [0, 2]  # (prompt k's choices: k * n ...)
    assert all(queue >= 0 and prefill is not None and prefill >= 0 for _, queue, prefill in timing)
    assert_no_leaks(llm)


def _beam_add(worker, rid, **params):
    worker.handle({"op": "add", "id": rid, "prompts": [[5, 6, 7]], "beam": {"length_penalty": 1.0},
                   "params": {"n": 2, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True, **params}})


def _run(worker, llm, limit=200):
    for _ in range(limit):
        if not llm.llm_engine.has_unfinished_requests():
            return
        worker.step()
    raise AssertionError("the engine never went idle")


@pytest.mark.parametrize("where", ["add", "nan"])
def test_a_beam_search_that_fails_mid_way_ends_alone(llm, monkeypatch, where):
    """A beam search whose third step cannot be added (`add`), or whose step request ends in error (`nan`: NaN
    logits), ends that search alone: its beams so far are answered with finish_reason "abort", nothing of it stays in
    the engine, and a plain request beside it and the next search finish as usual."""
    conn = _Conn()
    worker = EngineWorker(llm, conn, max_waiting=64)
    engine = llm.llm_engine
    if where == "add":
        real_add, calls = engine.add_request, {"n": 0}

        def add(rid, *a, **kw):
            if "#beam2." in str(rid):
                calls["n"] += 1
                if calls["n"] == 2:  # (the second beam of the third step: the first was added already)
                    raise ValueError("injected")
            return real_add(rid, *a, **kw)

        monkeypatch.setattr(engine, "add_request", add)
    else:
        runner, real_forward, calls = engine.runner, engine.runner.forward, {"n": 0}

        def forward(batch):
            logits = real_forward(batch)
            calls["n"] += 1
            if calls["n"] == 3:
                logits = logits.copy()
                logits[:] = np.nan
            return logits

        monkeypatch.setattr(runner, "forward", forward)
    _beam_add(worker, "b")
    worker.handle({"op": "add", "id": "p", "prompts": [[8, 9]], "params": {"max_tokens": 6, "ignore_eos": True}})
    _run(worker, llm)
    monkeypatch.undo()
    outs = [item for m in conn.sent if m["op"] == "outs" for item in m["items"]]
    final = [item for item in outs if item["id"] == "b" and item["finished"]]
    assert len(final) == 1 and [o["finish_reason"] for o in final[0]["outputs"]] == ["abort", "abort"]
    plain = [o for item in outs if item["id"] == "p" for o in item["outputs"]]
    assert plain[-1]["finish_reason"] in ("length", "error") and worker.beams == {} and worker.beam_of == {}
    assert_no_leaks(llm)
    _beam_add(worker, "again")
    _run(worker, llm)
    again = [item for m in conn.sent if m["op"] == "outs" for item in m["items"] if item["id"] == "again"]
    assert [o["finish_reason"] for o in again[-1]["outputs"]] == ["length", "length"]
    assert all(len(o["token_ids"]) == 5 for o in again[-1]["outputs"])
    assert_no_leaks(llm)


def test_a_beam_search_refused_part_way_through_its_first_step_leaves_nothing(llm, monkeypatch):
    """Two prompts: the first step adds one request a prompt; the second add is refused, so the request is a 400 and
    the first step request, already added, is taken back."""
    conn = _Conn()
    worker = EngineWorker(llm, conn, max_waiting=64)
    engine, real_add = llm.llm_engine, llm.llm_engine.add_request

    def add(rid, *a, **kw):
        if str(rid) == "b#beam0.1":
            raise ValueError("injected")
        return real_add(rid, *a, **kw)

    monkeypatch.setattr(engine, "add_request", add)
    worker.handle({"op": "add", "id": "b", "prompts": [[5, 6, 7], [8, 9]], "beam": {"length_penalty": 1.0},
                   "params": {"n": 2, "max_tokens": 5, "temperature": 0.0}})
    monkeypatch.undo()
    assert conn.sent[-1]["op"] == "rejected" and conn.sent[-1]["status"] == 400 and "injected" in conn.sent[-1]["error"]
    assert worker.beams == {} and worker.beam_of == {} and worker.children == {}
    _run(worker, llm)
    assert_no_leaks(llm)
    assert not [m for m in conn.sent if m["op"] == "outs"]


def test_a_beam_searchs_seed_seeds_its_step_requests(llm, monkeypatch):
    """The request's seed is on every step request's SamplingParams (their sampled candidate is drawn from it)."""
    conn, seeds = _Conn(), []
    worker = EngineWorker(llm, conn, max_waiting=64)
    real_add = llm.llm_engine.add_request
    monkeypatch.setattr(llm.llm_engine, "add_request",
                        lambda rid, prompt, params, **kw: seeds.append(params.seed) or real_add(rid, prompt, params, **kw))
    _beam_add(worker, "s", seed=11, temperature=1.5)
    _run(worker, llm)
    assert len(seeds) > 2 and set(seeds) == {11}
    seeds.clear()
    _beam_add(worker, "u", temperature=1.5)
    _run(worker, llm)
    assert set(seeds) == {None}
    assert_no_leaks(llm)
