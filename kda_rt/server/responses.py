"""OpenAI response bodies and stream chunks, built from the engine's per-request deltas.

A delta item (from the engine process) is `{"id", "finished", "outputs": [{"index", "text",
"token_ids", "logprobs", "finish_reason", "stop_reason"}]}`, where `logprobs` holds, per new token,
`[token bytes, logprob, [[bytes, logprob], ...top N]]`.  A prompt's logprobs (echo,
prompt_logprobs) come once, with the engine's `added` answer: per prompt token
`[token id, bytes, logprob | None, rank | None, [[id, bytes, logprob], ...]]`.

`Choices` accumulates the deltas for a non-streaming response; `StreamChoices` turns each delta
into a stream chunk's choices.  Both read tool calls out of chat text when the request asked for
them (`tool_mode`), and put the prompt in front for completions with `echo`.
"""

from __future__ import annotations

import time
from typing import Any

from kda_rt.text.tool_parser import ToolCallStream, forced_prefix, parse_tool_calls

__all__ = ["Choices", "StreamChoices", "chunk", "prompt_logprobs_field", "usage"]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _text(token: bytes) -> str:
    return token.decode("utf-8", errors="replace")


def _echo_entries(prompt_entries: list, as_ids: bool = False, num: int | None = None) -> list:
    """Prompt-logprob entries in the generation-entry form [bytes, logprob | None, top | None], each top cut to the
    request's `logprobs` (`num`; the entries may hold more for its `prompt_logprobs`), as vLLM cuts them; `as_ids`:
    tokens named "token_id:N" (return_tokens_as_token_ids, as the generated tokens' entries already are)."""
    if as_ids:
        return [[b"token_id:%d" % tok, lp,
                 None if lp is None else [[b"token_id:%d" % t, tlp] for t, _, tlp in top[:num]]]
                for tok, _, lp, _, top in prompt_entries]
    return [[b, lp, None if lp is None else [[tb, tlp] for _, tb, tlp in top[:num]]]
            for _, b, lp, _, top in prompt_entries]


