"""`SamplingParams`: per-request sampling settings, with vLLM's names, defaults and validation.

Every bad value raises `ValueError` naming the parameter and the value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

__all__ = ["SamplingParams", "StructuredOutputsParams", "GREEDY_EPS", "MAX_ALLOWED_TOKEN_IDS", "MAX_BAD_WORDS",
           "MAX_LOGIT_BIAS", "MAX_N", "MAX_REPETITION_PENALTY", "MAX_STOP_CHARS", "MAX_STOP_STRINGS", "MIN_REPETITION_PENALTY"]

# Temperatures below this are treated as greedy (vLLM's _SAMPLING_EPS).
GREEDY_EPS = 1e-5
_MAX_SEED = 2**63 - 1
_MAX_INT32 = 2**31 - 1  # token ids and top_k go to the samplers as int32
# Where the math breaks outside these, the value is refused (issue 10 #2): a repetition penalty of
# 1e-40 divides logits into inf, so softmax gives NaN.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# Every generated token is checked against every stop string of its sequence: bounded so that one
# request cannot slow the whole batch (issue 10 #4).
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 16384
# logit_bias: OpenAI's value range and entry limit; every entry is added on the host each step
MAX_LOGIT_BIAS = 300
MAX_BAD_WORDS = 64  # a request's bad_words (each is up to two token sequences: vLLM allows 128 sequences)
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # a request's allowed_token_ids (the vocabulary is 163,840: any real list fits)
MAX_LOGIT_BIAS_VALUE = 100.0
# samples of one request: each is a sequence made at add_request (n = 10**9 held it for minutes, building a billion);
# far past the server's 128 and any sampling use, and still a bounded amount of work
MAX_N = 1 << 16


def _is_int(value: object) -> bool:
    """A Python or NumPy integer (not a bool: True is not a count); the fields keep them as Python ints."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _number(name: str, value: object, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value!r}")
    return float(value)


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")  # exactly one per request


