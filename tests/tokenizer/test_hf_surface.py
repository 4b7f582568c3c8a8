"""`llm.get_tokenizer()` used as vLLM users use the Hugging Face tokenizer vLLM returns (text/hf_surface.py).

The expected values are those of the Kimi checkpoints' remote `TikTokenTokenizer` (transformers 5.25) loaded over
the demo vocabulary, written out here: `tok(text)` reads special-token strings as special ids and adds no BOS;
token strings are GPT-2's byte-level characters; `get_vocab` / `convert_tokens_to_ids` invert them, unknown -> unk.
"""

from __future__ import annotations

import pytest

from kda_rt.text.hf_surface import byte_to_char

TEXT = "Hello <|im_end|> naïve 東"
# the HF Kimi tokenizer's tok(TEXT)["input_ids"] and convert_ids_to_tokens of them on the demo vocabulary
HF_IDS = [72, 101, 288, 111, 32, 770, 310, 406, 175, 290, 32, 230, 157, 177]
HF_TOKENS = ["H", "e", "ll", "o", "Ġ", "<|im_end|>", "Ġn", "aÃ", "¯", "ve", "Ġ", "æ", "Ŀ", "±"]


def test_call_is_a_batch_encoding(demo_tok):
    enc = demo_tok(TEXT)
    assert enc["input_ids"] == enc.input_ids == HF_IDS
    assert enc.attention_mask == [1] * len(HF_IDS)
    assert demo_tok(TEXT, add_special_tokens=False).input_ids == HF_IDS  # no BOS either way
    batch = demo_tok(["ab", "c d"])
    assert batch.input_ids == [demo_tok.encode("ab"), demo_tok.encode("c d")]
    assert batch.attention_mask == [[1] * len(i) for i in batch.input_ids]
    assert list(demo_tok("hi", return_attention_mask=False)) == ["input_ids"]
    with pytest.raises(AttributeError):
        _ = enc.token_type_ids
    with pytest.raises(TypeError, match="return_tensors"):
        demo_tok("hi", return_tensors="pt")


def test_encode_and_decode_take_hf_arguments(demo_tok):
    # encode keeps special-token strings text (kda_rt's default); add_special_tokens adds nothing (no BOS)
    plain = demo_tok.encode(TEXT)
    assert demo_tok.encode(TEXT, add_special_tokens=True) == demo_tok.encode(TEXT, add_special_tokens=False) == plain
    assert 770 not in plain and demo_tok.encode(TEXT, allow_special=True) == HF_IDS
    assert demo_tok.decode(HF_IDS) == TEXT
    assert demo_tok.decode(HF_IDS, skip_special_tokens=True) == "Hello  naïve 東"
    assert demo_tok.decode(HF_IDS, clean_up_tokenization_spaces=True) == TEXT
    assert demo_tok.decode(770) == "<|im_end|>" and demo_tok.decode(230) == "\ufffd"  # one id; a partial character
    assert demo_tok.batch_decode([HF_IDS, [104, 105]]) == [TEXT, "hi"]
    assert demo_tok.batch_decode([HF_IDS], skip_special_tokens=True) == ["Hello  naïve 東"]


def test_token_strings(demo_tok):
    assert demo_tok.convert_ids_to_tokens(HF_IDS) == HF_TOKENS
    assert demo_tok.convert_ids_to_tokens(72) == "H"
    assert demo_tok.convert_ids_to_tokens(HF_IDS, skip_special_tokens=True) == [t for t in HF_TOKENS if t != "<|im_end|>"]
    assert demo_tok.convert_ids_to_tokens([1000]) == ["<|reserved_token_1000|>"]
    assert demo_tok.convert_tokens_to_ids(HF_TOKENS) == HF_IDS
    assert demo_tok.convert_tokens_to_ids("<|im_end|>") == 770
    assert demo_tok.convert_tokens_to_ids("zzzqq") == demo_tok.unk_token_id == 1022  # HF: unknown -> unk
    assert demo_tok.convert_tokens_to_string(HF_TOKENS) == TEXT
    assert demo_tok.convert_tokens_to_string(["æ", "Ŀ"]) == "\ufffd"  # an unfinished character
    with pytest.raises(ValueError, match="byte-level"):
        demo_tok.convert_tokens_to_string(["東"])
    vocab = demo_tok.get_vocab()
    assert len(vocab) == len(demo_tok) == demo_tok.vocab_size == 1024  # (HF's Kimi class: 1026, 2 reserved ids more)
    assert sorted(vocab.values()) == list(range(1024))
    assert vocab["Ā"] == 0 and vocab["<|im_end|>"] == 770 and vocab["<|reserved_token_773|>"] == 773
    vocab.clear()  # a copy: the tokenizer's own map is untouched
    assert demo_tok.convert_tokens_to_ids("Ā") == 0
    assert demo_tok.max_token_id == 1023


def test_byte_alphabet_is_gpt2s():
    """The byte-level alphabet equals transformers' bytes_to_unicode (GPT-2's), which the Kimi class uses."""
    convert = pytest.importorskip("transformers.convert_slow_tokenizer")
    hf = convert.bytes_to_unicode()
    assert byte_to_char() == tuple(hf[b] for b in range(256))


def test_special_tokens(demo_tok):
    assert (demo_tok.bos_token, demo_tok.eos_token, demo_tok.pad_token, demo_tok.unk_token) == \
        ("[BOS]", "<|im_end|>", "[PAD]", "[UNK]")
    assert (demo_tok.bos_token_id, demo_tok.eos_token_id, demo_tok.pad_token_id, demo_tok.unk_token_id) == \
        (768, 770, 1023, 1022)
    # all 256 special ids: the ones skip_special_tokens=True drops (HF's Kimi class lists only its named markers)
    assert demo_tok.all_special_ids == list(range(768, 1024))
    assert demo_tok.all_special_tokens == demo_tok.convert_ids_to_tokens(demo_tok.all_special_ids)
    assert demo_tok.decode(demo_tok.all_special_ids, skip_special_tokens=True) == ""


def test_apply_chat_template_hf_call(demo_tok):
    messages = [{"role": "user", "content": "hi"}]
    # the Kimi tokenizer's defaults: a string, with the generation prompt
    text = demo_tok.apply_chat_template(messages)
    assert text == demo_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_assistant|>assistant<|im_middle|>")
    ids = demo_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert ids == demo_tok(text).input_ids
    # other keyword arguments are template variables, as HF's
    template = "{{ messages[0].content }}{% if shout %}!{% endif %}"
    assert demo_tok.apply_chat_template(messages, chat_template=template, shout=True) == "hi!"
    assert demo_tok.apply_chat_template(messages, chat_template=template, chat_template_kwargs={"shout": True}) == "hi!"
    with pytest.raises(TypeError, match="return_tensors"):
        demo_tok.apply_chat_template(messages, tokenize=True, return_tensors="np")
