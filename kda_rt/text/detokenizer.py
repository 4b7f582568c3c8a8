"""`IncrementalDetokenizer`: text from a growing list of token ids, correct across UTF-8
character boundaries split between tokens (used for streaming and stop strings)."""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kda_rt.text.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """Streams text from token ids, holding back an unfinished UTF-8 character between add() calls.

    Unspaced, the concatenation of every add() and a final flush() equals
    `tokenizer.decode(all_ids, skip_special_tokens=...)`, because Python's incremental UTF-8
    decoder replaces invalid bytes exactly as the one-shot decoder does.  (The engine does not flush: a request
    that ends inside a character leaves those bytes out, as vLLM does.)

    Spaced (`spaces_between_special_tokens` with `skip_special_tokens=False`): vLLM's text for the Kimi tokenizer, one
    space between each of its special tokens (`Tokenizer.added_ids`) and what is next to it, text or another one.  The
    prompt's last token counts as what came before (vLLM's detokenizer starts from the prompt's tail): after a chat
    prompt's `<|im_middle|>` the output starts with a space.  The text between two of them is decoded apart, as vLLM
    decodes each piece, so the bytes of a character cut by one become U+FFFD before the space.  (Ids past the
    tokenizer stay out altogether, spaced or not, where vLLM makes each an empty piece of text.)  The default, False,
    is the plain decode; the engine passes the request's `SamplingParams.spaces_between_special_tokens`.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = False, prompt_token_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chunks: list[str] = []
        # the spaced tokens (none when not spaced: special tokens skipped leave nothing to space)
        self._spaced = tokenizer.added_ids if spaces_between_special_tokens and not skip_special_tokens else frozenset()
        self._after_any = bool(prompt_token_ids)  # a spaced token after another token is preceded by a space
        self._space_owed = bool(prompt_token_ids) and prompt_token_ids[-1] in self._spaced  # before the next text

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Feed ids; return the text they complete (possibly empty).  Ids the tokenizer does not know
        (a model whose vocabulary has more rows than the tokenizer has tokens) produce no text, so a
        generation never fails on detokenization."""
        if not isinstance(token_ids, Iterable):
            token_ids = [token_ids]
        known = self._tokenizer.vocab_size
        ids = [int(t) for t in token_ids if 0 <= int(t) < known]
        if not self._spaced:
            data = self._tokenizer.decode_bytes(ids, skip_special_tokens=self._skip_special_tokens)
            return self._emit(self._text(data))
        pieces: list[str] = []
        start = 0
        for k, token in enumerate(ids):
            if token in self._spaced:
                # the text before it ends here (a cut character becomes U+FFFD), then the space and the token's name
                pieces += [self._text(self._tokenizer.decode_bytes(ids[start:k]), final=True),
                           " " if self._after_any or k else "", self._tokenizer.decode(token)]
                self._space_owed, start = True, k + 1
        pieces.append(self._text(self._tokenizer.decode_bytes(ids[start:])))
        self._after_any = self._after_any or bool(ids)
        return self._emit("".join(pieces))

    def flush(self) -> str:
        """Emit held-back bytes (an unfinished character becomes U+FFFD)."""
        return self._emit(self._text(b"", final=True))

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def _text(self, data: bytes, final: bool = False) -> str:
        """Decoded text of the next bytes, after the space owed to a spaced token before it, once there is text."""
        text = self._decoder.decode(data, final=final)
        if text and self._space_owed:
            text, self._space_owed = " " + text, False
        return text

    def _emit(self, text: str) -> str:
        if text:
            self._chunks.append(text)
        return text
