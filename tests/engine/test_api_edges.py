"""Edge cases of the public API found in review: aborts end async streams, unstarted streams
do not leak requests, cancelling during add_request leaves no orphan, stop strings respect
min_tokens, and SamplingParams changed after construction are re-validated."""

from __future__ import annotations

import asyncio
import gc
import re

import pytest

from kda_rt import LLM, SamplingParams
from kda_rt.async_llm import AsyncLLM
from kda_rt.demo import demo_path


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(demo_path()), backend="numpy", max_num_seqs=4, max_model_len=4096)


def test_async_abort_ends_the_stream(llm):
    allm = AsyncLLM(llm)

    async def main():
        async def consume():
            return [d async for d in allm.generate("hello", SamplingParams(max_tokens=4000, ignore_eos=True),
                                                   request_id="r1")]

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.2)
        await allm.abort("r1")
        return await asyncio.wait_for(task, 10)

    got = asyncio.run(main())
    assert got[-1].finished and got[-1].outputs[0].finish_reason == "abort"
    assert llm.stats()["slots_used"] == 0 and llm.stats()["pages_used"] == 0


def test_async_abort_takes_several_ids_and_prompt_logprobs_come(llm):
    """AsyncLLM.abort takes a list of ids, as vLLM's (was: str(list) matched nothing and the requests ran on), and
    AsyncLLM.generate gives prompt_logprobs as LLM.generate does: with the first delta only, with every cumulative
    output (was: never)."""
    allm = AsyncLLM(llm)
    params = SamplingParams(max_tokens=3, prompt_logprobs=2, seed=1)
    ids = [5, 6, 7, 8]
    want = llm.generate({"prompt_token_ids": ids}, params)[0].prompt_logprobs

    async def main():
        async def consume(rid):
            return [d async for d in allm.generate("hello", SamplingParams(max_tokens=4000, ignore_eos=True),
                                                   request_id=rid)]

        tasks = [asyncio.create_task(consume(rid)) for rid in ("a1", "a2")]
        await asyncio.sleep(0.2)
        await allm.abort(["a1", "a2", "unknown"])
        cut = [await asyncio.wait_for(t, 10) for t in tasks]
        deltas = [d async for d in allm.generate({"prompt_token_ids": ids}, params)]
        cumulative = [d async for d in allm.generate({"prompt_token_ids": ids}, params, output_kind="cumulative")]
        return cut, deltas, cumulative

    cut, deltas, cumulative = asyncio.run(main())
    assert all(c[-1].finished and c[-1].outputs[0].finish_reason == "abort" for c in cut)
    assert want is not None and deltas[0].prompt_logprobs == want and all(d.prompt_logprobs is None for d in deltas[1:])
    assert all(c.prompt_logprobs == want for c in cumulative)
    assert llm.stats()["slots_used"] == 0 and llm.stats()["pages_used"] == 0


def test_unstarted_stream_does_not_leak(llm):
    stream = llm.generate(["a", "b", "c"], SamplingParams(max_tokens=50), stream=True)
    del stream
    gc.collect()
    assert llm.stats()["waiting"] == 0 and llm.stats()["running"] == 0
    before = llm.stats()["generated_tokens"]
    llm.generate("x", SamplingParams(max_tokens=8, ignore_eos=True))
    assert llm.stats()["generated_tokens"] - before == 8


def test_cancel_during_add_request_leaves_no_orphan(llm, monkeypatch):
    allm = AsyncLLM(llm)
    engine = llm.llm_engine
    real_add = engine.add_request

    def slow_add(*args, **kwargs):
        import time

        time.sleep(0.2)  # the window a long prompt's tokenization opens
        return real_add(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", slow_add)

    async def main():
        async def consume():
            async for _ in allm.generate("hello", SamplingParams(max_tokens=500, ignore_eos=True), request_id="c1"):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.4)  # the worker thread finishes adding; the abort follows
        monkeypatch.setattr(engine, "add_request", real_add)
        async for _ in allm.generate("x", SamplingParams(max_tokens=2, ignore_eos=True), request_id="c2"):
            pass

    asyncio.run(main())
    assert "c1" not in engine.requests and llm.stats()["waiting"] == 0 and llm.stats()["running"] == 0


def test_stop_strings_wait_for_min_tokens(llm):
    free = llm.generate("abc", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    stop = free.text[1:3]
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop],
                                             min_tokens=15))[0].outputs[0]
    assert len(out.token_ids) >= 15


