"""Chat templates: where a model directory's template comes from, the sandboxed Jinja environment
that renders it, and validation of chat messages (spec §7.5)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["BUILTIN_TEMPLATE", "ROLES", "align_stand_ins", "compile_template", "stand_in_strings", "template_source",
           "validate_messages"]

ROLES = ("system", "user", "assistant", "tool")
BUILTIN_TEMPLATE = Path(__file__).with_name("chat_template.jinja")


def template_source(model_dir: Path, config: Mapping[str, Any], where: str) -> str | None:
    """The model's chat template: `chat_template.jinja` in the directory, else the config's
    `chat_template`, else None (the built-in template is used)."""
    from kda_rt.tokenizer import TokenizerError

    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None:
        return None
    if isinstance(template, list):  # HF's list of named templates
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    if not isinstance(template, str):
        raise TokenizerError(f"{where}: field 'chat_template' must be a string or a list with a 'default' entry")
    return template


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def compile_template(source: str | None) -> Template:
    """Compile a template (None: the built-in one) in an immutable sandbox, with HF's `tojson`
    filter and `raise_exception` global."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source if source is not None else BUILTIN_TEMPLATE.read_text(encoding="utf-8"))


def validate_messages(messages: Any, tools: Any) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a str, got {type(message.get('content')).__name__}")
        if message.get("name") is not None and not isinstance(message["name"], str):
            raise ValueError(f"messages[{i}].name must be a str, got {type(message['name']).__name__}")
    if tools is not None and (not isinstance(tools, Sequence) or not all(isinstance(t, Mapping) for t in tools)):
        raise ValueError("tools must be None or a list of dicts")


# Keys whose string values steer the template (compared, not printed as free text): kept as they are
# and refused when they hold a control-token string.  Every other client string value is stood in for.
_STRUCTURAL_KEYS = frozenset({"role", "type"})


def stand_in_strings(value: Any, tag: str, found: list[str], check: Callable[[str, str], None], path: str = "") -> Any:
    """A copy of `value` (messages or tools) whose client strings are replaced by `{tag}{i}{tag}`,
    with the originals appended to `found`; dict keys and structural values go through `check`."""
    if isinstance(value, str):
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
