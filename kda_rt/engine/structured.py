"""Structured outputs: llguidance grammars, one matcher per constrained sequence, and the per-step
token masks the engine puts into the `SamplingBatch`.

    add_request   spec (json schema / regex / choice / grammar / json_object) -> llguidance grammar
                  (compiled and checked: an invalid one is a ValueError naming the field) -> one
                  `LLMatcher` per sample
    step          each constrained row's [ceil(V / 32)] int32 bitmask of allowed next tokens goes into
                  `SamplingBatch.allowed`, computed when the runner first reads it: the CUDA runner
                  queues the forward first, so the masks are computed while the GPU runs, then its
                  sampling kernel applies them; the NumPy runner applies them in
                  `sampler/reference.sample_rows`
    postprocess   the matcher consumes the accepted token; a grammar that cannot continue ends the
                  sequence with finish_reason "stop" (EOS is allowed only where the grammar accepts)
    masks         computed in parallel over sequences (`LLExecutor`, threads without the GIL)

The matcher state is a function of the output tokens only, so preemption by recompute (which keeps
the outputs) leaves it valid; `masks` checks the count and re-feeds the outputs if it ever differs.
JSON is generated compact on one line (llguidance `whitespace_flexible: false`, separators ", " and
": "), so a bounded schema always ends; a schema can override that with its `x-guidance` key.

llguidance is the `structured` extra; without it, a request that needs it gets a ValueError naming it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kda_rt.engine.sequence import Sequence as Seq
    from kda_rt.sampler.params import StructuredOutputsParams
    from kda_rt.text.tokenizer import Tokenizer

__all__ = ["GrammarState", "StructuredOutputs", "grammar_of", "import_llguidance"]

INSTALL_HINT = "pip install 'kda_rt[structured]'"
_JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_MAX_CACHED_GRAMMARS = 256


def import_llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise ValueError(f"structured outputs need llguidance, which is not installed: {INSTALL_HINT}") from None
    return llguidance


def grammar_of(spec: StructuredOutputsParams, field: str = "structured_outputs") -> str:
    """The llguidance grammar of `spec`, checked; ValueError naming `field`.KIND when it is invalid."""
    llg = import_llguidance()
    kind = spec.kind
    where = f"{field}.{kind}" if field == "structured_outputs" else field
    options = dict(_JSON_DEFAULTS)
    if spec.whitespace_pattern is not None:  # JSON's whitespace as the caller's regex instead of compact
        options = {"whitespace_flexible": True, "whitespace_pattern": spec.whitespace_pattern}
    try:
        if kind == "json":
            schema = _closed(spec.json) if spec.disable_additional_properties else spec.json
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
        elif kind == "json_object":
            grammar = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(spec.regex)
        elif kind == "choice":
            grammar = llg.grammar_from("choice", list(spec.choice))
        else:
            grammar = llg.grammar_from("grammar", spec.grammar)  # Lark, or GBNF/EBNF converted to Lark
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where} is invalid: {exc}") from None
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"{where} is invalid: {messages[0]}")
    return grammar


MAX_ERROR_CHARS = 500  # llguidance's error text carries its state and the whole grammar (megabytes for a large one)


def matcher_error(matcher: Any) -> str:
    """A matcher's error, its first line cut to MAX_ERROR_CHARS."""
    text = (matcher.get_error() or "the matcher failed").split("\n", 1)[0]
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + " ..."


def _closed(schema: Any) -> Any:
    """A copy of a JSON schema in which every object schema without `additionalProperties` gets it false (vLLM's
    disable_additional_properties)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class GrammarState:
    """One sequence's matcher, how many output tokens it has consumed, and its next-token mask."""

    __slots__ = ("matcher", "num_consumed", "mask")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.num_consumed = 0
        self.mask: np.ndarray | None = None  # [W] int32, for output token `num_consumed`


