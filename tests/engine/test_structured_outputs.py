"""Structured outputs (llguidance) and logit_bias, offline, on the demo checkpoint (random weights):
whatever a random model prefers, the output must match the grammar."""

from __future__ import annotations

import json
import logging
import re
import sys

import numpy as np
import pytest

from kda_rt import SamplingParams
from kda_rt.sampler.batch import SamplingBatch, StepOutput
from kda_rt.sampler.params import StructuredOutputsParams
from kda_rt.sampler.reference import sample_rows

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

# bounded (maxLength, integer range, no extra keys), so a compact JSON answer always ends
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}}
PROMPTS = ["Hello there", "Describe a person as JSON:", "1 2 3"]


@pytest.fixture(scope="module", params=["numpy", pytest.param("cuda", marks=pytest.mark.gpu)])
def llm(request):
    """The NumPy runner masks on the host; the CUDA runner uploads each step's bitmasks and its sampling
    kernel applies them (host rows only for the logit_bias)."""
    from helpers.engine import make_llm
    from kda_rt.demo import demo_path

    if request.param == "cuda":
        pytest.importorskip("cupy")
        return make_llm(demo_path(), backend="cuda", dtype="bfloat16", max_model_len=256, num_blocks=64)
    return make_llm(demo_path(), dtype="float32", max_model_len=256)


def _texts(llm, params: SamplingParams, prompts=PROMPTS) -> list[tuple[str, str]]:
    return [(c.text, c.finish_reason) for out in llm.generate(prompts, params) for c in out.outputs]


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=3, n=3)], ids=["greedy", "n3"])
def test_json_schema_validates(llm, sampling):
    for text, reason in _texts(llm, SamplingParams(max_tokens=120, structured_outputs={"json": SCHEMA}, **sampling)):
        assert reason == "stop", (text, reason)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_choice_regex_grammar_json_object(llm):
    choices = ["red", "green", "blue", "dark purple"]
    for text, reason in _texts(llm, SamplingParams(temperature=0.0, structured_outputs={"choice": choices})):
        assert text in choices and reason == "stop"
    regex = StructuredOutputsParams(regex=r"[a-z]{3}-[0-9]{2}")
    for text, reason in _texts(llm, SamplingParams(temperature=1.0, seed=5, max_tokens=30, structured_outputs=regex)):
        assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", text) and reason == "stop", text
    lark = 'start: answer " " NUM\nanswer: "yes" | "no"\nNUM: /[0-9]{1,3}/'
    for text, _ in _texts(llm, SamplingParams(temperature=0.0, max_tokens=20, structured_outputs={"grammar": lark})):
        assert re.fullmatch(r"(yes|no) [0-9]{1,3}", text), text
    # any JSON object: a random model may write keys forever, so tokens with a quote are banned
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs={"json_object": True},
                            logit_bias={t: -100.0 for t in range(tok.vocab_size) if b'"' in tok.token_bytes(t)})
    for text, reason in _texts(llm, params):
        assert reason == "stop" and json.loads(text) == {}, text


def test_logit_bias_forces_and_bans(llm):
    base = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    target = 300
    forced = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                  logit_bias={target: 100.0}, logprobs=1))
    for out in forced:
        assert out.outputs[0].token_ids == [target] * 4
        # logprobs are of the biased logits: the forced token is (almost) certain
        assert all(lp[target] > -1e-3 for lp in out.outputs[0].logprobs)
    banned = {out.outputs[0].token_ids[0] for out in base}
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                logit_bias={t: -100.0 for t in banned}))
    for out in outs:
        assert not banned & set(out.outputs[0].token_ids)


