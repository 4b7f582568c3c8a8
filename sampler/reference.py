"""NumPy sampling: the reference (and CPU) implementation of `kernels_cu/sampling.cu`.

Order per row, as in vLLM: repetition / frequency / presence penalties on the logits, then
greedy argmax, or temperature -> top-k -> top-p -> min-p -> draw.  The draw is
argmax(probs / e) with e ~ Exp(1) from a counter-based Philox stream keyed by (seed, step), so a
request with a seed gets the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import numpy as np

from .params import SamplingParams

__all__ = ["apply_penalties", "sample_row", "draw_noise", "top_logprobs"]


def apply_penalties(logits: np.ndarray, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> np.ndarray:
    """logits [V] -> penalised copy.  Repetition applies to prompt and output tokens; presence and
    frequency to output tokens only (vLLM semantics)."""
    if params.repetition_penalty == 1.0 and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0:
        return logits
    out = logits.astype(np.float32, copy=True)
    vocab = out.shape[0]
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(list(prompt_ids) + list(output_ids), dtype=np.int64))
        seen = seen[(seen >= 0) & (seen < vocab)]
        vals = out[seen]
        out[seen] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0):
        counts = np.bincount(np.asarray(output_ids, dtype=np.int64), minlength=vocab)[:vocab].astype(np.float32)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return out


def draw_noise(seed: int, step: int, vocab: int) -> np.ndarray:
    """[V] Exp(1) noise for generated-token index `step` of a request seeded `seed`."""
    key = np.array([seed & 0xFFFFFFFFFFFFFFFF, 0x6B64615F7274], dtype=np.uint64)  # second word: "kda_rt"
    gen = np.random.Generator(np.random.Philox(key=key, counter=np.array([step, 0, 0, 0], dtype=np.uint64)))
    return gen.standard_exponential(vocab, dtype=np.float32)


def _probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    x = logits.astype(np.float64) / params.temperature
    vocab = x.shape[0]
    if 0 < params.top_k < vocab:
        kth = np.partition(x, vocab - params.top_k)[vocab - params.top_k]
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        cut = int(np.searchsorted(cum, params.top_p, side="left")) + 1
        keep = np.zeros_like(p, dtype=bool)
        keep[order[:cut]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if params.min_p > 0.0:
        p = np.where(p >= params.min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def sample_row(logits: np.ndarray, params: SamplingParams, seed: int, step: int) -> int:
    """One token id from logits [V] (already penalised)."""
    if params.greedy:
        return int(np.argmax(logits))
    p = _probs(logits, params)
    noise = draw_noise(seed, step, p.shape[0]).astype(np.float64)
    return int(np.argmax(p / noise))


def top_logprobs(logits: np.ndarray, token_id: int, num: int) -> dict[int, float]:
    """log-softmax of the raw logits at the sampled token plus the `num` most likely tokens."""
    x = logits.astype(np.float64)
    m = x.max()
    logz = m + np.log(np.exp(x - m).sum())
    out = {int(token_id): float(x[token_id] - logz)}
    if num > 0:
        for t in np.argsort(-x, kind="stable")[:num]:
            out.setdefault(int(t), float(x[t] - logz))
    return out
