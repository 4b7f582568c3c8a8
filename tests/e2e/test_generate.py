"""End to end on the bundled demo checkpoint (numpy backend): the public API and the CLI."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from kda_rt import LLM, SamplingParams
from kda_rt.demo import demo_path


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(demo_path()), backend="numpy", max_num_seqs=4, max_model_len=512)


def greedy(n: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_batch_equals_alone(llm):
    prompts = ["The quick brown fox", "Hello", "naïve café — 東京 🙂 and more words here"]
    together = llm.generate(prompts, greedy())
    for prompt, out in zip(prompts, together, strict=True):
        alone = llm.generate(prompt, greedy())[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert out.outputs[0].text == alone.outputs[0].text
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 12


def test_decode_logprobs_match_full_prefill_scores(llm):
    """Each generated token's logprob (prefill then decode steps) equals log-softmax of score()
    over the whole prefix (one prefill): fp32 agreement to 1e-4."""
    prompt = llm.get_tokenizer().encode("Decode must agree with prefill.")
    out = llm.generate({"prompt_token_ids": prompt}, greedy(8, logprobs=0))[0].outputs[0]
    scores = llm.score(prompt + out.token_ids).astype(np.float64)
    assert scores.shape == (len(prompt) + 8, llm.model_config.vocab_size)
    for i, tok in enumerate(out.token_ids):
        row = scores[len(prompt) - 1 + i]
        assert tok == int(np.argmax(row))
        logz = row.max() + np.log(np.exp(row - row.max()).sum())
        assert abs(out.logprobs[i][tok] - (row[tok] - logz)) < 1e-4


def test_seeded_sampling_independent_of_batch(llm):
    """The seed decides the draw: the same seeded request gives the same tokens alone, at another row
    of a mixed batch, and twice in one batch; another seed gives other tokens (temperature 1.5 over
    1024 tokens: 10 equal draws by chance are impossible in practice).  A sampler that ignored the
    seed fails the last check if its noise is fixed per row, and the others if it comes from a
    shared RNG stream."""
    hot = dict(temperature=1.5, top_p=0.95, max_tokens=10, ignore_eos=True)
    p = SamplingParams(seed=1234, **hot)
    alone = llm.generate("Once upon a time", p)[0].outputs[0].token_ids
    assert llm.generate("Once upon a time", p)[0].outputs[0].token_ids == alone
    mixed = llm.generate(["Other prompt", "Once upon a time", "x", "Once upon a time", "Once upon a time"],
                         [SamplingParams(temperature=0.7, max_tokens=5), p, SamplingParams(max_tokens=3), p,
                          SamplingParams(seed=1235, **hot)])
    assert mixed[1].outputs[0].token_ids == alone and mixed[3].outputs[0].token_ids == alone
    assert mixed[4].outputs[0].token_ids != alone, "seeds 1234 and 1235 drew the same 10 tokens: the seed is ignored"


def test_n_samples_and_stop_conditions(llm):
    outs = llm.generate("abc", SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True))[0].outputs
    assert [o.index for o in outs] == [0, 1, 2] and len({tuple(o.token_ids) for o in outs}) > 1
    ref = llm.generate("abc", greedy(10))[0].outputs[0]
    stop_id = ref.token_ids[3]
    first = ref.token_ids.index(stop_id)
    out = llm.generate("abc", greedy(10, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == ref.token_ids[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    if len(ref.text) > 4:
        stop = ref.text[2:4]
        out = llm.generate("abc", greedy(10, stop=[stop]))[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == ref.text[: ref.text.find(stop)]


def _plain_tokens(llm, ids):
    """Positions j >= 1 of ids whose token decodes alone to ordinary text of 2+ characters (no special, no
    partial UTF-8) and does not occur before j."""
    tok = llm.get_tokenizer()
    return [j for j in range(1, len(ids)) if ids[j] not in ids[:j] and ids[j] not in tok.special_ids
            and len(tok.decode([ids[j]])) >= 2 and "\ufffd" not in tok.decode([ids[j]])]


def test_stop_token_text_with_include_stop_str_in_output(llm):
    """As vLLM's v1 detokenizer: a stop token id (or EOS) ends the text before it, and with
    include_stop_str_in_output its text is in the output.  Was: never in the text."""
    tok = llm.get_tokenizer()
    ref = llm.generate("Hello", greedy(12))[0].outputs[0]
    ids = list(ref.token_ids)
    j = _plain_tokens(llm, ids)[0]
    for include, upto in ((False, j), (True, j + 1)):
        out = llm.generate("Hello", greedy(12, stop_token_ids=[ids[j]], include_stop_str_in_output=include))[0]
        o = out.outputs[0]
        assert (o.finish_reason, o.stop_reason, list(o.token_ids)) == ("stop", ids[j], ids[: j + 1]), include
        assert o.text == tok.decode(ids[:upto], skip_special_tokens=True), (include, o.text)


def test_stop_string_in_a_stop_tokens_text_and_eos_first(llm):
    """A stop token's text (with include_stop_str_in_output) is searched for stop strings too, and a hit is the stop
    reason (vLLM's detokenizer result replaces the id); without the flag its text is not decoded, so the id stays.
    An id that is EOS and a stop id reports None: EOS is checked first, as vLLM's check_stop."""
    tok = llm.get_tokenizer()
    ref = llm.generate("Hello", greedy(12))[0].outputs[0]
    ids = list(ref.token_ids)
    j = next(j for j in _plain_tokens(llm, ids) if tok.decode([ids[j]])[-2:] not in
             tok.decode(ids[:j], skip_special_tokens=True) + tok.decode([ids[j]])[:-1])
    tail, upto = tok.decode([ids[j]])[-2:], tok.decode(ids[: j + 1], skip_special_tokens=True)
    o = llm.generate("Hello", greedy(12, stop_token_ids=[ids[j]], stop=[tail], include_stop_str_in_output=True))[0]
    assert (o.outputs[0].stop_reason, o.outputs[0].text) == (tail, upto)
    o = llm.generate("Hello", greedy(12, stop_token_ids=[ids[j]], stop=[tail]))[0]
    assert (o.outputs[0].stop_reason, o.outputs[0].text) == (ids[j], tok.decode(ids[:j], skip_special_tokens=True))
    eos = tok.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[eos], logit_bias={eos: 100.0})
    o = llm.generate("Hello", params)[0].outputs[0]
    assert (list(o.token_ids), o.finish_reason, o.stop_reason) == ([eos], "stop", None)
    o = llm.generate("Hello", replace(params, ignore_eos=True))[0].outputs[0]
    assert (list(o.token_ids), o.finish_reason, o.stop_reason) == ([eos], "stop", eos)  # ignore_eos: a stop id still