def test_invalid_grammar_and_bias_refused(llm):
    with pytest.raises(ValueError, match=r"structured_outputs\.json is invalid"):
        llm.generate(["x"], SamplingParams(structured_outputs={"json": {"type": "foo"}}))
    with pytest.raises(ValueError, match=r"structured_outputs\.regex is invalid"):
        llm.generate(["x"], SamplingParams(structured_outputs={"regex": "[a-"}))
    with pytest.raises(ValueError, match=r"logit_bias token id 5000 is outside the vocabulary"):
        llm.generate(["x"], SamplingParams(logit_bias={5000: 1.0}))
    for bad in ({1: 100.5}, {-1: 1.0}, {i: 1.0 for i in range(301)}, {1: float("nan")}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    assert llm.stats()["running"] == 0 and llm.stats()["waiting"] == 0


@pytest.mark.parametrize("spec", [{"regex": "[^\\s\\S]"}, {"regex": "a[^\\s\\S]"}, {"json": {"$ref": "#"}},
                                  {"grammar": 'start: a\na: a "x"'}], ids=["empty", "dead-end", "self-ref", "no-base"])
def test_unsatisfiable_grammar_refused(llm, spec):
    """A grammar that no output can satisfy is refused when the request is added, naming the field (was: only EOS
    allowed, and the request ended "stop" with an empty text that does not match)."""
    kind = next(iter(spec))
    with pytest.raises(ValueError, match=rf"structured_outputs\.{kind} is invalid: no output can satisfy it"):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert llm.stats()["running"] == 0 and llm.stats()["waiting"] == 0


def test_too_complex_grammar_error_is_short(llm):
    """A grammar past llguidance's parser limits fails at its first token: the request ends "error" with the
    matcher's first line (was: its state dump and the whole grammar, 540 KB a sample, in the output and the log)."""
    grammar = "start: " + " | ".join(f'"w{i}"' for i in range(5000))
    out = llm.generate(["x"], SamplingParams(max_tokens=4, n=2, structured_outputs={"grammar": grammar}))[0]
    for c in out.outputs:
        assert c.finish_reason == "error" and "Parser Error" in c.stop_reason and len(c.stop_reason) < 1000


def test_vllm_options(llm):
    """vLLM's structured-output options: disable_additional_properties closes an open object schema (only the named
    key can appear), whitespace_pattern lets JSON use that whitespace, disable_fallback and disable_any_whitespace are
    accepted; the options travel in to_dict; bad values are named."""
    open_schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["a"]}
    for seed in range(3):
        p = SamplingParams(temperature=1.0, seed=seed, max_tokens=40, structured_outputs=StructuredOutputsParams(
            json=open_schema, disable_additional_properties=True, disable_fallback=True, disable_any_whitespace=True))
        text, reason = _texts(llm, p, ["x"])[0]
        assert reason == "stop" and set(json.loads(text)) == {"a"}, text
    # whitespace_pattern: newlines only between the tokens (llguidance's default would put a space after the colon,
    # as disable_any_whitespace still does); was checked only for parsing, which the default passed too
    closed = {**open_schema, "additionalProperties": False}
    spec = StructuredOutputsParams(json=closed, whitespace_pattern=r"[\n]{1,2}")
    assert StructuredOutputsParams.from_dict(spec.to_dict()) == spec
    outs = _texts(llm, SamplingParams(temperature=1.0, seed=4, n=8, max_tokens=30, structured_outputs=spec), ["x"])
    assert all(reason == "stop" and set(json.loads(text)) == {"a"} and " " not in text for text, reason in outs), outs
    assert any("\n" in text for text, _ in outs), outs
    for bad in ({"disable_fallback": 1}, {"whitespace_pattern": ""}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            StructuredOutputsParams(json_object=True, **bad)


def test_missing_llguidance_names_the_extra(monkeypatch):
    from kda_rt.engine.structured import grammar_of

    monkeypatch.setitem(sys.modules, "llguidance", None)  # import now raises ImportError
    with pytest.raises(ValueError, match=r"kda_rt\[structured\]"):
        grammar_of(StructuredOutputsParams(regex="a"))
    SamplingParams(structured_outputs={"regex": "a"})  # the params themselves need no llguidance


def test_preemption_keeps_json_valid(caplog):
    """A page pool too small for the batch: sequences are preempted mid-JSON and recomputed; the
    matchers (a function of the kept output tokens) stay in step, so every answer still validates."""
    from helpers.engine import assert_no_leaks, make_llm
    from kda_rt.demo import demo_path

    tight = make_llm(demo_path(), dtype="float32", max_num_seqs=6, max_model_len=96, block_size=16, num_blocks=6,
                     max_num_batched_tokens=32)
    params = SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=60, structured_outputs={"json": SCHEMA})
    with caplog.at_level(logging.WARNING, logger="kda_rt.engine.scheduler"):
        outs = tight.generate([f"{p} #{i}" for i in range(3) for p in PROMPTS], params)
    assert tight.stats()["preemptions"] > 0, "the pool was meant to force preemption"
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert_no_leaks(tight)


