"""`LLMEngine`: requests in, incremental `RequestOutput`s out; `step()` = schedule -> run -> postprocess.

This first engine admits a request only when a KDA state slot and MLA pages for its whole length
(prompt + max_tokens) are free, runs every admitted sequence each step in one flat batch (whole
prompts for new sequences, one token for the others), and never needs preemption.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kda_rt.forward_batch import ForwardBatch
from kda_rt.outputs import CompletionOutput, RequestOutput
from kda_rt.sampler import reference as ref_sampler
from kda_rt.sampler.params import SamplingParams
from kda_rt.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from kda_rt.loader.config import ModelConfig
    from kda_rt.tokenizer import Tokenizer

__all__ = ["EngineConfig", "LLMEngine"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16
    max_model_len: int = 8192
    block_size: int = 64
    num_blocks: int | None = None  # None: enough for max_num_seqs sequences of max_model_len
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.block_size not in (16, 32, 64):
            raise ValueError(f"block_size must be 16, 32 or 64, got {self.block_size!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ValueError(f"num_blocks must be an int >= 1, got {self.num_blocks!r}")

    @property
    def resolved_num_blocks(self) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        return self.max_num_seqs * math.ceil(self.max_model_len / self.block_size)


class LLMEngine:
    def __init__(self, model_config: ModelConfig, runner, tokenizer: Tokenizer | None, config: EngineConfig,
                 *, num_slots: int, num_blocks: int, extra_eos_ids: Seq[int] = ()) -> None:
        """The engine hands out slots 0..num_slots-1 and pages 0..num_blocks-1 of the runner's pools."""
        self.model_config = model_config
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        eos = set(model_config.eos_token_ids) | set(extra_eos_ids)
        if tokenizer is not None:
            eos |= set(tokenizer.stop_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.num_slots, self.num_blocks = num_slots, num_blocks
        self.free_slots = deque(range(num_slots))
        self.free_blocks = deque(range(num_blocks))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, tuple[str | None, list[Sequence]]] = {}
        self._seed_rng = random.Random(config.seed)
        self._ids = itertools.count()

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: str | list[int] | dict, params: SamplingParams | None = None) -> str:
        """Queue a prompt (text, token ids or {"prompt_token_ids": [...]}); returns its request id."""
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {limit} (room for at least one output token needed)")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {len(ids) + max_tokens} exceeds max_model_len {limit}"
            )
        need = math.ceil((len(ids) + max_tokens) / self.config.block_size)
        if need > self.num_blocks:
            raise ValueError(f"request needs {need} KV pages but the pool has only {self.num_blocks} (num_blocks)")
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seqs = []
        for i in range(params.n):
            detok = None
            if self.tokenizer is not None:
                from kda_rt.tokenizer import IncrementalDetokenizer

                detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
            seqs.append(Sequence(request_id, i, list(ids), params, seed=(base_seed + i) % (1 << 64),
                                 max_tokens=max_tokens, detokenizer=detok,
                                 logprobs=[] if params.logprobs is not None else None))
        self.requests[request_id] = (text, seqs)
        self.waiting.extend(seqs)
        return request_id

    def _prompt_ids(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer files; pass {'prompt_token_ids': [...]} instead of text")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        if not ids:
            raise ValueError("prompt is empty (0 tokens)")
        vocab = self.model_config.vocab_size
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < vocab:
                raise ValueError(f"prompt token id {i!r} is outside the vocabulary [0, {vocab})")
        return text, [int(i) for i in ids]

    def abort(self, request_id: str) -> None:
        """Drop a request now; its slot and pages return to the pools."""
        entry = self.requests.get(str(request_id))
        if entry is None:
            return
        for seq in entry[1]:
            if not seq.finished:
                self._finish(seq, "abort")
        self.requests.pop(str(request_id), None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self._admit()
        if not self.running:
            return []
        seqs = list(self.running)
        batch = ForwardBatch.build(
            [s.uncomputed_tokens() for s in seqs],
            [s.num_computed for s in seqs],
            [s.slot for s in seqs],
            [s.blocks for s in seqs],
        )
        logits = self.runner.execute(batch)
        touched: dict[str, None] = {}
        for row, seq in enumerate(seqs):
            seq.num_computed = seq.num_tokens
            self._append_token(seq, logits[row])
            touched[seq.request_id] = None
        outputs = [self._request_output(rid) for rid in touched]
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        return outputs

    def _admit(self) -> None:
        while self.waiting and self.free_slots and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            need = math.ceil((len(seq.prompt_token_ids) + seq.max_tokens) / self.config.block_size)
            if need > len(self.free_blocks):
                break
            self.waiting.popleft()
            seq.slot = self.free_slots.popleft()
            seq.blocks = [self.free_blocks.popleft() for _ in range(need)]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def _append_token(self, seq: Sequence, logits: np.ndarray) -> None:
        p = seq.params
        n_out = len(seq.output_token_ids)
        logits = ref_sampler.apply_penalties(logits, p, seq.prompt_token_ids, seq.output_token_ids)
        if n_out < p.min_tokens:
            banned = [t for t in (*p.stop_token_ids, *([] if p.ignore_eos else self.eos_token_ids)) if t < logits.shape[0]]
            if banned:
                logits = logits.copy()
                logits[banned] = -np.inf
        token = ref_sampler.sample_row(logits, p, seq.seed, n_out)
        seq.output_token_ids.append(token)
        if seq.logprobs is not None:
            lp = ref_sampler.top_logprobs(logits, token, p.logprobs or 0)
            seq.logprobs.append(lp)
            seq.cumulative_logprob += lp[token]
        if token in p.stop_token_ids:
            self._finish(seq, "stop", token)
            return
        if not p.ignore_eos and token in self.eos_token_ids:
            self._finish(seq, "stop", None)
            return
        if seq.detokenizer is not None:
            before = len(seq.text)
            seq.text += seq.detokenizer.add([token])
            if p.stop_strings and self._check_stop_strings(seq, before):
                return
        if len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
            self._finish(seq, "length")

    def _check_stop_strings(self, seq: Sequence, before: int) -> bool:
        longest = max(len(s) for s in seq.params.stop_strings)
        start = max(0, before - longest + 1)
        hits = [(seq.text.find(s, start), s) for s in seq.params.stop_strings]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        i, s = min(hits)
        seq.text = seq.text[: i + len(s)] if seq.params.include_stop_str_in_output else seq.text[:i]
        self._finish(seq, "stop", s, flush=False)
        return True

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None, *, flush: bool = True) -> None:
        if flush and seq.detokenizer is not None and reason != "abort":
            seq.text += seq.detokenizer.flush()
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
            self.free_blocks.extend(seq.blocks)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.slot, seq.blocks = -1, []
        seq.status = SequenceStatus.FINISHED

    def _request_output(self, request_id: str) -> RequestOutput:
        text, seqs = self.requests[request_id]
        outs = [
            CompletionOutput(s.index, s.text, list(s.output_token_ids),
                             s.cumulative_logprob if s.logprobs is not None else None,
                             list(s.logprobs) if s.logprobs is not None else None, s.finish_reason, s.stop_reason)
            for s in seqs
        ]
        return RequestOutput(request_id, text, list(seqs[0].prompt_token_ids), outs, all(s.finished for s in seqs))

    # -- stats ------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "slots_free": len(self.free_slots),
            "slots_used": self.num_slots - len(self.free_slots),
            "pages_free": len(self.free_blocks),
            "pages_used": self.num_blocks - len(self.free_blocks),
        }
