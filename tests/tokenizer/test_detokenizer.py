"""IncrementalDetokenizer: streamed text == one-shot decode, for any ids and any chunking.

The demo vocabulary has 128 single-byte tokens 0x80..0xFF and partial-character merges such as
b'\\xe3\\x81', so random ids split multi-byte characters and produce invalid UTF-8 all the time.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_rt.text.detokenizer import IncrementalDetokenizer
from kda_rt.text.tokenizer import Tokenizer

_PARTIAL = [0xE4, 0xB8, 0xAD, 0xF0, 0x9F, 0x99, 0x82, 0xC3, 0xA9]  # bytes of 中, 🙂, é
ids_strategy = st.lists(st.one_of(st.integers(0, 1023), st.sampled_from(_PARTIAL)), max_size=60)
chunk_sizes = st.lists(st.integers(0, 6), min_size=1, max_size=20)


def _stream(tok: Tokenizer, ids: list[int], sizes: list[int], skip: bool) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    outputs, pos, k = [], 0, 0
    while pos < len(ids):
        size = sizes[k % len(sizes)] or 1
        outputs.append(detok.add(ids[pos:pos + size]))
        pos, k = pos + size, k + 1
    outputs.append(detok.flush())
    return outputs, detok


@settings(max_examples=300, deadline=None)
@given(ids=ids_strategy, sizes=chunk_sizes, skip=st.booleans())
def test_stream_matches_decode(demo_tok, ids, sizes, skip):
    outputs, detok = _stream(demo_tok, ids, sizes, skip)
    expected = demo_tok.decode(ids, skip_special_tokens=skip)
    assert "".join(outputs) == expected
    assert detok.text == expected


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40), sizes=chunk_sizes)
def test_stream_of_encoded_text(demo_tok, text, sizes):
    outputs, _ = _stream(demo_tok, demo_tok.encode(text), sizes, skip=True)
    assert "".join(outputs) == text


def test_holds_back_unfinished_character(demo_tok):
    detok = IncrementalDetokenizer(demo_tok)
    assert detok.add([0xE4]) == ""
    assert detok.add(0xB8) == ""
    assert detok.add([0xAD, *demo_tok.encode("!")]) == "中!"
    assert detok.add([0xF0, 0x9F]) == ""
    assert detok.add([770]) == ""  # special token skipped, the emoji is still incomplete
    assert detok.flush() == "\ufffd"
    assert detok.text == "中!\ufffd"


def test_specials_kept_when_asked(demo_tok):
    detok = IncrementalDetokenizer(demo_tok, skip_special_tokens=False)
    assert detok.add([0xC3, 770]) == "\ufffd<|im_end|>"
    assert detok.flush() == ""


def test_unknown_ids_produce_no_text():
    """A model with more vocabulary rows than the tokenizer has tokens must not crash generation."""
    from kda_rt.demo import demo_path
    from kda_rt.text.detokenizer import IncrementalDetokenizer
    from kda_rt.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(demo_path())
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode("abc")
    assert detok.add([ids[0], tok.vocab_size + 5, *ids[1:]]) + detok.flush() == "abc"


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