def test_sample_rows_applies_mask_and_bias():
    """The host sampler: bias added, disallowed tokens never drawn, an all-masked row is an error."""
    vocab = 70
    logits = np.zeros((3, vocab), np.float32)
    logits[:, 5] = 10.0
    mask = np.zeros(3, np.int32)  # [ceil(70 / 32)] words
    mask[1] = 1 << 2  # only token 34
    p = SamplingParams(temperature=0.0, logit_bias={7: 20.0})
    q = SamplingParams(temperature=1.0, seed=1)
    batch = SamplingBatch.build([(p, 0, [1], []), (q, 1, [1], []), (q, 2, [1], [])], [69],
                                [None, mask, np.zeros(3, np.int32)])
    # the bias makes row 0 a host row; masks alone do not (the GPU sampler applies them)
    assert batch.host_rows.tolist() == [True, False, False] and batch.constrained.tolist() == [False, True, True]
    out = StepOutput.empty(3)
    sample_rows(logits, batch, range(3), out)
    assert out.token_ids[:2] == [7, 34] and out.errors[2] is not None and "no token is allowed" in out.errors[2]
    # the CUDA runner passes only its host rows, as a {row: logits} dict: bias and mask stay with their rows
    out = StepOutput.empty(3)
    sample_rows({1: logits[1], 0: logits[0]}, batch, [0, 1], out)
    assert out.token_ids == [7, 34, None] and out.errors == [None, None, None]


def _sync_against_ahead(backend: str, budget: int, prompts, params) -> tuple[list, list]:
    """The demo model's outputs of `prompts` on a synchronous and an async engine (step budget `budget`): the async
    ones as (token_ids, text, finish_reason) lists, after checking them against the synchronous engine's (NumPy:
    equal; bf16 on the GPU, where a grammar's stop the host learns of afterwards changes a later batch: the finish
    reasons), and the handles of the async runner's launches made with the sampler held back (defer_sampling: steps
    that went ahead of grammar rows' tokens; not `sample` calls, which the CUDA runner's own launches make too)."""
    from helpers.engine import make_llm
    from kda_rt.demo import demo_path

    kw = dict(max_model_len=256, max_num_batched_tokens=budget, max_num_seqs=8)
    if backend == "cuda":
        pytest.importorskip("cupy")
        kw.update(backend="cuda", dtype="bfloat16", num_blocks=64)
    sync, ahead = make_llm(demo_path(), async_scheduling=False, **kw), make_llm(demo_path(), **kw)
    runner, calls = ahead.llm_engine.runner, []
    launch = runner.launch

    def spy_launch(*a, **k):
        handle = launch(*a, **k)
        if k.get("defer_sampling"):
            calls.append(handle)
        return handle

    runner.launch = spy_launch
    try:
        want = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in sync.generate(prompts, params)]
        got = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in ahead.generate(prompts, params)]
    finally:
        del runner.launch
    if backend == "numpy":
        assert got == want
    else:
        assert [[r for _, _, r in o] for o in got] == [[r for _, _, r in o] for o in want]
    return got, calls


