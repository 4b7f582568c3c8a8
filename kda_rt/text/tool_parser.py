"""Tool calls in Kimi K2-family output (vLLM's `--tool-call-parser kimi_k2`).

The model writes, after optional plain content:

    <|tool_calls_section_begin|>
      <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>   (once per call)
    <|tool_calls_section_end|>

The text must be decoded with `skip_special_tokens=False`, or the markers are gone.  The call id is
the model's own `functions.NAME:IDX` (the template writes it back in `<|tool_call_begin|>` and
`## Return of ...`, so the model sees its trained form in the next turn).  `parse_tool_calls`
reads a whole output; `ToolCallStream` turns text deltas into content deltas and OpenAI
`delta.tool_calls` entries, holding back only what could still be the start of a marker.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["CALL_BEGIN", "CALL_END", "ARG_BEGIN", "SECTION_BEGIN", "SECTION_END", "ToolCall", "ToolCallStream",
           "forced_prefix", "parse_tool_calls", "tool_call_grammar", "tool_prefix_ids"]

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARG_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
_SECTION_BEGINS = (SECTION_BEGIN, "<|tool_call_section_begin|>")  # K2 checkpoints emit either spelling

_MARKERS = (CALL_BEGIN, CALL_END, SECTION_END)  # what ends a call's arguments (CALL_END: the normal end)
_HEADER = re.compile(r"\s*(?P<id>[^<]+:\d+)\s*$", re.DOTALL)  # `functions.NAME:IDX`; an id holds no '<'


@dataclass
class ToolCall:
    id: str  # functions.NAME:IDX, as the model wrote it
    name: str
    arguments: str  # JSON text as generated (not validated; a call cut short keeps what it got)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _name_of(call_id: str) -> str:
    """`functions.get_weather:0` -> `get_weather`."""
    return call_id.strip().rsplit(":", 1)[0].split(".", 1)[-1]


def _section_start(text: str) -> tuple[int, int]:
    """(start, end) of the first section-begin marker in text, or (-1, -1)."""
    hits = [(text.find(m), len(m)) for m in _SECTION_BEGINS if m in text]
    if not hits:
        return -1, -1
    start, size = min(hits)
    return start, start + size


def parse_tool_calls(text: str, max_calls: int | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of one whole output.  Without a section marker the text is all content;
    with one, content is what precedes it (None when empty) and each call is parsed, as `ToolCallStream`
    reads it (one parser: a stream's deltas always add up to this)."""
    parser = ToolCallStream(max_calls)
    content = parser.feed(text, final=True)[0]
    return (text if parser.state == "content" else content or None), parser.calls


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of the markers."""
    for size in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-size:]) for m in markers):
            return size
    return 0


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """(index, marker) of the earliest marker in text, or (-1, '')."""
    hits = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(hits) if hits else (-1, "")


class ToolCallStream:
    """Incremental `parse_tool_calls`: `feed(delta)` -> (content delta, [delta.tool_calls entries]).
    Concatenating the content deltas and each call's argument deltas gives what `parse_tool_calls`
    gives for the whole text.  `max_calls` 1 keeps only the first call (parallel_tool_calls false).

    After the section opens, only calls are read (other text is dropped, past the section's end too).
    A call's id and name are sent once its header `<|tool_call_begin|>ID<|tool_call_argument_begin|>`
    is whole; its arguments end at `<|tool_call_end|>`, or, cut short, at the next call's begin, the
    section's end or the end of the output (a sent call cannot be taken back, so the whole-text parse keeps
    it too).  A header that is no `NAME:IDX` drops its call."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.buf = ""
        self.state = "content"  # content -> section -> args | skip -> section ...
        self.num_calls = 0  # call headers seen, kept or not
        self.calls: list[ToolCall] = []

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.buf += delta
        content, entries = "", []
        while True:
            if self.state == "content":
                start, end = _section_start(self.buf)
                if start >= 0:
                    content += self.buf[:start]
                    self.buf, self.state = self.buf[end:], "section"
                    continue
                keep = 0 if final else _held(self.buf, _SECTION_BEGINS)
                content += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return content, entries
            if self.state == "section" and not self._header(entries, final):
                return content, entries
            if self.state in ("args", "skip") and not self._arguments(entries, final):
                return content, entries

    def _header(self, entries: list[dict[str, Any]], final: bool) -> bool:
        """Section state: reads up to the next whole call header; False when more text is needed."""
        begin = self.buf.find(CALL_BEGIN)
        if begin < 0:  # nothing but text between calls: dropped
            self.buf = "" if final else self.buf[len(self.buf) - _held(self.buf, (CALL_BEGIN,)):]
            return False
        rest = self.buf[begin + len(CALL_BEGIN):]
        stop = rest.find("<")  # an id ends at the first '<': the argument marker, or something that drops the call
        if stop < 0 or (not rest.startswith(ARG_BEGIN, stop) and ARG_BEGIN.startswith(rest[stop:])):
            self.buf = "" if final else self.buf[begin:]  # wait for the rest of the header
            return False
        if not rest.startswith(ARG_BEGIN, stop):  # e.g. another call's begin: this one has no arguments
            self.buf = rest[stop:]
            return True
        header = _HEADER.match(rest[:stop])
        self.buf, self.state = rest[stop + len(ARG_BEGIN):], "skip"
        if header is None:
            return True
        if self.max_calls is None or self.num_calls < self.max_calls:
            call = ToolCall(header["id"].strip(), _name_of(header["id"]), "")
            self.calls.append(call)
            entries.append({"index": len(self.calls) - 1, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": ""}})
            self.state = "args"
        self.num_calls += 1
        return True

    def _arguments(self, entries: list[dict[str, Any]], final: bool) -> bool:
        """Args / skip state: a call's arguments (sent, or dropped when skipping) up to the marker that ends them;
        False when more text is needed."""
        keep = self.state == "args"
        if keep and not self.calls[-1].arguments:
            self.buf = self.buf.lstrip()
        stop, marker = _first(self.buf, _MARKERS)
        if stop >= 0:
            send = self.buf[:stop].rstrip()
            self.buf = self.buf[stop + len(CALL_END):] if marker == CALL_END else self.buf[stop:]
            self.state = "section"
        else:  # hold back a possible marker start, and trailing whitespace (stripped at the end)
            send = self.buf[:len(self.buf) - (0 if final else _held(self.buf, _MARKERS))].rstrip()
            self.buf = "" if final else self.buf[len(send):]
        if send and keep:
            self.calls[-1].arguments += send
            entries.append({"index": len(self.calls) - 1, "function": {"arguments": send}})
        return self.state == "section"


def _forced_id(tool_mode: dict[str, Any]) -> str:
    """A named function's call id: IDX counts the conversation's calls before it (`call_index`), as Kimi numbers
    them, so it never repeats an id of the history (whose `## Return of` results the model tells apart by id)."""
    return f"functions.{tool_mode['forced_name']}:{tool_mode.get('call_index', 0)}"


def forced_prefix(tool_mode: dict[str, Any] | None) -> str:
    """Text the engine appends to the prompt for tool_choice `required` (a call section is opened)
    or a named function (its call header is written); '' otherwise.  The parser reads the output
    with this text in front."""
    if not tool_mode:
        return ""
    if tool_mode.get("forced_name"):
        return f"{SECTION_BEGIN}{CALL_BEGIN}{_forced_id(tool_mode)}{ARG_BEGIN}"
    if tool_mode.get("required"):
        return f"{SECTION_BEGIN}{CALL_BEGIN}functions."
    return ""


def tool_prefix_ids(tokenizer, tool_mode: dict[str, Any] | None) -> list[int]:
    """Token ids of `forced_prefix`: the markers are control tokens, the function name plain text."""
    if not forced_prefix(tool_mode):
        return []
    try:
        section, call = tokenizer.token_to_id(SECTION_BEGIN), tokenizer.token_to_id(CALL_BEGIN)
        arg = tokenizer.token_to_id(ARG_BEGIN)
    except KeyError as exc:
        raise ValueError(f"tool_choice needs the Kimi tool-call tokens: {exc}") from None
    if tool_mode.get("forced_name"):
        return [section, call, *tokenizer.encode(_forced_id(tool_mode)), arg]
    return [section, call, *tokenizer.encode("functions.")]


# JSON arguments on one line, as the structured-output engine writes JSON (kda_rt/engine/structured.py)
_ARGS_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_call_grammar(tools: list[dict[str, Any]], tool_mode: dict[str, Any]) -> str | None:
    """The Lark grammar (llguidance: `<|name|>` is a special token, `%json` a JSON schema) of what
    follows `forced_prefix` for tool_choice `required` or a named function: each call's arguments
    must match its function's `parameters` schema, then the calls and the section close.  None for
    other modes.  `required`: one call, or several when parallel calls are allowed."""
    if not tool_mode or not (tool_mode.get("forced_name") or tool_mode.get("required")):
        return None
    schemas = {}
    for tool in tools:
        fn = tool["function"]
        schema = dict(fn.get("parameters") or {"type": "object"})
        schema.setdefault("x-guidance", _ARGS_STYLE)
        schemas[fn["name"]] = schema
    if tool_mode.get("forced_name"):
        name = tool_mode["forced_name"]
        return (f"start: args {CALL_END} {SECTION_END}\n"
                f"args: %json {json.dumps(schemas[name])}\n")
    lines = [f"call_{i}: {json.dumps(name + ':')} IDX {ARG_BEGIN} args_{i} {CALL_END}\nargs_{i}: %json {json.dumps(s)}"
             for i, (name, s) in enumerate(schemas.items())]
    more = f' ({CALL_BEGIN} "functions." call)*' if tool_mode.get("max_calls") is None else ""
    return "\n".join([f"start: call{more} {SECTION_END}", "call: " + " | ".join(f"call_{i}" for i in range(len(lines))),
                      *lines, "IDX: /[0-9]{1,3}/"]) + "\n"
