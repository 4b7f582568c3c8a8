"""Reading the tokenizer files of a model directory: the tiktoken rank file and the special tokens of
`tokenizer_config.json` (spec §7).  Every refusal is a `TokenizerError` naming the file and the
line or field."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kda_rt.loader.jsonfile import read_json

__all__ = ["KIMI_ADDITIONAL_SPECIAL_TOKENS", "NUM_SPECIAL_TOKENS", "TokenizerError", "additional_special_tokens",
           "load_json", "load_rank_file", "special_tokens", "token_field"]

NUM_SPECIAL_TOKENS = 256
# The Kimi class's `additional_special_tokens` when tokenizer_config.json gives none (its chat markers): with bos /
# eos / unk / pad, the tokens it calls special, and the only ones in its `get_added_vocab()`
KIMI_ADDITIONAL_SPECIAL_TOKENS = ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                  "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>")


class TokenizerError(ValueError):
    """A tokenizer file is missing or malformed; the message names the file and line or field."""


def load_rank_file(path: str | Path) -> dict[bytes, int]:
    """Parse a tiktoken rank file; ranks must be exactly 0..N-1, each token and rank unique."""
    path = Path(path)
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read rank file ({e.strerror or e})") from None
    ranks: dict[bytes, int] = {}
    line_of_rank: dict[int, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2 or not fields[1].isdigit() or len(fields[1]) > 10:  # ranks < 10**10
            raise TokenizerError(f"{path}:{lineno}: expected '<base64> <rank>', got {line[:80]!r}")
        try:
            token = base64.b64decode(fields[0], validate=True)
        except (binascii.Error, ValueError):
            raise TokenizerError(f"{path}:{lineno}: invalid base64 {fields[0][:80]!r}") from None
        rank = int(fields[1])
        if rank in line_of_rank:
            raise TokenizerError(f"{path}:{lineno}: duplicate rank {rank} (first on line {line_of_rank[rank]})")
        if token in ranks:
            raise TokenizerError(f"{path}:{lineno}: duplicate token {token!r} (already rank {ranks[token]})")
        ranks[token] = rank
        line_of_rank[rank] = lineno
    if not ranks:
        raise TokenizerError(f"{path}: no tokens")
    if max(line_of_rank) != len(ranks) - 1:
        missing = next(r for r in range(len(ranks)) if r not in line_of_rank)
        raise TokenizerError(f"{path}: ranks must be 0..{len(ranks) - 1} without gaps; rank {missing} is missing")
    return ranks


def load_json(path: Path) -> dict[str, Any]:
    """A JSON object file; TokenizerError naming the file (and line) otherwise."""
    return read_json(path, TokenizerError, missing="cannot read (No such file or directory)")


def special_tokens(config: Mapping[str, Any], where: str, num_base: int) -> dict[str, int]:
    """Named specials from `added_tokens_decoder`, reserved names for the rest of the 256-id block."""
    decoder = config.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise TokenizerError(f"{where}: field 'added_tokens_decoder' must be an object")
    names: dict[int, str] = {}
    for key, entry in decoder.items():
        field = f"{where}: added_tokens_decoder[{key!r}]"
        if not key.isdigit():
            raise TokenizerError(f"{field}: key must be a token id")
        token_id = int(key)
        if not num_base <= token_id < num_base + NUM_SPECIAL_TOKENS:
            hint = (f", which follows tiktoken.model's {num_base} ranks (is that file complete?)"
                    if token_id >= num_base + NUM_SPECIAL_TOKENS else "")
            raise TokenizerError(f"{field}: id outside the special range [{num_base}, "
                                 f"{num_base + NUM_SPECIAL_TOKENS}){hint}")
        content = entry.get("content") if isinstance(entry, dict) else None
        if not isinstance(content, str) or not content:
            raise TokenizerError(f"{field}: needs a non-empty string 'content'")
        names[token_id] = content
    specials: dict[str, int] = {}
    for token_id in range(num_base, num_base + NUM_SPECIAL_TOKENS):
        name = names.get(token_id, f"<|reserved_token_{token_id}|>")
        if name in specials:
            raise TokenizerError(f"{where}: special token {name!r} appears at ids {specials[name]} and {token_id}")
        specials[name] = token_id
    return specials


def token_field(config: Mapping[str, Any], field: str, where: str, specials: Mapping[str, int]) -> str | None:
    """A token named by `field` (a string or HF's {"content": ...}), which must be a special token."""
    value = config.get(field)
    if isinstance(value, dict):  # HF serialises AddedToken as {"content": ...}
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise TokenizerError(f"{where}: field {field!r} must be a string")
    if value is not None and value not in specials:
        raise TokenizerError(f"{where}: field {field!r} names {value!r}, which is not a special token")
    return value


def additional_special_tokens(config: Mapping[str, Any], where: str) -> tuple[str, ...] | None:
    """The config's `additional_special_tokens` (strings, or HF's {"content": ...}), None when it gives none."""
    value = config.get("additional_special_tokens")
    if value is None:
        return None
    if not isinstance(value, list):
        raise TokenizerError(f"{where}: field 'additional_special_tokens' must be a list of token strings")
    names = [v.get("content") if isinstance(v, dict) else v for v in value]
    for name in names:
        if not isinstance(name, str):
            raise TokenizerError(f"{where}: field 'additional_special_tokens' holds {name!r}, not a token string")
    return tuple(names)