def test_params_changed_after_construction_are_checked(llm):
    p = SamplingParams(max_tokens=4)
    p.temperature = -5.0
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("abc", p)
    q = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    text = llm.generate("abc", q)[0].outputs[0].text
    q.stop = [text[2:4]]
    out = llm.generate("abc", q)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == text[2:4]


def test_vllm_constructor_words():
    """LLM(..., trust_remote_code=True, tensor_parallel_size=1, dtype="auto") as vLLM's examples write it; another
    tensor_parallel_size is refused by name."""
    llm = LLM(str(demo_path()), backend="numpy", trust_remote_code=True, tensor_parallel_size=1, dtype="auto",
              max_model_len=64)
    assert llm.engine_config.dtype == "float32"
    with pytest.raises(ValueError, match="tensor_parallel_size 2"):
        LLM(str(demo_path()), backend="numpy", tensor_parallel_size=2)


def test_vllm_generate_and_chat_words(capsys):
    """A flat list of token ids is one prompt (vLLM); use_tqdm draws a bar on stderr and changes nothing else (and is
    refused with stream); lora_request other than None is refused; chat(continue_final_message=True) continues the last message."""
    llm = LLM(str(demo_path()), backend="numpy", max_model_len=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    ids = [5, 6, 7]
    one = llm.generate(ids, greedy)
    assert len(one) == 1 and one[0].prompt_token_ids == ids
    assert one[0].outputs[0].token_ids == llm.generate({"prompt_token_ids": ids}, greedy)[0].outputs[0].token_ids
    capsys.readouterr()
    barred = llm.generate(["a", "b"], greedy, use_tqdm=True)
    assert "requests" in capsys.readouterr().err
    assert [o.outputs[0].token_ids for o in barred] == [o.outputs[0].token_ids for o in llm.generate(["a", "b"], greedy)]
    with pytest.raises(ValueError, match="LoRA"):
        llm.generate("a", greedy, lora_request=object())
    with pytest.raises(ValueError, match="use_tqdm .* does not go with stream"):  # (was: no bar, silently)
        llm.generate("a", greedy, stream=True, use_tqdm=True)
    assert llm.llm_engine.has_unfinished_requests() is False  # the refusal added nothing
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well"}]
    cont = llm.chat(msgs, greedy, add_generation_prompt=False, continue_final_message=True)[0]
    tok = llm.get_tokenizer()
    assert cont.prompt_token_ids == tok.encode_chat(msgs, add_generation_prompt=False)[:-1]
    assert cont.prompt_token_ids[-1] != tok.eos_token_id


def test_every_token_banned_is_an_error():
    """With every token banned (stop_token_ids covering the vocabulary under min_tokens) and no grammar, the sample
    ends with an error naming the cause (was: a draw from NaN probabilities, token 0, and min_tokens ignored); the
    engine goes on serving."""
    llm = LLM(str(demo_path()), backend="numpy", max_model_len=64)
    vocab = llm.model_config.vocab_size
    out = llm.generate("hi", SamplingParams(max_tokens=3, min_tokens=3, seed=0, stop_token_ids=list(range(vocab))))
    c = out[0].outputs[0]
    assert c.finish_reason == "error" and "no token is allowed" in c.stop_reason and c.token_ids == []
    big = SamplingParams(max_tokens=2, top_k=2**31 - 1, temperature=0.0)
    assert llm.generate("hi", big)[0].outputs[0].token_ids == llm.generate(
        "hi", SamplingParams(max_tokens=2, temperature=0.0))[0].outputs[0].token_ids


@pytest.mark.parametrize(("prompt", "needle"), [(5, "prompts must be"), (b"abc", "prompts must be"),
                                                ([None], "a prompt must be"), ([b"abc"], "a prompt must be"),
                                                ([{"prompt_token_ids": None}], "prompt_token_ids must be"),
                                                ([{"prompt": 5}], "'prompt' must be a str"),
                                                ({"a", "b"}, "got a set: outputs come back in prompt order")])
def test_prompt_types_are_named(prompt, needle):
    """A prompt of a wrong type is a TypeError naming what a prompt may be (was: "'int' object is not iterable",
    or bytes read as token ids)."""
    llm = LLM(str(demo_path()), backend="numpy", max_model_len=64)
    with pytest.raises(TypeError, match=needle):
        llm.generate(prompt, SamplingParams(max_tokens=1))
    for bad in (None, "hello"):
        with pytest.raises(TypeError, match="token_ids must be"):
            llm.score(bad)
    assert llm.stats()["running"] == 0 and llm.stats()["waiting"] == 0


def test_prompt_logprobs_count_checked():
    """prompt_logprobs counts outside [0, 20] are refused by name (was: -1 listed every token, 5000 failed in NumPy's
    argpartition); a count past a small vocabulary lists every token."""
    llm = LLM(str(demo_path()), backend="numpy", max_model_len=64)
    for bad in (-1, 21, 5000, 2.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            llm.prompt_logprobs([1, 2, 3], bad)
    dicts, _ = llm.prompt_logprobs([1, 2, 3], 20)
    assert all(len(d) >= 20 for d in dicts[1:])


def test_truncate_prompt_tokens():
    """truncate_prompt_tokens keeps the prompt's last N ids (vLLM's left truncation; -1: max_model_len of them, which
    leaves no room to generate and is refused as any full prompt is); shorter prompts are untouched; bad values
    are named."""
    llm = LLM(str(demo_path()), backend="numpy", max_model_len=64)
    greedy = dict(temperature=0.0, max_tokens=3)
    ids = list(range(5, 45))
    cut = llm.generate({"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=10, **greedy))[0]
    ref = llm.generate({"prompt_token_ids": ids[-10:]}, SamplingParams(**greedy))[0]
    assert cut.prompt_token_ids == ids[-10:] and cut.outputs[0].token_ids == ref.outputs[0].token_ids
    same = llm.generate({"prompt_token_ids": ids[:5]}, SamplingParams(truncate_prompt_tokens=10, **greedy))[0]
    assert same.prompt_token_ids == ids[:5]
    text = "one two three four five six seven eight"  # the output's prompt stays the text given (vLLM's; was None)
    cut = llm.generate(text, SamplingParams(truncate_prompt_tokens=3, **greedy))[0]
    assert cut.prompt == text and cut.prompt_token_ids == llm.get_tokenizer().encode(text)[-3:]
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate({"prompt_token_ids": ids * 2}, SamplingParams(truncate_prompt_tokens=-1, **greedy))
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_llm_chat_template_argument():
    """LLM(chat_template=...) renders chats with the given template; without tokenizer files it is refused."""
    source = "{% for m in messages %}<|im_user|>{{ m['content'] }}<|im_end|>{% endfor %}"
    llm = LLM(str(demo_path()), backend="numpy", max_model_len=64, chat_template=source)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1))[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode("<|im_user|>hi<|im_end|>", allow_special=True)
    with pytest.raises(ValueError, match="chat_template needs the tokenizer"):
        LLM(str(demo_path()), backend="numpy", chat_template=source, skip_tokenizer_init=True)


def test_llm_chat_template_per_call(llm):
    """llm.chat(..., chat_template=...) (vLLM's argument): that call's conversations render with it, prompt text and
    ids alike; the next call uses the checkpoint's template again."""
    source = "{% for m in messages %}<|im_user|>{{ m['content'] }}<|im_end|>{% endfor %}<|im_assistant|>"
    tok = llm.get_tokenizer()
    convs = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "bye"}]]
    outs = llm.chat(convs, SamplingParams(max_tokens=1), chat_template=source)
    for conv, out in zip(convs, outs, strict=True):
        text = f"<|im_user|>{conv[0]['content']}<|im_end|><|im_assistant|>"
        assert out.prompt == text and out.prompt_token_ids == tok.encode(text, allow_special=True)
    again = llm.chat(convs[0], SamplingParams(max_tokens=1))[0]
    assert again.prompt_token_ids == tok.encode_chat(convs[0]) != outs[0].prompt_token_ids


