"""`SamplingParams.spaces_between_special_tokens` through the engine (vLLM's default True): with
`skip_special_tokens=False` the Kimi class's special tokens are spaced in every output (n > 1, streamed, stop strings
matched in the spaced text, a stop token kept by include_stop_str_in_output); with the default
`skip_special_tokens=True` the field changes nothing.  The demo model samples from `allowed_token_ids`, so its outputs
mix <|im_user|> (an added token of the Kimi class), the tool-call marker <|tool_call_begin|> (not one) and text."""

from __future__ import annotations

import pytest

from kda_rt import LLM, SamplingParams
from kda_rt.demo import demo_path

USER, CALL, END = 771, 781, 770  # <|im_user|>, <|tool_call_begin|>, <|im_end|> (the demo's EOS)
PROMPT = {"prompt_token_ids": [72, 105, 772, 97, 785]}  # ... <|im_assistant|> a <|im_middle|>: a chat prompt's end


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(demo_path()), backend="numpy", dtype="float64", max_num_seqs=4, max_model_len=128)


def params(**kw) -> SamplingParams:
    base = dict(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True, skip_special_tokens=False,
                allowed_token_ids=[72, 105, USER, CALL])
    return SamplingParams(**{**base, **kw})


def spaced(tok, ids: list[int], after_added: bool = True) -> str:
    """vLLM's text of ids of whole characters after a prompt ending in an added token: one space between an added token
    and its neighbours."""
    out = []
    for t in ids:
        here = t in tok.added_ids
        out.append((" " if here or after_added else "") + tok.decode([t]))
        after_added = here
    return "".join(out)


def test_outputs_are_spaced_by_default(llm):
    tok = llm.get_tokenizer()
    (out,) = llm.generate([PROMPT], params(n=2))
    assert len(out.outputs) == 2
    for c in out.outputs:
        assert USER in c.token_ids and CALL in c.token_ids  # both kinds are there to tell apart
        assert c.text == spaced(tok, c.token_ids)
        assert c.text.startswith(" ")  # after the prompt's <|im_middle|>, as vLLM starts it
    (plain,) = llm.generate([PROMPT], params(n=2, spaces_between_special_tokens=False))
    assert [c.token_ids for c in plain.outputs] == [c.token_ids for c in out.outputs]
    assert [c.text for c in plain.outputs] == [tok.decode(c.token_ids) for c in out.outputs]


def test_stream_adds_up_to_the_spaced_text(llm):
    (final,) = llm.generate([PROMPT], params(n=2))
    texts = {0: "", 1: ""}
    for out in llm.generate([PROMPT], params(n=2), stream=True):
        for c in out.outputs:
            texts[c.index] += c.text
    assert texts == {c.index: c.text for c in final.outputs}


def test_skipped_specials_leave_the_field_without_effect(llm):
    """The default skip_special_tokens=True drops every special token: True and False give the same text."""
    tok = llm.get_tokenizer()
    outs = [llm.generate(["Hello <|im_user|> there"], params(skip_special_tokens=True, n=2,
                                                              spaces_between_special_tokens=spaces))[0]
            for spaces in (True, False)]
    assert [c.text for c in outs[0].outputs] == [c.text for c in outs[1].outputs]
    assert [c.text for c in outs[0].outputs] == [tok.decode(c.token_ids, skip_special_tokens=True)
                                                 for c in outs[0].outputs]


def test_stop_strings_see_the_spaces(llm):
    """A stop string is matched in the spaced text (vLLM's detokenizer checks its own output): one holding the space
    before <|im_user|> stops the output there, the space before it left in the text; unspaced it never matches."""
    (ref,) = llm.generate([PROMPT], params())
    text = ref.outputs[0].text
    at = text.index(" <|im_user|>", 1)
    stop = text[at - 1:at + len(" <|im_user|>")]
    (cut,) = llm.generate([PROMPT], params(stop=[stop]))
    assert (cut.outputs[0].text, cut.outputs[0].finish_reason, cut.outputs[0].stop_reason) == \
        (text[:at - 1], "stop", stop)
    (kept,) = llm.generate([PROMPT], params(stop=[stop], include_stop_str_in_output=True))
    assert kept.outputs[0].text == text[:at + len(" <|im_user|>")]
    (plain,) = llm.generate([PROMPT], params(stop=[stop], spaces_between_special_tokens=False))
    assert plain.outputs[0].finish_reason == "length"


def test_a_kept_stop_token_is_spaced(llm):
    """EOS with include_stop_str_in_output: its text is in the output, spaced as the rest."""
    tok = llm.get_tokenizer()
    kw = dict(ignore_eos=False, allowed_token_ids=[72, USER, END], max_tokens=60)
    (out,) = llm.generate([PROMPT], params(include_stop_str_in_output=True, **kw))
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.token_ids[-1] == END
    assert c.text.endswith(" <|im_end|>") and c.text == spaced(tok, c.token_ids)
    (dropped,) = llm.generate([PROMPT], params(**kw))
    assert dropped.outputs[0].text == spaced(tok, c.token_ids[:-1])


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
