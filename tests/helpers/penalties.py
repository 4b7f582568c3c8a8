"""The GPU sampler's penalty (kernels_cu/sampling.cu `penalise`) in NumPy, float32 step by step, and the CUDA runner's
device sampling of penalised, banned and restricted rows (KDA_RT_GPU_SAMPLING_EXTRAS: sampler/penalties.PenaltyRows,
SamplingBatch.device_masks) on a NumPy runner, for the CPU tests."""

from __future__ import annotations

import numpy as np

from kda_rt.sampler.batch import StepOutput
from kda_rt.sampler.params import SamplingParams
from kda_rt.sampler.penalties import PenaltyRows
from kda_rt.sampler.reference import allowed_tokens, sample_row, sample_rows, top_logprobs


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


def use_device_extras(llm) -> PenaltyRows:
    """Make `llm`'s NumPy runner sample as the CUDA runner does with KDA_RT_GPU_SAMPLING_EXTRAS: every row like the GPU
    sampler, penalties and logit_bias from a PenaltyRows' rows (NumPy arrays, the sampled ids added after each
    launch) rather than the row's history, then `SamplingBatch.device_masks` (grammar, bans, allowed_token_ids) as
    -inf; a row that masks every token goes to the host sampler, which names the error
    (the kernel's flag 2).  The engine then treats such rows as device rows (async scheduling allowed)."""
    engine = llm.llm_engine
    runner = engine.runner
    vocab = llm.model_config.vocab_size
    pool = PenaltyRows(vocab, np, add_sampled, first_capacity=2)

    def execute(batch, sampling):
        logits = np.array(runner.forward(batch), dtype=np.float32)
        prepared = pool.prepare(sampling)
        rows = prepared[0] if prepared is not None else np.zeros(sampling.num_rows, np.int32)
        masks = sampling.device_masks(vocab)
        out = StepOutput.empty(sampling.num_rows)
        host = []
        for i in range(sampling.num_rows):
            x, p = logits[i], sampling.params[i]
            if sampling.host_rows[i] or not np.isfinite(x).all():
                host.append(i)
                continue
            if rows[i]:
                if prepared[2]:  # (HAS_BIAS: the row's biases, added where not 0, before the penalties)
                    b = pool.bias[rows[i]]
                    x = np.where(b != 0, (x + b).astype(np.float32), x)
                x = penalise(x, p, pool.counts[rows[i]], pool.prompt[rows[i]])
            if masks[i] is not None:
                x = np.where(allowed_tokens(masks[i], vocab), x, -np.inf).astype(np.float32)
            if not np.isfinite(x).any():  # (flag 2)
                host.append(i)
                continue
            token = sample_row(x, p, int(sampling.seeds[i]), int(sampling.steps[i]))
            out.token_ids[i] = token
            if sampling.num_logprobs[i] >= 0:
                out.logprobs[i] = top_logprobs(x, token, int(sampling.num_logprobs[i]))
        sample_rows(logits, sampling, host, out)
        if prepared is not None:
            pool.after_sample(sampling, np.array([-1 if t is None else t for t in out.token_ids], np.int32),
                              prepared[1])
        runner._last = out
        return out

    runner.execute = execute
    engine._device_extras = True
    return pool
