"""`LLM`: the offline API, with vLLM's names.

    llm = LLM("path/to/checkpoint", backend="numpy")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kda_rt import env
from kda_rt.cli import model_dir_problem
from kda_rt.engine import EngineConfig, LLMEngine
from kda_rt.engine.config import offline_batched_tokens
from kda_rt.engine.llm_engine import NoRoomToScore
from kda_rt.engine.postprocess import DeltaTracker
from kda_rt.engine.runner import make_runner, select_backend
from kda_rt.loader.config import load_config
from kda_rt.loader.jsonfile import read_json
from kda_rt.outputs import Logprob, RequestOutput, vllm_logprobs
from kda_rt.sampler.params import SamplingParams

if TYPE_CHECKING:
    from kda_rt.loader.config import ModelConfig
    from kda_rt.text.tokenizer import Tokenizer

__all__ = ["LLM", "build_engine"]

logger = logging.getLogger(__name__)


def build_engine(model_config: ModelConfig, weights: Mapping[str, np.ndarray], settings: EngineConfig, *,
                 tokenizer: Tokenizer | None = None, extra_eos_ids: Sequence[int] = ()) -> LLMEngine:
    """Runner + engine for in-memory weights.  An unset max_num_batched_tokens takes the offline default
    (`offline_batched_tokens` of the backend's device).  The runner plans its pools (kda_rt/engine/pools.py);
    the engine gets the plan's slots and pages, the resolved max_model_len and max_num_seqs."""
    if settings.max_num_batched_tokens is None:
        settings = dataclasses.replace(settings, max_num_batched_tokens=_offline_batched_tokens(settings.backend))
    if unknown := env.unknown_variables():
        logger.warning("unknown KDA_RT_* environment variable(s), ignored: %s (kda_rt/env.py lists the known ones)",
                       ", ".join(unknown))
    runner = make_runner(model_config, weights, settings)
    plan = runner.plan
    settings = dataclasses.replace(settings, max_model_len=plan.max_model_len, max_num_seqs=plan.engine_slots)
    return LLMEngine(model_config, runner, tokenizer, settings, num_slots=plan.engine_slots,
                     num_blocks=plan.engine_blocks, extra_eos_ids=extra_eos_ids, snapshot_slots=plan.snapshot_slots)


def _offline_batched_tokens(backend: str) -> int:
    """offline_batched_tokens for the device the backend will run on (none for NumPy)."""
    if select_backend(backend) != "cuda":
        return offline_batched_tokens(None)
    import cupy

    from kda_rt.cuda.ops.compile import device_name

    dev = cupy.cuda.Device()
    return offline_batched_tokens(int(dev.mem_info[1]), device_name(dev.id))


def _has_tokenizer(model_dir: str) -> bool:
    # lexists: a link to a missing file (a hub cache's pruned blob) is named when read, not taken for no tokenizer
    return os.path.lexists(os.path.join(model_dir, "tiktoken.model"))


def _generation_config(model_dir: str) -> tuple[dict[str, Any], str]:
    """(generation_config.json as a dict ({} when absent), its path)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.lexists(path):  # (a link to a missing file is an error, not "no generation_config.json")
        return {}, path
    return read_json(path, missing="a link to a missing file"), path


def _generation_eos(data: dict[str, Any], path: str, vocab_size: int) -> list[int]:
    eos = data.get("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos
    if not isinstance(eos, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
        raise ValueError(f"{path}: 'eos_token_id' must be an int or a list of ints, got {eos!r:.80}")
    bad = next((e for e in eos if not 0 <= e < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{path}: 'eos_token_id' holds {bad}, outside the vocabulary [0, {vocab_size})")
    return eos


# generation_config.json keys that become default sampling settings, as vLLM's --generation-config auto reads them
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def _generation_defaults(data: dict[str, Any], path: str) -> dict[str, Any]:
    """The sampling defaults the model's creator wrote into generation_config.json, checked (ValueError naming the
    file and key)."""
    out = {}
    for key, field in _GENERATION_DEFAULTS.items():
        if data.get(key) is None:
            continue
        try:
            SamplingParams(**{field: data[key]})
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: '{key}' {data[key]!r} is not a valid {field} ({exc})") from None
        out[field] = data[key]
    return out


def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)


class LLM:
    """Offline generation over one `LLMEngine` (continuous batching, chunked prefill, preemption)."""

    def __init__(self, model: str | os.PathLike[str], backend: str = "auto", *, skip_tokenizer_init: bool = False,
                 progress: bool | None = None, report: bool = False, trust_remote_code: bool = False,
                 tensor_parallel_size: int = 1, chat_template: str | None = None, generation_config: str = "auto",
                 **settings: Any) -> None:
        """`settings`: any `EngineConfig` field (dtype, max_num_seqs, max_model_len, block_size,
        num_blocks, max_num_batched_tokens, gpu_memory_utilization, seed, enforce_eager, load_format, ...).  `trust_remote_code` is
        accepted for vLLM's call lines (no code from the checkpoint is ever run); `tensor_parallel_size` must be 1.
        `chat_template`: a Jinja file's path or the template itself, in place of the checkpoint's (vLLM's
        --chat-template).  `generation_config` (vLLM's): "auto" takes the default sampling settings (temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens) from the checkpoint's generation_config.json, a
        directory's path from that directory's, "vllm" none (SamplingParams' own defaults)."""
        from kda_rt.loader.weights import load_checkpoint

        del trust_remote_code  # nothing to trust: the model code is kda_rt's own
        for name, value in (("skip_tokenizer_init", skip_tokenizer_init), ("report", report), ("progress", progress)):
            if not isinstance(value, bool) and not (name == "progress" and value is None):  # ("no" is truthy)
                raise TypeError(f"{name} must be a bool{' or None' if name == 'progress' else ''}, got {value!r}")
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size {tensor_parallel_size!r}: only 1 GPU is supported")

        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model must be a checkpoint directory's path (str or os.PathLike), got "
                            f"{type(model).__name__}")
        model_dir = os.fspath(model)
        if (problem := model_dir_problem(model_dir, "model")) is not None:
            raise FileNotFoundError(problem)
        engine_config = EngineConfig.from_kwargs(backend=backend, **settings)
        self.model_config = load_config(model_dir)
        gen, gen_path = _generation_config(model_dir)
        extra_eos = _generation_eos(gen, gen_path, self.model_config.vocab_size)  # checked before the weights load
        from_dir = generation_config not in ("auto", "vllm")
        if from_dir:
            if not isinstance(generation_config, (str, os.PathLike)) or not os.path.isdir(generation_config):
                raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory holding "
                                 f"generation_config.json, got {generation_config!r}")
            gen, gen_path = _generation_config(generation_config)
        self.default_sampling = {} if generation_config == "vllm" else _generation_defaults(gen, gen_path)
        if self.default_sampling:
            logger.warning("default sampling settings from %s: %s (as vLLM; generation_config='vllm' turns them off)",
                           gen_path, self.default_sampling)
        limit, max_model_len = self.model_config.max_model_len, engine_config.max_model_len
        if max_model_len is not None and max_model_len > limit:  # checked again by the pool plan; fail before loading
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit {limit} (config.json)")
        select_backend(engine_config.backend)  # a clear error before the weights load
        self.tokenizer = None
        if chat_template is not None and (skip_tokenizer_init or not _has_tokenizer(model_dir)):
            raise ValueError(f"chat_template needs the tokenizer ({model_dir} has no tiktoken.model, or "
                             "skip_tokenizer_init is set)")
        if not skip_tokenizer_init and _has_tokenizer(model_dir):
            from kda_rt.text.tokenizer import Tokenizer

            self.tokenizer = Tokenizer.from_dir(model_dir, chat_template=chat_template)
            if self.tokenizer.vocab_size != self.model_config.vocab_size:
                logger.warning("tokenizer has %d tokens but the model has %d vocabulary rows; ids the tokenizer does "
                               "not know produce no text", self.tokenizer.vocab_size, self.model_config.vocab_size)
        if engine_config.load_format == "dummy":
            from kda_rt.random_checkpoint import random_weights

            logger.warning("load_format='dummy': random weights of %s's config.json shapes (seed %d), no weight file "
                           "read: the text is meaningless", model_dir, engine_config.seed)
            weights = random_weights(self.model_config, engine_config.seed)
        else:
            weights = load_checkpoint(model_dir, self.model_config, progress=progress)
        self.llm_engine = build_engine(self.model_config, weights, engine_config, tokenizer=self.tokenizer,
                                       extra_eos_ids=extra_eos)
        if not self.llm_engine.eos_token_ids:
            logger.warning("%s names no EOS token (config.json / generation_config.json eos_token_id): a sequence ends "
                           "only at max_tokens, a stop string or a stop token id", model_dir)
        self.engine_config = self.llm_engine.config  # max_model_len resolved
        # vLLM's override_max_tokens: a --generation-config directory's max_new_tokens, which the server (not the
        # offline API) also applies to a request's own max_tokens
        self.max_tokens_override = self.default_sampling.get("max_tokens") if from_dir else None
        self.runner = self.llm_engine.runner
        self.backend = self.runner.name
        self.report = self.runner.report() if report else None
        if self.report:
            logger.info("%s", self.report)
        self._open: set[str] = set()  # request ids issued by generate() and not yet returned
        self._request_counter = itertools.count()  # request ids "0", "1", ... across calls, as vLLM's LLM
        self._parked: dict[str, tuple[int, RequestOutput]] = {}  # newest (step stamp, output) of an open request
        self._step_stamp = 0  # engine steps taken by the drivers; orders cumulative outputs
        # every engine call (add, step, abort, score) holds it: generate() from several threads takes turns, a step
        # at a time (its outputs parked for their own thread's driver); an AsyncLLM over this LLM takes it too
        self._engine_lock = threading.RLock()
        self._asyncs: weakref.WeakSet = weakref.WeakSet()  # the AsyncLLMs over this LLM
        self._async_ids = itertools.count()  # their request ids ("async-N", "beam-N"), unique across them
        self.model_dir = model_dir

    def get_tokenizer(self):
        return self.tokenizer

    # -- generation -------------------------------------------------------------------------

    def generate(
        self,
        prompts: str | dict | Iterable[str | dict | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        stream: bool = False,
        use_tqdm: bool = False,
        lora_request: None = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput] | Iterator[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.  A prompt is a text, a dict with
        `prompt_token_ids` (or `prompt`), or a list of token ids; a flat list of ints is one prompt, as in vLLM.
        `use_tqdm`: a progress bar of finished requests on stderr (not with `stream`); `lora_request`: only None;
        `priority` (vLLM's): one int a prompt, for an engine with `scheduling_policy="priority"` (lower runs first).

        With `stream=True`, returns an iterator instead, yielding a `RequestOutput` each time a
        request gets new tokens; its `CompletionOutput`s then hold only what is new (text delta,
        new token ids and logprobs), and `finished` marks a request's last one.  Request ids are
        the prompt indices as strings.  Closing the iterator early aborts what is still running.
        """
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported")
        if stream and use_tqdm:  # (was: the bar silently left out)
            raise ValueError("use_tqdm shows finished requests of a non-streaming call; it does not go with stream")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
            raise TypeError(f"prompts must be a str, a dict, a list of token ids or a list of those, got "
                            f"{type(prompts).__name__}")
        if isinstance(prompts, (set, frozenset)):  # (was: taken in the set's arbitrary order)
            raise TypeError("prompts must be a list (or another ordered iterable), got a set: outputs come back in "
                            "prompt order, which a set does not have")
        prompts = list(prompts)
        if prompts and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompts):
            prompts = [prompts]  # one prompt of token ids
        if not (sampling_params is None or isinstance(sampling_params, SamplingParams) or (
                isinstance(sampling_params, list) and all(isinstance(p, SamplingParams) for p in sampling_params))):
            raise TypeError(f"sampling_params must be a SamplingParams, a list of them or None, got "
                            f"{type(sampling_params).__name__}; for a dict d use SamplingParams(**d)")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
            params_list = sampling_params
        else:
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if priority is not None and (not isinstance(priority, (list, tuple)) or len(priority) != len(prompts)):
            raise ValueError(f"priority must be a list of one int a prompt ({len(prompts)}), got {priority!r}")
        fit = sampling_params is None and "max_tokens" in self.default_sampling  # fits each prompt's room
        prompt_lps = [self._prompt_logprobs_waiting(self.llm_engine.request_prompt(p, sp)[1], sp.prompt_logprobs,
                                                    sp.detokenize)
                      if sp.prompt_logprobs is not None else None
                      for p, sp in zip(prompts, params_list, strict=True)]
        ids = self._add_all(prompts, params_list, "cumulative" if stream else "final", fit, priority)
        if any(lp is not None for lp in prompt_lps) or any(sp.logprobs is not None for sp in params_list):
            by_id = {rid: (sp, lps) for rid, sp, lps in zip(ids, params_list, prompt_lps, strict=True)}
            attach = lambda out: self._vllm_output(out, *by_id[out.request_id])  # noqa: E731
        else:
            attach = None
        if stream:
            done: list = []
            gen = self._stream(ids, done, attach)
            # a generator closed before its first next() never runs its finally: abort then too
            done.append(weakref.finalize(gen, self._abort_all, list(ids)))
            return gen
        final: dict[str, RequestOutput] = {}
        bar = None
        try:
            bar = _progress_bar(len(ids)) if use_tqdm else None  # (one that fails leaves no request behind)
            for out in self._drive(ids):
                if out.finished:
                    final[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        finally:
            try:
                if bar is not None:
                    bar.close()
            finally:
                self._abort_all(ids)
        return [attach(final[rid]) if attach else final[rid] for rid in ids]

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults (vLLM's method)."""
        return SamplingParams(**self.default_sampling)

    def _decode_token(self, token: int) -> str | None:
        tok = self.tokenizer
        return tok.decode([token]) if tok is not None and token < tok.vocab_size else None

    def _vllm_output(self, out: RequestOutput, params: SamplingParams, prompt_lps: list | None,
                     done: dict[int, list] | None = None) -> RequestOutput:
        """`out` with its logprobs as vLLM's {token: Logprob} and its prompt logprobs attached.  `done` (for a
        request's cumulative outputs): each sample's entries converted so far, so each step converts only its own."""
        def convert(entries):
            decode = self._decode_token if params.detokenize else (lambda _token: None)  # vLLM: no decoded_token
            return [vllm_logprobs(e, params.logprobs, decode, greedy=params.greedy) for e in entries]

        outputs = []
        for c in out.outputs:
            if c.logprobs is None:
                outputs.append(c)
                continue
            if done is None:
                logprobs = convert(c.logprobs)
            else:
                seen = done.setdefault(c.index, [])
                seen += convert(c.logprobs[len(seen):])
                logprobs = list(seen)
            outputs.append(dataclasses.replace(c, logprobs=logprobs))
        return dataclasses.replace(out, outputs=outputs, prompt_logprobs=prompt_lps)

    def _vllm_prompt_logprobs(self, ids: list[int], num: int, detokenize: bool = True) -> list[dict[int, Logprob] | None]:
        """`detokenize=False`: no decoded_token (vLLM drops the request's tokenizer for both kinds of logprobs)."""
        dicts, ranks = self.prompt_logprobs(ids, num)
        decode = self._decode_token if detokenize else (lambda _token: None)
        return [None] + [vllm_logprobs(d, num, decode, rank=r) for d, r in zip(dicts[1:], ranks[1:], strict=True)]

    def _prompt_logprobs_waiting(self, ids: list[int], num: int,
                                 detokenize: bool = True) -> list[dict[int, Logprob] | None]:
        """`_vllm_prompt_logprobs`; while other drivers' requests (another thread's generate, an unread stream) hold
        every state slot or the pages, this thread steps the engine for them, their outputs parked for their drivers,
        until room frees (was: NoRoomToScore under load; AsyncLLM waits the same way)."""
        while True:
            try:
                return self._vllm_prompt_logprobs(ids, num, detokenize)
            except NoRoomToScore:
                with self._engine_lock:
                    self._refuse_beside_async()
                    if not self.llm_engine.has_unfinished_requests():
                        raise  # nothing running to free room: the pool itself is too small for this prompt
                    self._next_outputs(set(), {})  # one step, every output parked for its own driver

    def _refuse_beside_async(self) -> None:
        if any(a._streaming() for a in self._asyncs):
            raise RuntimeError("an AsyncLLM over this LLM has requests in flight: its engine runs one driver's "
                               "requests at a time; send these through the AsyncLLM too, or use another LLM")

    def _add_all(self, prompts: list, params_list: list[SamplingParams], output_kind: str,
                 fit_max_tokens: bool = False, priority: list[int] | None = None) -> list[str]:
        """Add every prompt, or none: a bad prompt raises and the ones added before it are aborted.
        Non-streaming requests ask the engine for their final output only (no per-step copies).
        `fit_max_tokens`: the params are the defaults (LLMEngine.add_request)."""
        with self._engine_lock:
            self._refuse_beside_async()
            ids: list[str] = []
            try:
                for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                    rid = self._request_id()
                    try:
                        ids.append(self.llm_engine.add_request(rid, prompt, params, output_kind=output_kind,
                                                               fit_max_tokens=fit_max_tokens,
                                                               priority=0 if priority is None else priority[i]))
                    except BaseException:
                        self._open.discard(rid)  # refused: the id was never the engine's
                        raise
            except BaseException:
                self._abort_all(ids)
                raise
            return ids

    def _request_id(self) -> str:
        rid = str(next(self._request_counter))
        while rid in self._open or rid in self.llm_engine.requests:  # taken (an id given to the engine directly)
            rid = str(next(self._request_counter))
        self._open.add(rid)
        return rid

    def _drive(self, ids: list[str]) -> Iterator[RequestOutput]:
        """Step the engine until every request in `ids` has finished, yielding their outputs.
        Outputs of other open requests (another stream) are parked for their own driver.

        Outputs are cumulative and stamped with the engine step that made them: a driver that was
        suspended while another one stepped may hold an older output than the parked one, so each
        driver yields an output only when it is newer than the last it yielded for that request,
        and parking keeps the newest."""
        mine, yielded = set(ids), {}  # yielded: request id -> step stamp of the last output yielded
        while mine:
            with self._engine_lock:  # (released while the outputs are yielded: another thread's driver may step)
                outputs = self._next_outputs(mine, yielded)
            if outputs is None:
                return
            yield from outputs

    def _next_outputs(self, mine: set[str], yielded: dict[str, int]) -> list[RequestOutput] | None:
        """`_drive`'s next outputs to yield (`mine` and `yielded` updated for them): the newer parked ones, else one
        engine step's (the other open requests' outputs parked); None when the engine has nothing left to run."""
        ready = []
        for rid in [r for r in self._parked if r in mine]:
            stamp, out = self._parked.pop(rid)
            if stamp > yielded.get(rid, -1):
                ready.append((stamp, out))
        if not ready:
            if not self.llm_engine.has_unfinished_requests():
                return None
            self._step_stamp += 1
            stamp = self._step_stamp
            # (cumulative: the newest of a request's outputs suffices; a step that returns the outputs a failed step
            # owed and its own can hold two of one request, the second maybe its finish)
            outputs = list({o.request_id: o for o in self.llm_engine.step()}.values())
            # park every other request's output: its driver (another stream, another thread) must find it (the
            # engine may already be idle)
            for out in outputs:
                if out.request_id not in mine and out.request_id in self._open:
                    self._parked[out.request_id] = (stamp, out)  # cumulative: the newest one suffices
            ready = [(stamp, out) for out in outputs if out.request_id in mine and stamp > yielded.get(out.request_id, -1)]
        for stamp, out in ready:
            yielded[out.request_id] = stamp
            if out.finished:
                mine.discard(out.request_id)
        return [out for _, out in ready]

    def _stream(self, ids: list[str], done: list, attach=None) -> Iterator[RequestOutput]:
        trackers = {rid: DeltaTracker() for rid in ids}
        given: set[str] = set()  # requests whose prompt_logprobs went out: with the first delta only (vLLM's deltas)
        try:
            for out in self._drive(ids):
                delta = trackers[out.request_id].delta(out)
                if attach is not None:
                    delta = attach(delta)
                    if delta.prompt_logprobs is not None and out.request_id in given:
                        delta = dataclasses.replace(delta, prompt_logprobs=None)
                    given.add(out.request_id)
                yield delta
        finally:
            done[0].detach()  # ids may be reused by later requests: never abort them from the finalizer
            self._abort_all(ids)

    def _abort_all(self, ids: list[str]) -> None:
        with self._engine_lock:
            for rid in ids:
                self.llm_engine.abort(rid)  # no-op for finished requests; frees resources after an error
                self._open.discard(rid)
                self._parked.pop(rid, None)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        stream: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        use_tqdm: bool = False,
        lora_request: None = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput] | Iterator[RequestOutput]:
        """Apply the chat template to one conversation (a list of messages) or several.  Messages may
        carry assistant `tool_calls` (content None) and `tool` results with `tool_call_id`; the
        `developer` role reads as `system`.  Generated tool calls stay in the text (pass
        `skip_special_tokens=False` to keep the markers, `spaces_between_special_tokens=False` for no space after the
        prompt's `<|im_middle|>`) and `kda_rt.text.tool_parser.parse_tool_calls` reads them.  `continue_final_message`
        (with `add_generation_prompt=False`): the model continues the last message instead of starting a new one, as in vLLM.  `chat_template` (vLLM's): a Jinja template string for
        this call instead of the checkpoint's.  `priority`: one int a conversation (`generate`'s)."""
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer files, so chat() is unavailable")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        conversations = messages if isinstance(messages[0], list) else [messages]
        for i, conv in enumerate(conversations):
            if not isinstance(conv, list) or not conv:
                raise ValueError(f"conversation {i} must be a non-empty list of {{'role', 'content'}} dicts, got {conv!r:.80}")
        # (content as text parts: the template layer keeps or joins them, `normalize_messages`)
        options = {"add_generation_prompt": add_generation_prompt, "tools": tools,
                   "chat_template_kwargs": chat_template_kwargs, "continue_final_message": continue_final_message,
                   "chat_template": chat_template}
        # the ids from encode_chat (client text never a control token); the rendered text as each output's prompt
        prompts = [{"prompt_token_ids": self.tokenizer.encode_chat(conv, **options),
                    "prompt": self.tokenizer.apply_chat_template(conv, **options)} for conv in conversations]
        return self.generate(prompts, sampling_params, stream=stream, use_tqdm=use_tqdm, lora_request=lora_request,
                             priority=priority)

    def score(self, token_ids: list[int]) -> np.ndarray:
        """[len(token_ids), vocab] float32 logits of every position of one sequence (`LLMEngine.score`:
        a slot and pages borrowed from the free pools, so running requests are untouched)."""
        with self._engine_lock:
            return self.llm_engine.score(token_ids)

    def prompt_logprobs(self, prompt: str | dict | list[int], num: int = 0
                        ) -> tuple[list[dict[int, float] | None], list[int | None]]:
        """(logprobs, ranks) of every prompt token from one `score()` pass: per position i >= 1,
        {token_id: logprob} of the prompt token and the `num` most likely ones under the logits of
        position i - 1, and the prompt token's rank (1 = most likely); position 0 has None.  `num` is an int in
        [0, 20] (vLLM's limit); past the vocabulary it lists every token."""
        if isinstance(num, bool) or not isinstance(num, (int, np.integer)) or not 0 <= num <= 20:
            raise ValueError(f"prompt_logprobs must be an int in [0, 20], got {num!r}")
        _, ids = self.llm_engine.prompt_ids(prompt)
        num = min(int(num), self.llm_engine.model_config.vocab_size)
        with self._engine_lock:  # (one prefill; on the CUDA runner the rows are reduced on the GPU)
            rows = self.llm_engine.prompt_logprob_rows(ids, num)
        dicts: list[dict[int, float] | None] = [None]
        ranks: list[int | None] = [None]
        for i in range(1, len(ids)):
            entry = {ids[i]: float(rows.logprob[i - 1])}
            for t, lp in zip(rows.top_ids[i - 1].tolist(), rows.top_logprobs[i - 1].tolist(), strict=True):
                entry.setdefault(t, lp)
            dicts.append(entry)
            ranks.append(int(rows.rank[i - 1]))
        return dicts, ranks

    def beam_search(self, prompts, params, *, use_tqdm: bool = False, concurrency_limit: int | None = None,
                    lora_request: None = None) -> list:
        """vLLM's beam search (`kda_rt.beam_search.BeamSearchParams`): for each prompt its best `beam_width`
        `BeamSearchSequence`s (tokens = prompt + generated ids, cum_logprob, text), in a `BeamSearchOutput`; each step
        one engine request a beam, resumed after its parent's tokens by the prefix cache (kda_rt/beam_search.py)."""
        from kda_rt.beam_search import beam_search

        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported")
        return beam_search(self, prompts, params, use_tqdm=use_tqdm, concurrency_limit=concurrency_limit)

    def reset_prefix_cache(self) -> bool:
        """Drop every kept prefix (`enable_prefix_caching`; vLLM's name); True."""
        with self._engine_lock:
            return self.llm_engine.reset_prefix_cache()

    def stats(self) -> dict[str, int | list[int]]:
        """Engine counters: running, waiting, preemptions, pages/slots used and free, tokens processed, and the steps
        binned by their tokens (`step_token_bins`)."""
        with self._engine_lock:
            return self.llm_engine.stats()
