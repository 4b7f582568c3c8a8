"""KDA mixer: projections -> short conv -> gates -> decode step or chunked prefill -> gated norm -> out.

Per token (spec §3), with x the post-input_layernorm hidden state:

    q, k, v = SiLU(conv(x Wq^T)), SiLU(conv(x Wk^T)), SiLU(conv(x Wv^T))      per head [K]
    q <- l2norm(q) * K**-0.5,  k <- l2norm(k)
    g = -exp(A_log) * softplus(x Wfa^T Wfb^T + dt_bias)      beta = sigmoid(x Wb^T)
    o = delta rule (kda_core) with per-sequence state from the pool
    y = rmsnorm(o) * o_norm.weight * sigmoid(x Wga^T Wgb^T)  per head;    out = y Wo^T

Sequences in the flat batch are independent: each starts from zeros (context_lens == 0) or from its
state slot, and its final conv and recurrent state are written back to that slot.  A sequence with
one new token takes the token-by-token path, longer ones the chunked path (same math).

Letters: T tokens in the batch, D hidden size, H heads, K = V head dim, P = H*K, W conv width,
S state slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kda_rt.reference.kda_core import kda_chunked, kda_gate, kda_recurrent, l2norm, short_conv, sigmoid
from kda_rt.reference.params import Compute

if TYPE_CHECKING:
    from kda_rt.engine.batch import ForwardBatch
    from kda_rt.loader.config import KDAConfig
    from kda_rt.loader.schema import KDAWeights

__all__ = ["kda_forward"]

def kda_forward(
    w: KDAWeights,  # one layer's self_attn weights
    x: np.ndarray,  # [T, D] post-input_layernorm hidden states of the whole batch
    batch: ForwardBatch,
    conv_pool: np.ndarray,  # [S, 3, W-1, P] raw q|k|v projections, oldest first; updated in place
    rec_pool: np.ndarray,  # [S, H, K, V] recurrent states, rows = key channel; updated in place
    cfg: KDAConfig,
    rms_eps: float,
    num: Compute | None = None,  # compute dtype and bf16 rounding; default: x's dtype, no rounding
) -> np.ndarray:  # [T, D]
    num = num or Compute(x.dtype)
    p, dtype = num.w, num.dtype
    num_heads, head_dim, width = cfg.num_heads, cfg.head_dim, cfg.conv_kernel_size
    num_tokens = x.shape[0]
    x = x.astype(dtype, copy=False)

    act = num.act  # bf16 rounding points of the references (identity unless emulating bf16)
    raw = [act(num.dense(x, m)) for m in (w.q_proj, w.k_proj, w.v_proj)]  # 3 x [T, P]
    taps = [p(c).reshape(-1, width) for c in (w.q_conv1d, w.k_conv1d, w.v_conv1d)]  # 3 x [P, W]
    f = act(act(x @ p(w.f_a_proj).T) @ p(w.f_b_proj).T)
    g = kda_gate(f, p(w.A_log), p(w.dt_bias), num_heads)
    beta = sigmoid(act(x @ p(w.b_proj).T))  # [T, H]
    heads = (num_tokens, num_heads, head_dim)
    out_gate = act(act(x @ p(w.g_a_proj).T) @ p(w.g_b_proj).T).reshape(heads)  # [T, H, K]

    o = np.empty(heads, dtype=dtype)  # [T, H, V]
    scale = head_dim**-0.5
    cu = batch.cu_seqlens
    for b in range(batch.num_seqs):
        t0, t1 = int(cu[b]), int(cu[b + 1])
        n = t1 - t0
        slot = int(batch.state_slots[b])
        if batch.context_lens[b] == 0:
            conv_state = np.zeros(conv_pool.shape[1:], dtype=dtype)  # [3, W-1, P]
            state = np.zeros(rec_pool.shape[1:], dtype=dtype)  # [H, K, V]
        else:
            conv_state = conv_pool[slot].astype(dtype)
            state = rec_pool[slot].astype(dtype)
        # a prefix-cache snapshot (batch.snapshot): the state after the first `cut` tokens also goes to its slot
        cut, snap = (int(batch.snapshot[b, 0]), int(batch.snapshot[b, 1])) if batch.snapshot is not None else (0, -1)
        for lo, hi in ((0, cut), (cut, n)) if cut else ((0, n),):
            qkv = []
            for i in range(3):
                y, conv_state[i] = short_conv(raw[i][t0 + lo:t0 + hi], conv_state[i], taps[i])
                qkv.append(act(y).reshape(hi - lo, num_heads, head_dim))
            q = l2norm(qkv[0]) * scale
            k = l2norm(qkv[1])
            core = kda_recurrent if n == 1 else kda_chunked
            o[t0 + lo:t0 + hi], state = core(q, k, qkv[2], g[t0 + lo:t0 + hi], beta[t0 + lo:t0 + hi], state)
            if hi == cut:
                conv_pool[snap] = conv_state
                rec_pool[snap] = state
        conv_pool[slot] = conv_state
        rec_pool[slot] = state

    # Gated RMSNorm per head: norm first, weight shared across heads, then the sigmoid gate.
    o = act(o)
    normed = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + rms_eps)
    y = act(normed * p(w.o_norm) * sigmoid(out_gate))  # [T, H, V]
    return num.dense(y.reshape(num_tokens, -1), w.o_proj)
