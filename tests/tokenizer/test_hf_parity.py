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


def test_none_valued_keys_are_left_out(demo_tok):
    """A message key whose value is None is not there for the template, as in transformers (was: `content: None`
    printed as the text "None", and `content is defined` / `'content' in m` held)."""
    source = ("{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ 'content' in m }}|{{ m.name is defined }}"
              "|{{ m.tool_calls | length if m.tool_calls is defined else '-' }}]{% endfor %}")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": "q", "name": None},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "assistant", "content": "a", "tool_calls": None}]
    expected = "[user|q|True|False|-][assistant||False|False|1][assistant|a|True|False|-]"
    assert demo_tok.apply_chat_template(messages, chat_template=source) == expected
    assert demo_tok.decode(demo_tok.encode_chat(messages, chat_template=source)) == expected
    # the built-in template renders alike with the key None or absent
    assert demo_tok.apply_chat_template(messages) == demo_tok.apply_chat_template(
        [{k: v for k, v in m.items() if v is not None} for m in messages])


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
