"""OpenAI response bodies and stream chunks, built from the engine's per-request deltas.

A delta item (from the engine process) is `{"id", "finished", "outputs": [{"index", "text",
"token_ids", "logprobs", "finish_reason", "stop_reason"}]}`, where `logprobs` holds, per new token,
`[token bytes, logprob, [[bytes, logprob], ...top N]]`.  `Choices` accumulates them for a
non-streaming response; `chunk_choices` turns one of them into a stream chunk's choices.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["Choices", "chunk", "chunk_choices", "usage"]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _text(token: bytes) -> str:
    return token.decode("utf-8", errors="replace")


def completion_logprobs(entries: list, offset: int) -> dict[str, list]:
    """The legacy completions `logprobs` object; `offset` = characters of this choice before these tokens."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lp, top in entries:
        text = _text(token)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append({_text(t): v for t, v in top})
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


class Choices:
    """Accumulates the deltas of one request into the `choices` of a non-streaming response."""

    def __init__(self, n: int, chat: bool) -> None:
        self.chat = chat
        self.text = [""] * n
        self.num_tokens = [0] * n
        self.logprobs: list[list | None] = [None] * n
        self.finish: list[tuple[str | None, Any]] = [(None, None)] * n

    def add(self, item: dict[str, Any]) -> None:
        for c in item["outputs"]:
            i = c["index"]
            self.text[i] += c["text"]
            self.num_tokens[i] += len(c["token_ids"])
            if c["logprobs"] is not None:
                self.logprobs[i] = (self.logprobs[i] or []) + c["logprobs"]
            if c["finish_reason"] is not None:
                self.finish[i] = (c["finish_reason"], c["stop_reason"])

    @property
    def completion_tokens(self) -> int:
        return sum(self.num_tokens)

    def build(self) -> list[dict[str, Any]]:
        out = []
        for i, text in enumerate(self.text):
            entries = self.logprobs[i]
            reason, stop_reason = self.finish[i]
            if self.chat:
                out.append({"index": i, "message": {"role": "assistant", "content": text},
                            "logprobs": chat_logprobs(entries) if entries is not None else None,
                            "finish_reason": reason, "stop_reason": stop_reason})
            else:
                out.append({"index": i, "text": text,
                            "logprobs": completion_logprobs(entries, 0) if entries is not None else None,
                            "finish_reason": reason, "stop_reason": stop_reason})
        return out


def chunk_choices(item: dict[str, Any], chat: bool, offsets: list[int]) -> list[dict[str, Any]]:
    """Stream-chunk choices of one delta item; `offsets` (characters sent per choice) is updated."""
    out = []
    for c in item["outputs"]:
        i, lps = c["index"], c["logprobs"]
        if chat:
            delta = {"content": c["text"]} if c["text"] or c["finish_reason"] is None else {}
            choice = {"index": i, "delta": delta, "logprobs": chat_logprobs(lps) if lps is not None else None}
        else:
            choice = {"index": i, "text": c["text"],
                      "logprobs": completion_logprobs(lps, offsets[i]) if lps is not None else None}
        offsets[i] += len(c["text"])
        choice["finish_reason"] = c["finish_reason"]
        choice["stop_reason"] = c["stop_reason"]
        out.append(choice)
    return out


def chunk(request_id: str, model: str, chat: bool, choices: list[dict[str, Any]],
          usage_: dict[str, int] | None = None) -> dict[str, Any]:
    body = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body
