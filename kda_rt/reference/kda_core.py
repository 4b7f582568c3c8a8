"""KDA math on one sequence: short conv, l2norm, forget gate, and the gated delta rule.

Recurrence (spec §3.6), per head, state S [K, V] with rows = key channels:

    S <- diag(exp(g_t)) S                    1) decay every key row
    r  = S^T k_t                             2) predict with the decayed state
    S <- S + beta_t k_t (v_t - r)^T          3) delta-rule write
    o_t = S^T q_t                            4) read after the write

`kda_chunked` computes the same thing 64 tokens at a time in the WY / UT form (spec §3.7).
Inside a chunk, with G_r = sum_{i<=r} g_i (per key channel) and E[r, s] = exp(G_r - G_s) for
s <= r (0 above the diagonal):

    A_kk[r, s] = beta_r sum_d k_r k_s E[r, s]     (s < r)      T = (I + A_kk)^-1
    W = T (beta * exp(G) * k)        U = T (beta * v)        V_new = U - W S0
    O = (q * exp(G)) S0 + A_qk V_new,   A_qk[r, s] = sum_d q_r k_s E[r, s]   (s <= r)
    S_next = diag(exp(G_last)) S0 + (exp(G_last - G) * k)^T V_new

Every exponent above is of a quantity <= 0: E is never factorised as exp(G_r) * exp(-G_s) (which
overflows for gates of -300 per step).  Inside a 16-row sub-block E is element-wise, its exponent
masked to -inf above the diagonal before the exp; below the sub-block it is split at the block's
first row n, exp(G_r - G_n) * exp(G_n - G_s), both <= 1, which turns it into matmuls.  Exponents
are direct sums of gates, never differences of cumulative sums: in float32 those cancel the small
gates that follow a huge one (~1e-5 relative error).  All math runs in the dtype of the inputs
(float32 at run time, float64 in tests).

Letters: T tokens of one sequence, H heads, K key dim, V value dim, C conv channels, W conv width,
L chunk length.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SUB_CHUNK", "kda_chunked", "kda_gate", "kda_recurrent", "l2norm", "short_conv", "sigmoid", "silu"]

SUB_CHUNK = 16  # rows per element-wise diagonal block inside a chunk (as fla)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)), via logaddexp so that large |x| neither overflows nor warns."""
    return np.exp(-np.logaddexp(0.0, -x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x / sqrt(sum(x**2) + eps) over the last axis (eps inside the sqrt, as fla and transformers)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def kda_gate(
    f: np.ndarray,  # [T, H*K] forget-gate projection (f_b_proj output)
    A_log: np.ndarray,  # [H] (any shape holding H values, e.g. the checkpoint's [1, 1, H, 1])
    dt_bias: np.ndarray,  # [H*K]
    num_heads: int,
) -> np.ndarray:  # [T, H, K]
    """g = -exp(A_log[h]) * softplus(f + dt_bias), softplus(z) = z for z > 20 (spec §3.4); g <= 0."""
    z = (f + dt_bias).reshape(f.shape[0], num_heads, -1)
    softplus = np.where(z > 20.0, z, np.logaddexp(0.0, z))
    decay_rate = np.exp(np.asarray(A_log, dtype=f.dtype).reshape(num_heads))
    return -decay_rate[None, :, None] * softplus


def short_conv(
    x: np.ndarray,  # [T, C] raw (pre-conv) projections of the new tokens
    conv_state: np.ndarray,  # [W-1, C] previous W-1 raw inputs, oldest first (zeros for a new sequence)
    weight: np.ndarray,  # [C, W] depthwise taps; tap W-1 multiplies the current token
) -> tuple[np.ndarray, np.ndarray]:  # y [T, C], new conv_state [W-1, C]
    """y_t = SiLU(sum_j weight[:, j] * x_{t-(W-1)+j}), causal and depthwise (spec §3.2)."""
    num_tokens, width = x.shape[0], weight.shape[1]
    padded = np.concatenate([conv_state.astype(x.dtype, copy=False), x], axis=0)  # [W-1+T, C]
    u = np.zeros_like(x)
    for j in range(width):
        u += weight[:, j] * padded[j : j + num_tokens]
    new_state = padded[padded.shape[0] - (width - 1) :].copy()
    return silu(u), new_state


def kda_recurrent(
    q: np.ndarray,  # [T, H, K] l2-normalised and scaled by K**-0.5
    k: np.ndarray,  # [T, H, K] l2-normalised
    v: np.ndarray,  # [T, H, V]
    g: np.ndarray,  # [T, H, K] log decay, <= 0
    beta: np.ndarray,  # [T, H]
    state: np.ndarray,  # [H, K, V] state entering the first token
) -> tuple[np.ndarray, np.ndarray]:  # o [T, H, V], final state [H, K, V]
    """Token-by-token delta rule, all heads at once; the decode path and the definition of correctness."""
    s = state.astype(q.dtype, copy=True)
    o = np.empty(v.shape, dtype=q.dtype)
    for t in range(q.shape[0]):
        s *= np.exp(g[t])[:, :, None]  # 1) decay
        r = np.matmul(k[t][:, None, :], s)[:, 0]  # 2) [H, V] prediction S^T k
        s += (beta[t][:, None] * (v[t] - r))[:, None, :] * k[t][:, :, None]  # 3) write
        o[t] = np.matmul(q[t][:, None, :], s)[:, 0]  # 4) read S^T q
    return o, s


def _exclusive_suffix_sum(g: np.ndarray) -> np.ndarray:  # [H, n, K] -> [H, n, K]
    """out[s] = sum_{i > s} g[i], summed directly (no total - prefix cancellation)."""
    out = np.zeros_like(g)
    out[:, :-1] = np.cumsum(g[:, :0:-1], axis=1)[:, ::-1]
    return out


def _chunk_scores(
    q: np.ndarray,  # [H, L, K]
    k: np.ndarray,  # [H, L, K]
    g: np.ndarray,  # [H, L, K]
    sub: int,
) -> tuple[np.ndarray, np.ndarray]:  # qk [H, L, L] (s <= r), kk [H, L, L] (s < r)
    """qk[r, s] = sum_d q_r k_s E[r, s] and kk[r, s] = sum_d k_r k_s E[r, s], by sub-blocks of rows.

    Rows r in block [n, n+sub) against columns s < n use the reference row n:
    E[r, s] = exp(G_r - G_n) * exp(G_n - G_s), both factors <= 1, so that part is two scaled
    matmuls.  The diagonal block takes E element-wise: G_r - G_s summed over s < i <= r (a matmul
    with a 0/1 mask), set to -inf above the diagonal before the exp.
    """
    num_heads, length, head_dim = q.shape
    qk = np.zeros((num_heads, length, length), dtype=q.dtype)
    kk = np.zeros_like(qk)
    idx = np.arange(sub)
    causal = idx[None, :] <= idx[:, None]  # [sub(r), sub(s)] s <= r
    strict = idx[None, :] < idx[:, None]  # [sub(r), sub(s)] s < r
    # between[r, s, i] = 1 where s < i <= r: a matmul with it sums exactly the gates of each pair
    r, s, i = idx[:, None, None], idx[None, :, None], idx[None, None, :]
    between = ((s < i) & (i <= r)).reshape(sub * sub, sub).astype(q.dtype)  # [sub*sub, sub]
    for n in range(0, length, sub):
        rows = slice(n, n + sub)
        q_b, k_b, g_b = q[:, rows], k[:, rows], g[:, rows]  # [H, sub, K]
        diff = np.matmul(between, g_b).reshape(num_heads, sub, sub, head_dim)  # [H, r, s, K] G_r - G_s
        k_decay = np.exp(np.where(causal[None, :, :, None], diff, -np.inf)) * k_b[:, None, :, :]
        qk[:, rows, rows] = np.matmul(k_decay, q_b[:, :, :, None])[..., 0]
        kk[:, rows, rows] = np.where(strict[None], np.matmul(k_decay, k_b[:, :, :, None])[..., 0], 0.0)
        if n == 0:
            continue
        to_row = np.zeros_like(g_b)  # [H, sub, K] G_r - G_n = sum_{n < i <= r} g_i
        to_row[:, 1:] = np.cumsum(g_b[:, 1:], axis=1)
        from_col = _exclusive_suffix_sum(g[:, : n + 1])[:, :n]  # [H, n, K] G_n - G_s = sum_{s < i <= n} g_i
        right = np.swapaxes(k[:, :n] * np.exp(from_col), 1, 2)  # [H, K, n]
        qk[:, rows, :n] = np.matmul(q_b * np.exp(to_row), right)
        kk[:, rows, :n] = np.matmul(k_b * np.exp(to_row), right)
    return qk, kk


def kda_chunked(
    q: np.ndarray,  # [T, H, K] l2-normalised and scaled by K**-0.5
    k: np.ndarray,  # [T, H, K] l2-normalised
    v: np.ndarray,  # [T, H, V]
    g: np.ndarray,  # [T, H, K] log decay, <= 0
    beta: np.ndarray,  # [T, H]
    state: np.ndarray,  # [H, K, V]
    chunk_size: int = 64,
) -> tuple[np.ndarray, np.ndarray]:  # o [T, H, V], final state [H, K, V]
    """Chunked WY / UT form of `kda_recurrent` (same outputs), vectorised over heads."""
    dtype = q.dtype
    num_tokens, num_heads, _ = q.shape
    num_padded = -(-num_tokens // chunk_size) * chunk_size
    sub = SUB_CHUNK if chunk_size % SUB_CHUNK == 0 else chunk_size

    def heads_first(x: np.ndarray) -> np.ndarray:  # [T, H, ...] -> [H, T_padded, ...], zero tail
        out = np.zeros((num_heads, num_padded, *x.shape[2:]), dtype=dtype)
        out[:, :num_tokens] = np.moveaxis(x, 0, 1)
        return out

    # The zero tail (g = 0, beta = 0, k = v = q = 0) leaves the state untouched; its outputs are dropped.
    q_h, k_h, v_h, g_h, beta_h = (heads_first(x) for x in (q, k, v, g, beta))  # [H, Tp, K|V] and [H, Tp]
    s = state.astype(dtype, copy=True)  # [H, K, V]
    o_h = np.empty((num_heads, num_padded, v.shape[2]), dtype=dtype)  # [H, Tp, V]
    eye = np.eye(chunk_size, dtype=dtype)
    for c0 in range(0, num_padded, chunk_size):
        span = slice(c0, c0 + chunk_size)
        q_c, k_c, v_c, g_c, b_c = q_h[:, span], k_h[:, span], v_h[:, span], g_h[:, span], beta_h[:, span]
        a_qk, a_kk = _chunk_scores(q_c, k_c, g_c, sub)  # [H, L, L] each
        a_kk *= b_c[:, :, None]
        # I + A_kk is unit lower triangular with |entries| < 1, so LU does no pivoting and the
        # solve is exact forward substitution.
        lhs = eye[None] + a_kk  # [H, L, L]
        decay_in = np.exp(np.cumsum(g_c, axis=1))  # [H, L, K] exp(G_r), decay since the chunk start
        w = np.linalg.solve(lhs, b_c[:, :, None] * decay_in * k_c)  # [H, L, K]
        u = np.linalg.solve(lhs, b_c[:, :, None] * v_c)  # [H, L, V]
        v_new = u - np.matmul(w, s)  # [H, L, V]
        o_h[:, span] = np.matmul(q_c * decay_in, s) + np.matmul(a_qk, v_new)
        k_tail = np.exp(_exclusive_suffix_sum(g_c)) * k_c  # [H, L, K] exp(G_last - G_s) * k_s
        s = decay_in[:, -1][:, :, None] * s + np.matmul(np.swapaxes(k_tail, 1, 2), v_new)
    return np.moveaxis(o_h[:, :num_tokens], 0, 1).copy(), s