def test_other_eos_ids_report_their_id(llm):
    """An EOS id other than the tokenizer's own (here the tokenizer's second stop token, `[EOS]`; likewise
    generation_config.json's extra ids) ends the sequence with its id as stop_reason, as vLLM's stop token ids do;
    ignore_eos ignores it too (vLLM adds those ids to the stop ids only without ignore_eos)."""
    tok = llm.get_tokenizer()
    others = sorted(llm.llm_engine.eos_token_ids - {tok.eos_token_id})
    assert others, "the demo checkpoint has a second EOS id"
    other = others[0]
    params = SamplingParams(temperature=0, max_tokens=4, logit_bias={other: 100.0})
    o = llm.generate("Hello", params)[0].outputs[0]
    assert (list(o.token_ids), o.finish_reason, o.stop_reason) == ([other], "stop", other)
    o = llm.generate("Hello", replace(params, ignore_eos=True))[0].outputs[0]
    assert (list(o.token_ids), o.finish_reason, o.stop_reason) == ([other] * 4, "length", None)


def test_stop_string_ending_first_wins(llm):
    """Two stop strings completed by one token: the one that ends first in the text wins (vLLM's
    check_stop_strings), whatever starts first.  Was: the earliest start."""
    tok = llm.get_tokenizer()
    ids = list(llm.generate("Hello", greedy(12))[0].outputs[0].token_ids)
    for k in _plain_tokens(llm, ids):
        before, new = tok.decode(ids[:k], skip_special_tokens=True), tok.decode([ids[k]])
        if "\ufffd" in before or not before or tok.decode(ids[: k + 1], skip_special_tokens=True) != before + new:
            continue
        early_end, early_start = new[:2], before[-1] + new  # ends at before + 2 / starts at before - 1
        if early_end not in before + new[:1] and early_start not in before:
            break
    else:
        raise AssertionError("no token of the greedy output fits the test")
    for stops in ([early_start, early_end], [early_end, early_start]):
        o = llm.generate("Hello", greedy(12, stop=stops))[0].outputs[0]
        assert (o.stop_reason, o.text) == (early_end, before), stops
        o = llm.generate("Hello", greedy(12, stop=stops, include_stop_str_in_output=True))[0].outputs[0]
        assert (o.stop_reason, o.text) == (early_end, before + early_end), stops


