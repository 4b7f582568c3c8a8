"""Beam search over the engine, with vLLM's offline API (`LLM.beam_search(prompts, BeamSearchParams(...))`).

Each step asks the engine for one token of every live beam with the top `2 * beam_width` logprobs of the model's
distribution (before temperature, as the engine reports them), extends every beam by every listed token, and
keeps the `beam_width` best of each prompt's candidates; a candidate ending in an EOS id (unless `ignore_eos`) is set
aside as finished.  The beams of one prompt share its start and every beam's next request repeats its parent's
tokens, so prefix caching (on by default) resumes each request after them and computes one token: the engine's
end-of-request entries hold exactly the states the next step needs.

Ranking as vLLM's: `cum_logprob / len(tokens) ** length_penalty`, `tokens` the prompt and the generated ids (a
final EOS not counted, also under `ignore_eos`), over the finished candidates and the last step's beams together.
A beam stops at any of the engine's EOS ids, as `generate` does (vLLM's beam search: the tokenizer's EOS alone);
`text` is the decoded `tokens`, prompt and EOS included, as vLLM's offline beam search has it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from kda_rt.llm import LLM
    from kda_rt.outputs import Logprob

__all__ = ["BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "beam_score", "beam_search", "generated"]


# logprobs per request are capped at 20 (SamplingParams), and a step lists 2 x beam_width candidates a beam
MAX_BEAM_WIDTH = 10


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's `BeamSearchParams`: `beam_width` beams a prompt (1 to 10), up to `max_tokens` generated tokens each;
    `temperature` applies to the one token each step's requests sample, which is a candidate beside the listed
    ones (0: it is the most likely one); `length_penalty` the exponent of the ranking's length;
    `include_stop_str_in_output` is accepted for vLLM's signature (beams stop on EOS ids only, never in text)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an int in [1, {MAX_BEAM_WIDTH}] (each step lists 2 x beam_width "
                             f"logprobs, at most 20), got {self.beam_width!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        for name in ("temperature", "length_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` the prompt's ids and the generated ones (vLLM's layout), `logprobs` one {token: Logprob}
    a generated token (the step's listed candidates), `cum_logprob` the generated tokens' summed logprobs, `text`
    the decoded `tokens` (prompt and generated, as vLLM's offline search; None without a tokenizer),
    `finish_reason` "stop" (an EOS id; `stop_reason` as `generate` reports it: None for the tokenizer's EOS, else
    the id) or "length"."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best `beam_width` sequences, best first."""

    sequences: list[BeamSearchSequence]


def _length(tokens: list[int], eos_ids: Iterable[int]) -> int:
    return max(len(tokens) - (1 if tokens and tokens[-1] in eos_ids else 0), 1)


def beam_score(tokens: list[int], cum_logprob: float, eos_ids: Iterable[int], length_penalty: float = 1.0) -> float:
    """vLLM's ranking: the summed logprob over the length (prompt and generated ids, a final EOS not counted) to the
    power `length_penalty` (a power past a float's range: the score's limit, 0 or an infinity, not an error)."""
    length = _length(tokens, eos_ids)
    try:
        return cum_logprob / length ** length_penalty
    except (OverflowError, ZeroDivisionError):
        if cum_logprob == 0 or length_penalty > 0:
            return 0.0 * cum_logprob
        return math.copysign(math.inf, cum_logprob)


def _rank_key(tokens: list[int], cum_logprob: float, eos_ids: Iterable[int], length_penalty: float) -> tuple:
    """A sort key in `beam_score`'s order that stays exact where the score itself would leave a float's range:
    (its sign, then the log of its size)."""
    if cum_logprob == 0:
        return (1, 0.0)
    size = math.log(abs(cum_logprob)) - length_penalty * math.log(_length(tokens, eos_ids))
    return (2, size) if cum_logprob > 0 else (0, -size)


class BeamStepper:
    """The search's state, apart from how its requests run (`beam_search` runs them through `LLM.generate`,
    `AsyncLLM.beam_search` through its async generate): `requests()` the token lists of the live beams (one
    one-token request each, with `step_params`), `advance(listed)` the {token: Logprob} each request listed, in that
    order; `done` once no beam is live or `max_tokens` steps ran; `outputs(tokenizer)` each prompt's best beams."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos: frozenset, quiet: frozenset) -> None:
        from kda_rt.sampler.params import SamplingParams

        self.params, self.eos, self.quiet = params, eos, quiet
        self.stops = frozenset() if params.ignore_eos else eos  # (a final EOS leaves the ranking's length anyway)
        self.step_params = SamplingParams(temperature=params.temperature, max_tokens=1, ignore_eos=True,
                                          logprobs=2 * params.beam_width)
        self.beams = [[BeamSearchSequence(list(p))] for p in prompts]
        self.finished: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_tokens or not any(self.beams)

    def _key(self, b: BeamSearchSequence) -> tuple:
        return _rank_key(b.tokens, b.cum_logprob, self.eos, self.params.length_penalty)

    def requests(self) -> list[list[int]]:
        return [b.tokens for beams in self.beams for b in beams]

    def owners(self) -> list[int]:
        """The prompt each of `requests()` belongs to."""
        return [i for i, beams in enumerate(self.beams) for _ in beams]

    def advance(self, listed: list[dict[int, Logprob]]) -> None:
        if len(listed) != sum(len(beams) for beams in self.beams):
            raise ValueError(f"beam search: {len(listed)} results for {sum(map(len, self.beams))} beams")
        it = iter(listed)
        for i, beams in enumerate(self.beams):
            grown = []
            for beam in beams:
                entry = next(it)
                for token, lp in entry.items():
                    new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [entry], beam.cum_logprob + float(lp))
                    if token in self.stops:
                        new.finish_reason, new.stop_reason = "stop", None if token in self.quiet else token
                        self.finished[i].append(new)
                    else:
                        grown.append(new)
            grown.sort(key=self._key, reverse=True)
            self.beams[i] = grown[:self.params.beam_width]
        self.steps += 1

    def outputs(self, tokenizer) -> list[list[BeamSearchSequence]]:
        """Each prompt's best `beam_width` of its finished and live beams, best first, `text` the decoded tokens."""
        out = []
        for beams, finished in zip(self.beams, self.finished, strict=True):
            for b in beams:
                b.finish_reason = "length"
            best = sorted(finished + beams, key=self._key, reverse=True)[:self.params.beam_width]
            for b in best:
                b.text = _decode(tokenizer, b.tokens) if tokenizer is not None else None
            out.append(best)
        return out


