"""Float64 gold reference for KDA: a plain per-token, per-head loop, independent of kda_rt.

For each token t and head h (spec §3.6), with S [K, V] (rows = key channel):

    S = diag(exp(g[t, h])) @ S
    r = S.T @ k[t, h]
    S = S + beta[t, h] * outer(k[t, h], v[t, h] - r)
    o[t, h] = S.T @ q[t, h]

`kda_layer_ref` runs the whole mixer (spec §3.1-3.8) for one sequence from its hub-named weights,
again one token at a time, with the conv written as an explicit window over past raw inputs.

Letters: T tokens, H heads, K key dim, V value dim, D hidden size, P = H*K, W conv width.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["kda_layer_ref", "kda_recurrence_ref"]


def kda_recurrence_ref(
    q: np.ndarray,  # [T, H, K] normalised and scaled
    k: np.ndarray,  # [T, H, K] normalised
    v: np.ndarray,  # [T, H, V]
    g: np.ndarray,  # [T, H, K]
    beta: np.ndarray,  # [T, H]
    state: np.ndarray,  # [H, K, V]
) -> tuple[np.ndarray, np.ndarray]:  # o [T, H, V], final state [H, K, V]
    q, k, v, g, beta = (np.asarray(a, dtype=np.float64) for a in (q, k, v, g, beta))
    num_tokens, num_heads = q.shape[:2]
    states = [np.array(state[h], dtype=np.float64) for h in range(num_heads)]
    o = np.zeros((num_tokens, num_heads, v.shape[2]))
    for t in range(num_tokens):
        for h in range(num_heads):
            s = np.diag(np.exp(g[t, h])) @ states[h]
            r = s.T @ k[t, h]
            s = s + beta[t, h] * np.outer(k[t, h], v[t, h] - r)
            o[t, h] = s.T @ q[t, h]
            states[h] = s
    return o, np.stack(states)


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def _softplus(z: float) -> float:
    return z if z > 20.0 else math.log1p(math.exp(z))


def kda_layer_ref(
    weights: dict[str, np.ndarray],  # hub names without the 'model.layers.N.self_attn.' prefix
    x: np.ndarray,  # [T, D] post-input_layernorm hidden states of one sequence
    num_heads: int,
    head_dim: int,
    rms_eps: float,
    conv_history: np.ndarray | None = None,  # [3, W-1, P] raw q|k|v inputs before x (None: zeros)
    state: np.ndarray | None = None,  # [H, K, V] (None: zeros)
) -> tuple[np.ndarray, np.ndarray]:  # out [T, D], final state [H, K, V]
    w = {name: np.asarray(a, dtype=np.float64) for name, a in weights.items()}
    x = np.asarray(x, dtype=np.float64)
    num_tokens = x.shape[0]
    taps = [w[f"{n}_conv1d.weight"][:, 0, :] for n in "qkv"]  # 3 x [P, W]
    width = taps[0].shape[1]
    raw = [x @ w[f"{n}_proj.weight"].T for n in "qkv"]  # 3 x [T, P]
    if conv_history is not None:  # prepend the cached raw inputs so the window can reach them
        raw = [np.concatenate([np.asarray(conv_history[i], dtype=np.float64), raw[i]]) for i in range(3)]
    offset = raw[0].shape[0] - num_tokens
    decay_rate = np.exp(w["A_log"].reshape(num_heads))
    s = np.zeros((num_heads, head_dim, head_dim)) if state is None else np.array(state, dtype=np.float64)
    out = np.zeros((num_tokens, w["o_proj.weight"].shape[0]))
    for t in range(num_tokens):
        conv = []
        for i in range(3):  # u[c] = sum_j tap[c, j] * raw[t - (W-1) + j, c], zeros before the start
            u = np.zeros(raw[i].shape[1])
            for j in range(width):
                src = offset + t - (width - 1) + j
                if src >= 0:
                    u += taps[i][:, j] * raw[i][src]
            conv.append(u * np.array([_sigmoid(z) for z in u]))
        f = x[t] @ w["f_a_proj.weight"].T @ w["f_b_proj.weight"].T + w["dt_bias"]
        gate = x[t] @ w["g_a_proj.weight"].T @ w["g_b_proj.weight"].T
        b_logit = x[t] @ w["b_proj.weight"].T
        y = np.zeros(num_heads * head_dim)
        for h in range(num_heads):
            cols = slice(h * head_dim, (h + 1) * head_dim)
            q = conv[0][cols] / math.sqrt(float(conv[0][cols] @ conv[0][cols]) + 1e-6) / math.sqrt(head_dim)
            k = conv[1][cols] / math.sqrt(float(conv[1][cols] @ conv[1][cols]) + 1e-6)
            v = conv[2][cols]
            g = np.array([-decay_rate[h] * _softplus(z) for z in f[cols]])
            beta = _sigmoid(float(b_logit[h]))
            s[h] = np.diag(np.exp(g)) @ s[h]
            s[h] = s[h] + beta * np.outer(k, v - s[h].T @ k)
            o = s[h].T @ q
            normed = o / math.sqrt(float(np.mean(o * o)) + rms_eps)
            y[cols] = normed * w["o_norm.weight"] * np.array([_sigmoid(z) for z in gate[cols]])
        out[t] = w["o_proj.weight"] @ y
    return out, s
