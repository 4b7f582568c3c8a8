"""`spaces_between_special_tokens` in the detokenizer: vLLM's text for the Kimi tokenizer.

vLLM detokenizes Kimi's TikTokenTokenizer (a slow `PreTrainedTokenizer` whose `get_added_vocab()` is not empty) with
its slow incremental detokenizer: the tokens of the added vocabulary (the Kimi class's special tokens alone) are
pieces of their own, joined to the text between them with one space, starting from the prompt's tail.  The expected
pieces below are that detokenizer's, one token at a time, run over the HF Kimi tokenizer (transformers 5.25) on the
demo vocabulary and written out here.  Demo ids: 785 <|im_middle|>, 770 <|im_end|>, 771 <|im_user|> (added);
769 [EOS], 779-783 the tool-call markers, 1000 a reserved slot (not added); 230 157 177 the bytes of 東.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_rt.text.detokenizer import IncrementalDetokenizer
from kda_rt.text.tokenizer import Tokenizer

HF_ADDED = {"[BOS]": 768, "<|im_end|>": 770, "[UNK]": 1022, "[PAD]": 1023, "<|im_user|>": 771, "<|im_assistant|>": 772,
            "<|start_header_id|>": 774, "<|end_header_id|>": 775, "[EOT]": 777, "<|im_system|>": 778,
            "<|im_middle|>": 785}

# (prompt, output ids, vLLM's text of each output token)
VLLM_SPACED = [
    ([72, 785], [72, 105, 259, 261], [" H", "i", " the", "re"]),
    ([72, 785], [770, 771, 72, 105, 770], [" <|im_end|>", " <|im_user|>", " H", "i", " <|im_end|>"]),
    ([72, 105], [770, 72], [" <|im_end|>", " H"]),
    ([785], [785, 785, 72], [" <|im_middle|>", " <|im_middle|>", " H"]),
    ([72, 785], [230, 157, 177, 770, 97], ["", "", " 東", " <|im_end|>", " a"]),
    ([72, 785], [230, 157, 770, 97], ["", "", " \ufffd <|im_end|>", " a"]),  # a character cut by a special token
    ([72, 785], [779, 781, 102, 58, 48, 782, 371, 125, 783, 780],
     [" <|tool_calls_section_begin|>", "<|tool_call_begin|>", "f", ":", "0", "<|tool_call_argument_begin|>", '{"', "}",
      "<|tool_call_end|>", "<|tool_calls_section_end|>"]),
    ([72, 785], [769, 1000, 72, 770], [" [EOS]", "<|reserved_token_1000|>", "H", " <|im_end|>"]),
]


def test_added_vocab_is_the_kimi_classes(demo_tok):
    """get_added_vocab() as the HF Kimi class answers it: its special tokens alone, not the tool-call markers."""
    assert demo_tok.get_added_vocab() == HF_ADDED
    assert demo_tok.added_ids == frozenset(HF_ADDED.values())


def test_added_vocab_follows_the_configs_additional_special_tokens(model_dir):
    """A config's additional_special_tokens replace the chat markers, as in the Kimi class (names that are no special
    token are left out); a field that is no list of token strings is refused by name."""
    import json

    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["additional_special_tokens"] = ["<|tool_call_begin|>", {"content": "[EOS]"}, "<|nope|>"]
    path.write_text(json.dumps(config))
    tok = Tokenizer.from_dir(model_dir)
    assert tok.get_added_vocab() == {"[BOS]": 768, "[EOS]": 769, "<|im_end|>": 770, "<|tool_call_begin|>": 781,
                                     "[UNK]": 1022, "[PAD]": 1023}
    config["additional_special_tokens"] = "<|im_end|>"
    path.write_text(json.dumps(config))
    from kda_rt.text.tokenizer_files import TokenizerError

    with pytest.raises(TokenizerError, match="additional_special_tokens"):
        Tokenizer.from_dir(model_dir)


@pytest.mark.parametrize("prompt, ids, expected", VLLM_SPACED, ids=[f"case{i}" for i in range(len(VLLM_SPACED))])
def test_spaced_like_vllm(demo_tok, prompt, ids, expected):
    detok = IncrementalDetokenizer(demo_tok, skip_special_tokens=False, spaces_between_special_tokens=True,
                                   prompt_token_ids=prompt)
    assert [detok.add([t]) for t in ids] == expected


@pytest.mark.parametrize("prompt, ids, expected", VLLM_SPACED, ids=[f"case{i}" for i in range(len(VLLM_SPACED))])
def test_unspaced_and_skipped_are_unchanged(demo_tok, prompt, ids, expected):
    """spaces_between_special_tokens=False: the plain decode; skip_special_tokens=True: no spaces, either way."""
    for spaces in (False, True):
        plain = IncrementalDetokenizer(demo_tok, skip_special_tokens=False, spaces_between_special_tokens=False,
                                       prompt_token_ids=prompt)
        skipped = IncrementalDetokenizer(demo_tok, skip_special_tokens=True, spaces_between_special_tokens=spaces,
                                         prompt_token_ids=prompt)
        assert "".join(plain.add([t]) for t in ids) == demo_tok.decode(ids)
        assert "".join(skipped.add([t]) for t in ids) == demo_tok.decode(ids, skip_special_tokens=True)


def spaced_decode(tok: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    """One-shot reference: the runs of text between added tokens decoded apart, every piece joined by one space.  The
    prompt's last token is a piece before the output (added) or opens its first run (text), with no text of its own."""
    added = prompt and prompt[-1] in tok.added_ids
    pieces: list[str] = [""] if added else []
    run: list[int] | None = [] if prompt and not added else None  # the open run of text, None when there is none
    for t in ids:
        if t in tok.added_ids:
            pieces += [tok.decode(run)] if run is not None else []
            pieces.append(tok.decode([t]))
            run = None
        else:
            run = (run or []) + [t]
    pieces += [tok.decode(run)] if run is not None else []
    return " ".join(pieces)


_PARTIAL = [0xE4, 0xB8, 0xAD, 0xF0, 0x9F, 0x99, 0x82, 0xC3, 0xA9]  # bytes of 中, 🙂, é
_ADDED = sorted(HF_ADDED.values())
ids_strategy = st.lists(st.one_of(st.integers(0, 1023), st.sampled_from(_PARTIAL), st.sampled_from(_ADDED)),
                        max_size=40)


@settings(max_examples=300, deadline=None)
@given(prompt=st.lists(st.one_of(st.integers(0, 1023), st.sampled_from(_ADDED)), max_size=3), ids=ids_strategy,
       sizes=st.lists(st.integers(1, 5), min_size=1, max_size=8))
def test_spaced_stream_matches_the_one_shot_reference(demo_tok, prompt, ids, sizes):
    """Any chunking of any ids (cut characters, invalid bytes, added tokens in a row) gives the reference's text."""
    detok = IncrementalDetokenizer(demo_tok, skip_special_tokens=False, spaces_between_special_tokens=True,
                                   prompt_token_ids=prompt)
    out, pos, k = [], 0, 0
    while pos < len(ids):
        size = sizes[k % len(sizes)]
        out.append(detok.add(ids[pos:pos + size]))
        pos, k = pos + size, k + 1
    out.append(detok.flush())
    assert "".join(out) == detok.text == spaced_decode(demo_tok, prompt, ids)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
