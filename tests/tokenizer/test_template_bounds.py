"""Chat template rendering bounds (issue 10 #6): runaway templates fail the request with an error
naming the template file, within the time bound (checked with 0.5 s bound, 10 s test limit)."""

from __future__ import annotations

import time

import pytest

import kda_rt.text.chat as chat
from kda_rt.text.tokenizer import Tokenizer, TokenizerError

USER = [{"role": "user", "content": "hi"}]

RUNAWAY = {
    "nested-loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "huge-range": "{% for i in range(10**10) %}{{ i }}{% endfor %}",
    "recursive-macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "repeat-string": "{{ 'x' * 10**10 }}",
    "doubling": "{% set s = namespace(v='x') %}{% for i in range(60) %}{% set s.v = s.v + s.v %}{% endfor %}{{ s.v }}",
    "big-output": "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
    "huge-power": "{{ 7 ** 100000000 }}",
    "power-of-a-power": "{{ (10 ** 4096) ** 4096 }}",
    # widths and counts that build a string past the bound in one call (the review's 3.45 GB template)
    "center-filter": "{{ 'x'|center(300000000) }}",
    "center-method": "{{ 'x'.center(300000000) }}",
    "percent-width": "{{ '%300000000s' % 'a' }}",
    "percent-precision": "{{ '%.300000000f' % 1.0 }}",
    "percent-star": "{{ '%*d' % (300000000, 1) }}",
    "format-filter": "{{ '%300000000s'|format('a') }}",
    "format-method": "{{ '{:>300000000}'.format('b') }}",
    "format-nested-width": "{{ '{:{w}}'.format('a', w=300000000) }}",
    "indent-filter": "{{ ('a\n' * 1000)|indent(1000000) }}",
    "replace-filter": "{{ ('a' * 1000000)|replace('a', 'b' * 100) }}",
    "replace-method": "{{ ('a' * 1000000).replace('a', 'b' * 100) }}",
    "join-method": "{{ ('x' * 1000000).join(['a'] * 100) }}",
    "expandtabs": "{{ ('\t' * 1000000).expandtabs(100) }}",
}


@pytest.mark.parametrize("source", RUNAWAY.values(), ids=RUNAWAY.keys())
def test_runaway_template_gets_named_error(model_dir, monkeypatch, source):
    monkeypatch.setattr(chat, "MAX_RENDER_SECONDS", 0.5)
    (model_dir / "chat_template.jinja").write_text(source)
    tok = Tokenizer.from_dir(model_dir)
    start = time.monotonic()
    with pytest.raises(ValueError, match="chat_template.jinja"):
        tok.encode_chat(USER)
    assert time.monotonic() - start < 10


def test_normal_template_unaffected(demo_tok):
    assert demo_tok.apply_chat_template(USER).endswith("<|im_assistant|>assistant<|im_middle|>")


def test_bounded_operations_still_work_at_normal_sizes(demo_tok):
    """The checked filters, methods and operators give what Jinja gives where their results are small."""
    source = ("{{ '%5s|%-3d|%.2f' % ('a', 7, 1.5) }}{{ 'x'|center(5) }}{{ 'q'.rjust(3) }}{{ '{:>4}'.format('w') }}"
              "{{ 'l1\nl2'|indent(2) }}{{ 'a b a'|replace('a', 'cc') }}{{ 'a-b'.replace('-', '+') }}"
              "{{ ','.join(['p', 'q']) }}{{ '%s'|format('f') }}{{ 7 % 3 }}")
    assert demo_tok.apply_chat_template(USER, chat_template=source) == \
        "    a|7  |1.50" "  x  " "  q" "   w" "l1\n  l2" "cc b cc" "a+b" "p,q" "f" "1"


def test_non_utf8_template_file_is_named(model_dir):
    (model_dir / "chat_template.jinja").write_bytes(b"{{ messages }}\xff\xfe")
    with pytest.raises(TokenizerError, match=r"chat_template\.jinja: not UTF-8"):
        Tokenizer.from_dir(model_dir)
