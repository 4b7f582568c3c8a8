"""Chat templates: where a model directory's template comes from, the sandboxed Jinja environment
that renders it, and validation of chat messages (spec §7.5)."""

from __future__ import annotations

import json
import os
import re
import signal
import string
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError, nodes
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

__all__ = ["BUILTIN_TEMPLATE", "MAX_RENDER_CHARS", "MAX_RENDER_SECONDS", "MAX_RANGE_STEPS", "REASONING_FIELDS",
           "RESERVED_TEMPLATE_VARS", "ROLES", "TemplateLimitError", "align_stand_ins", "compile_template",
           "join_text_parts", "normalize_messages", "render_template", "stand_in_strings", "template_source",
           "validate_messages"]

ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: OpenAI's newer name, read as system
# Names the renderer sets itself; `chat_template_kwargs` cannot override them.
RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                    "_kda_rt_concat"})  # (the last: the sandbox's bounded `~`)
BUILTIN_TEMPLATE = Path(__file__).with_name("chat_template.jinja")


def template_source(model_dir: Path, config: Mapping[str, Any], where: str,
                    override: str | None = None) -> tuple[str | None, str]:
    """(source, name) of the model's chat template: `override` (vLLM's --chat-template: a file's path, else the
    template itself when it holds `{`, `}` or a newline; on one line its \\n and \\t escapes are read), else
    `chat_template.jinja` in the directory, else the config's `chat_template`, else None (the built-in template is
    used); name says which."""
    from kda_rt.text.tokenizer import TokenizerError

    if override is not None:
        if not isinstance(override, str) or not override:
            raise TokenizerError(f"chat_template must be a file path or a template string, got {override!r:.80}")
        jinja_path = Path(override)
        try:  # a path is tried first (vLLM's order): one holding '{' is still a path
            is_file = "\n" not in override and jinja_path.is_file()
        except (OSError, ValueError):  # too long for a name, a NUL: a template then
            is_file = False
        if not is_file:
            if not any(c in override for c in "{}\n"):
                raise TokenizerError(f"chat_template {override!r}: no such file (a template string holds '{{')")
            if "\n" not in override:  # one command-line line, as vLLM reads it: its \n and \t escapes are meant
                override = override.replace("\\n", "\n").replace("\\t", "\t")
            return override, "the given chat_template"
    else:
        jinja_path = model_dir / "chat_template.jinja"
        if os.path.lexists(jinja_path) and not jinja_path.is_file():  # (was: the config's template, silently)
            raise TokenizerError(f"{jinja_path}: not a readable file (a directory, or a link to a missing file)")
    if jinja_path.is_file():
        try:
            return jinja_path.read_text(encoding="utf-8"), str(jinja_path)
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{jinja_path}: not UTF-8 text (byte {e.start})") from None
        except OSError as e:
            raise TokenizerError(f"{jinja_path}: cannot read ({e.strerror or e})") from None
    template = config.get("chat_template")
    if template is None:
        return None, f"built-in {BUILTIN_TEMPLATE.name}"
    if isinstance(template, list):  # HF's list of named templates
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    if not isinstance(template, str):
        raise TokenizerError(f"{where}: field 'chat_template' must be a string or a list with a 'default' entry")
    return template, f"{where} field 'chat_template'"


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    """HF's `strftime_now` global (templates that print today's date, e.g. Llama 3's): the local time, formatted."""
    if not isinstance(fmt, str) or len(fmt) > 256:
        raise TemplateLimitError("strftime_now takes a format string of at most 256 characters")
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    if isinstance(indent, int) and indent > 64 or isinstance(indent, str) and len(indent) > 64:
        raise TemplateLimitError("tojson's indent is over 64 characters")
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


# Rendering bounds (issue 10 #6): a template is configuration, but it runs on every request, so a
# runaway one must fail that request with a clear error instead of stalling or exhausting the engine.
MAX_RENDER_SECONDS = 5.0  # wall time of one rendering
MAX_RENDER_CHARS = 16 * 1024 * 1024  # rendered prompt, and any string / list a template builds
MAX_RANGE_STEPS = 1_000_000  # items drawn from range() in one rendering, over all loops
MAX_INT_BITS = 1 << 16  # the largest integer a template may build by * or ** (a 20,000-digit number)


