"""Encode/decode round trips, special-token handling and the `&&` pre-tokenizer regex (spec §7.2-7.4).

Demo vocabulary: ids 0..767 are BPE tokens (0..255 single bytes), 768..1023 specials
([BOS]=768, [EOS]=769, <|im_end|>=770, ..., <|im_middle|>=785, [UNK]=1022, [PAD]=1023).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import regex

import kda_rt.demo
from kda_rt.demo.make_vocab import NUM_MERGEABLE, SAMPLE_TEXT, rank_file_text, tokenizer_config, train_bpe
from kda_rt.text.tokenizer import PAT_STR, Tokenizer

DEMO_DIR = Path(kda_rt.demo.__file__).parent
ROUND_TRIP = {
    "ascii": "Hello, world! Is 123 a prime? It's 3 * 41.\n\tdef f(x): return x ** 2\r\n",
    "cjk": "你好，世界！机器学习是人工智能的一个分支。こんにちは。안녕하세요",
    "emoji": "🙂🚀 👍🏽 👨‍👩‍👧 ❤️ 🇯🇵",
    "mixed": "Café naïve 中文abc Привет 🌍 x=1,234,567 <|im_end|> [BOS]   \n\n end",
    "empty": "",
    "spaces": "   \n \n\n\t  ",
}


@pytest.mark.parametrize("text", ROUND_TRIP.values(), ids=ROUND_TRIP.keys())
def test_round_trip(demo_tok, text):
    ids = demo_tok.encode(text)
    assert all(0 <= i < 768 for i in ids)
    assert demo_tok.decode(ids) == text
    assert b"".join(demo_tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_vocab_layout(demo_tok):
    assert demo_tok.vocab_size == 1024
    assert demo_tok.bos_token_id == 768
    assert demo_tok.eos_token_id == 770
    assert demo_tok.stop_token_ids == (770, 769)
    assert demo_tok.special_ids == frozenset(range(768, 1024))
    assert demo_tok.token_to_id("<|im_middle|>") == 785
    assert demo_tok.token_to_id("<|reserved_token_773|>") == 773
    assert demo_tok.token_bytes(65) == b"A"
    assert demo_tok.token_bytes(1023) == b"[PAD]"


@pytest.mark.parametrize("special", ["<|im_end|>", "[BOS]", "<|im_user|>", "<|reserved_token_800|>"])
def test_special_strings_are_text_by_default(demo_tok, special):
    text = f"say {special} now"
    ids = demo_tok.encode(text)
    assert not set(ids) & demo_tok.special_ids
    assert demo_tok.decode(ids) == text
    control = demo_tok.encode(text, allow_special=True)
    assert control.count(demo_tok.token_to_id(special)) == 1
    assert demo_tok.decode(control) == text


@pytest.mark.parametrize(("text", "index"), [("a\ud800b", 1), ("\udfff", 0), ("ok " * 3 + "\udc80", 9)])
def test_lone_surrogates_are_refused(demo_tok, text, index):
    """A str holding a lone surrogate is no Unicode text: a ValueError naming it and its index (tiktoken encoded it
    as U+FFFD, silently; the server's JSON decoder refuses it with a 400)."""
    with pytest.raises(ValueError, match=f"lone surrogate .* at index {index}"):
        demo_tok.encode(text)


def test_decode_skip_special_and_errors(demo_tok):
    ids = [778, *demo_tok.encode("hi"), 770]
    assert demo_tok.decode(ids) == "<|im_system|>hi<|im_end|>"
    assert demo_tok.decode(ids, skip_special_tokens=True) == "hi"
    assert demo_tok.decode([0xE4, 0xB8]) == "\ufffd"  # half of 中: one replacement char
    with pytest.raises(ValueError, match="1024"):
        demo_tok.decode([1024])
    with pytest.raises(ValueError, match="-1"):
        demo_tok.token_bytes(-1)


def _chain_tokenizer(text: str) -> Tokenizer:
    """256 bytes + every prefix of `text`: BPE merges a pre-split piece to one token iff it is a prefix."""
    data = text.encode("utf-8")
    ranks = {bytes([b]): b for b in range(256)}
    for end in range(2, len(data) + 1):
        ranks.setdefault(data[:end], len(ranks))
    return Tokenizer(ranks, {"<|im_end|>": len(ranks)}, bos_token=None, eos_token="<|im_end|>", chat_template="")


@pytest.mark.parametrize(("text", "first_piece"), [
    ("abc中文", "abc"),  # rule 2's letter class excludes Han only through `&&[^\p{Han}]`
    ("Hello世界", "Hello"),  # rule 3 (uppercase start), same intersection
    ("中文abc", "中文"),  # rule 1 stops at the first non-Han letter
    ("Hello", "Hello"),  # control: one piece, one token
])
def test_regex_class_intersection(text, first_piece):
    tok = _chain_tokenizer(text)
    ids = tok.encode(text)
    assert tok.token_bytes(ids[0]) == first_piece.encode("utf-8")
    assert (len(ids) == 1) == (first_piece == text)


def test_regex_needs_v1_semantics():
    """Python's `regex` agrees with tiktoken only in V1 mode; without it `&&` is literal text."""
    assert regex.findall(PAT_STR, "abc中文", flags=regex.V1) == ["abc", "中文"]
    assert regex.findall(PAT_STR, "abc中文") != ["abc", "中文"]


@pytest.mark.parametrize("text", [*ROUND_TRIP.values(), SAMPLE_TEXT], ids=[*ROUND_TRIP, "sample"])
def test_token_boundaries_include_regex_pieces(demo_tok, text):
    """Every V1-regex piece boundary is a token boundary of tiktoken's (Rust regex) encoding."""
    ends, pos = set(), 0
    for i in demo_tok.encode(text):
        pos += len(demo_tok.token_bytes(i))
        ends.add(pos)
    pos = 0
    for piece in regex.findall(PAT_STR, text, flags=regex.V1):
        pos += len(piece.encode("utf-8"))
        assert pos in ends, f"piece {piece!r} ends inside a token"


def test_long_runs_are_cut_like_the_reference(demo_tok):
    """Runs longer than 25 000 same-class chars are cut every 25 000 chars before BPE."""
    text = "ab" * 15_000
    assert demo_tok.encode(text) == demo_tok.encode(text[:25_000]) + demo_tok.encode(text[25_000:])
    assert demo_tok.decode(demo_tok.encode(" " * 60_001)) == " " * 60_001


def test_demo_vocab_is_reproducible():
    """The committed demo files are exactly what make_vocab.py writes."""
    vocab = train_bpe(SAMPLE_TEXT, NUM_MERGEABLE)
    assert len(vocab) == 768 and vocab[:256] == [bytes([b]) for b in range(256)]
    assert (DEMO_DIR / "tiktoken.model").read_text(encoding="ascii") == rank_file_text(vocab)
    assert json.loads((DEMO_DIR / "tokenizer_config.json").read_text(encoding="utf-8")) == tokenizer_config()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