@dataclass
class StructuredOutputsParams:
    """One output constraint (vLLM's `StructuredOutputsParams`): exactly one of
    `json` (a JSON schema, as a dict or a JSON string), `regex`, `choice` (a list of strings),
    `grammar` (Lark or GBNF/EBNF) or `json_object=True` (any JSON object).  Only the shape is
    checked here; the grammar itself is compiled (and refused when invalid) by llguidance when the
    request is added (kda_rt/engine/structured.py)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's options.  JSON is written compact on one line already, so disable_any_whitespace changes nothing, and
    # there is no other grammar engine to fall back to; whitespace_pattern (a regex) sets the whitespace JSON may
    # use between tokens; disable_additional_properties closes every object schema that does not say otherwise
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.json_object is not None and not isinstance(self.json_object, bool):  # (1 == True: was accepted)
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and not (isinstance(self.choice, (list, tuple)) and self.choice
                                            and all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool, got {getattr(self, name)!r}")
        if self.whitespace_pattern is not None and not (isinstance(self.whitespace_pattern, str) and
                                                        self.whitespace_pattern):
            raise ValueError("structured_outputs.whitespace_pattern must be a non-empty regex string")

    @property
    def kind(self) -> str:
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))

    @classmethod
    def from_dict(cls, value: Any) -> StructuredOutputsParams:
        """From a mapping with these keys (how it crosses the server's wire); unknown keys are refused."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict, "
                             f"got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unsupported keys {unknown}; supported: {sorted(known)}")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        out = {self.kind: getattr(self, self.kind)}
        out.update({f.name: getattr(self, f.name) for f in fields(self)
                    if f.name not in _CONSTRAINTS and getattr(self, f.name) != f.default})
        return out


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled token is always included)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # top-N logprobs of every prompt token (LLM.generate; vLLM's name)
    # keep only the prompt's last N tokens (-1: max_model_len of them), as vLLM's left truncation
    truncate_prompt_tokens: int | None = None
    # {token id: bias in [-100, 100]} added to the logits before sampling (OpenAI / vLLM)
    logit_bias: dict[int, float] | None = None
    # a grammar the output must match (llguidance; the `structured` extra); a dict is converted
    structured_outputs: StructuredOutputsParams | dict | None = None
    # (the fields below came later: after the others, so positional arguments keep their meaning)
    # only these token ids can be sampled (vLLM's field: every other logit is -inf); None: all
    allowed_token_ids: list[int] | None = None
    # words never generated (vLLM's field): each word's tokens, as written and after a space, are never completed
    bad_words: list[str] | None = None
    detokenize: bool = True  # False: no output text (token ids only; vLLM's field, stop strings then refused)
    # vLLM's field and default; it changes the text only with skip_special_tokens=False (True drops every special
    # token, so nothing is left to space; in vLLM too, where Kimi's added vocabulary is the set it skips).  vLLM runs
    # Kimi's tokenizer (TikTokenTokenizer: a slow PreTrainedTokenizer, not PreTrainedTokenizerFast, with a non-empty
    # get_added_vocab()) through its slow incremental detokenizer, whose rule this is: each of the Kimi class's
    # special tokens (bos, eos, unk, pad and additional_special_tokens, by default the chat markers <|im_end|>,
    # <|im_user|>, <|im_assistant|>, <|im_system|>, <|im_middle|>, ...: Tokenizer.added_ids) is set apart by one space
    # from the text or token on either side, the prompt's last token included (after a chat prompt's <|im_middle|>
    # the text starts with a space).  The tool-call markers, [EOS] and the reserved ids are not in its added
    # vocabulary, so they join the text unspaced either way.  The spaces are part of the text: streamed, cumulative
    # and final outputs and stop strings all see them.  False: concatenated.
    spaces_between_special_tokens: bool = True
    # bad_words as token ids: set by the engine with its tokenizer at add_request on the request's own copy of the params
    # (vLLM's _bad_words_token_ids on its clone); () on the caller's object
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), init=False, repr=False, compare=False)
    # allowed_token_ids once each, sorted, as an int64 array (set at validate: the host sampler's index each step)
    allowed_ids_array: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check (and normalise) every field; the engine calls it again at add_request, so fields
        changed after construction are checked too."""
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an int in [1, MAX_N = {MAX_N}], got {self.n!r}")
        self._python_ints()
        self.temperature = _number("temperature", self.temperature, 0.0)
        self.top_p = _number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if not _is_int(self.top_k) or not -1 <= self.top_k <= _MAX_INT32:
            raise ValueError(f"top_k must be an int in [-1, 2**31 - 1] (0 or -1 disables it; any value past the "
                             f"vocabulary keeps every token), got {self.top_k!r}")
        self.min_p = _number("min_p", self.min_p, 0.0, 1.0)
        self.presence_penalty = _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        # bounded where float32 logits stay finite: logit / 0.01 and logit * 100 (|logit| < 1e30)
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY,
                                          MAX_REPETITION_PENALTY)
        if self.seed is not None and (not _is_int(self.seed) or not -_MAX_SEED <= self.seed <= _MAX_SEED):
            raise ValueError(f"seed must be an int in [-2**63+1, 2**63-1] or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {type(stop).__name__}")
        if stop is not None and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(stop)} strings; the limit is MAX_STOP_STRINGS = {MAX_STOP_STRINGS}")
        if stop is not None and not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if stop is not None and sum(len(s) for s in stop) > MAX_STOP_CHARS:
            raise ValueError(f"stop strings total {sum(len(s) for s in stop)} characters; the limit is "
                             f"MAX_STOP_CHARS = {MAX_STOP_CHARS}")
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or
                                not all(_is_int(i) and 0 <= i <= _MAX_INT32 for i in ids)):
            raise ValueError(f"stop_token_ids must be a list of token ids (ints in [0, 2**31 - 1]), got {ids!r:.200}")
        self.stop_token_ids = [int(i) for i in ids or []]
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched in the output text)")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an int in [0, 20] or None, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be an int in [0, 20] or None, got {self.prompt_logprobs!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or not (t == -1 or 1 <= t <= _MAX_INT32)):
            raise ValueError(f"truncate_prompt_tokens must be -1 (max_model_len) or an int >= 1, got {t!r}")
        self._validate_logit_bias()
        ids = self.allowed_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and 0 <= i <= _MAX_INT32 for i in ids):
                raise ValueError(f"allowed_token_ids must be a list of token ids (ints in [0, 2**31 - 1]), got "
                                 f"{ids!r:.200}")
            if not ids:
                raise ValueError("allowed_token_ids is empty: no token could be sampled (None allows every token)")
            if len(ids) > MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids has {len(ids)} ids; at most MAX_ALLOWED_TOKEN_IDS = "
                                 f"{MAX_ALLOWED_TOKEN_IDS}")
            self.allowed_token_ids = [int(i) for i in ids]
        self.allowed_ids_array = None if ids is None else np.unique(np.asarray(self.allowed_token_ids, np.int64))
        words = self.bad_words
        if words is not None:
            if isinstance(words, str) or not isinstance(words, (list, tuple)) or \
                    not all(isinstance(w, str) and w.strip() for w in words):
                raise ValueError(f"bad_words must be a list of non-blank strings, got {words!r:.200}")
            words = list(dict.fromkeys(words))  # duplicates once, as vLLM
            if len(words) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words has {len(words)} words; at most MAX_BAD_WORDS = {MAX_BAD_WORDS}")
            self.bad_words = words or None
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
            self.structured_outputs.validate()

    def _python_ints(self) -> None:
        """NumPy integers given for the integer fields become Python ints (vLLM takes them too); each field is checked
        after this, so anything that is not an integer is still refused by name."""
        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
                     "truncate_prompt_tokens"):
            value = getattr(self, name)
            if isinstance(value, np.integer):  # (np.bool_ is not one)
                setattr(self, name, int(value))

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict {{token id: bias}}, got {type(bias).__name__}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}")
        out = {}
        for k, v in bias.items():
            # a JSON key is a string: ASCII digits only ('²'.isdigit() is true, and int() refuses it)
            token = int(k) if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10 else k
            if not _is_int(token) or not 0 <= token <= _MAX_INT32:
                raise ValueError(f"logit_bias keys must be token ids (ints in [0, 2**31 - 1]), got {k!r:.40}")
            out[int(token)] = _number(f"logit_bias[{token}]", v, -MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE)
        self.logit_bias = out or None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