class TemplateLimitError(ValueError):
    """A chat template went past a rendering bound; the message names the template and the bound."""


class _Budget(threading.local):
    deadline = 0.0
    steps = 0


_budget = _Budget()


def _check_time() -> None:
    if time.monotonic() > _budget.deadline:
        raise TemplateLimitError(f"rendering took over {MAX_RENDER_SECONDS:g} s")


class _Deadline(BaseException):
    """The alarm of `_time_bound` (no Exception: a template's own `except`, or a filter's, such as `int`'s, must not
    swallow it); turned into TemplateLimitError where the bound was set."""


_ALARM_LAG = 0.25  # the alarm's first firing after the deadline: where a check runs, its error is raised and handled first


class _Alarm:
    """The alarm half of the time bound: in the main thread (the engine process's loop), SIGALRM interrupts what the
    checks do not reach (a loop over a list, a filter folded at compile time) between two bytecodes, _ALARM_LAG after
    the deadline and every 50 ms after; elsewhere, with an alarm already set, or with a SIGALRM handler installed
    outside Python, nothing (the checks alone).  The handler raises only while `live`: cleared first thing on the way
    out (a plain attribute store runs no Python code and so no signal handler in between), the handler cannot raise
    into the unwinding of an error a check raised, nor leave the timer set (was: a `_Deadline` landing in contextlib's
    exit escaped as a BaseException with the 50 ms timer still running)."""

    def __init__(self) -> None:
        self.live, self.previous = False, None
        if (threading.current_thread() is threading.main_thread() and not signal.getitimer(signal.ITIMER_REAL)[0]
                and signal.getsignal(signal.SIGALRM) is not None):
            self.previous = signal.signal(signal.SIGALRM, self._on_alarm)
            self.live = True
            signal.setitimer(signal.ITIMER_REAL, MAX_RENDER_SECONDS + _ALARM_LAG, 0.05)

    def _on_alarm(self, signum, frame) -> None:
        if self.live:
            raise _Deadline

    def close(self) -> None:
        self.live = False
        if self.previous is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
            self.previous = None


def _time_bound(what: str, fn: Callable[[], Any]) -> Any:
    """`fn()` within the time bound: the deadline the checks above read, and the alarm (`_Alarm`)."""
    _budget.deadline, _budget.steps = time.monotonic() + MAX_RENDER_SECONDS, 0
    alarm = _Alarm()
    try:
        try:
            return fn()
        finally:
            alarm.live = False  # (a store, before the call: the handler may run when close() is called)
            alarm.close()
    except _Deadline:
        raise TemplateLimitError(f"{what} took over {MAX_RENDER_SECONDS:g} s") from None


def _bounded_range(*args: int) -> Iterator[int]:
    for i in range(*args):
        _budget.steps += 1
        if _budget.steps > MAX_RANGE_STEPS:
            raise TemplateLimitError(f"loops drew over {MAX_RANGE_STEPS} items from range()")
        if _budget.steps % 1024 == 0:
            _check_time()
        yield i


def _size(value: Any) -> int:
    """Characters a value brings to what an operator builds: a string's, or a list's items' (strings counted by their
    characters, so `[big] * n` and its join are bounded by what they hold, not by their item count)."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return len(value) + sum(len(x) for x in value if isinstance(x, (str, bytes)))
    return 0


def _count(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


def _bounded_concat(items: list) -> str:
    """Jinja's `~` (a Concat node: no operator the sandbox intercepts), with the concatenation bound."""
    _check_time()
    parts = [str(x) for x in items]
    if sum(map(len, parts)) > MAX_RENDER_CHARS:
        raise TemplateLimitError(f"a concatenation (~) would build over {MAX_RENDER_CHARS} characters")
    return "".join(parts)


class _ConcatBound(NodeTransformer):
    """Rewrites every `a ~ b ~ ...` into a call of the bounded concatenation."""

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return nodes.Call(nodes.Name("_kda_rt_concat", "load"), [nodes.List(node.nodes)], [], None, None)


# a %-format's conversion spec: its width and precision (digits, or * taken from the arguments)
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill"})