def test_abort_request_alias():
    """LLMEngine.abort_request (vLLM's name) takes one id or several; the slots come back."""
    llm = LLM(str(demo_path()), backend="numpy", max_model_len=64)
    engine = llm.llm_engine
    for rid in ("a", "b", "c"):
        engine.add_request(rid, "hi", SamplingParams(max_tokens=5))
    engine.abort_request("a")
    engine.abort_request(["b", "c", "unknown"])
    assert not engine.requests and llm.stats()["slots_used"] == 0


def test_generation_config_defaults(tmp_path):
    """generation_config.json's sampling settings are the defaults (vLLM's --generation-config auto): a request
    without SamplingParams uses them, explicit ones win; "vllm" turns them off; a directory's file is read; a bad
    value names the file and key."""
    import json
    import shutil

    for f in demo_path().iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3,
                                                                 "do_sample": False}))
    llm = LLM(str(tmp_path), backend="numpy", max_model_len=64)
    assert llm.default_sampling == {"temperature": 0.0, "max_tokens": 3}
    out = llm.generate("hi")[0].outputs[0]
    greedy = llm.generate("hi", SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0]
    assert out.token_ids == greedy.token_ids and len(out.token_ids) <= 3
    assert len(llm.chat([{"role": "user", "content": "hi"}])[0].outputs[0].token_ids) <= 3
    plain = LLM(str(tmp_path), backend="numpy", max_model_len=64, generation_config="vllm")
    assert plain.default_sampling == {} and plain.get_default_sampling_params().max_tokens == 16
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 5}))
    assert LLM(str(tmp_path), backend="numpy", max_model_len=64, generation_config=str(other)).default_sampling == \
        {"top_k": 5}
    # a directory's max_new_tokens is vLLM's override_max_tokens, which its server applies (tests/server) and the
    # offline API does not: a request's own SamplingParams run as given
    (other / "generation_config.json").write_text(json.dumps({"max_new_tokens": 4}))
    capped = LLM(str(tmp_path), backend="numpy", max_model_len=64, generation_config=str(other))
    assert capped.max_tokens_override == 4 and llm.max_tokens_override is None
    long = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    assert len(capped.generate("hi", long)[0].outputs[0].token_ids) == 20
    assert len(capped.generate("hi")[0].outputs[0].token_ids) <= 4
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="generation_config.json: 'temperature' -1"):
        LLM(str(tmp_path), backend="numpy")
    with pytest.raises(ValueError, match="generation_config must be"):
        LLM(str(demo_path()), backend="numpy", generation_config="/nope")


