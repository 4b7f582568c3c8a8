"""Kimi tokenizer: tiktoken byte-level BPE, a block of 256 special ids, Jinja chat template (spec §7).

Files read from a model directory:
  tiktoken.model         one `<base64 token bytes> <rank>` per line; ranks 0..N-1 are the token ids
  tokenizer_config.json  `added_tokens_decoder` {id: {"content": ...}}, `bos_token`, `eos_token`,
                         optional `chat_template`
  chat_template.jinja    optional; preferred over the config's template; else kda_rt/chat_template.jinja

Special ids fill [N, N + 256): the named ones from `added_tokens_decoder`, every other slot
`<|reserved_token_{id}|>`.  Unlike the reference tokenizer, plain `encode()` never emits a special
id: a literal `<|im_end|>` in user text stays text.  Control tokens come only from the chat
template's markers (`encode_chat`) or from `encode(..., allow_special=True)`, which the engine uses for a
text prompt (the caller's whole input, as in vLLM's completions).
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import tiktoken
from jinja2 import TemplateError

from kda_rt.text.chat import (
    TemplateLimitError,
    align_stand_ins,
    compile_template,
    normalize_messages,
    render_template,
    stand_in_strings,
    template_source,
    validate_messages,
)
from kda_rt.text.hf_surface import HFSurface
from kda_rt.text.tokenizer_files import (
    KIMI_ADDITIONAL_SPECIAL_TOKENS,
    NUM_SPECIAL_TOKENS,
    TokenizerError,
    additional_special_tokens,
    load_json,
    load_rank_file,
    special_tokens,
    token_field,
)

__all__ = ["NUM_SPECIAL_TOKENS", "PAT_STR", "Tokenizer", "TokenizerError", "load_rank_file"]


_LETTER_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"  # `&&` = class intersection (Rust regex)
_LETTER_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
PAT_STR = "|".join([
    r"[\p{Han}]+",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTER_UPPER}*{_LETTER_LOWER}+{_CONTRACTION}",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTER_UPPER}+{_LETTER_LOWER}*{_CONTRACTION}",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# The reference encoder cuts text into <= 400k-char pieces and cuts runs of > 25k whitespace or
# non-whitespace chars before BPE (spec §7.3); mirrored so that pathological inputs split alike.
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000
_LONG_RUN = re.compile(rf"\s{{{_MAX_RUN_CHARS + 1},}}|\S{{{_MAX_RUN_CHARS + 1},}}")


def _split_for_bpe(text: str) -> Iterator[str]:
    """Cut text the way the reference encoder does before BPE (see _MAX_ENCODE_CHARS)."""
    for start in range(0, len(text), _MAX_ENCODE_CHARS):
        chunk = text[start:start + _MAX_ENCODE_CHARS]
        cut = 0
        for run in _LONG_RUN.finditer(chunk):
            for pos in range(run.start() + _MAX_RUN_CHARS, run.end(), _MAX_RUN_CHARS):
                yield chunk[cut:pos]
                cut = pos
        yield chunk[cut:]


class Tokenizer(HFSurface):
    """Byte-level BPE over `mergeable_ranks` plus special tokens, and the chat template; Hugging Face's tokenizer
    calls (`tok(text)`, `convert_ids_to_tokens`, `all_special_ids`, ...) from `HFSurface` (text/hf_surface.py)."""

    def __init__(self, mergeable_ranks: dict[bytes, int], special_tokens: dict[str, int], *,
                 bos_token: str | None = None, eos_token: str | None = None, chat_template: str | None = None,
                 name: str = "kimi", chat_template_name: str | None = None, pad_token: str | None = None,
                 unk_token: str | None = None, additional_special_tokens: Sequence[str] | None = None) -> None:
        """chat_template None means the built-in kda_rt/chat_template.jinja; chat_template_name
        (its file or config field) is named in rendering errors.  additional_special_tokens (the config's; None: the
        Kimi class's chat markers) with bos / eos / pad / unk are the Kimi class's special tokens (`added_ids`)."""
        for field, token in (("bos_token", bos_token), ("eos_token", eos_token), ("pad_token", pad_token),
                             ("unk_token", unk_token)):
            if token is not None and token not in special_tokens:
                raise TokenizerError(f"{field} {token!r} is not a special token")
        self._enc = tiktoken.Encoding(name, pat_str=PAT_STR, mergeable_ranks=mergeable_ranks,
                                      special_tokens=special_tokens,
                                      explicit_n_vocab=len(mergeable_ranks) + len(special_tokens))
        self._specials = dict(special_tokens)
        self._special_ids = frozenset(special_tokens.values())
        self._special_re = re.compile("|".join(re.escape(s) for s in sorted(special_tokens, key=len, reverse=True)))
        self._bos_token, self._eos_token = bos_token, eos_token
        self._pad_token, self._unk_token = pad_token, unk_token
        extra = KIMI_ADDITIONAL_SPECIAL_TOKENS if additional_special_tokens is None else additional_special_tokens
        # (a name that is no special token gets a new id past the vocabulary in the Kimi class: never generated here)
        self._added_ids = frozenset(special_tokens[t] for t in (bos_token, eos_token, unk_token, pad_token, *extra)
                                    if t in special_tokens)
        self._vocab: dict[str, int] | None = None  # {token string: id}, built by the first get_vocab()
        self._template = compile_template(chat_template)
        self._template_name = chat_template_name or ("built-in template" if chat_template is None else "given template")

    @classmethod
    def from_dir(cls, model_dir: str | Path, chat_template: str | None = None) -> Tokenizer:
        """Load `tiktoken.model` + `tokenizer_config.json` (+ optional `chat_template.jinja`) from a directory;
        `chat_template` (a file's path or the template itself) replaces the checkpoint's template."""
        model_dir = Path(model_dir)
        ranks = load_rank_file(model_dir / "tiktoken.model")
        config_path = model_dir / "tokenizer_config.json"
        config = load_json(config_path)
        specials = special_tokens(config, str(config_path), len(ranks))
        tokens = {f: token_field(config, f, str(config_path), specials) for f in ("bos_token", "eos_token")}
        for field in ("pad_token", "unk_token"):  # (read for HF's calls only: one that is not a special token is
            try:                                   # dropped, not a reason to refuse the checkpoint)
                tokens[field] = token_field(config, field, str(config_path), specials)
            except TokenizerError:
                tokens[field] = None
        template, template_name = template_source(model_dir, config, str(config_path), chat_template)
        extra = additional_special_tokens(config, str(config_path))
        try:
            return cls(ranks, specials, **tokens, chat_template=template, name=model_dir.name or "kimi",
                       chat_template_name=template_name, additional_special_tokens=extra)
        except TemplateError as e:
            line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
            raise TokenizerError(f"{template_name}: chat template does not compile{line}: {e}") from None
        except TemplateLimitError as e:  # (its compile went past a bound: the time, folding constants)
            raise TokenizerError(f"{template_name}: chat template does not compile: {e}") from None

    # ---- vocabulary ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Mergeable tokens + the 256 special slots (the model's embedding rows)."""
        return self._enc.n_vocab

    @property
    def encoding(self) -> tiktoken.Encoding:
        """The tiktoken encoding (mergeable ranks, special tokens, split pattern): llguidance builds
        its token table from it (kda_rt/engine/structured.py)."""
        return self._enc

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id(self._bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id(self._eos_token)

    def _special_id(self, token: str | None) -> int | None:
        """The id of a configured special token (bos / eos / pad / unk), None where none is configured."""
        return self._specials.get(token) if token else None

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def added_ids(self) -> frozenset[int]:
        """The ids of the Kimi class's special tokens (bos, eos, unk, pad and `additional_special_tokens`): its whole
        `get_added_vocab()`, the tokens vLLM's detokenizer keeps apart from the text (spaced, with
        `spaces_between_special_tokens`).  The tool-call markers, `[EOS]` and the reserved ids are not among them."""
        return self._added_ids

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """eos (`<|im_end|>` for Kimi) first, then `[EOS]` when the vocabulary has it (spec §7.6)."""
        ids = [self.eos_token_id, self._specials.get("[EOS]")]
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def token_to_id(self, token: str) -> int:
        """Id of a special token string such as `<|im_end|>`."""
        if token not in self._specials:
            raise KeyError(f"{token!r} is not a special token")
        return self._specials[token]

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (a special token's bytes are its UTF-8 name)."""
        return self._enc.decode_single_token_bytes(self._check_ids([token_id])[0])

    # ---- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, *, allow_special: bool = False, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; special-token strings are ordinary text unless allow_special (Hugging Face's Kimi
        tokenizer reads them as special ids: `tok(text)` does).  `add_special_tokens` (HF's) is accepted and adds
        nothing, as the Kimi tokenizer adds no BOS or EOS."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        try:  # (tiktoken would encode a lone surrogate as U+FFFD; the server's JSON decoder refuses it)
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"text holds a lone surrogate {text[exc.start]!r} at index {exc.start}: not valid "
                             "Unicode") from None
        ids: list[int] = []
        for piece in _split_for_bpe(text):
            if allow_special:
                ids += self._enc.encode(piece, allowed_special="all", disallowed_special=())
            else:
                ids += self._enc.encode_ordinary(piece)
        return ids

    def decode_bytes(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> bytes:
        """Concatenated token bytes (may end mid-character); ids outside the vocabulary raise."""
        ids = self._check_ids(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self._enc.decode_bytes(ids)

    def decode(self, ids: int | Iterable[int], *, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """Text of ids (or of one id, as HF's decode takes); invalid UTF-8 becomes U+FFFD.
        `clean_up_tokenization_spaces` (HF's) is accepted: the Kimi tokenizer's cleanup changes nothing."""
        if not isinstance(ids, Iterable):
            ids = [ids]
        return self.decode_bytes(ids, skip_special_tokens=skip_special_tokens).decode("utf-8", errors="replace")

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        ids = [operator.index(i) for i in ids]
        bad = next((i for i in ids if not 0 <= i < self._enc.n_vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} outside the vocabulary [0, {self._enc.n_vocab})")
        return ids

    # ---- chat ---------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            chat_template_kwargs: Mapping[str, Any] | None = None, tokenize: bool = False,
                            continue_final_message: bool = False, chat_template: str | None = None,
                            **template_kwargs: Any) -> str | list[int]:
        """Render the chat template to a prompt string; `chat_template_kwargs` and any other keyword arguments
        (as Hugging Face's) are extra template variables (e.g. `thinking`).  `tokenize=True`: the prompt ids
        instead (`encode_chat`).  The defaults, `add_generation_prompt=True` and `tokenize=False`, are the Kimi
        tokenizer's (transformers' own are False and True); HF's tensor and padding arguments are refused.
        `continue_final_message`: the text stops right after the last message's content, so the model
        continues that message (its end marker and whatever the template puts after it are left out).
        `chat_template` (vLLM's): a Jinja template string used for this call instead of the tokenizer's."""
        refused = sorted(set(template_kwargs) & _HF_TENSOR_ARGS)
        if refused:
            raise TypeError(f"apply_chat_template does not take {refused}: it returns a string or a list of ids")
        if template_kwargs:
            chat_template_kwargs = {**(chat_template_kwargs or {}), **template_kwargs}
        if tokenize:
            return self.encode_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                    chat_template_kwargs=chat_template_kwargs,
                                    continue_final_message=continue_final_message, chat_template=chat_template)
        messages, template, text = self._checked_render(messages, add_generation_prompt, tools, chat_template_kwargs,
                                                        continue_final_message, chat_template)
        if continue_final_message:
            text = text[:len(text) - len(self._final_tail(text, messages, tools, chat_template_kwargs, template))]
        return text

    def _checked_render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, tools: Any,
                        extra: Any, continue_final_message: bool, chat_template: str | None
                        ) -> tuple[list[dict[str, Any]], tuple[Any, str], str]:
        """(normalized messages, template, rendered text) after the checks that `apply_chat_template` and
        `encode_chat` share: the messages, tools and extra variables validated, `continue_final_message` allowed."""
        validate_messages(messages, tools, extra)
        _check_continue(messages, add_generation_prompt, continue_final_message)
        template = self._template_for(chat_template)
        messages = normalize_messages(messages, template[0].reads_content_parts)
        return messages, template, self._render(messages, add_generation_prompt, tools, extra, template)

    def _template_for(self, source: str | None) -> tuple[Any, str]:
        """(compiled template, its name in errors): the tokenizer's own, or `source` compiled (a few kept)."""
        if source is None:
            return self._template, self._template_name
        if not isinstance(source, str):
            raise ValueError(f"chat_template must be a string (a Jinja template), got {type(source).__name__}")
        return _compiled(source), "chat_template (the request's)"

    def _final_tail(self, rendered: str, messages: list[dict[str, Any]], tools: Any, extra: Any,
                    template: tuple[Any, str]) -> str:
        """What the template put after the last message's content (continue_final_message): found by rendering
        again with a mark after that content (a search for the content itself can land inside the end marker,
        e.g. for the content "e"), and checked to follow the content in `rendered`."""
        content = messages[-1]["content"]
        mark = "\ue001"
        while mark in rendered:
            mark += "\ue001"
        if isinstance(content, list):  # text parts: the mark after the last one's text (as transformers continues)
            *first, last = content
            marked_content: Any = [*first, {**last, "text": last["text"] + mark}]
            content = last["text"]
        else:
            marked_content = content + mark
        marked = self._render([*messages[:-1], {**messages[-1], "content": marked_content}], False, tools, extra,
                              template)
        at = marked.rfind(mark)
        tail = marked[at + len(mark):] if at >= 0 else None
        if tail is None or not rendered.endswith(content + tail):
            raise ValueError("continue_final_message: the chat template does not print the last message's content "
                             "as it is, so the prompt cannot stop right after it")
        return tail

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    chat_template_kwargs: Mapping[str, Any] | None = None,
                    continue_final_message: bool = False, chat_template: str | None = None) -> list[int]:
        """Prompt ids: the template's markers are control tokens; every client string (contents,
        names, tool names, descriptions, schemas, tool-call arguments, tool results) stays text.

        The template is rendered twice: as is, and with each client string value replaced by a
        stand-in; the two must line up once the strings are put back (as is, or JSON-escaped where
        the template used `tojson`), else the template edits client text and the prompt is refused.
        Special-token strings found in the template pieces become control ids; text between two
        control ids (template text and client text alike) is encoded as one ordinary span, so the
        ids equal `encode(rendered, allow_special=True)` whenever no client string holds a
        special-token string.  Dict keys and the steering values `role` / `type` are not stood in
        for: one holding a special-token string is refused.  `continue_final_message`: the ids stop
        right after the last message's content (`apply_chat_template`); `chat_template` as there.
        """
        messages, template, real = self._checked_render(messages, add_generation_prompt, tools, chat_template_kwargs,
                                                        continue_final_message, chat_template)
        tag = "\ue000"
        while tag in real:
            tag += "\ue000"

        def check(text: str, where: str) -> None:
            if self._special_re.search(text):
                raise ValueError(f"{where} holds a special-token string, which is not allowed there")

        found: list[str] = []
        stand_msgs = stand_in_strings(messages, tag, found, check, "messages")
        stand_tools = stand_in_strings(tools, tag, found, check, "tools") if tools is not None else None
        stand_kwargs = (stand_in_strings(chat_template_kwargs, tag, found, check, "chat_template_kwargs")
                        if chat_template_kwargs is not None else None)
        skeleton = self._render(stand_msgs, add_generation_prompt, stand_tools, stand_kwargs, template)
        parts = align_stand_ins(real, re.split(f"{re.escape(tag)}(\\d+){re.escape(tag)}", skeleton), found)
        ids: list[int] = []
        span: list[str] = []
        for k, part in enumerate(parts):
            if k % 2:
                span.append(part)
                continue
            pos = 0
            for match in self._special_re.finditer(part):
                span.append(part[pos:match.start()])
                ids += self.encode("".join(span))
                ids.append(self._specials[match.group()])
                span, pos = [], match.end()
            span.append(part[pos:])
        ids += self.encode("".join(span))
        if continue_final_message:
            tail = self.encode(self._final_tail(real, messages, tools, chat_template_kwargs, template),
                               allow_special=True)
            if tail and ids[len(ids) - len(tail):] != tail:
                raise ValueError("continue_final_message: the template's text after the last message's content "
                                 "does not tokenize apart from it")
            ids = ids[:len(ids) - len(tail)]
        return ids

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: Any,
                extra: Mapping[str, Any] | None, template: tuple[Any, str]) -> str:
        # HF's variables: the special tokens (pad / unk a client's kwargs may replace, as there) and `documents`
        # (None unless given: a template's `documents is none` holds, as in transformers' apply_chat_template)
        defaults = {"documents": None, **{k: v for k, v in (("pad_token", self._pad_token),
                                                              ("unk_token", self._unk_token)) if v is not None}}
        return render_template(*template, **{**defaults, **(extra or {})}, messages=messages, tools=tools,
                               add_generation_prompt=add_generation_prompt, bos_token=self._bos_token or "",
                               eos_token=self._eos_token or "")


# Hugging Face's apply_chat_template arguments for tensors, padding and dict outputs: refused, not read as template
# variables
_HF_TENSOR_ARGS = frozenset({"return_tensors", "return_dict", "padding", "truncation", "max_length",
                             "return_assistant_tokens_mask", "tokenizer_kwargs"})

MAX_REQUEST_TEMPLATE_CHARS = 65536  # a request's own chat template (compiled on the engine's loop: ~0.2 s at this)


@functools.lru_cache(maxsize=16)
def _compiled(source: str):
    """A request's template, compiled in the same sandbox as the checkpoint's (requests repeat theirs: kept)."""
    if len(source) > MAX_REQUEST_TEMPLATE_CHARS:
        raise ValueError(f"chat_template (the request's) is {len(source)} characters; at most "
                         f"{MAX_REQUEST_TEMPLATE_CHARS}")
    try:
        return compile_template(source)
    except TemplateError as e:
        raise ValueError(f"chat_template (the request's) does not compile: {e}") from None
    except (RecursionError, MemoryError, SyntaxError):  # (SyntaxError: Python's "too many statically nested blocks")
        raise ValueError("chat_template (the request's) does not compile: nested too deeply") from None


def _check_continue(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, cont: bool) -> None:
    """continue_final_message's conditions (as vLLM's): no generation prompt, a last message with text content (a
    string, or text parts whose last one has text)."""
    if not cont:
        return
    if add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: set "
                         "add_generation_prompt=False to continue the last message")
    content = messages[-1].get("content") if messages else None
    if isinstance(content, (list, tuple)) and content and isinstance(content[-1], Mapping):
        content = content[-1].get("text")
    if not isinstance(content, str) or not content:
        raise ValueError("continue_final_message needs the last message's content as a non-empty string "
                         "(or text parts whose last one is)")