def generated(beam: BeamSearchSequence, prompt_len: int, tokenizer, params: BeamSearchParams) -> tuple[list[int], str]:
    """A finished search's beam as a completion (vLLM's `EngineClient.beam_search` outputs): its generated ids, and
    their text, a final EOS left out unless `include_stop_str_in_output` ("" without a tokenizer)."""
    gen = beam.tokens[prompt_len:]
    shown = gen[:-1] if beam.finish_reason == "stop" and not params.include_stop_str_in_output else gen
    return gen, _decode(tokenizer, shown) if tokenizer is not None else ""


def _decode(tokenizer, ids: list[int]) -> str:
    """The text of `ids`, those past the tokenizer's vocabulary left out (a checkpoint's embedding may have more
    rows than its tokenizer has tokens; `generate`'s text leaves them out too)."""
    known = tokenizer.vocab_size
    return tokenizer.decode([t for t in ids if t < known])


def prompt_token_ids(engine, prompts, params: BeamSearchParams) -> tuple[list[list[int]], list[str | None]]:
    """The prompts' checked ids (a flat id list is one prompt, as `generate` reads it; each must leave room for
    `max_tokens` within max_model_len) and their cache salts (a prompt dict's "cache_salt", else None)."""
    from kda_rt.engine.llm_engine import cache_salt_of

    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if isinstance(prompts, (set, frozenset)) or not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of prompts (texts, dicts or token-id lists), got "
                        f"{type(prompts).__name__}")
    if prompts and all(_is_int(t) for t in prompts):
        prompts = [list(prompts)]
    limit = engine.config.max_model_len
    out = []
    salts = [cache_salt_of(p) for p in prompts]
    for i, p in enumerate(prompts):
        ids = list(engine.prompt_ids(p)[1])
        if len(ids) + params.max_tokens > limit:
            raise ValueError(f"prompt {i}: {len(ids)} tokens + max_tokens {params.max_tokens} exceed max_model_len "
                             f"{limit}")
        out.append(ids)
    return out, salts


def step_prompts(search: BeamStepper, salts: list[str | None]) -> list[dict]:
    """The prompts of a search step's requests, each with its prompt's cache salt."""
    return [{"prompt_token_ids": t} if salts[o] is None else {"prompt_token_ids": t, "cache_salt": salts[o]}
            for t, o in zip(search.requests(), search.owners(), strict=True)]


def _check(params, concurrency_limit) -> None:
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    if concurrency_limit is not None and (not _is_int(concurrency_limit) or concurrency_limit < 1):
        raise ValueError(f"concurrency_limit must be an int >= 1 or None, got {concurrency_limit!r}")


def beam_search(llm: LLM, prompts: list, params: BeamSearchParams, *, use_tqdm: bool = False,
                concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    """`LLM.beam_search`: prompts as `generate` takes them (texts, {"prompt_token_ids": ...} or {"prompt": ...}
    dicts, token-id lists); `concurrency_limit`: how many prompts search together (None: all)."""
    _check(params, concurrency_limit)
    engine = llm.llm_engine
    starts, salts = prompt_token_ids(engine, prompts, params)
    group = concurrency_limit or max(len(starts), 1)
    tokenizer = llm.get_tokenizer()
    outputs: list[BeamSearchOutput] = []
    bar = None
    if use_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=params.max_tokens * math.ceil(len(starts) / group), desc="beam search", unit="step")
    try:
        for lo in range(0, len(starts), group):
            search = BeamStepper(starts[lo:lo + group], params, engine.eos_token_ids,
                                 engine.postprocessor.quiet_eos_ids)
            while not search.done:
                results = llm.generate(step_prompts(search, salts[lo:lo + group]), search.step_params)
                search.advance([r.outputs[0].logprobs[0] for r in results])
                if bar is not None:
                    bar.update(1)
            outputs += [BeamSearchOutput(best) for best in search.outputs(tokenizer)]
    finally:
        if bar is not None:
            bar.close()
    return outputs
