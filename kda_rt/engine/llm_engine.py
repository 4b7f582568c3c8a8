"""`LLMEngine`: requests in, incremental `RequestOutput`s out; `step()` = schedule -> run -> postprocess.

    schedule     Scheduler (pure Python): [(sequence, new tokens)] under the token budget, with
                 KDA state slots and MLA pages allocated as tokens are computed (preempting by
                 recompute when pages run out)
    run          one flat varlen `ForwardBatch` + a `SamplingBatch` (flat sampling settings of the
                 sequences that finish their prompt or decode this step) -> runner.execute ->
                 `StepOutput` (one token, or an error, per such sequence)
    postprocess  accept tokens, detokenize, stop checks; finished sequences return slot and pages;
                 structured outputs: matchers consume the tokens; the next step's masks are computed
                 while its forward runs (kda_rt/engine/structured.py)

The engine is backend-agnostic: it calls `runner.execute(ForwardBatch, SamplingBatch) -> StepOutput`
(or its two halves `launch` / `collect`) and `runner.score(ForwardBatch)` (the `Runner` contract,
kda_rt/engine/runner.py), nothing else.  With `async_scheduling` the next step (a steady decode
step; with KDA_RT_ASYNC_PREFILL=1 also prefill chunks and admissions) is scheduled and launched before
the previous step's tokens reach the host (`step()` says when), so the host's postprocess and
scheduling overlap the GPU's next forward.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import gc
import itertools
import logging
import random
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from kda_rt import env
from kda_rt.engine.batch import ForwardBatch
from kda_rt.engine.config import EngineConfig
from kda_rt.engine.postprocess import OUTPUT_KINDS, Postprocessor, request_output
from kda_rt.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kda_rt.engine.sequence import Sequence, SequenceStatus
from kda_rt.sampler.batch import SamplingBatch, needs_host_sampling
from kda_rt.sampler.params import SamplingParams

if TYPE_CHECKING:
    from kda_rt.loader.config import ModelConfig
    from kda_rt.outputs import RequestOutput
    from kda_rt.text.tokenizer import Tokenizer

__all__ = ["EngineConfig", "LLMEngine", "NoRoomToScore", "STEP_TOKEN_BOUNDS"]

logger = logging.getLogger(__name__)

# upper bounds of the bins of each step's tokens (its prefill tokens plus the tokens it sampled): vLLM's
# vllm:iteration_tokens_total buckets.  The engine bins every step itself (one bisect), so /metrics reads the
# cumulative bins with each scrape instead of one number a step crossing to the HTTP process
STEP_TOKEN_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def _raise_gc_threshold() -> None:
    """Fewer young-generation collections (`env.gc_threshold`): each one re-examines every live
    sequence's lists, which at hundreds of sequences was ~40% of the engine's host time per step.
    Only ever raised, never lowered below what the process already set."""
    threshold = env.gc_threshold()
    first, *rest = gc.get_threshold()
    if threshold > first:
        gc.set_threshold(threshold, *rest)


def bad_words_token_ids(tokenizer: Tokenizer, words: Seq[str]) -> tuple[tuple[int, ...], ...]:
    """Each bad word as token ids, as vLLM reads `bad_words`: the word without its leading white space, and again
    after one space (the word in mid-text) where that gives another first token in as many tokens.  Special-token
    strings are their ids (`<|im_end|>` bans the end marker), as the checkpoint's tokenizer reads them in vLLM."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), allow_special=True))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), allow_special=True))
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


class NoRoomToScore(RuntimeError):
    """`LLMEngine.score` found too few free state slots or KV pages: other requests hold them (retry once some end)."""


@dataclass(eq=False)
class _Launched:
    """A step handed to the runner: what was scheduled and the handle its results come from."""
    sched: SchedulerOutput
    batch: ForwardBatch
    sampled: list[Sequence]
    sampling: SamplingBatch
    num_decodes: int
    handle: object
    result: object = None  # the runner's StepOutput once collected
    committed: bool = False  # its tokens counted as computed (scheduler.commit), at the latest by its postprocess
    deferred: bool = False  # launched without its sampler (runner.sample queues it once the masks can be made)



