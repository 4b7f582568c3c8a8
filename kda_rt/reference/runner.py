"""`NumpyRunner`: the reference backend's runner (the `Runner` contract of kda_rt/engine/runner.py):
weights, cache pools and the NumPy model; `execute` = forward + the NumPy reference sampler."""

from __future__ import annotations

import dataclasses
import resource
import sys
from typing import TYPE_CHECKING

import numpy as np

from kda_rt.engine.config import NUMPY_MAX_NUM_SEQS
from kda_rt.engine.pools import host_memory_bytes, plan_pools
from kda_rt.engine.runner import lead_ids_rows
from kda_rt.reference.cache import KDAStatePool, MLAKVPool
from kda_rt.sampler.batch import SamplingBatch, StepOutput
from kda_rt.sampler.reference import sample_rows

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kda_rt.engine import EngineConfig
    from kda_rt.engine.batch import ForwardBatch
    from kda_rt.loader.config import ModelConfig

__all__ = ["NumpyRunner"]


@dataclasses.dataclass(eq=False)
class _Deferred:
    """A launch whose forward ran and whose sampling waits for `NumpyRunner.sample`."""

    logits: np.ndarray
    sampling: SamplingBatch
    result: StepOutput | None = None


class NumpyRunner:
    """The reference backend: float32 (or float64) NumPy on the CPU."""

    name = "numpy"
    writes_snapshots = True  # (the forward writes ForwardBatch.snapshot's states: prompt snapshots)

    def __init__(self, config: ModelConfig, weights: Mapping[str, np.ndarray], engine: EngineConfig) -> None:
        """engine.dtype: "float32", "float64", or "bfloat16" (float32 math with activations rounded to
        bf16 where the bf16 references round them: the oracle for the CUDA backend)."""
        from kda_rt.reference.kimi_linear import KimiLinearModel

        bf16_activations = engine.dtype == "bfloat16"
        self.config = config
        self.dtype = np.dtype(np.float32 if bf16_activations else engine.dtype)
        weight_bytes = sum(int(np.prod(w.shape)) for w in weights.values()) * self.dtype.itemsize
        self.plan = plan_pools(config, engine, itemsize=self.dtype.itemsize, memory_bytes=host_memory_bytes(),
                               weight_bytes=weight_bytes, cap_to_sequences=True, where="host",
                               default_seqs=NUMPY_MAX_NUM_SEQS)
        self.model = KimiLinearModel(config, weights, self.dtype, bf16_activations=bf16_activations)
        # np.zeros is backed by lazily committed pages, so a generous pool costs little until used
        self.kda_pool = KDAStatePool(config, self.plan.num_slots, dtype=self.dtype)
        self.mla_pool = MLAKVPool(config, self.plan.num_blocks, engine.block_size, dtype=self.dtype)
        self._last: StepOutput | None = None  # what the last launch sampled (ids_from_last)

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """[N, vocab] float32 logits at `batch.logits_indices`."""
        return np.asarray(self.model.forward(batch, self.kda_pool, self.mla_pool), dtype=np.float32)

    def execute(self, batch: ForwardBatch, sampling: SamplingBatch) -> StepOutput:
        """Forward, then sample every row with the NumPy reference sampler."""
        return self._sample(self.forward(batch), sampling)

    def _sample(self, logits: np.ndarray, sampling: SamplingBatch) -> StepOutput:
        out = StepOutput.empty(sampling.num_rows)
        sample_rows(logits, sampling, range(sampling.num_rows), out)
        self._last = out
        return out

    def launch(self, batch: ForwardBatch, sampling: SamplingBatch, *, ids_from_last=(),
               defer_sampling: bool = False) -> StepOutput | _Deferred:
        """`execute` now (the CPU has nothing to overlap), kept for `collect`; `ids_from_last`: the batch's first
        sequences take the tokens that the previous launch sampled in those rows (the engine's async scheduling,
        the same contract as the CUDA runner's, `lead_ids_rows`; an errored row feeds id 0, its sequence is
        finished).  `defer_sampling`: the forward now, the sampler at `sample(handle)` (as the CUDA runner queues
        them)."""
        if ids_from_last is True or len(ids_from_last):
            last = self._last
            rows = lead_ids_rows(batch, ids_from_last, None if last is None else len(last.token_ids))
            ids = batch.input_ids.copy()
            for j, r in enumerate(rows):
                if r >= 0:
                    ids[j] = last.token_ids[r] or 0
            batch = dataclasses.replace(batch, input_ids=ids)
        self._last = None
        if defer_sampling:
            return _Deferred(self.forward(batch), sampling)
        return self.execute(batch, sampling)

    def sample(self, pending: _Deferred) -> None:
        """Sample a launch made with `defer_sampling`."""
        if pending.result is not None:
            raise RuntimeError("sample: this launch already ran")
        pending.result = self._sample(pending.logits, pending.sampling)

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """KDA states (conv and recurrent, every KDA layer) of slots `src` into slots `dst` (the prefix cache's
        snapshots; the engine orders the calls with the steps)."""
        pool = self.kda_pool
        pool.conv[:, dst] = pool.conv[:, src]
        pool.recurrent[:, dst] = pool.recurrent[:, src]

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """MLA pages `src` (every MLA layer) into pages `dst`."""
        self.mla_pool.kv[:, dst] = self.mla_pool.kv[:, src]

    @staticmethod
    def collect(pending: StepOutput | _Deferred) -> StepOutput:
        if isinstance(pending, _Deferred):  # (never sampled: a launch the engine drops, every row finished)
            return pending.result if pending.result is not None else StepOutput.empty(pending.sampling.num_rows)
        return pending

    def score(self, batch: ForwardBatch) -> np.ndarray:
        return self.forward(batch)

    def report(self) -> str:
        return f"fast-path report ({self.name} backend): NumPy reference ops (kda_rt/reference/*), no GPU kernels"

    def peak_memory_bytes(self) -> int:
        """Peak resident memory of this process (the CPU is the device here)."""
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)