def test_stop_string_inside_min_tokens_is_not_matched(llm):
    """A stop string whose text lies wholly inside the first min_tokens tokens' text never stops the request,
    even beside a longer stop string (vLLM checks only text after token min_tokens).  Was: the longest string's
    window reached back into it."""
    tok = llm.get_tokenizer()
    ref = llm.generate("Hello", greedy(12))[0].outputs[0]
    ids, full = list(ref.token_ids), ref.text
    j = next(j for j in _plain_tokens(llm, ids) if j <= 3 and full.count(tok.decode([ids[j]])) == 1)
    stop = tok.decode([ids[j]])
    o = llm.generate("Hello", greedy(12, stop=[stop, "Z" * 40], min_tokens=4))[0].outputs[0]
    assert (o.finish_reason, o.stop_reason, o.text) == ("length", None, full)


def test_include_stop_str_streams_without_holding_back(llm):
    """With include_stop_str_in_output nothing is held back while streaming (vLLM's stop_buffer_length 0): the
    deltas are those of a request without stop strings; without it, longest - 1 characters are held back."""
    plain = [d.outputs[0].text for d in llm.generate("Hello", greedy(12), stream=True)]
    kept = [d.outputs[0].text for d in llm.generate("Hello", greedy(12, stop=["Z" * 6],
                                                                   include_stop_str_in_output=True), stream=True)]
    held = [d.outputs[0].text for d in llm.generate("Hello", greedy(12, stop=["Z" * 6]), stream=True)]
    assert kept == plain and "".join(held) == "".join(plain) and held != plain


def test_request_ids_count_on_across_calls(llm):
    """vLLM's LLM numbers requests with one counter for its lifetime: a second generate call's ids follow the
    first's (were "0", "1", ... again each call)."""
    first = [o.request_id for o in llm.generate(["a", "b"], greedy(1))]
    second = [o.request_id for o in llm.generate(["c", "d", "e"], greedy(1))]
    start = int(first[0])
    assert first + second == [str(start + i) for i in range(5)]


def test_unfinished_character_at_the_end_is_left_out(llm):
    """A request that ends inside a multi-byte character (here: max_tokens) leaves those bytes out of its text, as
    vLLM's detokenizers do (was: a trailing U+FFFD); token_ids keep every token."""
    import codecs

    tok = llm.get_tokenizer()
    ids = list(llm.generate("Hello", greedy(24))[0].outputs[0].token_ids)

    def pending(k):  # the bytes of an unfinished character at the end of the first k tokens' bytes
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        dec.decode(tok.decode_bytes(ids[:k], skip_special_tokens=True))
        return dec.getstate()[0]

    k = next(k for k in range(1, len(ids)) if pending(k))
    data = tok.decode_bytes(ids[:k], skip_special_tokens=True)
    o = llm.generate("Hello", greedy(k))[0].outputs[0]
    assert list(o.token_ids) == ids[:k] and o.finish_reason == "length"
    assert o.text == data[: len(data) - len(pending(k))].decode("utf-8", errors="replace")
    assert tok.decode(ids[:k], skip_special_tokens=True) == o.text + "\ufffd"  # what a flush gave