@pytest.mark.parametrize("backend", ["numpy", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_grammar_steps_go_ahead_with_the_sampler_held_back(backend, monkeypatch):
    """KDA_RT_ASYNC_PREFILL=1: a step after one with grammar rows is launched before their tokens are accepted, its
    sampler queued (runner.sample) once the matchers have them, so its masks follow them; the outputs (JSON, choices,
    regex, n = 2 seeded, beside unconstrained rows and prompts entering over chunked steps) are the synchronous
    engine's and valid."""
    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", "1")
    prompts = [*PROMPTS, "Pick one colour", "Name a code"]
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs={"json": SCHEMA}),
              SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=60, structured_outputs={"json": SCHEMA}),
              SamplingParams(temperature=0.0, max_tokens=12),
              SamplingParams(temperature=0.0, structured_outputs={"choice": ["red", "green", "dark purple"]}),
              SamplingParams(temperature=0.8, seed=7, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3}-[0-9]{2}"))]
    got, calls = _sync_against_ahead(backend, 24, prompts, params)
    assert len(calls) >= 5, "no step went ahead of grammar rows"
    for text, reason in [(t, r) for o in got[:2] for _, t, r in o]:
        assert reason == "stop", (text, reason)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert got[3][0][1] in ("red", "green", "dark purple") and re.fullmatch(r"[a-z]{3}-[0-9]{2}", got[4][0][1])



@pytest.mark.parametrize("grammar", ["1", "0"])
@pytest.mark.parametrize("backend", ["numpy", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_decode_steps_after_grammar_rows_with_the_switch(backend, grammar, monkeypatch):
    """KDA_RT_ASYNC_PREFILL=0 with KDA_RT_ASYNC_GRAMMAR: 1 lets the decode steps after steps with grammar rows go
    ahead with their sampler held back (runner.sample called), 0 keeps each of them waiting for the host (never
    called); the outputs are the synchronous engine's (NumPy: equal; bf16 on the GPU: the finish reasons, each output
    valid) either way."""
    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", "0")
    monkeypatch.setenv("KDA_RT_ASYNC_GRAMMAR", grammar)
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs={"json": SCHEMA}),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=20,
                             structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3}-[0-9]{2}"))]
    got, calls = _sync_against_ahead(backend, 64, PROMPTS, params)
    if grammar == "1":
        assert len(calls) >= 5, "no decode step went ahead of grammar rows"
    else:
        assert not calls
    jsonschema.validate(json.loads(got[0][0][1]), SCHEMA)
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", got[2][0][1])


def test_held_back_sampler_only_where_a_grammar_row_waits(monkeypatch):
    """A step scheduled ahead that preempted its pending grammar sequence and samples no row is launched whole (no
    `sample` call a CUDA runner would refuse: its launch sampled nothing); the outputs are the synchronous engine's.
    (21 pages of 16 tokens, an 8-token budget: the grammar request is preempted while a long prompt fills.)"""
    from helpers.engine import make_llm
    from kda_rt.demo import demo_path

    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", "1")
    kw = dict(max_model_len=336, block_size=16, num_blocks=21, max_num_batched_tokens=8, max_num_seqs=8)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [(i * 7) % 400 + 3 for i in range(300)]},
               {"prompt_token_ids": [9, 10, 11, 12]}]
    params = [SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=120, structured_outputs={"regex": "[a-z]{300}"})]
    sync, ahead = make_llm(demo_path(), async_scheduling=False, **kw), make_llm(demo_path(), **kw)
    runner, deferred = ahead.llm_engine.runner, []
    launch, sample = runner.launch, runner.sample

    def spy_launch(batch, sampling, **k):
        if k.get("defer_sampling"):
            deferred.append(sampling.num_rows)
        return launch(batch, sampling, **k)

    runner.launch = spy_launch
    runner.sample = lambda handle: sample(handle)
    try:
        want = [[c.token_ids for c in o.outputs] for o in sync.generate(prompts, params)]
        got = [[c.token_ids for c in o.outputs] for o in ahead.generate(prompts, params)]
    finally:
        del runner.launch, runner.sample
    assert got == want
    assert ahead.stats()["preemptions"] > 0 and deferred and min(deferred) > 0



if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