def completion_logprobs(entries: list, offset: int) -> dict[str, list]:
    """The legacy completions `logprobs` object; `offset` = characters of this choice before these tokens.
    An echoed first prompt token has logprob None and top_logprobs None (no context).  Each top_logprobs holds the
    chosen token too, as OpenAI's and vLLM's do (up to logprobs + 1 entries)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lp, top in entries:
        text = _text(token)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(None if top is None else {**{_text(t): v for t, v in top}, text: lp})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(entries: list) -> dict[str, list]:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    return {"content": [
        {"token": _text(token), "logprob": lp, "bytes": list(token),
         "top_logprobs": [{"token": _text(t), "logprob": v, "bytes": list(t)} for t, v in top]}
        for token, lp, top in entries
    ]}


def prompt_logprobs_field(prompt_entries: list) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
    out: list[dict[str, Any] | None] = []
    for tok, b, lp, rank, top in prompt_entries:
        if lp is None:
            out.append(None)
            continue
        ranks = {t: k + 1 for k, (t, _, _) in enumerate(sorted(top, key=lambda e: -e[2]))}
        entry = {str(t): {"logprob": v, "rank": ranks[t], "decoded_token": _text(tb)} for t, tb, v in top}
        entry[str(tok)] = {"logprob": lp, "rank": rank, "decoded_token": _text(b)}
        out.append(entry)
    return out


class _Shape:
    """What every choice of one request shares: n samples per prompt, the prompts (echo text,
    prompt logprobs), and the tool-call mode."""

    def __init__(self, n: int, num_choices: int, chat: bool, prompts: list[dict[str, Any]], echo: bool,
                 tool_mode: dict[str, Any] | None, token_ids: bool = False, as_ids: bool = False,
                 num_logprobs: int | None = None) -> None:
        self.n, self.num_choices, self.chat, self.prompts, self.echo = n, num_choices, chat, prompts, echo
        self.num_logprobs = num_logprobs  # the request's `logprobs`: echoed prompt tokens' top entries
        self.as_ids = as_ids  # return_tokens_as_token_ids: echoed prompt tokens named "token_id:N"
        self.tool_mode = tool_mode
        self.token_ids = token_ids  # vLLM's return_token_ids: the prompt's and each choice's ids in the response
        self.prefix = forced_prefix(tool_mode)

    def prompt_of(self, i: int) -> dict[str, Any]:
        return self.prompts[i // self.n] if self.prompts else {}


class Choices(_Shape):
    """Accumulates the deltas of one request into the `choices` of a non-streaming response."""

    def __init__(self, n: int, chat: bool, *, num_choices: int | None = None, prompts: list | None = None,
                 echo: bool = False, tool_mode: dict[str, Any] | None = None, logprobs: bool = False,
                 token_ids: bool = False, as_ids: bool = False, num_logprobs: int | None = None,
                 keep_output: bool = True) -> None:
        super().__init__(n, num_choices or n, chat, prompts or [], echo, tool_mode, token_ids, as_ids, num_logprobs)
        self.with_logprobs = logprobs
        # False for a stream: its chunks carry the output, so only the counts and finishes are kept here (a long
        # stream's text and logprobs would otherwise stay in the HTTP process until it ends)
        self.keep_output = keep_output
        self.pieces: list[list[str]] = [[] for _ in range(self.num_choices)]  # (joined once: += on each delta copied
        # the whole text so far, quadratic in a choice's length)
        self.ids: list[list[int]] = [[] for _ in range(self.num_choices)] if token_ids else []
        self.num_tokens = [0] * self.num_choices
        self.logprobs: list[list | None] = [None] * self.num_choices
        self.finish: list[tuple[str | None, Any]] = [(None, None)] * self.num_choices

    def add(self, item: dict[str, Any]) -> None:
        for c in item["outputs"]:
            i = c["index"]
            self.num_tokens[i] += len(c["token_ids"])
            if c["finish_reason"] is not None:
                self.finish[i] = (c["finish_reason"], c["stop_reason"])
            if not self.keep_output:
                continue
            self.pieces[i].append(c["text"])
            if self.token_ids:
                self.ids[i] += c["token_ids"]
            if c["logprobs"] is not None:
                if self.logprobs[i] is None:
                    self.logprobs[i] = []
                self.logprobs[i] += c["logprobs"]  # (in place: a new list a delta was quadratic too)

    def text(self, i: int) -> str:
        return "".join(self.pieces[i])

    @property
    def completion_tokens(self) -> int:
        return sum(self.num_tokens)

    def build(self) -> list[dict[str, Any]]:
        return [self._chat_choice(i) if self.chat else self._completion_choice(i) for i in range(self.num_choices)]

    def _chat_choice(self, i: int) -> dict[str, Any]:
        entries = self.logprobs[i]
        reason, stop_reason = self.finish[i]
        text = self.text(i)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tool_mode is not None:
            # (a call cut short, by max_tokens or the model, is kept as far as it got, as a stream shows it)
            content, calls = parse_tool_calls(self.prefix + text, self.tool_mode.get("max_calls"))
            message = {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}
            if calls and reason == "stop":  # ("length" stays: the last call may be cut, its arguments not JSON)
                reason = "tool_calls"
        choice = {"index": i, "message": message, "logprobs": chat_logprobs(entries) if entries is not None else None,
                  "finish_reason": reason, "stop_reason": stop_reason}
        if self.token_ids:
            choice["token_ids"] = self.ids[i]
        return choice

    def _completion_choice(self, i: int) -> dict[str, Any]:
        entries, prompt = self.logprobs[i], self.prompt_of(i)
        reason, stop_reason = self.finish[i]
        text = self.text(i)
        if self.echo:
            text = prompt.get("text", "") + text
            if self.with_logprobs and "logprobs" in prompt:
                entries = _echo_entries(prompt["logprobs"], self.as_ids, self.num_logprobs) + (entries or [])
        choice = {"index": i, "text": text,
                  "logprobs": completion_logprobs(entries, 0) if entries is not None else None,
                  "finish_reason": reason, "stop_reason": stop_reason}
        if "logprobs" in prompt:
            choice["prompt_logprobs"] = prompt_logprobs_field(prompt["logprobs"])
        if self.token_ids:
            choice["prompt_token_ids"], choice["token_ids"] = prompt.get("ids"), self.ids[i]
        return choice


class StreamChoices(_Shape):
    """Turns delta items into stream-chunk choices, keeping per-choice offsets and tool-call parsers."""

    def __init__(self, n: int, chat: bool, *, num_choices: int | None = None, prompts: list | None = None,
                 echo: bool = False, tool_mode: dict[str, Any] | None = None, logprobs: bool = False,
                 token_ids: bool = False, as_ids: bool = False, num_logprobs: int | None = None) -> None:
        super().__init__(n, num_choices or n, chat, prompts or [], echo, tool_mode, token_ids, as_ids, num_logprobs)
        self.offsets = [0] * self.num_choices
        self.ids_sent = [False] * self.num_choices  # (completions: a choice's first chunk carries its prompt's ids)
        self.with_logprobs = logprobs
        self.parsers = None
        self.pending: list[list[dict[str, Any]]] = [[] for _ in range(self.num_choices)]  # from the forced prefix
        if tool_mode is not None:
            self.parsers = [ToolCallStream(tool_mode.get("max_calls")) for _ in range(self.num_choices)]
            for i, parser in enumerate(self.parsers):
                self.pending[i] = parser.feed(self.prefix)[1]

    def echo_choices(self) -> list[dict[str, Any]]:
        """The first chunk of a completion with echo: each choice's prompt (and its logprobs)."""
        out = []
        for i in range(self.num_choices):
            prompt = self.prompt_of(i)
            text = prompt.get("text", "") if self.echo else ""
            lps = None
            if self.echo and self.with_logprobs and "logprobs" in prompt:
                lps = completion_logprobs(_echo_entries(prompt["logprobs"], self.as_ids, self.num_logprobs), 0)
            choice = {"index": i, "text": text, "logprobs": lps, "finish_reason": None, "stop_reason": None}
            if "logprobs" in prompt:
                choice["prompt_logprobs"] = prompt_logprobs_field(prompt["logprobs"])
            self._ids(choice, i, [])
            self.offsets[i] = len(text)
            out.append(choice)
        return out

    def _ids(self, choice: dict[str, Any], i: int, ids: list[int]) -> None:
        """return_token_ids: the chunk's ids, and a completion choice's prompt ids in its first chunk (vLLM's)."""
        if not self.token_ids:
            return
        if not self.chat and not self.ids_sent[i]:
            choice["prompt_token_ids"], self.ids_sent[i] = self.prompt_of(i).get("ids"), True
        choice["token_ids"] = ids

    def choices(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        for c in item["outputs"]:
            i, lps, reason = c["index"], c["logprobs"], c["finish_reason"]
            if self.chat:
                delta: dict[str, Any] = {}
                content = c["text"]
                if self.parsers is not None:
                    parser = self.parsers[i]
                    content, calls = parser.feed(c["text"], final=reason is not None)
                    calls, self.pending[i] = self.pending[i] + calls, []
                    if calls:
                        delta["tool_calls"] = calls
                    if parser.calls and reason == "stop":  # ("length" stays, as above)
                        reason = "tool_calls"
                if content or (reason is None and "tool_calls" not in delta):
                    delta = {"content": content, **delta}
                choice = {"index": i, "delta": delta, "logprobs": chat_logprobs(lps) if lps is not None else None}
            else:
                choice = {"index": i, "text": c["text"],
                          "logprobs": completion_logprobs(lps, self.offsets[i]) if lps is not None else None}
            self.offsets[i] += len(c["text"])
            choice["finish_reason"] = reason
            choice["stop_reason"] = c["stop_reason"]
            self._ids(choice, i, c["token_ids"])
            out.append(choice)
        return out


def chunk(request_id: str, model: str, chat: bool, choices: list[dict[str, Any]],
          usage_: dict[str, int] | None = None, created: int | None = None) -> dict[str, Any]:
    """One SSE chunk; `created` is the request's (every chunk of a stream carries the same, as OpenAI's do)."""
    body = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()) if created is None else created, "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body
