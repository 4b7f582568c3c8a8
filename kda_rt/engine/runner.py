"""The `Runner` contract both backends implement, and backend selection (`make_runner` is the one
place a backend is chosen).

A runner owns one backend's weights, cache pools and model.  It plans its pools at construction
(`plan`, from kda_rt/engine/pools.py) and then only ever sees flat batches:

    execute(ForwardBatch, SamplingBatch) -> StepOutput   forward + sample the rows that sample
    launch(ForwardBatch, SamplingBatch, *, ids_from_last=()) -> handle    optional: execute's
    collect(handle) -> StepOutput                            two halves (queue; wait); with
                                 ids_from_last (rows of the previous launch's samples, -1 for none,
                                 or True: all of them, a decode batch of as many sequences) the
                                 batch's first sequences, one token each, take those sampled ids in
                                 place of their input_ids (async_scheduling; `lead_ids_rows` checks)
    launch(..., defer_sampling=True); sample(handle)         optional: the forward now, the sampler
                                 (and the grammar masks it asks for) when `sample` is called, before
                                 the next launch (async steps after grammar rows)
    score(ForwardBatch) -> [N, vocab] float32            forward only (LLM.score, all positions)
    copy_slots(src, dst); copy_pages(src, dst)           optional (prefix caching): KDA states of slots
                                 src into slots dst, MLA pages src into pages dst, every layer, ordered
                                 after the launches made so far and before the next (prefix caching is
                                 on by default: a runner without them needs enable_prefix_caching=False)
    writes_snapshots: bool                               optional (prefix caching): True when the forward
                                 writes ForwardBatch.snapshot's states (prompt snapshots; without it the
                                 engine makes none)
    report() -> str                                      what a decode step runs
    peak_memory_bytes() -> int

Host-side sampling fallbacks (penalties, bans, non-finite rows) live inside the runner that needs
them; the engine has no backend-specific branch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from kda_rt.engine.config import BACKENDS

if TYPE_CHECKING:
    from kda_rt.engine.batch import ForwardBatch
    from kda_rt.engine.config import EngineConfig
    from kda_rt.engine.pools import PoolPlan
    from kda_rt.loader.config import ModelConfig
    from kda_rt.sampler.batch import SamplingBatch, StepOutput

__all__ = ["BACKENDS", "Runner", "cuda_unavailable_reason", "lead_ids_rows", "make_runner", "select_backend"]

logger = logging.getLogger(__name__)


@runtime_checkable
class Runner(Protocol):
    name: str
    plan: PoolPlan

    def execute(self, batch: ForwardBatch, sampling: SamplingBatch) -> StepOutput: ...

    def score(self, batch: ForwardBatch) -> np.ndarray: ...

    def report(self) -> str: ...

    def peak_memory_bytes(self) -> int: ...


def lead_ids_rows(batch: ForwardBatch, ids_from_last, num_sampled: int | None) -> tuple[int, ...]:
    """`launch`'s `ids_from_last` as the previous launch's sample rows that feed `batch`'s first sequences, one each
    (-1: that sequence keeps its own input id; True: every row in order, for a batch of as many sequences);
    ValueError when the previous launch sampled nothing (`num_sampled` None), a row is not one of its
    `num_sampled`, or a sequence up to the last one fed is not one token."""
    rows = tuple(range(batch.num_seqs)) if ids_from_last is True else tuple(int(r) for r in ids_from_last)
    if num_sampled is None or (ids_from_last is True and num_sampled != batch.num_seqs):
        raise ValueError(f"ids_from_last: the previous launch sampled {num_sampled} rows, this batch has "
                         f"{batch.num_seqs} sequences")
    if len(rows) > batch.num_seqs or any(not -1 <= r < num_sampled for r in rows):
        raise ValueError(f"ids_from_last: rows {list(rows)} for a batch of {batch.num_seqs} sequences after a launch "
                         f"that sampled {num_sampled} rows")
    k = len(rows)
    if not np.array_equal(batch.cu_seqlens[: k + 1], np.arange(k + 1)):
        raise ValueError(f"ids_from_last: the batch's first {k} sequences must be one token each, "
                         f"got {batch.seq_lens[:k].tolist()}")
    return rows


def make_runner(config: ModelConfig, weights: Mapping[str, np.ndarray], settings: EngineConfig) -> Runner:
    """The runner of `settings.backend` ("auto" resolved here)."""
    backend = select_backend(settings.backend)
    if backend == "cuda":
        from kda_rt.cuda.runner import CudaRunner

        return CudaRunner(config, weights, settings)
    from kda_rt.reference.runner import NumpyRunner

    if settings.quantization == "fp8":  # the experts' e4m3 values, dequantized (the CUDA backend quantizes on upload)
        from kda_rt.loader.quant import quantize_experts

        weights = quantize_experts(config, weights)
    return NumpyRunner(config, weights, settings)


def smem_shortfall(optin: int, head_dim: int = 128) -> str | None:
    """Why a GPU whose blocks may opt in to `optin` bytes of shared memory cannot run the CUDA kernels, or None.  The
    largest block is the KDA prefill kernel's (kda_prefill_intra: 64-token chunks of Kimi Linear's 128-wide heads,
    221,616 bytes): sm_90 and sm_100 GPUs allow 232,448, sm_80 (A100) 166,912, sm_86 / sm_89 101,376."""
    from kda_rt.cuda.ops.kda_prefill import _CHUNK, _intra_smem_bytes

    need = _intra_smem_bytes(head_dim, _CHUNK, 4)
    if optin >= need:
        return None
    return (f"this GPU lets a block use {optin} bytes of shared memory and the KDA prefill kernel (kda_prefill_intra) "
            f"needs {need}: the CUDA backend runs on Hopper or newer data-center GPUs (sm_90 / sm_100 allow 232448)")


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run here, or None when it can."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed: pip install 'kda_rt[cuda12]' (CUDA 12 driver) or 'kda_rt[cuda13]'"
    try:
        from cupy.cuda import nvrtc, runtime

        if runtime.getDeviceCount() < 1:
            return "no CUDA device is visible"
        cc = int(cupy.cuda.Device().compute_capability)  # e.g. "90" -> 90
        if cc < 80:
            return f"compute capability {cc // 10}.{cc % 10} is below 8.0 (bf16 kernels need Ampere or newer)"
        from kda_rt.cuda.ops.compile import smem_optin

        short = smem_shortfall(smem_optin(cupy.cuda.Device().id))
        if short:
            return short
        if runtime.driverGetVersion() < 12000:
            return f"the NVIDIA driver supports CUDA {runtime.driverGetVersion()}, kda_rt needs CUDA >= 12.0"
        nvrtc.getVersion()
    except Exception as exc:  # no driver, broken install, NVRTC library missing
        return f"CUDA is not usable here ({type(exc).__name__}: {exc}); check the driver and the CuPy extra"
    return None


def select_backend(backend: str) -> str:
    """Resolve "auto" (cuda when a usable GPU and CuPy are present, else numpy) and check that the
    requested backend can run here."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "numpy":
        return backend
    reason = cuda_unavailable_reason()
    if backend == "cuda":
        if reason:
            raise RuntimeError(f"backend='cuda' is unavailable: {reason}")
        return "cuda"
    if reason:
        if reason not in _logged_reasons:  # LLM checks before the weights load, make_runner again: one line
            _logged_reasons.add(reason)
            logger.info("using the numpy backend: %s", reason)
        return "numpy"
    return "cuda"


_logged_reasons: set[str] = set()
