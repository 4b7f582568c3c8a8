"""Chat template rendering bounds (issue 10 #6): runaway templates fail the request with an error
naming the template file, within the time bound (checked with 0.5 s bound, 10 s test limit)."""

from __future__ import annotations

import re
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


# each refused by its own bound, before the value is built (the message names which: a test of the message fails on a
# sandbox that built the value and was stopped by the output bound, or not at all)
SPECIFIC = {
    "power-of-a-power": ("{{ (10 ** 4096) ** 4096 }}", "a power would be an integer over"),
    "center-filter": ("{{ 'x'|center(300000000) }}", "center asks for widths"),
    "center-method": ("{{ 'x'.center(300000000) }}", "str.center asks for widths"),
    "percent-width": ("{{ '%300000000s' % 'a' }}", "a %-format asks for widths"),
    "percent-precision": ("{{ '%.300000000f' % 1.0 }}", "a %-format asks for widths"),
    "percent-star": ("{{ '%*d' % (300000000, 1) }}", "a %-format takes a width or precision from its arguments"),
    "percent-many-fields": ("{{ '%(a)9000000s%(a)9000000s' % {'a': 1} }}", "a %-format asks for widths"),
    "format-filter": ("{{ '%300000000s'|format('a') }}", "a %-format asks for widths"),
    "format-method": ("{{ '{:>300000000}'.format('b') }}", "a format spec asks for widths"),
    "format-nested-width": ("{{ '{:{w}}'.format('a', w=300000000) }}", "a format spec takes a width"),
    "indent-filter": ("{{ ('a\n' * 1000)|indent(1000000) }}", "an indent would build"),
    "replace-filter": ("{{ ('a' * 1000000)|replace('a', 'b' * 100) }}", "a replace would build"),
    "replace-count-minus-one": ("{{ ('a' * 1000000)|replace('a', 'b' * 100, -1) }}", "a replace would build"),
    "replace-method": ("{{ ('a' * 1000000).replace('a', 'b' * 100) }}", "a replace would build"),
    "join-method": ("{{ ('x' * 1000000).join(['a'] * 100) }}", "a join would build"),
    "join-of-big-items": ("{% set big = 'x' * 6000000 %}{{ ''.join([big, big, big]) }}", "a join would build"),
    "join-filter": ("{% set big = 'x' * 6000000 %}{{ [big, big, big]|join }}", "a join would build"),
    "repeated-big-list": ("{% set big = 'x' * 10000000 %}{{ ([big] * 3)|length }}", "a repetition would build"),
    "tilde-concat": ("{% set s = 'x' * 7000000 %}{{ s ~ s ~ s }}", "a concatenation (~) would build"),
    "expandtabs": ("{{ ('\t' * 1000000).expandtabs(100) }}", "an expandtabs would build"),
    "wordwrap": ("{{ ('a' * 100000)|wordwrap(1, wrapstring='x' * 1000) }}", "a wordwrap would build"),
    "tojson-indent": ("{{ [1, 2]|tojson(indent=100000000) }}", "tojson's indent is over"),
    "batch": ("{{ [1]|batch(100000000, 0)|list|length }}", "a batch of over"),
    "pprint": ("{{ [1]|pprint }}", "pprint"),
    "loops-over-lists": ("{% for a in [1] * 3000 %}{% for b in [1] * 3000 %}{% for c in [1] * 3000 %}{% endfor %}"
                         "{% endfor %}{% endfor %}", "rendering took over"),
}

# loops that call nothing the sandbox sees and write nothing: only the alarm stops them (hours of work otherwise)
ALARM = {
    "loops-over-a-set-list": "{% set l = [1] * 3000 %}{% for a in l %}{% for b in l %}{% for c in l %}{% endfor %}"
                             "{% endfor %}{% endfor %}",
    "int-filter-in-a-loop": "{% set l = ['x'] * 3000 %}{% for a in l %}{% for b in l %}{% for c in l %}"
                            "{% if c|int %}{% endif %}{% endfor %}{% endfor %}{% endfor %}",  # (int catches ValueError)
}


@pytest.mark.parametrize("source", ALARM.values(), ids=ALARM.keys())
def test_the_alarm_stops_what_no_check_reaches(demo_tok, monkeypatch, source):
    import signal

    if signal.getitimer(signal.ITIMER_REAL)[0]:
        pytest.skip("an alarm is set already (pytest-timeout's): the bound's own alarm stands aside")
    monkeypatch.setattr(chat, "MAX_RENDER_SECONDS", 0.5)
    start = time.monotonic()
    with pytest.raises(ValueError, match="rendering took over 0.5 s"):
        demo_tok.apply_chat_template(USER, chat_template=source)
    assert time.monotonic() - start < 5
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_the_alarm_leaves_the_previous_handler(demo_tok, monkeypatch):
    import signal

    if signal.getitimer(signal.ITIMER_REAL)[0]:
        pytest.skip("an alarm is set already (pytest-timeout's)")
    mine = lambda signum, frame: None  # noqa: E731
    old = signal.signal(signal.SIGALRM, mine)
    try:
        demo_tok.apply_chat_template(USER)
        with pytest.raises(ValueError, match="rendering took over"):
            monkeypatch.setattr(chat, "MAX_RENDER_SECONDS", 0.3)
            demo_tok.apply_chat_template(USER, chat_template=ALARM["loops-over-a-set-list"])
        assert signal.getsignal(signal.SIGALRM) is mine and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    finally:
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize(("source", "needle"), SPECIFIC.values(), ids=SPECIFIC.keys())
def test_each_bound_refuses_before_building(demo_tok, monkeypatch, source, needle):
    monkeypatch.setattr(chat, "MAX_RENDER_SECONDS", 0.5)
    start = time.monotonic()
    with pytest.raises(ValueError, match=re.escape(needle)):
        demo_tok.apply_chat_template(USER, chat_template=source)
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


def test_the_alarm_never_escapes_a_checked_limit(demo_tok, monkeypatch):
    """A loop the checks reach raises TemplateLimitError at the deadline; the alarm must not land in that error's
    unwinding (was: with the alarm due at the same moment, a `_Deadline` escaped `apply_chat_template` as a
    BaseException in most of 40 tries at 0.5 s, leaving its 50 ms timer running into whatever ran next)."""
    import signal

    if signal.getitimer(signal.ITIMER_REAL)[0]:
        pytest.skip("an alarm is set already (pytest-timeout's)")
    monkeypatch.setattr(chat, "MAX_RENDER_SECONDS", 0.02)
    monkeypatch.setattr(chat, "_ALARM_LAG", 0.0, raising=False)  # the alarm due with the checks' deadline: the race at its worst
    before = signal.getsignal(signal.SIGALRM)
    for _ in range(150):
        with pytest.raises(ValueError, match="took over 0.02 s"):
            demo_tok.apply_chat_template(USER, chat_template="{% for i in range(10**10) %}{{ i }}{% endfor %}")
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) is before