def _check_widths(numbers: Iterable[str | int], what: str) -> None:
    """Widths and precisions that add up past MAX_RENDER_CHARS (or one taken from the arguments, `*`) would build a
    string past the bound: refused before it is built."""
    total = 0
    for n in numbers:
        if n in ("*", "{"):
            raise TemplateLimitError(f"{what} takes a width or precision from its arguments")
        total += int(n) if n not in ("", None) else 0
        if total > MAX_RENDER_CHARS:
            raise TemplateLimitError(f"{what} asks for widths or precisions over {MAX_RENDER_CHARS} characters")


def _check_percent(fmt: Any) -> None:
    if isinstance(fmt, str) and "%" in fmt:
        _check_widths((x for m in _PERCENT_SPEC.finditer(fmt) for x in m.groups()), "a %-format")


def _check_format_spec(fmt: str) -> None:
    """str.format / format_map: every number in a field's spec (nested fields included)."""
    for _, field, spec, _ in string.Formatter().parse(fmt):
        if field is not None and spec:
            _check_widths(re.findall(r"\d+|\{", spec), "a format spec")  # (a nested {width}: refused, as *)


def _check_growth(old: Any, new: Any, times: int, base: int, what: str) -> None:
    if isinstance(old, str) and isinstance(new, str) and base + times * max(len(new) - len(old), 0) > MAX_RENDER_CHARS:
        raise TemplateLimitError(f"{what} would build over {MAX_RENDER_CHARS} characters")


def _check_method(obj: Any, args: tuple, kwargs: dict) -> None:
    """The str methods that build a string larger than their inputs by a number they are given."""
    obj = getattr(obj, "__wrapped__", obj)  # (the sandbox hands out str.format wrapped)
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return
    if name in _WIDTH_METHODS and args and isinstance(args[0], int):
        _check_widths([args[0]], f"str.{name}")
    elif name in ("format", "format_map"):
        _check_format_spec(owner)
    elif name == "replace" and len(args) >= 2:
        _check_growth(args[0], args[1], owner.count(args[0]) if isinstance(args[0], str) else 0, len(owner),
                      "a replace")
    elif name == "expandtabs":
        size = args[0] if args and isinstance(args[0], int) else kwargs.get("tabsize", 8)
        if isinstance(size, int) and len(owner) + owner.count("\t") * size > MAX_RENDER_CHARS:
            raise TemplateLimitError(f"an expandtabs would build over {MAX_RENDER_CHARS} characters")
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        if len(owner) * len(args[0]) + _size(args[0]) > MAX_RENDER_CHARS:
            raise TemplateLimitError(f"a join would build over {MAX_RENDER_CHARS} characters")


