"""The GPU sampler's penalty (kernels_cu/sampling.cu `penalise`) in NumPy, float32 step by step, and the CUDA runner's
device penalties (KDA_RT_GPU_PENALTIES: sampler/penalties.PenaltyRows) on a NumPy runner, for the CPU tests."""

from __future__ import annotations

import dataclasses

import numpy as np

from kda_rt.sampler.batch import StepOutput
from kda_rt.sampler.params import SamplingParams
from kda_rt.sampler.penalties import PenaltyRows
from kda_rt.sampler.reference import sample_rows


def add_sampled(counts, ids, rows) -> None:
    """update_counts in NumPy: counts[rows[b], ids[b]] += 1 where rows[b] >= 0 and 0 <= ids[b] < V."""
    keep = (rows >= 0) & (ids >= 0) & (ids < counts.shape[1])
    np.add.at(counts, (rows[keep], ids[keep]), 1)


def penalise(x: np.ndarray, p: SamplingParams, counts: np.ndarray, prompt: np.ndarray) -> np.ndarray:
    """sampling.cu's penalise over a row, float32 step by step (__fdiv_rn / __fmul_rn / __fadd_rn / __fsub_rn)."""
    f32 = np.float32
    out = x.astype(np.float32, copy=True)
    for i in np.flatnonzero((counts > 0) | (prompt > 0) | (p.frequency_penalty != 0) | (p.presence_penalty != 0)):
        c, v = int(counts[i]), out[i]
        if c > 0 or prompt[i]:
            v = f32(v / f32(p.repetition_penalty)) if v > 0 else f32(v * f32(p.repetition_penalty))
        sub = f32(f32(f32(p.frequency_penalty) * f32(c)) + (f32(p.presence_penalty) if c > 0 else f32(0)))
        out[i] = f32(v - sub)
    return out


def use_device_penalties(llm) -> PenaltyRows:
    """Make `llm`'s NumPy runner sample penalised rows as the CUDA runner does with KDA_RT_GPU_PENALTIES: their
    penalties from a PenaltyRows' counts (NumPy arrays, the sampled ids added after each launch), not from the rows'
    histories; the engine then treats them as device rows (no host rows, async scheduling allowed)."""
    engine = llm.llm_engine
    runner = engine.runner
    pool = PenaltyRows(llm.model_config.vocab_size, np, add_sampled, first_capacity=2)

    def execute(batch, sampling):
        logits = np.array(runner.forward(batch), dtype=np.float32)
        prepared = pool.prepare(sampling)
        history = list(sampling.history)
        if prepared is not None:
            rows, update = prepared
            for i in np.flatnonzero(rows):
                logits[i] = penalise(logits[i], sampling.params[i], pool.counts[rows[i]], pool.prompt[rows[i]])
                history[i] = None  # (the host sampler must not penalise them again)
        out = StepOutput.empty(sampling.num_rows)
        sample_rows(logits, dataclasses.replace(sampling, history=tuple(history)), range(sampling.num_rows), out)
        if prepared is not None:
            pool.after_sample(sampling, np.array([-1 if t is None else t for t in out.token_ids], np.int32), update)
        runner._last = out
        return out

    runner.execute = execute
    engine._device_penalties = True
    return pool
