"""NumPy sampling: the reference (and CPU) implementation of `kernels_cu/sampling.cu`.

Order per row, as in vLLM: logit_bias, then repetition / frequency / presence penalties on the biased logits,
min_tokens and bad_words bans, allowed_token_ids and the structured-output mask (disallowed tokens -> -inf; these
commute with the penalties),
then greedy argmax, or temperature -> top-k and min-p -> top-p over the renormalised rest -> draw.  Logprobs
are those of these processed logits (before temperature): a constrained row reports a distribution over the
tokens its grammar allows.  The draw is argmax(probs / e) with e ~ Exp(1) from a counter-based Philox-4x32-10
stream keyed by (seed, step), so a request with a seed gets the same tokens whatever else is in the batch, on
either backend.
"""

from __future__ import annotations

import numpy as np

from .batch import SamplingBatch, StepOutput
from .params import SamplingParams

__all__ = ["apply_penalties", "nonfinite_error", "penalty_error", "allowed_tokens", "sample_row", "sample_rows",
           "draw_noise", "draw_noise_at", "philox4x32_10", "top_logprobs"]


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
        # float32 throughout, rounded as the GPU sampler rounds (sampling.cu penalties_only):
        # x - (f c + (c > 0 ? p : 0))
        f32 = np.float32
        out -= f32(params.frequency_penalty) * counts + np.where(counts > 0, f32(params.presence_penalty), f32(0))
    return out


