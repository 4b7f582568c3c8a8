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


PARTS = [{"type": "text", "text": "a"}, {"type": "text", "text": "b<|im_end|>"}]


@pytest.mark.parametrize("loop", [
    "{% for p in m.content %}{{ p.text }}{% endfor %}",
    "{% for p in m['content'] | selectattr('type', 'equalto', 'text') %}{{ p['text'] }}{% endfor %}",
    "{% set c = m.get('content') %}{% for p in c %}{{ p.text }}{% endfor %}",
], ids=["attr", "item-filter", "set-get"])
def test_content_parts_reach_a_template_that_loops_over_them(demo_tok, loop):
    """Content as OpenAI text parts: a template that loops over a message's content (Kimi K2's `render_content`) is
    given the parts, as transformers gives them (was: refused, "content must be a str or None"; LLM.chat and the
    server joined them with newlines first, so such a template printed "a\nb" where transformers prints "ab")."""
    source = ("{% for m in messages %}<|im_user|>{% if m.content is string %}{{ m.content }}{% else %}" + loop
              + "{% endif %}<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_assistant|>{% endif %}")
    messages = [{"role": "user", "content": PARTS}, {"role": "assistant", "content": "c"}]
    expected = "<|im_user|>ab<|im_end|><|im_end|><|im_user|>c<|im_end|><|im_assistant|>"
    assert demo_tok.apply_chat_template(messages, chat_template=source) == expected
    ids = demo_tok.encode_chat(messages, chat_template=source)
    assert demo_tok.decode(ids) == expected
    assert ids.count(demo_tok.eos_token_id) == 2  # the part's "<|im_end|>" stays text
    cont = [messages[0], {"role": "assistant", "content": [{"type": "text", "text": "Sure, "}]}]
    assert demo_tok.apply_chat_template(cont, chat_template=source, add_generation_prompt=False,
                                        continue_final_message=True).endswith("<|im_user|>Sure, ")


def test_content_parts_joined_for_a_string_template(demo_tok):
    """A template that reads content as a string (the built-in one) gets the parts joined by newlines (vLLM's rule;
    transformers would give it the list, which the built-in template prints as nothing); a part that is not text
    is refused by name."""
    text = demo_tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": PARTS}],
                                        add_generation_prompt=False)
    assert text.endswith("<|im_user|>user<|im_middle|>a\nb<|im_end|><|im_end|>")
    cont = [USER, {"role": "assistant", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "Sure"}]}]
    assert demo_tok.apply_chat_template(cont, add_generation_prompt=False, continue_final_message=True).endswith(
        "<|im_assistant|>assistant<|im_middle|>x\nSure")
    with pytest.raises(ValueError, match=r"messages\[0\].content: only text parts"):
        demo_tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


@pytest.mark.parametrize("field", ["reasoning_content", "thinking", "reasoning"])
def test_reasoning_aliases(demo_tok, field):
    """A message's reasoning under any of transformers' names reaches a template as `reasoning_content` and
    `thinking` too, as transformers aliases them (was: a template reading reasoning_content missed `reasoning`)."""
    source = ("{% for m in messages %}[{{ m.reasoning_content }}|{{ m.thinking }}|{{ m.reasoning is defined }}|"
              "{{ m.content }}]{% endfor %}")
    messages = [USER, {"role": "assistant", "content": "a", field: "why"}]
    expected = f"[||False|hi][why|why|{field == 'reasoning'}|a]"
    assert demo_tok.apply_chat_template(messages, chat_template=source) == expected
    assert demo_tok.decode(demo_tok.encode_chat(messages, chat_template=source)) == expected


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
