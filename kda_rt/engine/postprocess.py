"""After the runner sampled: accept tokens, detokenize, check stop conditions, and build
`RequestOutput`s.  (Sampling itself happens in the runner; the draw for output token `k` of a
sequence is keyed by (seed, k), so a sequence preempted and recomputed samples the same tokens.)

Stop conditions as vLLM's v1 engine: a stop token id or an EOS id leaves its text out unless
`include_stop_str_in_output` (then it is decoded, a special token as `skip_special_tokens` says); a stop string
counts where it ends inside the text of the tokens after the first `min_tokens`, and where several end in one
token's text the one that ends first wins (ties: list order).

Streaming: `RequestOutput` text is cumulative.  While a sequence with stop strings that are cut from the output
is running, its last (longest stop string - 1) characters are held back, because a stop string completed by a
later token would cut them off again; so visible text only ever grows.  With `include_stop_str_in_output` nothing
is held back: the cut falls after the new text's stop string, never inside text already shown.  `DeltaTracker` turns the
cumulative outputs of one request into deltas (new text, new token ids).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kda_rt.outputs import CompletionOutput, RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from kda_rt.engine.sequence import Sequence

__all__ = ["OUTPUT_KINDS", "Postprocessor", "DeltaTracker", "request_output"]

logger = logging.getLogger(__name__)


class Postprocessor:
    def __init__(self, eos_token_ids: Iterable[int], max_model_len: int, quiet_eos_ids: Iterable[int] | None = None) -> None:
        """quiet_eos_ids: the EOS ids whose stop reports no stop_reason (default: all of them).  The engine passes the
        tokenizer's own EOS: vLLM stops on that one as EOS (stop_reason None) and on generation_config.json's other
        EOS ids as stop token ids, reporting the id."""
        self.eos_token_ids = frozenset(eos_token_ids)
        self.quiet_eos_ids = self.eos_token_ids if quiet_eos_ids is None else frozenset(quiet_eos_ids)
        self.max_model_len = max_model_len

    def accept_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None = None) -> bool:
        """Append a sampled token (and its logprobs when requested); returns True when `seq` is now
        finished (its `finish_reason` and `stop_reason` set, its text final)."""
        p = seq.params
        if not seq.output_token_ids and not seq.first_token_time:
            seq.first_token_time = time.time()
        seq.output_token_ids.append(token)
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token]
        # EOS before the stop ids, as vLLM's check_stop (a quiet EOS id that is also a stop id reports None)
        eos = not p.ignore_eos and token in self.eos_token_ids
        if eos:
            stop_id = None if token in self.quiet_eos_ids else token
        else:
            stop_id = token if token in p.stop_token_ids else None
        ended = eos or stop_id is not None
        if seq.detokenizer is not None and (not ended or p.include_stop_str_in_output):
            before = len(seq.text)
            seq.text += seq.detokenizer.add([token])  # a stop token's text only with include_stop_str_in_output
            # like EOS and stop ids, stop strings only count once min_tokens tokens exist (vLLM); one found in a
            # stop token's text is the stop reason (vLLM's detokenizer result replaces the id)
            if p.stop_strings and len(seq.output_token_ids) > p.min_tokens and self._check_stop_strings(seq, before):
                return True
        if ended:
            return self.finish(seq, "stop", stop_id)
        if len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return self.finish(seq, "length")
        return False

    @staticmethod
    def _check_stop_strings(seq: Sequence, before: int) -> bool:
        """A stop string that ends in the text after `before` (the new token's): the one ending first, ties by
        list order; the text cut at its start (or its end with include_stop_str_in_output)."""
        best = None  # (end, start, stop string)
        for s in seq.params.stop_strings:
            i = seq.text.find(s, max(0, before - len(s) + 1))
            if i >= 0 and (best is None or i + len(s) < best[0]):
                best = (i + len(s), i, s)
        if best is None:
            return False
        _, i, s = best
        seq.text = seq.text[: i + len(s)] if seq.params.include_stop_str_in_output else seq.text[:i]
        seq.finish_reason, seq.stop_reason = "stop", s
        return True

    @staticmethod
    def fail(seq: Sequence, why: str) -> bool:
        """End `seq` with finish_reason "error" (no token is appended; its text stays as it was)."""
        logger.warning("request %s sample %d: %s; finishing it with an error", seq.request_id, seq.index, why)
        seq.finish_reason, seq.stop_reason = "error", why
        return True

    @staticmethod
    def finish(seq: Sequence, reason: str, stop_reason: int | str | None = None) -> bool:
        """End `seq` now (its last token already accepted): set the reasons.  The bytes of an unfinished UTF-8
        character at the end stay out of the text, as vLLM's detokenizers hold them back and never flush them
        (was: one U+FFFD)."""
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        return True


def _visible_text(seq: Sequence) -> str:
    stops = seq.params.stop_strings
    if seq.finish_reason is not None or not stops or seq.params.include_stop_str_in_output:
        return seq.text
    hold = max(len(s) for s in stops) - 1
    return seq.text[: max(0, len(seq.text) - hold)]


OUTPUT_KINDS = ("cumulative", "delta", "final")


def request_output(request_id: str, prompt: str | None, seqs: list[Sequence], kind: str = "cumulative",
                   prompt_token_ids: list[int] | None = None, now: float | None = None) -> RequestOutput:
    """Output of one request (one `CompletionOutput` per sample): everything so far ("cumulative"
    and "final"), or only what is new since the last "delta" output of each sample (O(new) work per
    step instead of copying every token so far).  `prompt_token_ids`: a list to return as is (the
    engine keeps one copy per request), else a copy of the first sample's prompt.  `now`: the step's
    `time.time()` (the metrics' last token time; one clock read a step, not one an output)."""
    outs = []
    for s in seqs:
        text = _visible_text(s)
        chars, toks = s.sent if kind == "delta" else (0, 0)
        if kind == "delta":
            s.sent = (max(chars, len(text)), max(toks, len(s.output_token_ids)))
        outs.append(CompletionOutput(
            s.index, text[chars:], s.output_token_ids[toks:], s.cumulative_logprob if s.logprobs is not None else None,
            s.logprobs[toks:] if s.logprobs is not None else None, s.finish_reason, s.stop_reason))
    prompt_ids = list(seqs[0].prompt_token_ids) if prompt_token_ids is None else prompt_token_ids
    finished = all(s.finish_reason is not None for s in seqs)
    # metrics on a request's first output and its last (between them vLLM's V1 engine gives none either): built on
    # every output they cost ~10% of the host work of a batch-256 decode step
    first = len(seqs[0].output_token_ids) <= 1
    return RequestOutput(request_id, prompt, prompt_ids, outs, finished, num_cached_tokens=seqs[0].num_cached,
                         metrics=_metrics(seqs, finished, time.time() if now is None else now)
                         if first or finished else None)


def _metrics(seqs: list[Sequence], finished: bool, now: float) -> RequestMetrics:
    s = seqs[0]
    if len(seqs) == 1:  # (the usual request: no scans)
        scheduled, first = s.scheduled_time or None, s.first_token_time or None
    else:
        scheduled = min((q.scheduled_time for q in seqs if q.scheduled_time), default=None)
        first = min((q.first_token_time for q in seqs if q.first_token_time), default=None)
    return RequestMetrics(s.arrival_time, scheduled, first, now,
                          None if scheduled is None else scheduled - s.arrival_time, now if finished else None)


class DeltaTracker:
    """Cumulative `RequestOutput`s of one request in, deltas out: each `CompletionOutput` then holds
    only the text, token ids and logprobs that are new since the previous call (an older output
    than one already seen gives an empty delta)."""

    def __init__(self) -> None:
        self._sent: dict[int, tuple[int, int]] = {}  # sample index -> (chars, tokens) already sent

    def delta(self, out: RequestOutput) -> RequestOutput:
        comps = []
        for c in out.outputs:
            chars, toks = self._sent.get(c.index, (0, 0))
            # an out-of-date output must never move the mark back: later deltas would repeat tokens
            self._sent[c.index] = (max(chars, len(c.text)), max(toks, len(c.token_ids)))
            comps.append(CompletionOutput(
                c.index, c.text[chars:], c.token_ids[toks:], c.cumulative_logprob,
                c.logprobs[toks:] if c.logprobs is not None else None, c.finish_reason, c.stop_reason,
            ))
        # (num_cached_tokens and metrics kept: AsyncLLM's delta outputs dropped them)
        return RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, comps, out.finished,
                             num_cached_tokens=out.num_cached_tokens, metrics=out.metrics)