def test_allowed_token_ids(llm):
    """vLLM's allowed_token_ids: every sampled token is one of them, with their probabilities renormalised among
    themselves (greedy: the one of them with the largest logit); an empty list or an id past the vocabulary is
    refused, named."""
    allowed = [40, 41, 97, 300]
    out = llm.generate(["Hello", "naïve"], SamplingParams(temperature=1.0, max_tokens=24, seed=5, ignore_eos=True,
                                                          allowed_token_ids=allowed, logprobs=2))
    for o in out:
        ids = list(o.outputs[0].token_ids)
        assert len(ids) == 24 and set(ids) <= set(allowed), ids
        assert all(set(lp) <= set(allowed) for lp in o.outputs[0].logprobs)  # the rest are -inf: never listed
    logits = llm.score(llm.get_tokenizer().encode("Hello"))[-1]
    first = llm.generate("Hello", greedy(1, allowed_token_ids=allowed))[0].outputs[0].token_ids[0]
    assert first == allowed[int(np.argmax(logits[allowed]))]
    for bad, match in (([], "allowed_token_ids is empty"), ([5, -1], "allowed_token_ids must be a list of token ids"),
                       ("40", "allowed_token_ids must be a list")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(allowed_token_ids=bad)
    with pytest.raises(ValueError, match=r"allowed_token_ids holds 99999999, outside the vocabulary"):
        llm.generate("Hello", greedy(1, allowed_token_ids=[3, 99999999]))


def test_bad_words(llm):
    """vLLM's bad_words: a word's last token is banned wherever its other tokens end the output, so the word is
    never completed; a one-token word is never generated.  Greedy: the output follows the reference up to the word
    and then departs from it at the banned token."""
    from kda_rt.engine.llm_engine import bad_words_token_ids

    tok = llm.get_tokenizer()
    ids = list(llm.generate("Hello", greedy(16))[0].outputs[0].token_ids)
    plain = [j for j in _plain_tokens(llm, ids) if j + 1 < len(ids)]
    one = next(j for j in plain if tuple(tok.encode(tok.decode([ids[j]]).lstrip())) == (ids[j],))
    word = tok.decode([ids[one]])
    o = llm.generate("Hello", greedy(16, bad_words=[word]))[0].outputs[0]
    assert list(o.token_ids[:one]) == ids[:one] and o.token_ids[one] != ids[one]
    assert not set(o.token_ids) & {w[-1] for w in bad_words_token_ids(tok, [word])}
    two = next(j for j in range(1, len(ids) - 1) if j in plain and j + 1 in plain
               and tuple(tok.encode(tok.decode(ids[j:j + 2]).lstrip())) == tuple(ids[j:j + 2]))
    # a two-token word: its second token is banned only right after its first
    o = llm.generate("Hello", greedy(16, bad_words=[tok.decode(ids[two:two + 2])]))[0].outputs[0]
    assert list(o.token_ids[:two + 1]) == ids[:two + 1] and o.token_ids[two + 1] != ids[two + 1]
    for bad, match in (([""], "bad_words must be a list of non-blank strings"), ("word", "bad_words must be a list"),
                       ([" "], "non-blank"), (["w"] * 1 + [str(i) for i in range(70)], "at most MAX_BAD_WORDS")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(bad_words=bad)
    assert SamplingParams(bad_words=["a", "a", "b"]).bad_words == ["a", "b"]
    end = tok.encode("<|im_end|>", allow_special=True)
    assert len(end) == 1 and bad_words_token_ids(tok, ["<|im_end|>"])[0] == tuple(end)  # the marker, not its text
    # the token ids go on the request's own copy of the params, never on the caller's object (which another engine,
    # with another tokenizer, may take next), and a params object without bad_words is the request's own
    mine = greedy(4, bad_words=[word])
    llm.llm_engine.add_request("bw-copy", "Hello", mine)
    (seq,) = llm.llm_engine.requests["bw-copy"][1]
    assert mine.bad_words_token_ids == () and seq.params.bad_words_token_ids == bad_words_token_ids(tok, [word])
    assert seq.params is not mine and seq.params.bad_words == [word]
    llm.llm_engine.abort("bw-copy")
    plain_params = greedy(4)
    llm.llm_engine.add_request("bw-none", "Hello", plain_params)
    assert llm.llm_engine.requests["bw-none"][1][0].params is plain_params
    llm.llm_engine.abort("bw-none")


def test_bad_word_bans_rule():
    """sampler/batch.bad_word_bans: the last token of every word whose other tokens end the output."""
    from kda_rt.sampler.batch import bad_word_bans

    p = SamplingParams(bad_words=["x"])
    p.bad_words_token_ids = ((7,), (1, 2, 3), (4, 5))
    assert bad_word_bans(p, []) == [7]
    assert bad_word_bans(p, [9, 1, 2]) == [7, 3]
    assert bad_word_bans(p, [1, 2, 4]) == [7, 5]
    assert bad_word_bans(p, [2]) == [7]


def test_detokenize_false(llm):
    """vLLM's detokenize=False: the same token ids, no text, logprobs without decoded tokens; stop strings refused
    (they are matched in the text)."""
    ref = llm.generate("Hello", greedy(8, logprobs=1))[0].outputs[0]
    o = llm.generate("Hello", greedy(8, logprobs=1, detokenize=False))[0].outputs[0]
    assert o.token_ids == ref.token_ids and o.text == "" and ref.text
    assert all(lp.decoded_token is None for step in o.logprobs for lp in step.values())
    assert any(lp.decoded_token for step in ref.logprobs for lp in step.values())
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="detokenize must be a bool"):
        SamplingParams(detokenize=0)


def test_chat_and_errors(llm):
    out = llm.chat([{"role": "user", "content": "hi <|im_end|>"}], greedy(4))[0]
    tok = llm.get_tokenizer()
    assert len(out.outputs[0].token_ids) == 4
    assert out.prompt_token_ids.count(tok.encode("<|im_end|>", allow_special=True)[0]) == 2  # system + user turn ends
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [1] * 600}, greedy(4))
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, greedy(4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [5, 1024]}, greedy(4))
    with pytest.raises(ValueError, match="backend"):
        LLM(str(demo_path()), backend="tpu")
    assert llm.stats()["slots_used"] == 0 and llm.stats()["pages_used"] == 0


