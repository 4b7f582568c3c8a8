"""The Hugging Face tokenizer surface of `Tokenizer` (what vLLM users call on `llm.get_tokenizer()`).

Semantics are those of the Kimi checkpoints' remote `TikTokenTokenizer` (a `PreTrainedTokenizer`), checked against it
on the demo vocabulary:
  tok(text) / tok([texts])   {"input_ids", "attention_mask"}, also as attributes; no BOS is added (the Kimi tokenizer
                             adds none: `add_special_tokens` is accepted and changes nothing); special-token strings
                             in the text become their ids, as the Kimi tokenizer's encode and as the engine reads a text
                             prompt (`Tokenizer.encode` keeps them text unless `allow_special=True`)
  convert_ids_to_tokens      byte-level token strings (GPT-2's byte-to-character table: b" hi" -> "Ġhi"), a special
                             token's name; convert_tokens_to_ids / convert_tokens_to_string / get_vocab the inverse
  bos/eos/pad/unk_token(_id) from tokenizer_config.json
  get_added_vocab            the Kimi class's special tokens (bos / eos / unk / pad and its chat markers, or the
                             config's additional_special_tokens): what vLLM's detokenizer spaces (`added_ids`)
Differences, by design: `len(tok)` is the mergeable tokens + 256 special ids (the model's rows), where the Kimi class
counts 2 reserved ids more; `all_special_ids` / `all_special_tokens` are all 256 special ids, the ones
`skip_special_tokens=True` drops (the Kimi class lists only bos / eos / unk / pad and its chat markers and skips only
those, keeping e.g. `[EOS]` and the tool-call markers).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["BatchEncoding", "HFSurface", "byte_to_char"]


@functools.cache
def byte_to_char() -> tuple[str, ...]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68 bytes (controls, space,
    DEL, NBSP, soft hyphen) for U+0100, U+0101, ... in byte order, so every token is a printable string."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(0x100 + extra))
            extra += 1
    return tuple(chars)


@functools.cache
def _char_to_byte() -> dict[str, int]:
    return {c: b for b, c in enumerate(byte_to_char())}


class BatchEncoding(dict):
    """`tok(text)`: a dict whose keys are also attributes (`enc["input_ids"]`, `enc.input_ids`), as HF's."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class HFSurface:
    """Mixin of `Tokenizer` (which provides `encode`, `decode`, `token_bytes`, `vocab_size`, `_specials`,
    `_special_ids`, `_special_id`, `added_ids`, the token names and `_vocab`, None until `get_vocab` builds it)."""

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def max_token_id(self) -> int:
        """vLLM's tokenizer attribute: the largest token id."""
        return self.vocab_size - 1

    def __call__(self, text: str | Sequence[str], *, add_special_tokens: bool = True, allow_special: bool = True,
                 return_attention_mask: bool = True, **kwargs: Any) -> BatchEncoding:
        """HF's `tok(text)`: `input_ids` (and `attention_mask`, all ones) of a string, or lists of them for a list of
        strings.  No padding, truncation or tensors (those arguments are refused by name)."""
        if kwargs:
            raise TypeError(f"Tokenizer.__call__ does not take {sorted(kwargs)}: it returns plain lists, unpadded")
        del add_special_tokens  # (the Kimi tokenizer adds no special tokens)
        if isinstance(text, str):
            ids: Any = self.encode(text, allow_special=allow_special)
            mask: Any = [1] * len(ids)
        elif isinstance(text, (list, tuple)) and all(isinstance(t, str) for t in text):
            ids = [self.encode(t, allow_special=allow_special) for t in text]
            mask = [[1] * len(i) for i in ids]
        else:
            raise TypeError(f"text must be a str or a list of str, got {type(text).__name__}")
        return BatchEncoding(input_ids=ids, attention_mask=mask) if return_attention_mask else \
            BatchEncoding(input_ids=ids)

    def batch_decode(self, sequences: Iterable[Iterable[int]], *, skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: bool | None = None) -> list[str]:
        """`decode` of each sequence (`clean_up_tokenization_spaces`: accepted; the Kimi tokenizer's cleanup is a
        no-op)."""
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]

    # ---- token strings --------------------------------------------------------------------------

    def convert_ids_to_tokens(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> str | list[str]:
        """Token strings: a special token's name, else its bytes in the byte-level alphabet (`byte_to_char`)."""
        if not isinstance(ids, Iterable):
            return self._token_string(ids)
        return [self._token_string(i) for i in ids if not (skip_special_tokens and i in self._special_ids)]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | None | list[int | None]:
        """Ids of token strings; a string that is no token gives `unk_token_id` (HF's)."""
        vocab = self._vocab_map()
        if isinstance(tokens, str):
            return vocab.get(tokens, self.unk_token_id)
        return [vocab.get(t, self.unk_token_id) for t in tokens]

    def convert_tokens_to_string(self, tokens: Iterable[str]) -> str:
        """Text of token strings (`convert_ids_to_tokens`' inverse); invalid UTF-8 becomes U+FFFD."""
        table = _char_to_byte()
        data = bytearray()
        for token in tokens:
            if token in self._specials:
                data += token.encode("utf-8")
            else:
                try:
                    data += bytes(table[c] for c in token)
                except KeyError:
                    raise ValueError(f"{token!r} is not a token string (a character outside the byte-level "
                                     "alphabet)") from None
        return data.decode("utf-8", errors="replace")

    def get_added_vocab(self) -> dict[str, int]:
        """{token string: id} of `added_ids`, by id (the Kimi class's added vocabulary: its special tokens alone)."""
        return {self._token_string(i): i for i in sorted(self.added_ids)}

    def get_vocab(self) -> dict[str, int]:
        """{token string: id} for every id: a new dict of ~164k entries on Kimi's vocabulary."""
        return dict(self._vocab_map())

    def _vocab_map(self) -> dict[str, int]:
        if self._vocab is None:  # (built on first use: ~0.2 s on Kimi's vocabulary)
            self._vocab = {self._token_string(i): i for i in range(self.vocab_size)}
        return self._vocab

    def _token_string(self, token_id: int) -> str:
        data = self.token_bytes(token_id)
        if token_id in self._special_ids:
            return data.decode("utf-8")
        table = byte_to_char()
        return "".join(table[b] for b in data)

    # ---- special tokens -------------------------------------------------------------------------

    @property
    def all_special_ids(self) -> list[int]:
        """Every special id (the ones `skip_special_tokens=True` drops), ascending."""
        return sorted(self._special_ids)

    @property
    def all_special_tokens(self) -> list[str]:
        return sorted(self._specials, key=self._specials.__getitem__)

    @property
    def bos_token(self) -> str | None:
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        return self._eos_token

    @property
    def pad_token(self) -> str | None:
        return self._pad_token

    @property
    def unk_token(self) -> str | None:
        return self._unk_token

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id(self._pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._special_id(self._unk_token)
