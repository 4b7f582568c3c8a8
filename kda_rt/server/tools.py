"""Tool calling in chat requests (vLLM's `--enable-auto-tool-choice --tool-call-parser kimi_k2`):
the assistant `tool_calls` of the history, `tool_choice` / `parallel_tool_calls` read into a tool
mode, and for `required` or a named function the structured-output spec that constrains the calls
(a Lark grammar of the tools' `parameters` schemas, `text/tool_parser.tool_call_grammar`).
Every refusal is an `InvalidRequest` naming the field."""

from __future__ import annotations

import logging
from typing import Any

from kda_rt.sampler.params import StructuredOutputsParams
from kda_rt.server.errors import InvalidRequest
from kda_rt.text.tool_parser import tool_call_grammar

__all__ = ["forced_calls_spec", "history_calls", "tool_mode"]

logger = logging.getLogger(__name__)
_warned_no_llguidance: list[bool] = []


def history_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """messages[i].tool_calls, checked and normalised."""
    if not isinstance(calls, list):
        raise InvalidRequest(f"messages[{i}].tool_calls must be a list")
    out = []
    for k, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{k}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]):
            raise InvalidRequest(f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}")
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise InvalidRequest(f"{where}.function.arguments must be a JSON string")
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise InvalidRequest(f"{where}.id must be a string")
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def tool_mode(tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None, parallel: bool,
              auto_tools: bool, num_history_calls: int = 0) -> dict[str, Any] | None:
    """How the output is read for tool calls: None (plain text), or {"max_calls", "forced_name",
    "required", "call_index"}.  `required` and a named function are forced by the prompt prefix the engine adds, and
    the arguments by `forced_calls_spec`.  `call_index`, the number of calls in the history, is the IDX of a named
    function's forced header `functions.NAME:IDX`: Kimi numbers the calls of a conversation (vLLM's kimi_k2 ids)."""
    names = []
    for k, tool in enumerate(tools or []):
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise InvalidRequest(f"tools[{k}] must be {{'type': 'function', 'function': {{'name': str, ...}}}}")
        if not fn["name"] or fn["name"] in names:
            raise InvalidRequest(f"tools[{k}].function.name must be a non-empty name of its own, got {fn['name']!r}")
        if "<" in fn["name"]:  # a call header `functions.NAME:IDX` ends at '<': no call to it could be parsed back
            raise InvalidRequest(f"tools[{k}].function.name must not contain '<' (the kimi_k2 tool-call format "
                                 f"cannot carry it), got {fn['name']!r:.100}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InvalidRequest(f"tools[{k}].function.parameters must be a JSON schema object, got "
                                 f"{type(fn['parameters']).__name__}")
        names.append(fn["name"])
    if choice is None:
        choice = "auto" if names else "none"
    named = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or "
                                 "{'type': 'function', 'function': {'name': str}}")
        named = fn["name"]
        if named not in names:
            raise InvalidRequest(f"tool_choice names the function {named!r}, which is not in tools")
    elif choice not in ("none", "auto", "required"):
        raise InvalidRequest(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}")
    if choice == "none":
        return None
    if not names:
        raise InvalidRequest(f"tool_choice {choice!r} needs tools")
    if choice == "auto" and not auto_tools:
        raise InvalidRequest('"auto" tool choice needs the server flags --enable-auto-tool-choice and '
                             "--tool-call-parser kimi_k2")
    return {"max_calls": None if parallel else 1, "forced_name": named, "required": choice == "required",
            "call_index": num_history_calls}


def forced_calls_spec(tools: list[dict[str, Any]], mode: dict[str, Any]) -> dict[str, Any] | None:
    """The structured-output spec (dict) forcing the calls of `required` / a named function, checked
    (a bad `parameters` schema is a 400); None for other modes.  Without llguidance a named function is forced by
    the prompt prefix alone (its arguments unconstrained; logged once) and `required` is a 400: the prefix cannot
    make the model name a declared function."""
    from kda_rt.engine.structured import grammar_of

    grammar = tool_call_grammar(tools, mode)
    if grammar is None:
        return None
    spec = StructuredOutputsParams(grammar=grammar)
    try:
        grammar_of(spec, "tools[].function.parameters")
    except ValueError as exc:
        if "llguidance" in str(exc) and "not installed" in str(exc):
            if mode.get("required") and not mode.get("forced_name"):
                # the prefix opens the call section and stops at "functions.": without a grammar nothing makes the
                # model name a declared function, so the answer could hold no call at all
                raise InvalidRequest("tool_choice 'required' needs llguidance (pip install 'kda_rt[structured]') "
                                     "to make the model name one of the declared tools; name a function in "
                                     "tool_choice instead, or use 'auto'") from None
            if not _warned_no_llguidance:
                _warned_no_llguidance.append(True)
                logger.warning("tool_choice required / named: llguidance is not installed, so the call's "
                               "arguments are not constrained to the schema (%s)", exc)
            return None
        raise InvalidRequest(_bad_parameters(tools, mode) or str(exc)) from None
    return spec.to_dict()


def _bad_parameters(tools: list[dict[str, Any]], mode: dict[str, Any]) -> str | None:
    """The error of the first forced tool whose `parameters` schema does not compile alone, naming its index and
    function (the grammar of all the tools names neither)."""
    from kda_rt.engine.structured import grammar_of

    for k, tool in enumerate(tools):
        name = tool["function"]["name"]
        if mode.get("forced_name") not in (None, name):
            continue
        try:
            grammar_of(StructuredOutputsParams(grammar=tool_call_grammar([tool], {"forced_name": name})),
                       f"tools[{k}].function.parameters (function {name!r:.100})")
        except ValueError as exc:
            return str(exc)
    return None