def _bounded_filters(filters: dict[str, Callable]) -> None:
    """Jinja's filters that build a string larger than their input by a number they are given, checked first (they
    run directly, also when a constant expression is folded at compile time, not through `call`)."""
    center, indent, fmt, replace = filters["center"], filters["indent"], filters["format"], filters["replace"]
    wordwrap, batch, join = filters["wordwrap"], filters["batch"], filters["join"]

    def bounded_center(value, width=80):
        _check_widths([width] if isinstance(width, int) else [], "center")
        return center(value, width)

    def bounded_indent(s, width=4, first=False, blank=False):
        per = width if isinstance(width, int) else len(width) if isinstance(width, str) else 0
        if isinstance(s, str) and len(s) + (s.count("\n") + 1) * max(per, 0) > MAX_RENDER_CHARS:
            raise TemplateLimitError(f"an indent would build over {MAX_RENDER_CHARS} characters")
        return indent(s, width, first, blank)

    def bounded_format(value, *args, **kwargs):
        _check_percent(value)
        return fmt(value, *args, **kwargs)

    def bounded_replace(eval_ctx, s, old, new, count=None):
        text = str(s)
        times = text.count(str(old)) if count is None or count < 0 else min(count, text.count(str(old)))
        _check_growth(str(old), str(new), times, len(text), "a replace")
        return replace(eval_ctx, s, old, new, count)

    def bounded_wordwrap(environment, s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
        text, sep = str(s), "\n" if wrapstring is None else str(wrapstring)
        if len(text) + (len(text) // max(int(width), 1) + 1) * len(sep) > MAX_RENDER_CHARS:
            raise TemplateLimitError(f"a wordwrap would build over {MAX_RENDER_CHARS} characters")
        return wordwrap(environment, s, width, break_long_words, wrapstring, break_on_hyphens)

    def bounded_batch(value, linecount, fill_with=None):
        if isinstance(linecount, int) and linecount > MAX_RANGE_STEPS:
            raise TemplateLimitError(f"a batch of over {MAX_RANGE_STEPS} items")
        return batch(value, linecount, fill_with)

    def bounded_join(eval_ctx, value, d="", attribute=None):
        items = list(value)  # (a generator too: `map(...)|join`)
        if attribute is not None:
            from jinja2.filters import make_attrgetter

            items = list(map(make_attrgetter(eval_ctx.environment, attribute), items))
        if len(str(d)) * len(items) + _size(items) > MAX_RENDER_CHARS:
            raise TemplateLimitError(f"a join would build over {MAX_RENDER_CHARS} characters")
        return join(eval_ctx, items, d)

    bounded_replace.jinja_pass_arg = replace.jinja_pass_arg  # (jinja passes the eval context to its replace)
    bounded_wordwrap.jinja_pass_arg = wordwrap.jinja_pass_arg  # (and the environment to its wordwrap)
    bounded_join.jinja_pass_arg = join.jinja_pass_arg
    filters.update(center=bounded_center, indent=bounded_indent, format=bounded_format, replace=bounded_replace,
                   wordwrap=bounded_wordwrap, batch=bounded_batch, join=bounded_join)
    filters.pop("pprint", None)  # (its output has no bound; no chat template needs it)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """Sandbox whose `+`, `*`, `**`, `%` and `~`, and the str methods and filters that take a width, a count or a
    separator, refuse results past the size bounds before building them (a list by the characters its strings hold),
    and whose calls and operators check the time bound (an alarm stops the rest in the main thread, `_Alarm`).
    These are the known ways to build a large value, not a proof: a request's own template is for trusted clients
    (`--trust-request-chat-template`, as vLLM's flag)."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _bounded_filters(self.filters)  # (an environment's own copy of the filters)
        self.globals["_kda_rt_concat"] = _bounded_concat

    def _parse(self, source, name, filename):  # (jinja's hook between parsing and compiling)
        return _ConcatBound().visit(super()._parse(source, name, filename))

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        _check_time()
        both_ints = isinstance(left, int) and isinstance(right, int)
        if operator == "%":
            _check_percent(left)
        elif operator == "*":
            count = right if isinstance(right, int) else left if isinstance(left, int) else 0
            if max(_size(left), _size(right)) * max(count, 0) > MAX_RENDER_CHARS:
                raise TemplateLimitError(f"a repetition would build over {MAX_RENDER_CHARS} items")
            if both_ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateLimitError(f"a product would be an integer over {MAX_INT_BITS} bits")
        elif operator == "+" and _count(left) + _count(right) > MAX_RENDER_CHARS:  # (items: no scan of the strings,
            # which a template's `ns.msgs = ns.msgs + [m]` loop would make quadratic; their characters exist already)
            raise TemplateLimitError(f"a concatenation would build over {MAX_RENDER_CHARS} items")
        elif operator == "**" and both_ints and abs(left) > 1 and right * left.bit_length() > MAX_INT_BITS:
            # (by the result's size, not the exponent's: (10 ** 4096) ** 4096 took 13 s)
            raise TemplateLimitError(f"a power would be an integer over {MAX_INT_BITS} bits")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805  (jinja's signature)
        _check_time()
        _check_method(__obj, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


def compile_template(source: str | None) -> Template:
    """Compile a template (None: the built-in one) in an immutable sandbox, with HF's `tojson`
    filter and `raise_exception` and `strftime_now` globals, and the rendering bounds of `render_template`."""
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _bounded_range
    text = source if source is not None else BUILTIN_TEMPLATE.read_text(encoding="utf-8")

    def build() -> Template:  # (constant expressions are folded, filters run, while it compiles)
        ast = env.parse(text)  # parsed once: read for its content loops, then compiled
        reads = _reads_content_parts(ast)  # (before compiling, which folds the tree in place)
        template = env.from_string(ast)
        template.reads_content_parts = reads
        return template

    return _time_bound("compiling", build)


def _is_content(node: nodes.Node, names: set[str]) -> bool:
    """`node` reads a message's content: `x.content`, `x['content']`, `x.get('content')`, a variable set from one of
    those, or one of those through filters (`x.content | selectattr(...)`)."""
    while isinstance(node, nodes.Filter) and node.node is not None:
        node = node.node
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    if isinstance(node, nodes.Call) and isinstance(node.node, nodes.Getattr) and node.node.attr == "get":
        return bool(node.args) and isinstance(node.args[0], nodes.Const) and node.args[0].value == "content"
    return isinstance(node, nodes.Name) and node.name in names


def _reads_content_parts(ast: nodes.Template) -> bool:
    """Whether a template loops over a message's content (OpenAI's parts, e.g. Kimi K2's `render_content`): such a
    template is given content parts as they are, as transformers gives them; any other gets them joined to one string
    (`join_text_parts`, vLLM's rule for templates that read content as a string)."""
    names = {a.target.name for a in ast.find_all(nodes.Assign)
             if isinstance(a.target, nodes.Name) and _is_content(a.node, set())}
    return any(_is_content(loop.iter, names) for loop in ast.find_all(nodes.For))


def render_template(template: Template, name: str, **context: Any) -> str:
    """Render within MAX_RENDER_SECONDS and MAX_RENDER_CHARS; every failure is a ValueError that
    names the template (`name`: its file or config field)."""
    pieces: list[str] = []

    def render() -> None:
        size = 0
        for piece in template.generate(**context):
            size += len(piece)
            if size > MAX_RENDER_CHARS:
                raise TemplateLimitError(f"output is over {MAX_RENDER_CHARS} characters")
            pieces.append(piece)
            _check_time()

    try:
        _time_bound("rendering", render)
    except TemplateLimitError as e:
        raise TemplateLimitError(f"chat template {name}: {e}") from None
    except TemplateError as e:
        raise ValueError(f"chat template {name} failed: {e}") from e
    except RecursionError:
        raise ValueError(f"chat template {name} failed: recursion too deep") from None
    except MemoryError:
        raise TemplateLimitError(f"chat template {name}: out of memory while rendering") from None
    except (TypeError, ValueError, OverflowError, ArithmeticError, LookupError, AttributeError) as e:
        raise ValueError(f"chat template {name} failed: {type(e).__name__}: {e}") from None
    return "".join(pieces)


def validate_messages(messages: Any, tools: Any, chat_template_kwargs: Any = None) -> None:
    """Refuse (ValueError naming the field) what the template cannot render: content must be a str, a list of
    OpenAI text parts or None, `tool_calls` a list of {"id", "type", "function": {"name": str, "arguments": str | dict}}."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}")
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            join_text_parts(i, content)  # (refuses a part that is not text)
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a str, a list of text parts or None, "
                             f"got {type(content).__name__}")
        for field in ("name", "tool_call_id"):
            if message.get(field) is not None and not isinstance(message[field], str):
                raise ValueError(f"messages[{i}].{field} must be a str, got {type(message[field]).__name__}")
        calls = message.get("tool_calls")
        if calls is None or (isinstance(calls, (list, tuple)) and not calls):
            continue
        if role != "assistant":
            raise ValueError(f"messages[{i}].tool_calls is only allowed on assistant messages")
        if isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence):
            raise ValueError(f"messages[{i}].tool_calls must be a list")
        for k, call in enumerate(calls):
            where = f"messages[{i}].tool_calls[{k}]"
            fn = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping):
                raise ValueError(f"{where} must be a dict with a 'function' dict")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"{where}.function.name must be a non-empty str")
            if fn.get("arguments") is not None and not isinstance(fn["arguments"], (str, Mapping)):
                raise ValueError(f"{where}.function.arguments must be a JSON string, a dict or null")
            if call.get("id") is not None and not isinstance(call["id"], str):
                raise ValueError(f"{where}.id must be a str")
    if tools is not None and (not isinstance(tools, Sequence) or not all(isinstance(t, Mapping) for t in tools)):
        raise ValueError("tools must be None or a list of dicts")
    if chat_template_kwargs is not None:
        if not isinstance(chat_template_kwargs, Mapping) or not all(isinstance(k, str) for k in chat_template_kwargs):
            raise ValueError("chat_template_kwargs must be a dict with string keys")
        taken = sorted(RESERVED_TEMPLATE_VARS & set(chat_template_kwargs))
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)}")


def join_text_parts(i: int, parts: Sequence[Any]) -> str:
    """Message i's content given as OpenAI text parts ([{"type": "text", "text": str}, ...]) as one string, the parts
    joined by newlines as vLLM joins them; a part of another type is refused (ValueError naming the message)."""
    if not all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        raise ValueError(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': str}}) are supported")
    return "\n".join(p["text"] for p in parts)


# A message's reasoning under the names clients send it; the first is the one chat templates read.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def normalize_messages(messages: Sequence[Mapping[str, Any]], content_parts: bool = False) -> list[dict[str, Any]]:
    """Copies for the template: a key whose value is None is left out (as transformers' apply_chat_template does:
    `content: None` reads as no content, never the text "None"), content given as text parts kept as parts (copies)
    where `content_parts` (the template loops over them, `Template.reads_content_parts`), else joined to one string,
    a reasoning given as `reasoning_content`, `thinking` or `reasoning` also under the other two of the first two
    names (transformers' aliases), `developer` becomes `system`, a tool call's arguments given as null or "" become {} (vLLM's rule), and a tool call
    without an id gets Kimi's own form `functions.{name}:{k}` (k counts the calls of the conversation)."""
    out, k = [], 0
    for i, message in enumerate(messages):
        msg = {key: value for key, value in message.items() if value is not None}
        reasoning = next((msg[key] for key in REASONING_FIELDS if key in msg), None)
        if reasoning is not None:  # transformers' aliases: what templates read (reasoning_content; gpt-oss: thinking)
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        if isinstance(msg.get("content"), (list, tuple)):
            parts = msg["content"]
            msg["content"] = [dict(p) for p in parts] if content_parts else join_text_parts(i, parts)
        if msg.get("role") == "developer":
            msg["role"] = "system"
        if msg.get("tool_calls"):
            calls = []
            for call in msg["tool_calls"]:
                call = dict(call)
                if not call["function"].get("arguments"):  # null or "": no arguments, {} (vLLM's rule)
                    call["function"] = {**call["function"], "arguments": {}}
                if call.get("id") is None:
                    call["id"] = f"functions.{call['function']['name']}:{k}"
                call.setdefault("type", "function")
                calls.append(call)
                k += 1
            msg["tool_calls"] = calls
        out.append(msg)
    return out


# Keys whose string values steer the template (compared, not printed as free text): kept as they are
# and refused when they hold a control-token string.  Every other client string value is stood in for.
_STRUCTURAL_KEYS = frozenset({"role", "type"})


def stand_in_strings(value: Any, tag: str, found: list[str], check: Callable[[str, str], None], path: str = "") -> Any:
    """A copy of `value` (messages or tools) whose client strings are replaced by `{tag}{i}{tag}`,
    with the originals appended to `found`; dict keys and structural values go through `check`."""
    if isinstance(value, str):
        if not value:  # nothing to hide, and the template may test it for truth (`if content`)
            return value
        found.append(value)
        return f"{tag}{len(found) - 1}{tag}"
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str):
                check(key, f"key {where!r}")
            if key in _STRUCTURAL_KEYS and isinstance(item, str):
                check(item, where)
                out[key] = item
            else:
                out[key] = stand_in_strings(item, tag, found, check, where)
        return out
    if isinstance(value, (list, tuple)):
        return [stand_in_strings(item, tag, found, check, f"{path}[{i}]") for i, item in enumerate(value)]
    return value


def align_stand_ins(real: str, parts: list[str], found: list[str]) -> list[str]:
    """`parts` = template pieces alternating with stand-in indices (from re.split); returns the same
    list with each index replaced by the client text at that place of `real`: the string itself, or
    its JSON-escaped form where the template printed it through `tojson`.  Raises ValueError when
    the rendering with stand-ins does not line up with the real one (the template edits client text)."""
    out, pos = [parts[0]], len(parts[0])
    if not real.startswith(parts[0]):
        raise ValueError("the chat template transforms client text, so it cannot be kept as text")
    for k in range(1, len(parts), 2):
        value, after = found[int(parts[k])], parts[k + 1]
        for form in (value, json.dumps(value, ensure_ascii=False)[1:-1]):
            if real.startswith(form, pos) and real.startswith(after, pos + len(form)):
                break
        else:
            raise ValueError("the chat template transforms client text, so it cannot be kept as text")
        out += [form, after]
        pos += len(form) + len(after)
    if pos != len(real):
        raise ValueError("the chat template transforms client text, so it cannot be kept as text")
    return out
