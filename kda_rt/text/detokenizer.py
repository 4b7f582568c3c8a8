"""`IncrementalDetokenizer`: text from a growing list of token ids, correct across UTF-8
character boundaries split between tokens (used for streaming and stop strings)."""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kda_rt.text.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """Streams text from token ids, holding back an unfinished UTF-8 character between add() calls.

    The concatenation of every add() and a final flush() equals
    `tokenizer.decode(all_ids, skip_special_tokens=...)`, because Python's incremental UTF-8
    decoder replaces invalid bytes exactly as the one-shot decoder does.  (The engine does not flush: a request
    that ends inside a character leaves those bytes out, as vLLM does.)
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chunks: list[str] = []

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Feed ids; return the text they complete (possibly empty).  Ids the tokenizer does not know
        (a model whose vocabulary has more rows than the tokenizer has tokens) produce no text, so a
        generation never fails on detokenization."""
        if not isinstance(token_ids, Iterable):
            token_ids = [token_ids]
        known = self._tokenizer.vocab_size
        ids = [int(t) for t in token_ids if 0 <= int(t) < known]
        data = self._tokenizer.decode_bytes(ids, skip_special_tokens=self._skip_special_tokens)
        return self._emit(self._decoder.decode(data))

    def flush(self) -> str:
        """Emit held-back bytes (an unfinished character becomes U+FFFD)."""
        return self._emit(self._decoder.decode(b"", final=True))

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def _emit(self, text: str) -> str:
        if text:
            self._chunks.append(text)
        return text