class StructuredOutputs:
    """Grammars and masks for one engine.  The llguidance tokenizer (token bytes per id, special
    tokens, EOS ids) is built from kda_rt's tiktoken tokenizer on first use."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.llg = import_llguidance()
        from llguidance.tiktoken import lltokenizer_from_encoding

        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.ll_tokenizer = lltokenizer_from_encoding(tokenizer.encoding, n_vocab=self.vocab_size,
                                                      eos_token=sorted(eos_token_ids))
        self.mask_words = (self.vocab_size + 31) // 32
        self.executor = self.llg.LLExecutor()
        self._grammars: OrderedDict[str, str] = OrderedDict()  # spec as JSON -> grammar (LRU)

    def states(self, spec: StructuredOutputsParams, n: int) -> list[GrammarState]:
        """`n` fresh matchers of `spec` (one per sample); ValueError when the grammar is invalid."""
        key = json.dumps(spec.to_dict(), sort_keys=True)
        grammar = self._grammars.get(key)
        if grammar is None:
            grammar = grammar_of(spec)
            self._grammars[key] = grammar
            if len(self._grammars) > _MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(key)
        first = self.llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if first.is_error():
            raise ValueError(f"structured_outputs.{spec.kind} is invalid: {matcher_error(first)}")
        # the first mask now (kept for the first step): a grammar that no output can satisfy fails only here (it
        # used to leave EOS alone allowed, and the request ended "stop" with an empty text that does not match)
        from llguidance.numpy import fill_next_token_bitmask

        mask = np.zeros((1, self.mask_words), dtype=np.int32)
        fill_next_token_bitmask(first, mask, 0)
        if first.is_error():
            raise ValueError(f"structured_outputs.{spec.kind} is invalid: no output can satisfy it "
                             f"(llguidance: {matcher_error(first)})")
        states = [GrammarState(first if i == 0 else first.deep_copy()) for i in range(n)]
        for g in states:
            g.mask = mask[0]
        return states

    def masks(self, seqs: Sequence[Seq]) -> list[np.ndarray | None] | None:
        """Each sequence's mask for its next token (None: unconstrained); None when no sequence is
        constrained.  Masks not prefetched are computed now."""
        if all(s.grammar is None for s in seqs):
            return None
        for s in seqs:
            if s.grammar is not None and not s.finished:
                self._sync(s)
        self.prefetch(seqs)
        # (a sequence finished meanwhile, its row of a step launched ahead to be dropped: any mask will do)
        return [None if s.grammar is None else np.full(self.mask_words, -1, np.int32) if s.finished
                else s.grammar.mask for s in seqs]

    def prefetch(self, seqs: Iterable[Seq]) -> None:
        """Compute the missing next-token masks of `seqs` in one parallel llguidance call."""
        todo = [s.grammar for s in seqs if s.grammar is not None and s.grammar.mask is None and not s.finished]
        if not todo:
            return
        from llguidance.numpy import fill_next_token_bitmask_par

        bitmask = np.zeros((len(todo), self.mask_words), dtype=np.int32)
        fill_next_token_bitmask_par(self.executor, [(g.matcher, i) for i, g in enumerate(todo)], bitmask)
        for i, g in enumerate(todo):
            g.mask = bitmask[i]

    def accept(self, seq: Seq, token: int) -> str | None:
        """Feed the accepted `token` to `seq`'s matcher: None (go on), "stop" (the grammar is
        complete: the sequence must end), or an error message (the token breaks the grammar)."""
        g = seq.grammar
        g.mask = None
        if not g.matcher.consume_token(token) or g.matcher.is_error():
            return f"token {token} does not match the structured-output grammar: {matcher_error(g.matcher)}"
        g.num_consumed += 1
        return "stop" if g.matcher.is_stopped() else None

    @staticmethod
    def _sync(seq: Seq) -> None:
        """Make the matcher state match the output tokens (it always does; recompute keeps them)."""
        g = seq.grammar
        if g.num_consumed == len(seq.output_token_ids):
            return
        g.matcher.reset()
        if not g.matcher.consume_tokens(list(seq.output_token_ids)):
            raise RuntimeError(f"request {seq.request_id}: its output tokens no longer match its grammar")
        g.num_consumed, g.mask = len(seq.output_token_ids), None
