"""`LLM`: the offline API, with vLLM's names.

    llm = LLM("path/to/checkpoint", backend="numpy")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from kda_rt.engine import EngineConfig, LLMEngine
from kda_rt.forward_batch import ForwardBatch
from kda_rt.loader.config import load_config
from kda_rt.outputs import RequestOutput
from kda_rt.sampler.params import SamplingParams

__all__ = ["LLM", "select_backend"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "numpy", "cuda")


def _cuda_available() -> bool:
    try:
        import cupy  # noqa: F401
        from cupy.cuda import runtime

        return runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, or no device
        return False


def select_backend(backend: str) -> str:
    """Resolve "auto" and check the request can be met."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "cuda":
        # The CUDA backend lands with the GPU kernels; until then say so instead of failing later.
        raise NotImplementedError("backend='cuda' is not available in this build yet; use backend='numpy'")
    if backend == "auto":
        if _cuda_available():
            logger.info("a GPU is present but the CUDA backend is not built yet; using the numpy backend")
        return "numpy"
    return backend


def _has_tokenizer(model_dir: str) -> bool:
    return os.path.exists(os.path.join(model_dir, "tiktoken.model"))


def _generation_eos(model_dir: str) -> list[int]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.exists(path):
        return []
    try:
        with open(path, encoding="utf-8") as fh:
            eos = json.load(fh).get("eos_token_id")
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    eos = [eos] if isinstance(eos, int) else (eos or [])
    return [int(e) for e in eos if isinstance(e, int)]


class LLM:
    def __init__(
        self,
        model: str | os.PathLike[str],
        backend: str = "auto",
        *,
        dtype: str = "float32",
        max_num_seqs: int = 16,
        max_model_len: int | None = None,
        block_size: int = 64,
        num_blocks: int | None = None,
        seed: int = 0,
        skip_tokenizer_init: bool = False,
        progress: bool | None = None,
    ) -> None:
        from kda_rt.loader.weights import load_checkpoint

        model_dir = os.fspath(model)
        if not os.path.isdir(model_dir):
            raise FileNotFoundError(f"model directory {model_dir!r} does not exist")
        self.backend = select_backend(backend)
        if dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64' on the numpy backend, got {dtype!r}")
        self.model_config = load_config(model_dir)
        limit = self.model_config.max_model_len
        if max_model_len is None:
            max_model_len = min(limit, 8192)
        elif max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit {limit}")
        self.engine_config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                          block_size=block_size, num_blocks=num_blocks, seed=seed)
        self.tokenizer = None
        if not skip_tokenizer_init and _has_tokenizer(model_dir):
            from kda_rt.tokenizer import Tokenizer

            self.tokenizer = Tokenizer.from_dir(model_dir)
        weights = load_checkpoint(model_dir, self.model_config, progress=progress)
        from kda_rt.runner import NumpyRunner

        # one slot and enough pages beyond max_num_seqs are kept for score()
        self.runner = NumpyRunner(
            self.model_config, weights,
            num_slots=max_num_seqs + 1,
            num_blocks=self.engine_config.resolved_num_blocks + math.ceil(max_model_len / block_size),
            block_size=block_size, dtype=np.dtype(dtype),
        )
        # the engine gets the first max_num_seqs slots and resolved_num_blocks pages; score() the rest
        self.llm_engine = LLMEngine(self.model_config, self.runner, self.tokenizer, self.engine_config,
                                    num_slots=max_num_seqs, num_blocks=self.engine_config.resolved_num_blocks,
                                    extra_eos_ids=_generation_eos(model_dir))
        self.model_dir = model_dir

    def get_tokenizer(self):
        return self.tokenizer

    # -- generation -------------------------------------------------------------------------

    def generate(
        self,
        prompts: str | dict | Iterable[str | dict | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
            params_list = sampling_params
        else:
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        engine = self.llm_engine
        ids = []
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                ids.append(engine.add_request(None, prompt, params))
            final: dict[str, RequestOutput] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
        finally:
            for rid in ids:
                engine.abort(rid)  # no-op for finished requests; frees resources after an error
        return [final[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation (a list of messages) or several."""
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer files, so chat() is unavailable")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        conversations = messages if isinstance(messages[0], list) else [messages]
        prompts = [
            {"prompt_token_ids": self.tokenizer.encode_chat(conv, add_generation_prompt=add_generation_prompt, tools=tools)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    def score(self, token_ids: list[int]) -> np.ndarray:
        """[len(token_ids), vocab] float32 logits of every position of one sequence."""
        engine = self.llm_engine
        _, ids = engine._prompt_ids({"prompt_token_ids": list(token_ids)})
        if len(ids) > self.engine_config.max_model_len:
            raise ValueError(f"token_ids has {len(ids)} tokens; max_model_len is {self.engine_config.max_model_len}")
        bs = self.engine_config.block_size
        slot = self.llm_engine.num_slots  # reserved in __init__
        first = self.engine_config.resolved_num_blocks
        blocks = list(range(first, first + math.ceil(len(ids) / bs)))
        batch = ForwardBatch.build([ids], [0], [slot], [blocks], all_logits=True)
        return self.runner.execute(batch)

    def stats(self) -> dict[str, int]:
        return self.llm_engine.stats()