def allowed_tokens(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """[V] bool of a [ceil(V / 32)] int32 bitmask (token t is bit t % 32 of word t // 32; llguidance's layout)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask, dtype=np.int32).view(np.uint8), bitorder="little")
    out = np.zeros(vocab, dtype=bool)
    n = min(vocab, bits.shape[0])
    out[:n] = bits[:n].astype(bool)
    return out


_M32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(c0, c1, c2, c3, k0: int, k1: int):
    """Philox-4x32-10 (Salmon et al. 2011) on uint64 arrays holding 32-bit words; returns the four
    output words.  The same generator as kernels_cu/sampling.cu."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _M32 for c in (c0, c1, c2, c3))
    k0, k1 = np.uint64(k0) & _M32, np.uint64(k1) & _M32
    for r in range(10):
        if r:
            k0, k1 = (k0 + np.uint64(0x9E3779B9)) & _M32, (k1 + np.uint64(0xBB67AE85)) & _M32
        p0, p1 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _M32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _M32
    return c0, c1, c2, c3


def draw_noise_at(seed: int, step: int, tokens: np.ndarray, vocab: int) -> np.ndarray:
    """draw_noise(seed, step, vocab)[tokens] (tokens ascending), generating only the Philox blocks they need when
    they are few."""
    if 4 * len(tokens) > vocab:
        return draw_noise(seed, step, vocab)[tokens]
    seed &= 0xFFFFFFFFFFFFFFFF
    tokens = np.asarray(tokens, dtype=np.int64)
    words = np.stack(philox4x32_10((tokens // 4).astype(np.uint64), step, 0, 0, seed & 0xFFFFFFFF, seed >> 32), axis=1)
    w = words[np.arange(len(tokens)), tokens % 4]
    u = ((w >> np.uint64(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-23)
    return -np.log(u.astype(np.float64))


def draw_noise(seed: int, step: int, vocab: int) -> np.ndarray:
    """[V] float64 Exp(1) noise for generated-token index `step` of a request seeded `seed`:
    key = seed's two 32-bit halves, counter = (token // 4, step, 0, 0), word token % 4;
    U = ((w >> 9) + 0.5) * 2^-23 (exact in float32, never 0 or 1), E = -log U.  Bit-identical
    uniforms to the GPU sampler, so both backends draw the same tokens for the same seed."""
    seed &= 0xFFFFFFFFFFFFFFFF
    groups = np.arange((vocab + 3) // 4, dtype=np.uint64)
    words = np.stack(philox4x32_10(groups, step, 0, 0, seed & 0xFFFFFFFF, seed >> 32), axis=1).reshape(-1)[:vocab]
    u = ((words >> np.uint64(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-23)
    return -np.log(u.astype(np.float64))


def _probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    x = logits.astype(np.float64) / params.temperature
    vocab = x.shape[0]
    if 0 < params.top_k < vocab:
        kth = np.partition(x, vocab - params.top_k)[vocab - params.top_k]
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    # min_p before top_p, as vLLM's v1 sampler: top_p's cumulative mass is over what top_k and min_p keep
    if params.min_p > 0.0:
        p = np.where(p >= params.min_p * p.max(), p, 0.0)
        p /= p.sum()
    if params.top_p < 1.0:
        p = np.where(_top_p_keep(p, params.top_p), p, 0.0)
        p /= p.sum()
    return p


def _top_p_keep(p: np.ndarray, top_p: float) -> np.ndarray:
    """[V] bool: the smallest prefix of p's stable descending order (larger first, lower index on ties) whose
    cumulative mass (summed in that order) reaches top_p; always at least one token.  Looked for among the k
    largest first (1024, then 8192: a peaked distribution's prefix is short), which gives the full sort's prefix and
    sums term for term whenever the prefix ends above the k-th largest value (every larger token is among the k,
    in the same order); otherwise, and for wide prefixes, the whole row is sorted."""
    vocab = p.shape[0]
    keep = np.zeros(vocab, dtype=bool)
    for k in (1024, 8192):
        if 4 * k > vocab:
            break
        cand = np.argpartition(-p, k - 1)[:k]
        order = cand[np.lexsort((cand, -p[cand]))]
        cum = np.cumsum(p[order])
        cut = int(np.searchsorted(cum, top_p, side="left")) + 1
        if cut <= k and p[order[cut - 1]] > p[order[-1]]:
            keep[order[:cut]] = True
            return keep
    order = np.argsort(-p, kind="stable")
    cum = np.cumsum(p[order])
    cut = int(np.searchsorted(cum, top_p, side="left")) + 1
    keep[order[:cut]] = True
    return keep


def sample_row(logits: np.ndarray, params: SamplingParams, seed: int, step: int) -> int:
    """One token id from logits [V] (already penalised)."""
    if params.greedy:
        return int(np.argmax(logits))
    p = _probs(logits, params)
    kept = np.flatnonzero(p > 0)  # (a dropped token's p / E is 0: it never wins; ascending, so ties go lower)
    return int(kept[np.argmax(p[kept] / draw_noise_at(seed, step, kept, p.shape[0]))])


def top_logprobs(logits: np.ndarray, token_id: int, num: int) -> dict[int, float]:
    """log-softmax of the raw logits at the sampled token plus the `num` most likely tokens."""
    x = logits.astype(np.float64)
    m = x.max()
    logz = m + np.log(np.exp(x - m).sum())
    out = {int(token_id): float(x[token_id] - logz)}
    if num > 0:
        for t in _top_indices(x, num):
            if np.isfinite(x[t]):  # masked or banned tokens are not listed (-inf is not JSON)
                out.setdefault(int(t), float(x[t] - logz))
    return out


def _top_indices(x: np.ndarray, num: int) -> np.ndarray:
    """np.argsort(-x, kind="stable")[:num] without sorting the row: the values above the num-th largest, sorted (lower
    index first on ties), then the lowest indices of those equal to it."""
    vocab = x.shape[0]
    if num >= vocab:
        return np.argsort(-x, kind="stable")
    t = np.partition(x, vocab - num)[vocab - num]
    above = np.flatnonzero(x > t)
    above = above[np.lexsort((above, -x[above]))]
    return np.concatenate([above, np.flatnonzero(x == t)[: num - len(above)]])


def nonfinite_error(step: int) -> str:
    """The error of a row whose raw logits hold NaN or inf (checked before anything else)."""
    return f"non-finite logits (NaN or inf) from the model at output token {step}"


def penalty_error(step: int) -> str:
    """The error of a row whose logits are finite but not after its penalties (an overflow)."""
    return f"non-finite logits after penalties at output token {step}"


def sample_rows(logits, batch: SamplingBatch, rows, out: StepOutput) -> None:
    """Sample `rows` on the host into `out` (the same row indices); `logits[i]` is row i's [V]
    logits (an [N, V] array, or a {row: [V]} dict holding only `rows`).  logit_bias,
    penalties, min_tokens and bad_words bans, allowed_token_ids, the grammar mask, then `sample_row`; a row with NaN or inf logits,
    or with every token masked, gets an error instead."""
    for i in rows:
        x, p = logits[i], batch.params[i]
        step = int(batch.steps[i])
        if not np.isfinite(x).all():
            out.errors[i] = nonfinite_error(step)
            continue
        vocab = x.shape[0]
        bias = batch.logit_bias[i]
        if bias is not None:  # before the penalties, as vLLM: a repetition penalty acts on the biased logit
            keep = bias[0] < vocab
            x = x.astype(np.float32, copy=True)
            np.add.at(x, bias[0][keep], bias[1][keep])
        if batch.history[i] is not None:
            x = apply_penalties(x, p, *batch.history[i])
            if not np.isfinite(x).all():
                out.errors[i] = penalty_error(step)
                continue
        banned = [t for t in batch.banned[i] if t < vocab]
        if banned:
            x = x.copy()
            x[banned] = -np.inf
        if p.allowed_token_ids is not None:  # only these (vLLM's allowed_token_ids)
            ids = p.allowed_ids_array
            keep = np.zeros(vocab, dtype=bool)
            keep[ids[ids < vocab]] = True
            x = np.where(keep, x, -np.inf).astype(np.float32)
        mask = batch.allowed[i]
        if mask is not None:
            x = np.where(allowed_tokens(mask, vocab), x, -np.inf).astype(np.float32)
        restricted = mask is not None or banned or bias is not None or p.allowed_token_ids is not None
        if restricted and not np.isfinite(x).any():
            out.errors[i] = (f"no token is allowed at output token {step} (the grammar, the bans of stop_token_ids "
                             "and EOS under min_tokens, bad_words, allowed_token_ids and logit_bias exclude all)")
            continue
        token = sample_row(x, p, int(batch.seeds[i]), step)
        out.token_ids[i] = token
        if batch.num_logprobs[i] >= 0:
            out.logprobs[i] = top_logprobs(x, token, int(batch.num_logprobs[i]))