def test_generation_config_max_tokens_fits_the_context(tmp_path):
    """A max_new_tokens from generation_config.json larger than a prompt's room in the context is capped to that
    room, as vLLM caps it (was: every request without its own max_tokens failed on the context length); a client's
    own max_tokens is still checked."""
    import json
    import shutil

    for f in demo_path().iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 1000, "temperature": 0.0}))
    llm = LLM(str(tmp_path), backend="numpy", max_model_len=64)
    ids = list(range(5, 55))
    out = llm.generate({"prompt_token_ids": ids})[0].outputs[0]
    assert len(out.token_ids) <= 14
    assert len(llm.chat([{"role": "user", "content": "hi"}])[0].outputs[0].token_ids) <= 64
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1000))


def test_model_argument_names_what_is_wrong(tmp_path):
    """LLM(model): a non-path is a TypeError naming the parameter (was: os.fspath's message), a file is not a
    directory (was: 'does not exist'), a missing path is no such directory (the CLIs' --model words)."""
    with pytest.raises(TypeError, match=r"model must be a checkpoint directory's path .* got int"):
        LLM(5)
    (tmp_path / "f").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"is a file, not a checkpoint directory"):
        LLM(str(tmp_path / "f"))
    with pytest.raises(FileNotFoundError, match=r"model '.*missing': no such directory"):
        LLM(str(tmp_path / "missing"))


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"report": "no"}, "report must be a bool, got 'no'"),
    ({"skip_tokenizer_init": 1}, "skip_tokenizer_init must be a bool, got 1"),
    ({"progress": "x"}, "progress must be a bool or None, got 'x'"),
], ids=["report-str", "skip-int", "progress-str"])
def test_llm_flags_must_be_bools(kwargs, needle):
    """LLM's on/off arguments are bools (was: any truthy value: report="no" turned the report on)."""
    with pytest.raises(TypeError, match=re.escape(needle)):
        LLM(str(demo_path()), backend="numpy", **kwargs)


def test_prompt_dict_without_a_prompt_names_its_keys(llm):
    """A prompt dict with neither 'prompt' nor 'prompt_token_ids' (a misspelt key) is refused naming the keys it has,
    and leaves no request behind."""
    with pytest.raises(ValueError, match=r"needs 'prompt_token_ids' or 'prompt', got keys 'promt'$"):
        llm.generate([{"promt": "hi"}], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"got keys none$"):
        llm.generate([{}], SamplingParams(max_tokens=2))
    out = llm.generate(["hi"], SamplingParams(max_tokens=2, temperature=0))
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 2
