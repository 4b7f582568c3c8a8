"""Chat templates render as transformers' apply_chat_template renders them (its globals, variables and message
normalisation); the expected strings are transformers 5.25's output for the same template and inputs."""

from __future__ import annotations

from datetime import datetime

import pytest

USER = {"role": "user", "content": "hi"}


def test_hf_globals_and_variables(demo_tok):
    """strftime_now (a global of HF's sandbox), `documents` (None unless given) and the pad / unk special tokens are
    there for a template, as in transformers (was: 'strftime_now' is undefined; documents undefined, so `documents is
    none` was false; pad_token / unk_token undefined)."""
    source = ("{{ strftime_now('%Y') }}|{{ documents is none }}|{{ pad_token }}|{{ unk_token }}|{{ bos_token }}|"
              "{{ eos_token }}|{% for m in messages %}{{ m.content }}{% endfor %}")
    year = datetime.now().strftime("%Y")
    expected = f"{year}|True|[PAD]|[UNK]|[BOS]|<|im_end|>|hi"
    assert demo_tok.apply_chat_template([USER], chat_template=source) == expected
    assert demo_tok.decode(demo_tok.encode_chat([USER], chat_template=source)) == expected
    given = "{% for d in documents %}{{ d.title }}:{{ d.text }};{% endfor %}{{ pad_token }}"
    docs = [{"title": "a", "text": "b"}]
    assert demo_tok.apply_chat_template([USER], chat_template=given, documents=docs, pad_token="P") == "a:b;P"


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