def cache_salt_of(prompt) -> str | None:
    """A prompt dict's "cache_salt" (vLLM's: its prefix-cache entries are shared only with prompts of the same salt),
    checked; None for other prompts."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string if given, got {salt!r:.40}")
    return salt

class LLMEngine:
    def __init__(self, model_config: ModelConfig, runner, tokenizer: Tokenizer | None, config: EngineConfig,
                 *, num_slots: int, num_blocks: int, extra_eos_ids: Seq[int] = (),
                 snapshot_slots: Seq[int] = ()) -> None:
        """The engine hands out slots 0..num_slots-1 and pages 0..num_blocks-1 of the runner's pools; with
        `config.enable_prefix_caching` the prefix cache keeps its KDA states in `snapshot_slots` (the runner's
        `copy_slots` / `copy_pages` move them).  `config.max_model_len` must be resolved (not None): `build_engine`
        does that."""
        if config.max_model_len is None or config.max_num_batched_tokens is None or config.max_num_seqs is None:
            raise ValueError("LLMEngine needs a resolved max_model_len, max_num_batched_tokens and max_num_seqs "
                             "(build_engine plans the first and the last from the pools and defaults the second)")
        for switch in (env.async_prefill, env.async_waiting, env.async_ending, env.async_grammar, env.prompt_snapshots):
            switch()  # (read at every step; a bad value is refused here, by name, not at the step that reads it first)
        self.model_config = model_config
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        eos = set(model_config.eos_token_ids) | set(extra_eos_ids)
        if tokenizer is not None:
            eos |= set(tokenizer.stop_token_ids)
        self.eos_token_ids = frozenset(eos)
        if config.enable_prefix_caching:  # (on by default: where it cannot run, the engine runs without it)
            missing = [m for m in ("copy_slots", "copy_pages") if not callable(getattr(runner, m, None))]
            why = (f"the {getattr(runner, 'name', type(runner).__name__)} runner has no {' / '.join(missing)}"
                   if missing else None if snapshot_slots else
                   "the pool plan has no state slots for its snapshots (too little memory after the KV pages)")
            if why is not None:
                logger.warning("prefix caching off: %s", why)
                self.config = config = replace(config, enable_prefix_caching=False)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=config.block_size, num_blocks=num_blocks, num_slots=num_slots,
            prefill_tail_tokens=config.tail_tokens(),
            snapshot_slots=tuple(snapshot_slots) if config.enable_prefix_caching else (),
            prompt_snapshots=getattr(runner, "writes_snapshots", False) is True,
            policy=config.scheduling_policy,
        ))
        # the tokenizer's EOS (else config.json's first) stops with stop_reason None, every other EOS id (config.json's,
        # generation_config.json's, the tokenizer's other stop token) reports its id, as vLLM's stop token ids do
        quiet = tokenizer.eos_token_id if tokenizer is not None else None
        if quiet is None and model_config.eos_token_ids:
            quiet = model_config.eos_token_ids[0]
        self.postprocessor = Postprocessor(self.eos_token_ids, config.max_model_len,
                                           quiet_eos_ids=() if quiet is None else (quiet,))
        self.requests: dict[str, tuple[str | None, list[Sequence]]] = {}
        self._output_kind: dict[str, tuple[str, list[int]]] = {}  # request id -> (output kind, prompt ids
        # returned in its outputs: one copy per request, not one per step)
        self._structured = None  # StructuredOutputs, built by the first request that needs it
        self._seed_rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._inflight: _Launched | None = None  # a step queued ahead (async_scheduling)
        self._held_outputs: list[RequestOutput] = []  # outputs of a step collected by a call that raised
        # the runner samples penalised, banned and allowed_token_ids rows on the device (the CUDA runner with
        # KDA_RT_GPU_SAMPLING_EXTRAS): they are no host rows, and SamplingBatch.keys (each sequence's arrival number)
        # finds the penalised ones' token counts there
        self._device_extras = bool(getattr(runner, "device_extras", False))
        self.counters = {"steps": 0, "tokens_processed": 0, "prefill_tokens": 0, "generated_tokens": 0,
                         "requests_finished": 0, "requests_aborted": 0, "steps_launched_ahead": 0}
        # steps by their tokens, bin k: STEP_TOKEN_BOUNDS[k - 1] < tokens <= STEP_TOKEN_BOUNDS[k], the last one above
        # them all (their sum is prefill_tokens + generated_tokens, their count `steps`)
        self.step_token_bins = [0] * (len(STEP_TOKEN_BOUNDS) + 1)
        _raise_gc_threshold()

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: str | list[int] | dict,
                    sampling_params: SamplingParams | None = None, *, output_kind: str = "cumulative",
                    fit_max_tokens: bool = False, priority: int = 0) -> str:
        """Queue a prompt (text, token ids or {"prompt_token_ids": [...]}); returns its request id.  A prompt dict's
        "cache_salt" (vLLM's) keeps its prefix-cache entries to requests of the same salt.

        `output_kind` (vLLM's RequestOutputKind): "cumulative" (every output holds everything so
        far), "delta" (only what is new since the request's previous output) or "final" (one
        output, when the request finishes): the last two cost O(new tokens) per step, not O(all).

        `priority` (vLLM's): with `scheduling_policy="priority"`, where the request stands in the queues (lower runs
        first, and is preempted last); any other value than 0 is refused under "fcfs".

        `fit_max_tokens`: `max_tokens` is a default (generation_config.json's max_new_tokens), capped to the
        prompt's room in the context as vLLM caps it, instead of refused when it does not fit.

        Raises ValueError (and queues nothing) for an empty prompt, token ids outside the
        vocabulary, prompt + max_tokens over max_model_len, or a request the page pool can never hold.
        """
        params = sampling_params or SamplingParams()
        params.validate()  # fields may have been changed after construction
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {output_kind!r}")
        self.check_priority(priority)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        arrived = time.time()
        text, ids = self.request_prompt(prompt, params)
        salt = cache_salt_of(prompt)
        limit = self.config.max_model_len
        # "maximum context length" as OpenAI and vLLM word it: clients (LiteLLM, LangChain) match that phrase
        if len(ids) >= limit:
            raise ValueError(f"This model's maximum context length is {limit} tokens: prompt has {len(ids)} tokens; "
                             f"max_model_len is {limit} (room for at least one output token needed)")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if fit_max_tokens:
            max_tokens = min(max_tokens, limit - len(ids))
        if len(ids) + max_tokens > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens: prompt ({len(ids)} tokens) + max_tokens "
                f"({max_tokens}) = {len(ids) + max_tokens} exceeds max_model_len {limit}"
            )
        if params.min_tokens > max_tokens:  # (max_tokens left out or a capped default: the room, as vLLM checks it)
            raise ValueError(f"min_tokens ({params.min_tokens}) must be <= max_tokens ({max_tokens}: the room the "
                             f"prompt's {len(ids)} tokens leave in max_model_len {limit})")
        self.scheduler.check_fits(len(ids) + max_tokens - 1)
        vocab = self.model_config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias token id {max(params.logit_bias)} is outside the vocabulary [0, {vocab})")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words needs the checkpoint's tokenizer files (this checkpoint has none)")
        if params.stop_strings and self.tokenizer is None:  # (was: accepted, and never matched: no text is made)
            raise ValueError("stop strings need the checkpoint's tokenizer files (this checkpoint has none, or "
                             "skip_tokenizer_init is set): they are matched in the output text; use stop_token_ids")
        if params.bad_words:  # the ids on the request's own copy (vLLM clones them too): the caller's object may go to
            params = copy.copy(params)  # another engine, whose tokenizer reads the words otherwise
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        if params.allowed_token_ids is not None and max(params.allowed_token_ids) >= vocab:
            raise ValueError(f"allowed_token_ids holds {max(params.allowed_token_ids)}, outside the vocabulary "
                             f"[0, {vocab})")
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab:  # (never sampled: vLLM refuses them too)
            raise ValueError(f"stop_token_ids holds {max(params.stop_token_ids)}, outside the vocabulary [0, {vocab})")
        grammars = (self.structured().states(params.structured_outputs, params.n)
                    if params.structured_outputs is not None else [None] * params.n)
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seqs = []
        for i in range(params.n):
            detok = None
            if self.tokenizer is not None and params.detokenize:  # detokenize=False: token ids only, text ""
                from kda_rt.text.detokenizer import IncrementalDetokenizer

                detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                                               spaces_between_special_tokens=params.spaces_between_special_tokens,
                                               prompt_token_ids=ids)
            seqs.append(Sequence(request_id, i, list(ids), params, seed=(base_seed + i) % (1 << 64),
                                 max_tokens=max_tokens, arrival=next(self._arrivals), priority=priority,
                                 arrival_time=arrived, cache_salt=salt, detokenizer=detok,
                                 logprobs=[] if params.logprobs is not None else None, grammar=grammars[i]))
        self.requests[request_id] = (text, seqs)
        self._output_kind[request_id] = (output_kind, list(ids))
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

    def check_priority(self, priority: object) -> None:
        """Raise TypeError for a priority that is no int, ValueError for one other than 0 under "fcfs"."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, got {type(priority).__name__} {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority {priority}: priority scheduling is not enabled (start the engine with "
                             f"scheduling_policy=\"priority\", --scheduling-policy priority)")

    def structured(self):
        """The structured-output state of this engine (llguidance tokenizer, grammar cache)."""
        if self._structured is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the checkpoint's tokenizer files")
            from kda_rt.engine.structured import StructuredOutputs

            self._structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        return self._structured

    def request_prompt(self, prompt: str | list[int] | dict, params: SamplingParams) -> tuple[str | None, list[int]]:
        """`prompt_ids`, then `params.truncate_prompt_tokens`: the last N ids (vLLM's left truncation; -1 is
        max_model_len of them); the text stays the one given, as vLLM's outputs report it."""
        text, ids = self.prompt_ids(prompt)
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = self.config.max_model_len if keep == -1 else keep
            if len(ids) > keep:
                ids = ids[len(ids) - keep:]
        return text, ids

    def prompt_ids(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        """(text or None, checked token ids) of a prompt.  A text prompt is the model's whole input, so its
        special-token strings (`<|im_user|>`, `<|im_end|>`, ...) are the control tokens, as the checkpoint's own
        tokenizer and vLLM read them: a chat template applied by the caller works.  (Chat messages go through
        `Tokenizer.encode_chat` instead, where client text never becomes a control token.)  A dict with both
        'prompt_token_ids' and 'prompt' runs the ids and reports the text as the prompt (`LLM.chat`'s rendered
        template)."""
        given_text = None
        if isinstance(prompt, dict):
            for key in ("multi_modal_data", "mm_processor_kwargs"):  # (vLLM's prompt keys for images and audio)
                if prompt.get(key):  # (was: ignored, the prompt run as text alone)
                    raise ValueError(f"a prompt dict's {key!r} is not supported: Kimi Linear takes text only")
            if "prompt_token_ids" in prompt:
                given_text = prompt.get("prompt")
                if given_text is not None and not isinstance(given_text, str):
                    raise TypeError(f"a prompt dict's 'prompt' must be a str, got {type(given_text).__name__}")
                prompt = prompt["prompt_token_ids"]
                if not isinstance(prompt, (list, tuple, np.ndarray)):
                    raise TypeError(f"prompt_token_ids must be a list of token ids, got {type(prompt).__name__}")
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):
                    raise TypeError(f"a prompt dict's 'prompt' must be a str, got {type(prompt).__name__}")
            else:
                keys = ", ".join(repr(k) for k in list(prompt)[:8]) or "none"
                raise ValueError(f"prompt dict needs 'prompt_token_ids' or 'prompt', got keys {keys}")
        elif not isinstance(prompt, (str, list, tuple, np.ndarray)):  # bytes would read as ids, an int not at all
            raise TypeError(f"a prompt must be a str, a list of token ids or a dict with 'prompt_token_ids' or "
                            f"'prompt', got {type(prompt).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer files; pass {'prompt_token_ids': [...]} instead of text")
            text, ids = prompt, self.tokenizer.encode(prompt, allow_special=True)
        else:
            text, ids = given_text, list(prompt)
        if not ids:
            raise ValueError("prompt is empty (0 tokens)")
        vocab = self.model_config.vocab_size
        if set(map(type, ids)) == {int}:  # the usual list of Python ints: the range checked in one pass in C
            with contextlib.suppress(OverflowError):  # (an int past int64: the per-item pass names it)
                arr = np.fromiter(ids, dtype=np.int64, count=len(ids))
                if arr.min() >= 0 and arr.max() < vocab:
                    return text, ids
        for n, i in enumerate(ids):
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
                raise ValueError(f"prompt token ids must be ints; item {n} is {i!r} ({type(i).__name__})")
            if not 0 <= i < vocab:
                raise ValueError(f"prompt token id {i!r} is outside the vocabulary [0, {vocab})")
        return text, [int(i) for i in ids]

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """vLLM's name: abort one request or several (`abort` returns the final output of one)."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self.abort(rid)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request now; its slots and pages return to the pools at once.  Returns its final
        output (unfinished samples get finish_reason "abort"); unknown or finished ids give None."""
        rid = str(request_id)
        entry = self.requests.pop(rid, None)
        if entry is None:
            return None
        self._output_kind.pop(rid, None)
        for seq in entry[1]:
            if not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        self.counters["requests_aborted"] += 1
        return request_output(rid, *entry)

    def has_unfinished_requests(self) -> bool:
        """Requests queued or running, or outputs a step that raised still owes (the next `step()` returns them)."""
        return self.scheduler.has_unfinished() or bool(self._held_outputs)

    def reset_prefix_cache(self) -> bool:
        """Drop every prefix-cache entry and the prompts remembered for junctions (vLLM's name; True: done, also
        with no cache).  Running requests keep what they resumed from; only later ones compute it again."""
        if self.scheduler.cache is not None:
            self.scheduler.cache.clear(forget_prompts=True)
        return True

    def has_pending_step(self) -> bool:
        """A step was launched ahead (async scheduling) and the next step() collects it."""
        return self._inflight is not None

    def num_waiting(self) -> int:
        """Sequences in the waiting queue (a request with n samples adds n)."""
        return len(self.scheduler.waiting)

    # -- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one model step; returns the cumulative output of every request that got a token.

        With `async_scheduling` (and a runner that can `launch` without waiting) the step after this one
        is scheduled and queued before this step's tokens are collected, whenever none of them has to be
        known on the host first (`_launch_next`; by default only after a steady decode step,
        KDA_RT_ASYNC_PREFILL): the GPU runs step k+1 while the host postprocesses step k.  Step k+1's rows of
        the sequences that step k samples take their input ids from step k's samples on the device; a
        sequence that step k finishes (EOS, a stop string, an abort) has its row of step k+1 dropped.
        Tokens are those of the synchronous engine, one step of them per call; the batches can differ where
        such a finish would have freed room a step earlier (its pages and slot serve step k+2, not k+1; a
        sequence that step k ends by length is retired before k+1 is scheduled, as in the synchronous engine).

        A launch that raises leaves no half-computed state behind: every sequence of its schedule goes back
        to the queue to be recomputed (its KDA state may already hold some of the step's tokens), and a step
        k collected on the way out returns its outputs with the next call."""
        held, self._held_outputs = self._held_outputs, []
        cur, self._inflight = self._inflight, None
        if cur is not None and all(s.finished for s, _ in cur.sched.scheduled):  # aborted meanwhile: nothing to keep
            self._discard_errored(cur, self._collect(cur))
            cur = None
        if cur is None:
            sched = self.scheduler.schedule()
            if not sched.scheduled:
                if self.scheduler.has_unfinished():  # cannot happen: the oldest sequence always fits
                    raise RuntimeError(f"scheduler made no progress: {self.scheduler.stats()}")
                return held
            try:
                cur = self._launch_or_requeue(sched)
            except BaseException:
                self._held_outputs = held  # (still owed to the caller)
                raise
        try:
            nxt = self._launch_next(cur)
        except BaseException:  # the launch ahead failed: step k still counts, its tokens are kept
            try:  # (its sequences' states are not kept: the failed launch may have advanced some of them)
                self._held_outputs = held + self._postprocess(cur, self._collect(cur), keep_states=False)
            except BaseException:  # (k's collect failed too, a sticky device error: k is computed again)
                self._held_outputs = held
                self._requeue(cur.sched)
                raise
            raise
        try:
            outputs = held + self._postprocess(cur, self._collect(cur), nxt)
        except BaseException:
            # step k's tokens were not all accepted (its retired and pending sequences among them), and a step k+1
            # launched ahead will never be collected (its forward may have run, uncommitted): both computed again
            self._held_outputs = held
            self._requeue(SchedulerOutput(scheduled=[*cur.sched.scheduled, *(nxt.sched.scheduled if nxt else ())]))
            raise
        if nxt is not None:
            if all(s.finished for s, _ in nxt.sched.scheduled):  # every row was finished by this step: drop it
                self._drop_ahead(nxt, outputs)
            else:
                if nxt.deferred:  # its grammar masks follow this step's tokens, accepted just now
                    try:
                        self.runner.sample(nxt.handle)
                    except BaseException:  # (its forward ran uncommitted: its sequences are computed again)
                        self._requeue(nxt.sched)
                        self._held_outputs = outputs
                        raise
                self._inflight = nxt
        return outputs

    def _launch_or_requeue(self, sched: SchedulerOutput, ids_from_last: tuple[int, ...] = (),
                           defer_sampling: bool = False) -> _Launched:
        """`_launch`; if it raises, the schedule's sequences are queued again for recompute (the runner may have run
        part of the forward, folding some of their tokens into the KDA state) before the error goes on."""
        try:
            return self._launch(sched, ids_from_last, defer_sampling)
        except BaseException:
            self._requeue(sched)
            raise

    def _requeue(self, sched: SchedulerOutput) -> None:
        """The running sequences of a schedule that did not complete (retired ones too) back to the queue, to be
        computed again from the tokens the host holds; a waiting one (preempted by an early schedule) drops the
        pending token it will never be given."""
        # (newest first, each to the queue's front: the oldest ends up first)
        for seq, _ in sorted(sched.scheduled, key=lambda sn: sn[0].arrival, reverse=True):
            if seq.status is SequenceStatus.RUNNING:
                self.scheduler.requeue(seq)
            elif seq.status is SequenceStatus.WAITING:
                seq.pending = 0
        if self.scheduler.cache is not None:  # (what a failed step left in a slot is not kept: entries made since
            self.scheduler.cache.clear()  # its launch may copy such a slot)

    def _launch(self, sched: SchedulerOutput, ids_from_last: tuple[int, ...] = (),
                defer_sampling: bool = False) -> _Launched:
        batch, sampled = self.build_batch(sched)
        now = 0.0
        for s, _ in sched.scheduled:  # (a request's time in the queue ends when it is first scheduled)
            if not s.scheduled_time:
                s.scheduled_time = now = now or time.time()
        num_decodes = sum(1 for s, _ in sched.scheduled if not s.in_prefill)
        # (a pending token's id is not on the host: its count is the row's step, the device has the rest)
        rows = ((s.params, s.seed, s.prompt_token_ids, s.output_token_ids, s.pending) for s in sampled)
        constrained = [s.grammar is not None for s in sampled]
        kw = dict(device_extras=self._device_extras, keys=[s.arrival for s in sampled])
        if any(constrained):  # masks computed when the runner asks: after it has launched the forward
            sampling = SamplingBatch.build(rows, self.eos_token_ids, constrained=constrained,
                                           masks=lambda: self._structured.masks(sampled), **kw)
        else:
            sampling = SamplingBatch.build(rows, self.eos_token_ids, **kw)
        return self._submit(sched, batch, sampled, sampling, num_decodes, ids_from_last, defer_sampling)

    def _submit(self, sched, batch, sampled, sampling, num_decodes, ids_from_last: tuple[int, ...] = (),
                defer_sampling: bool = False) -> _Launched:
        self._flush_copies()
        launch = getattr(self.runner, "launch", None)
        if launch is None:  # a runner that only executes: run now
            return _Launched(sched, batch, sampled, sampling, num_decodes, None, self.runner.execute(batch, sampling))
        kw = {**({"ids_from_last": ids_from_last} if ids_from_last else {}),
              **({"defer_sampling": True} if defer_sampling else {})}
        handle = launch(batch, sampling, **kw)
        return _Launched(sched, batch, sampled, sampling, num_decodes, handle, deferred=defer_sampling)

    def _flush_copies(self) -> None:
        """Hand the prefix cache's queued copies to the runner (before a launch: after every step queued so far)."""
        cache = self.scheduler.cache
        if cache is None or not cache.ops:
            return
        for kind, src, dst in cache.take_ops():
            (self.runner.copy_slots if kind == "slot" else self.runner.copy_pages)(src, dst)

    def _collect(self, launched: _Launched):
        if launched.result is None:
            launched.result = self.runner.collect(launched.handle)
        return launched.result

    def _commit(self, launched: _Launched) -> None:
        """Count `launched`'s tokens as computed (once: ahead of its results when the next step is scheduled early)."""
        if not launched.committed:
            launched.committed = True
            self.scheduler.commit(SchedulerOutput(scheduled=[(s, n) for s, n in launched.sched.scheduled
                                                             if not s.finished]))

    def _launch_next(self, cur: _Launched) -> _Launched | None:
        """Schedule and queue the step after `cur` before `cur`'s tokens are known (async_scheduling): `cur`'s
        tokens count as computed, each sequence that `cur` samples holds its token as `pending`, and its row of the
        next step is fed `cur`'s sampled id on the device.  The rows keep the scheduler's order (decodes first, so
        the fed rows are among the leading one-token rows; the batches are the synchronous engine's when they hold
        the same sequences).  A sequence that `cur`'s token ends by length (max_tokens, max_model_len) is retired
        (`Scheduler.retire`: no row, its seat, slot and pages free for the next step, as in the synchronous engine).
        Not done (None) when a token of `cur` has to be on the host first: a row of `cur` sampled on the host, or a
        sequence whose next row would be (without device extras a logit_bias, penalties, a min_tokens ban,
        allowed_token_ids) or that has bad_words (their bans read the outputs' ids).  A grammar row's next mask
        needs `cur`'s token too: with KDA_RT_ASYNC_PREFILL=1 (or KDA_RT_ASYNC_GRAMMAR=1) and a runner that can
        `sample` later, the step goes ahead with its sampler held back (`step()` has the runner queue it once `cur`'s
        tokens are accepted); else not done.  With KDA_RT_ASYNC_PREFILL=0 also not unless `cur` is a steady decode
        step (every running sequence decoding, nothing waiting unless KDA_RT_ASYNC_WAITING=1, the default, allows it
        where the step launched ahead admits nobody, none ending by length unless nothing waits and
        KDA_RT_ASYNC_ENDING=1, the default, the pages for one more token free)."""
        if not self.config.async_scheduling or getattr(self.runner, "launch", None) is None:
            return None
        steady_only = not env.async_prefill()  # (KDA_RT_ASYNC_PREFILL=0: the form before, steady decode steps only)
        # a grammar row's next mask needs its token: its step can go ahead with the sampler held back (runner.sample)
        can_defer = (not steady_only or env.async_grammar()) and callable(getattr(self.runner, "sample", None))
        if cur.sampling.host_rows.any() or (cur.sampling.constrained.any() and not can_defer):
            return None
        sched = self.scheduler
        # (KDA_RT_ASYNC_WAITING, default 1: a decode step goes ahead while requests wait too, where the step launched
        # ahead admits nobody for sure: `cur`'s schedule admitted nobody, with no less room, and the queue is the same:
        # none preempted by it, which skips admission, and none added or aborted since)
        admits = bool(cur.sched.preempted) or cur.sched.queue_changes != sched.queue_changes
        if steady_only and ((sched.waiting and (admits or not env.async_waiting()))
                            or len(cur.sampled) != len(cur.sched.scheduled) or len(cur.sampled) != len(sched.running)
                            or any(n != 1 or s.in_prefill for s, n in cur.sched.scheduled)):
            return None
        limit = self.config.max_model_len
        pending, ending = [], []
        for s in cur.sampled:
            if s.finished:
                continue
            if len(s.output_token_ids) + 1 >= s.max_tokens or s.num_tokens + 1 >= limit:
                if steady_only and (sched.waiting or not env.async_ending()):
                    return None  # (its room would admit a waiting request: a prompt chunk launched ahead)
                ending.append(s)  # (its token ends it: postprocess finishes it whatever the id)
            elif (s.params.bad_words_token_ids  # (bad_words' bans read the outputs' ids)
                  or needs_host_sampling(s.params, len(s.output_token_ids) + 1, self._device_extras)
                  or (s.grammar is not None and not can_defer)):
                return None
            else:
                pending.append(s)
        if steady_only and sum(max(0, sched.pages_for(s.num_tokens + 1) - len(s.blocks))
                               for s in pending) > sched.num_free_pages:
            return None  # (it would preempt)
        self._commit(cur)
        for s in pending:
            s.pending = 1
        for s in ending:  # (no row; their room is the next step's, as after the synchronous engine's postprocess)
            sched.retire(s, keep=s.num_computed)  # (its state: every token but the one `cur` samples)
        nsched = sched.schedule()
        if not nsched.scheduled:
            return None
        row_of = {s: i for i, s in enumerate(cur.sampled)}
        fed = [i for i, (s, _) in enumerate(nsched.scheduled) if s.pending]
        # (a pending sequence is a decode: every row up to the last fed one is a one-token decode row; a pending
        # sequence the schedule preempted has no row)
        rows = tuple(row_of[s] if s.pending else -1 for s, _ in nsched.scheduled[: fed[-1] + 1]) if fed else ()
        # (the sampler waits for `cur`'s tokens where a row of the new step is a grammar's with its token pending)
        defer = any(s.pending and s.grammar is not None for s, _ in nsched.scheduled)
        launched = self._launch_or_requeue(nsched, rows, defer)
        self.counters["steps_launched_ahead"] += 1
        return launched

    def _drop_ahead(self, nxt: _Launched, outputs: list[RequestOutput]) -> None:
        """A step launched ahead whose every row the step before finished: uncollected, unless the prefix cache kept
        states that hold its rows (then its errors are read; never sampled, grammar rows held back: they are unknown
        and those states go).  If reading them raises, the cache goes and `outputs` stay owed."""
        cache = self.scheduler.cache
        if cache is None:
            return
        if nxt.deferred:
            for s in nxt.sampled:
                cache.discard(s.kept)
            return
        try:
            self._discard_errored(nxt, self._collect(nxt))
        except BaseException:
            cache.clear()
            self._held_outputs = outputs
            raise

    def _discard_errored(self, launched: _Launched, result) -> None:
        """An errored row's state may be non-finite: no prefix-cache entry made from its sequence stays; the others'
        entries kept before their rows were read (retired by a step launched ahead) are found by lookups from now."""
        if self.scheduler.cache is not None:
            for i, seq in enumerate(launched.sampled):
                if result.errors[i] is not None:
                    self.scheduler.cache.discard(seq.kept)
                else:
                    self.scheduler.cache.confirm(seq.kept)

    def _postprocess(self, cur: _Launched, result, ahead: _Launched | None = None,
                     keep_states: bool = True) -> list[RequestOutput]:
        """Accept `cur`'s tokens; rows of sequences finished or aborted since `cur` was launched are dropped.
        `ahead`: the step launched after `cur`, whose tokens a finished sequence's state also holds; `keep_states`
        False: no finished sequence's state goes to the prefix cache."""
        batch, sampled = cur.batch, cur.sampled
        live = [(i, seq) for i, seq in enumerate(sampled) if not seq.finished]
        self._commit(cur)  # (before the rows' errors are read: the prompt snapshots it keeps wait for them)
        self._discard_errored(cur, result)  # (a finished sequence's row of a step launched ahead counts too)
        for seq in sampled:  # (its id is known now: accepted below, or dropped with its finished sequence)
            seq.pending = 0
        self.counters["steps"] += 1
        self.counters["tokens_processed"] += batch.num_tokens
        self.counters["prefill_tokens"] += batch.num_tokens - cur.num_decodes
        self.step_token_bins[bisect.bisect_left(STEP_TOKEN_BOUNDS, batch.num_tokens - cur.num_decodes + len(live))] += 1
        touched: dict[str, None] = {}
        ahead_n = dict(ahead.sched.scheduled) if ahead is not None else {}
        for i, seq in live:
            self.counters["generated_tokens"] += 1
            if result.errors[i] is not None:
                done = self.postprocessor.fail(seq, result.errors[i])
            else:
                done = self.postprocessor.accept_token(seq, result.token_ids[i], result.logprobs[i])
                if not done and seq.grammar is not None:
                    verdict = self._structured.accept(seq, result.token_ids[i])
                    if verdict == "stop":
                        done = self.postprocessor.finish(seq, "stop")
                    elif verdict is not None:
                        done = self.postprocessor.fail(seq, verdict)
            if done:
                keep = 0  # (a finished sequence's state holds the tokens computed, `ahead`'s too)
                if keep_states and seq.finish_reason in ("stop", "length"):
                    keep = seq.num_computed + ahead_n.get(seq, 0)
                self.scheduler.finish(seq, keep)
            touched[seq.request_id] = None
        outputs, now = [], time.time()
        for rid in touched:
            text, seqs = self.requests[rid]
            finished = all(s.finish_reason is not None for s in seqs)
            kind, prompt_ids = self._output_kind[rid]
            if finished:
                self.requests.pop(rid)
                self._output_kind.pop(rid)
                self.counters["requests_finished"] += 1
            elif kind == "final":
                continue
            outputs.append(request_output(rid, text, seqs, "delta" if kind == "delta" else "cumulative", prompt_ids,
                                          now))
        return outputs

    @staticmethod
    def build_batch(sched: SchedulerOutput) -> tuple[ForwardBatch, list[Sequence]]:
        """The flat batch of a schedule, and the sequences whose logits rows it returns, in order.

        Only sequences whose new tokens reach their last token (end of prompt, or a decode) get a
        logits row; a prefill chunk in the middle of a prompt only fills the caches.
        """
        seqs = [s for s, _ in sched.scheduled]
        ends = [s.num_computed + n for s, n in sched.scheduled]
        wants = [end == s.num_tokens for s, end in zip(seqs, ends, strict=True)]
        batch = ForwardBatch.build(
            [s.tokens(s.num_computed, end) for s, end in zip(seqs, ends, strict=True)],
            [s.num_computed for s in seqs],
            [s.slot for s in seqs],
            [s.blocks for s in seqs],
            logits_for=wants,
            snapshot=[(s.prompt_snapshot[0] - s.num_computed, s.prompt_snapshot[1]) if s.prompt_snapshot else (0, 0)
                      for s in seqs],
        )
        return batch, [s for s, w in zip(seqs, wants, strict=True) if w]

    def score(self, token_ids: list[int]) -> np.ndarray:
        """[len(token_ids), vocab] float32 logits of every position of one sequence: one prefill in a
        slot and pages borrowed from the free pools and returned at once, so running requests are
        untouched.  RuntimeError when too few are free (other requests hold them)."""
        return self._score(token_ids, lambda batch, _ids: self.runner.score(batch))

    def prompt_logprob_rows(self, token_ids: list[int], num: int):
        """sampler.prompt_logprobs.PromptLogprobRows of positions 0 .. T - 2 of one sequence (row i: the logits at
        position i against token i + 1), from one prefill as `score`; a runner with `score_logprobs` reduces the
        logits where they are (the CUDA runner: on the GPU, only these rows come back), else from `score`'s."""
        from kda_rt.sampler.prompt_logprobs import prompt_logprob_rows

        reduce = getattr(self.runner, "score_logprobs", None)

        def run(batch, ids):  # (ids: checked by _score)
            targets = np.asarray(ids[1:], np.int64)
            if reduce is not None:
                return reduce(batch, targets, num)
            return prompt_logprob_rows(self.runner.score(batch)[:-1], targets, num)

        return self._score(token_ids, run)

    def _score(self, token_ids: list[int], run):
        """run(batch, ids) on a one-sequence prefill of token_ids (checked: ids) with every position's logits, in a
        slot and pages borrowed from the free pools (NoRoomToScore when too few are free)."""
        if self._inflight is not None:  # a step queued ahead: its results are kept for step()
            self._collect(self._inflight)
        if not isinstance(token_ids, (list, tuple, np.ndarray)):
            raise TypeError(f"token_ids must be a list of token ids, got {type(token_ids).__name__}")
        _, ids = self.prompt_ids({"prompt_token_ids": list(token_ids)})
        limit = self.config.max_model_len
        if len(ids) > limit:  # (prompt logprobs come through here before add_request checks the prompt)
            raise ValueError(f"This model's maximum context length is {limit} tokens: prompt has {len(ids)} tokens; "
                             f"max_model_len is {limit}")
        sched = self.scheduler
        need = sched.pages_for(len(ids))
        if sched.slots.num_free < 1 or sched.num_free_pages < need:
            raise NoRoomToScore(f"score() needs 1 state slot and {need} KV pages; {sched.slots.num_free} slots and "
                               f"{sched.num_free_pages} pages are free while other requests run")
        slot = sched.slots.allocate()[0]
        blocks = sched.allocate_pages(need)
        try:
            try:
                self._flush_copies()  # (a copy out of a slot or page lent here goes first)
            except BaseException:  # (entries whose copies did not run are not kept)
                self.scheduler.cache.clear()
                raise
            return run(ForwardBatch.build([ids], [0], [slot], [blocks], all_logits=True), ids)
        finally:
            sched.pages.release(blocks)
            sched.slots.release([slot])

    # -- stats ------------------------------------------------------------------------------

    def stats(self) -> dict[str, int | list[int]]:
        """Queues, preemptions, page and slot use, token counters since start, and the steps binned by their tokens
        (`step_token_bins`, a copy: callers keep snapshots)."""
        return {**self.scheduler.stats(), **self.counters, "step_token_bins": list(self.step_token_bins)}
