"""Inputs, float64 reference and checks shared by the kda_prefill and kda_decode kernel tests
(tests/kernels/test_kda_prefill.py has the formula and tolerances).  CuPy is imported inside the
functions.  Letters: T tokens, B sequences, H heads, K = V = 128, P = H*K, W = 4, S slots.
"""

from __future__ import annotations

import numpy as np

from helpers.gpu import BF16, bf16_round, poison, rms_rel, to_np
from kda_rt.reference.kda_core import kda_gate, kda_recurrent, l2norm, short_conv, sigmoid

__all__ = ["EPS", "K", "W", "check", "make_inputs", "reference", "run_op", "upload"]

K, W, EPS = 128, 4, 1e-5


def make_inputs(rng, lengths, num_heads, gates="normal", num_slots=8, fresh=None):
    """Host inputs (float64 holding bf16 / fp32 values) and random pools; `fresh[b]` -> context_lens 0."""
    T, P = sum(lengths), num_heads * K
    fresh = [i % 2 == 0 for i in range(len(lengths))] if fresh is None else fresh
    dt = {"normal": rng.normal(size=P), "near_zero": np.full(P, -20.0), "extreme": rng.uniform(40, 300, size=P),
          "mixed": rng.choice([-20.0, 0.0, 300.0], size=P)}[gates]
    a_log = rng.uniform(np.log(4), np.log(16), size=num_heads) if gates in ("extreme", "mixed") else rng.uniform(-1, 1, size=num_heads)
    inp = dict(
        qkv=bf16_round(rng.normal(size=(T, 3 * P))), f=bf16_round(rng.normal(size=(T, P))),
        b=bf16_round(2 * rng.normal(size=(T, num_heads))), gate=bf16_round(rng.normal(size=(T, P))),
        conv_w=rng.normal(size=(3 * P, W)).astype(np.float32).astype(np.float64) * 0.5,
        A_log=a_log.astype(np.float32).astype(np.float64), dt_bias=dt.astype(np.float32).astype(np.float64),
        o_norm_w=(1 + 0.1 * rng.normal(size=K)).astype(np.float32).astype(np.float64),
        conv_pool=bf16_round(rng.normal(size=(num_slots, 3, W - 1, P))),
        rec_pool=(0.1 * rng.normal(size=(num_slots, num_heads, K, K))).astype(np.float32).astype(np.float64),
        cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        context_lens=np.array([0 if fr else 7 for fr in fresh], dtype=np.int32),
        state_slots=rng.permutation(num_slots)[: len(lengths)].astype(np.int32))
    return inp


def reference(inp, num_heads):
    """float64 mixer tail; returns out [T, P], conv_pool, rec_pool (copies, updated)."""
    P, cu = num_heads * K, inp["cu_seqlens"]
    conv_pool, rec_pool = inp["conv_pool"].copy(), inp["rec_pool"].copy()
    out = np.empty((cu[-1], P))
    for s in range(len(cu) - 1):
        t0, t1, slot = cu[s], cu[s + 1], inp["state_slots"][s]
        fresh = inp["context_lens"][s] == 0
        conv_state = np.zeros((3, W - 1, P)) if fresh else conv_pool[slot].copy()
        state = np.zeros((num_heads, K, K)) if fresh else rec_pool[slot]
        ys = []
        for i in range(3):
            y, conv_state[i] = short_conv(inp["qkv"][t0:t1, i * P:(i + 1) * P], conv_state[i],
                                          inp["conv_w"][i * P:(i + 1) * P])
            ys.append(bf16_round(y).reshape(t1 - t0, num_heads, K))
        g = kda_gate(inp["f"][t0:t1], inp["A_log"], inp["dt_bias"], num_heads)
        o, state = kda_recurrent(l2norm(ys[0]) * K**-0.5, l2norm(ys[1]), ys[2], g, sigmoid(inp["b"][t0:t1]), state)
        o = bf16_round(o)
        y = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + EPS) * inp["o_norm_w"]
        out[t0:t1] = (y * sigmoid(inp["gate"][t0:t1].reshape(t1 - t0, num_heads, K))).reshape(t1 - t0, P)
        conv_pool[slot], rec_pool[slot] = conv_state, state
    return out, conv_pool, rec_pool


def upload(inp):
    import cupy

    dev = {}
    for name, a in inp.items():
        if a.dtype == np.int32:
            dev[name] = cupy.asarray(a)
        elif name in ("qkv", "f", "b", "gate", "conv_pool"):
            dev[name] = cupy.asarray(a.astype(np.float32).astype(BF16))
        else:
            dev[name] = cupy.asarray(a.astype(np.float32))
    return dev


def run_op(op, dev, num_heads, out=None, stream=None, **variant):
    """op(dev inputs) into `out` (poisoned when allocated here); `variant`: extra keywords of the op
    (kda_decode's split / threads)."""
    import cupy

    if out is None:
        out = cupy.empty(dev["f"].shape, dtype=BF16)
        poison(out)
    args = [dev[n] for n in ("qkv", "f", "b", "gate", "conv_w", "A_log", "dt_bias", "o_norm_w", "conv_pool",
                             "rec_pool", "cu_seqlens", "context_lens", "state_slots")]
    return op(*args, num_heads=num_heads, head_dim=K, eps=EPS, out=out, stream=stream, **variant)


def check(out, dev, ref, inp, tag, *, out_tol=5e-3, state_tol=1e-4, windows=0):
    """Compare out / pools with the reference; returns the measured errors (printed by the tests).
    Defaults: the decode kernel's fp32 bounds; `windows` > 0 also checks out per window of that many
    tokens along T (long prefills: error must not grow with position)."""
    ref_out, ref_conv, ref_rec = ref
    got = to_np(out)
    err_out = rms_rel(got, ref_out)
    conv, rec = to_np(dev["conv_pool"]), to_np(dev["rec_pool"])
    used = set(inp["state_slots"].tolist())
    err_state = max(rms_rel(rec[s], ref_rec[s]) for s in used)
    print(f"{tag}: out rms_rel {err_out:.2e}, max abs {np.max(np.abs(got - ref_out)):.2e}, "
          f"state rms_rel {err_state:.2e}")
    for t0 in range(0, got.shape[0] if windows else 0, windows or 1):
        w_got, w_ref = got[t0:t0 + windows], ref_out[t0:t0 + windows]
        w_rms = rms_rel(w_got, w_ref)
        w_max = float(np.max(np.abs(w_got - w_ref)) / max(np.sqrt(np.mean(w_ref**2)), 1e-30))
        print(f"  tokens {t0:6d}..{t0 + len(w_got):6d}: rms_rel {w_rms:.2e}, max abs / rms(ref) {w_max:.2e}")
        assert w_rms <= out_tol, f"{tag}: window at {t0}: out rms_rel {w_rms:.3e}"
    assert err_out <= out_tol, f"{tag}: out rms_rel {err_out:.3e}, max abs {np.max(np.abs(got - ref_out)):.3e}"
    assert err_state <= state_tol, f"{tag}: state rms_rel {err_state:.3e}"
    for s in range(conv.shape[0]):
        if s in used:
            assert np.array_equal(conv[s], ref_conv[s]), f"{tag}: conv state of slot {s} differs"
        else:
            assert np.array_equal(conv[s], inp["conv_pool"][s]) and np.array_equal(rec[s], inp["rec_pool"][s]), \
                f"{tag}: slot {s} is not in the batch but changed"
    return err_out, err_state