def test_chat_takes_text_content_parts(llm):
    # OpenAI's content parts, as vLLM's LLM.chat and the server take them (was: "content must be a str or None"),
    # joined by newlines as vLLM joins them
    plain = llm.chat([{"role": "user", "content": "hi\nthere"}], greedy(3))[0]
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}],
                     greedy(3))[0]
    assert parts.prompt == plain.prompt and parts.prompt_token_ids == plain.prompt_token_ids
    assert parts.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"messages\[0\].content: only text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], greedy(3))


def test_text_prompt_reads_special_tokens(llm):
    """A text prompt is the whole model input: the chat template applied by the caller gives the chat's own ids
    (its markers are control tokens, as the checkpoint's tokenizer and vLLM read them), and the same greedy output;
    a chat message's literal marker stays text (test above)."""
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": "Is 123 a prime?"}]
    text = tok.apply_chat_template(msgs)
    chat = llm.chat(msgs, greedy(5))[0]
    plain = llm.generate(text, greedy(5))[0]
    assert plain.prompt_token_ids == chat.prompt_token_ids == tok.encode_chat(msgs)
    assert chat.prompt == plain.prompt == text  # the rendered template is the chat output's prompt, as in vLLM
    two = llm.chat([msgs, [{"role": "user", "content": "x"}]], greedy(1), add_generation_prompt=False)
    assert [o.prompt for o in two] == [tok.apply_chat_template(m, add_generation_prompt=False)
                                       for m in (msgs, [{"role": "user", "content": "x"}])]
    with pytest.raises(TypeError, match="'prompt' must be a str, got int"):
        llm.generate({"prompt_token_ids": [5, 6], "prompt": 7}, greedy(1))
    assert llm.generate({"prompt_token_ids": [5, 6], "prompt": "ab"}, greedy(1))[0].prompt == "ab"
    assert tok.encode("<|im_end|>", allow_special=True)[0] in plain.prompt_token_ids
    assert plain.outputs[0].token_ids == chat.outputs[0].token_ids
    assert llm.generate("a <|im_end|> b", greedy(1))[0].prompt_token_ids == tok.encode("a <|im_end|> b",
                                                                                      allow_special=True)


def test_cli_runs_demo():
    res = subprocess.run([sys.executable, "-m", "kda_rt.generate", "--max-tokens", "5", "--backend", "numpy"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "demo checkpoint" in res.stderr and "generated 5 tokens" in res.stderr


def test_bfloat16_emulation_is_close_to_float32():
    """dtype="bfloat16" rounds activations where the bf16 references do: `Compute.act` is bf16's round-to-nearest
    bit for bit (and the identity without the option), and the logits sit at bf16's noise from the float32 run on
    most positions (a router near-tie can flip an expert, which is why this is a median, not a max): bf16's 2^-9
    relative rounding at ~10 points a layer over 4 layers gives ~1e-2 (measured 0.0113), float16's 2^-11 would give
    ~0.0015 (measured by rounding to float16 instead), so the window [5e-3, 3e-2] tells the two apart."""
    import ml_dtypes

    from kda_rt.reference.params import Compute

    x = np.random.default_rng(6).normal(size=(7, 33)).astype(np.float32) * 10
    rounded = Compute(np.float32, bf16_activations=True).act(x)
    assert np.array_equal(rounded, x.astype(ml_dtypes.bfloat16).astype(np.float32)) and not np.array_equal(rounded, x)
    assert Compute(np.float32).act(x) is x
    ids = list(np.random.default_rng(5).integers(0, 768, size=40))
    f32 = LLM(str(demo_path()), backend="numpy", max_model_len=128).score(ids)
    b16 = LLM(str(demo_path()), backend="numpy", dtype="bfloat16", max_model_len=128).score(ids)
    err = np.linalg.norm(b16 - f32, axis=-1) / np.linalg.norm(f32, axis=-1)
    assert 5e-3 < np.median(err) < 3e-2, err
