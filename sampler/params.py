"""`SamplingParams`: per-request sampling settings, with vLLM's names, defaults and validation.

Every bad value raises `ValueError` naming the parameter and the value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SamplingParams", "GREEDY_EPS", "MAX_REPETITION_PENALTY", "MAX_STOP_CHARS", "MAX_STOP_STRINGS",
           "MIN_REPETITION_PENALTY"]

# Temperatures below this are treated as greedy (vLLM's _SAMPLING_EPS).
GREEDY_EPS = 1e-5
_MAX_SEED = 2**63 - 1
# Where the math breaks outside these, the value is refused (issue 10 #2): a repetition penalty of
# 1e-40 divides logits into inf, so softmax gives NaN.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# Every generated token is checked against every stop string of its sequence: bounded so that one
# request cannot slow the whole batch (issue 10 #4).
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 16384


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(name: str, value: object, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value!r}")
    return float(value)


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

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check (and normalise) every field; the engine calls it again at add_request, so fields
        changed after construction are checked too."""
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        self.temperature = _number("temperature", self.temperature, 0.0)
        self.top_p = _number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 disables it), got {self.top_k!r}")
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
        if ids is not None and (not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids)):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {ids!r}")
        self.stop_token_ids = list(ids or [])
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an int in [0, 20] or None, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be an int in [0, 20] or None, got {self.prompt_logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
