"""KDA tests: chunked == token-by-token == float64 gold, short-conv state carry, the mixer's varlen
and prefill/decode state handling, and parity with transformers' KimiLinearDeltaAttention.

Gold recurrence (tests/helpers/kda_ref.py), per token and head, S [K, V]:
    S = diag(exp(g)) S;  S += beta k (v - S^T k)^T;  o = S^T q
Errors are relative to the reference's scale: max|out - ref| / max|ref|, and the output error is
also reported per window of 32 tokens so that drift along T would show.

Letters: T tokens, H heads, K key dim, V value dim, D hidden size, P = H*K, W conv width, S slots.
Run: python -m pytest tests/model/test_kda.py -q -s   (or PYTHONPATH=tests python tests/model/test_kda.py)
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.kda_ref import kda_layer_ref, kda_recurrence_ref
from kda_rt.engine.batch import ForwardBatch
from kda_rt.loader.config import KDAConfig
from kda_rt.loader.schema import KDAWeights, Reader
from kda_rt.reference.kda import kda_forward
from kda_rt.reference.kda_core import kda_chunked, kda_gate, kda_recurrent, l2norm, short_conv, sigmoid

TOL = 1e-10  # float64 everywhere
WINDOW = 32


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-300))


def window_errs(out: np.ndarray, ref: np.ndarray) -> list[float]:  # [T, ...] -> per window of WINDOW tokens
    scale = max(np.max(np.abs(ref)), 1e-300)
    return [
        float(np.max(np.abs(out[i : i + WINDOW] - ref[i : i + WINDOW])) / scale) for i in range(0, len(ref), WINDOW)
    ]


# ---------------------------------------------------------------------------------------------
# core recurrence


def gate_params(case: str, rng: np.random.Generator, num_heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(A_log [1, 1, H, 1], dt_bias [H*K]) that put g = -exp(A_log) softplus(f + dt_bias) in a regime."""
    p = num_heads * head_dim
    if case == "normal":  # decay rates 1..16, g mostly in [-20, -0.1]
        a_log, dt_bias = np.log(rng.uniform(1.0, 16.0, num_heads)), rng.normal(0.0, 1.0, p)
    elif case == "tiny":  # g ~ -1e-9: almost no decay, pure delta rule
        a_log, dt_bias = np.full(num_heads, -20.0), rng.normal(0.0, 1.0, p)
    elif case == "strong":  # g <= -100 on every channel: each token nearly wipes the state
        a_log, dt_bias = np.full(num_heads, np.log(16.0)), rng.uniform(12.0, 30.0, p)
    elif case == "mixed":  # per channel: tiny, normal or hugely negative, side by side
        a_log = np.log(rng.uniform(1.0, 16.0, num_heads))
        dt_bias = rng.choice([-30.0, 0.0, 40.0], size=p) + rng.normal(0.0, 1.0, p)
    else:
        raise ValueError(case)
    return a_log.reshape(1, 1, num_heads, 1), dt_bias


def make_inputs(num_tokens: int, gate: str, seed: int = 0, num_heads: int = 2, head_dim: int = 16, v_dim: int = 8):
    """Seeded q, k, v, g, beta, state for the core: q, k normalised (q scaled), g from `kda_gate`."""
    rng = np.random.default_rng([seed, num_tokens])
    shape = (num_tokens, num_heads, head_dim)
    q = l2norm(rng.normal(size=shape)) * head_dim**-0.5
    k = l2norm(rng.normal(size=shape))
    v = rng.normal(size=(num_tokens, num_heads, v_dim))
    a_log, dt_bias = gate_params(gate, rng, num_heads, head_dim)
    f = rng.normal(size=(num_tokens, num_heads * head_dim))
    if gate == "mixed":  # also whole tokens that reset or keep everything
        f[rng.random(num_tokens) < 0.1] += 60.0
        f[rng.random(num_tokens) < 0.1] -= 60.0
    g = kda_gate(f, a_log, dt_bias, num_heads)
    beta = sigmoid(rng.normal(size=(num_tokens, num_heads)))
    state = rng.normal(size=(num_heads, head_dim, v_dim))
    return q, k, v, g, beta, state


LENGTHS = [1, 63, 64, 65, 150, 200]
GATES = ["normal", "tiny", "strong", "mixed"]


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("num_tokens", LENGTHS, ids=lambda n: f"T{n}")
def test_chunked_and_recurrent_match_gold(num_tokens: int, gate: str) -> None:
    q, k, v, g, beta, state = make_inputs(num_tokens, gate)
    if gate == "strong":
        assert g.max() <= -100.0
    if gate == "tiny":
        assert -1e-6 < g.min() and g.max() < 0.0
    o_ref, s_ref = kda_recurrence_ref(q, k, v, g, beta, state)
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # underflow to 0 is expected
        o_rec, s_rec = kda_recurrent(q, k, v, g, beta, state)
        o_chk, s_chk = kda_chunked(q, k, v, g, beta, state)
    errs = {
        "rec.o": rel_err(o_rec, o_ref),
        "rec.S": rel_err(s_rec, s_ref),
        "chunk.o": rel_err(o_chk, o_ref),
        "chunk.S": rel_err(s_chk, s_ref),
    }
    windows = window_errs(o_chk, o_ref)
    print(f"T{num_tokens}-{gate}: " + " ".join(f"{n}={e:.1e}" for n, e in errs.items()))
    print(f"  chunk.o per {WINDOW}-token window: " + " ".join(f"{e:.1e}" for e in windows))
    assert np.all(np.isfinite(o_chk)) and np.all(np.isfinite(s_chk))
    assert max(errs.values()) <= TOL, errs
    assert max(windows) <= TOL, windows


@pytest.mark.parametrize("chunk_size", [1, 16, 128], ids=lambda c: f"chunk{c}")
def test_chunk_size_does_not_change_result(chunk_size: int) -> None:
    q, k, v, g, beta, state = make_inputs(100, "mixed", seed=3)
    o_ref, s_ref = kda_recurrence_ref(q, k, v, g, beta, state)
    o, s = kda_chunked(q, k, v, g, beta, state, chunk_size=chunk_size)
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL


@pytest.mark.parametrize("gate", GATES)
def test_float32_stays_float32_and_close(gate: str) -> None:
    """float32 run vs float64 gold.  1e-6 catches G_r - G_s taken as a difference of cumulative sums:
    after a -300 gate that cancellation alone costs ~1e-5 on 'mixed'."""
    q, k, v, g, beta, state = make_inputs(200, gate, seed=1)
    o_ref, s_ref = kda_recurrence_ref(q, k, v, g, beta, state)
    args32 = [a.astype(np.float32) for a in (q, k, v, g, beta, state)]
    for core in (kda_recurrent, kda_chunked):
        o, s = core(*args32)
        assert o.dtype == np.float32 and s.dtype == np.float32
        errs = rel_err(o, o_ref), rel_err(s, s_ref)
        print(f"float32 {core.__name__} {gate}: o={errs[0]:.1e} S={errs[1]:.1e}")
        assert max(errs) <= 1e-6, (core.__name__, errs)


def test_gate_formula_and_threshold() -> None:
    rng = np.random.default_rng(7)
    num_heads, head_dim = 3, 4
    f = rng.normal(0.0, 15.0, size=(5, num_heads * head_dim))
    a_log = rng.normal(size=(1, 1, num_heads, 1))
    dt_bias = rng.normal(size=num_heads * head_dim)
    g = kda_gate(f, a_log, dt_bias, num_heads)
    z = (f + dt_bias).reshape(5, num_heads, head_dim)
    softplus = np.where(z > 20.0, z, np.log1p(np.exp(np.minimum(z, 20.0))))
    assert g.shape == (5, num_heads, head_dim)
    np.testing.assert_allclose(g, -np.exp(a_log.reshape(1, num_heads, 1)) * softplus, rtol=1e-14, atol=0)
    big = kda_gate(np.array([[20.5, 19.5, 1000.0, -1000.0]]), np.zeros(1), np.zeros(4), 1)
    assert big[0, 0, 0] == -20.5 and big[0, 0, 2] == -1000.0 and big[0, 0, 3] <= 0.0
    np.testing.assert_allclose(big[0, 0, 1], -np.log1p(np.exp(19.5)), rtol=1e-15)


def test_l2norm_eps_inside_sqrt() -> None:
    x = np.array([[3.0, 4.0], [0.0, 0.0]])
    np.testing.assert_allclose(l2norm(x), [[3 / np.sqrt(25 + 1e-6), 4 / np.sqrt(25 + 1e-6)], [0.0, 0.0]], rtol=1e-15)


# ---------------------------------------------------------------------------------------------
# short conv


def conv_ref(x: np.ndarray, weight: np.ndarray) -> np.ndarray:  # [T, C], [C, W] -> [T, C], zero history
    width = weight.shape[1]
    u = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(width):
            if t - (width - 1) + j >= 0:
                u[t] += weight[:, j] * x[t - (width - 1) + j]
    return u / (1.0 + np.exp(-u))


@pytest.mark.parametrize(
    "pieces", [[1] * 9, [2, 1, 2, 4], [5, 1, 3], [9]], ids=lambda p: "split" + "-".join(map(str, p))
)
def test_short_conv_split_equals_whole(pieces: list[int]) -> None:
    rng = np.random.default_rng(11)
    width, channels = 4, 6
    x = rng.normal(size=(sum(pieces), channels))
    weight = rng.normal(size=(channels, width))
    whole, whole_state = short_conv(x, np.zeros((width - 1, channels)), weight)
    np.testing.assert_allclose(whole, conv_ref(x, weight), rtol=1e-13, atol=1e-15)
    np.testing.assert_array_equal(whole_state, x[-(width - 1) :])
    state, outs, t0 = np.zeros((width - 1, channels)), [], 0
    for n in pieces:
        y, state = short_conv(x[t0 : t0 + n], state, weight)
        outs.append(y)
        t0 += n
        expect = np.concatenate([np.zeros((width - 1, channels)), x[:t0]])[-(width - 1) :]
        np.testing.assert_array_equal(state, expect)  # last W-1 raw inputs, with history for short pieces
    np.testing.assert_allclose(np.concatenate(outs), whole, rtol=1e-14, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# the mixer

HIDDEN, HEADS, HEAD_DIM, WIDTH, RMS_EPS = 32, 2, 8, 4, 1e-5
CFG = KDAConfig(num_heads=HEADS, head_dim=HEAD_DIM, conv_kernel_size=WIDTH)


def make_layer_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Random hub-named weights (no prefix) for a tiny KDA layer, with gates in a lively range."""
    rng = np.random.default_rng(seed)
    p = HEADS * HEAD_DIM

    def lin(out_dim: int, in_dim: int) -> np.ndarray:
        return rng.normal(0.0, in_dim**-0.5, size=(out_dim, in_dim))

    w = {f"{n}_proj.weight": lin(p, HIDDEN) for n in "qkv"}
    w |= {f"{n}_conv1d.weight": rng.normal(0.0, 0.5, size=(p, 1, WIDTH)) for n in "qkv"}
    w |= {"f_a_proj.weight": lin(HEAD_DIM, HIDDEN), "f_b_proj.weight": lin(p, HEAD_DIM)}
    w |= {"dt_bias": rng.normal(0.0, 2.0, size=p), "A_log": rng.normal(0.0, 1.0, size=(1, 1, HEADS, 1))}
    w |= {"b_proj.weight": lin(HEADS, HIDDEN), "g_a_proj.weight": lin(HEAD_DIM, HIDDEN)}
    w |= {"g_b_proj.weight": lin(p, HEAD_DIM), "o_norm.weight": rng.uniform(0.5, 1.5, size=HEAD_DIM)}
    w |= {"o_proj.weight": lin(HIDDEN, p)}
    return w


def layer_params(weights: dict[str, np.ndarray]) -> KDAWeights:
    return KDAWeights.read(Reader(weights), CFG, HIDDEN)


def make_pools(num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    p = HEADS * HEAD_DIM
    return np.zeros((num_slots, 3, WIDTH - 1, p)), np.zeros((num_slots, HEADS, HEAD_DIM, HEAD_DIM))


def run_step(params, pools, xs: list[np.ndarray], context_lens: list[int], slots: list[int]) -> list[np.ndarray]:
    """One varlen forward over sequences xs[b] [n_b, D]; returns per-sequence outputs."""
    batch = ForwardBatch.build([[0] * len(x) for x in xs], context_lens, slots, [[] for _ in xs])
    out = kda_forward(params, np.concatenate(xs), batch, *pools, CFG, RMS_EPS)
    return np.split(out, batch.cu_seqlens[1:-1])


def hidden(num_tokens: int, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, 99]).normal(size=(num_tokens, HIDDEN))


@pytest.mark.parametrize("num_tokens", [1, 3, 70], ids=lambda n: f"T{n}")
def test_mixer_matches_gold_layer(num_tokens: int) -> None:
    weights = make_layer_weights()
    x = hidden(num_tokens, seed=1)
    pools = make_pools(2)
    (out,) = run_step(layer_params(weights), pools, [x], [0], [1])
    ref, s_ref = kda_layer_ref(weights, x, HEADS, HEAD_DIM, RMS_EPS)
    print(f"mixer T{num_tokens}: out {rel_err(out, ref):.1e}  state {rel_err(pools[1][1], s_ref):.1e}")
    assert rel_err(out, ref) <= TOL and rel_err(pools[1][1], s_ref) <= TOL
    assert not pools[0][0].any() and not pools[1][0].any()  # the other slot is untouched


def test_mixer_varlen_equals_alone() -> None:
    params = layer_params(make_layer_weights())
    lens, slots = [5, 70, 2], [2, 0, 1]
    xs = [hidden(n, seed=i) for i, n in enumerate(lens)]
    pools = make_pools(3)
    outs = run_step(params, pools, xs, [0, 0, 0], slots)
    for x, out, slot in zip(xs, outs, slots, strict=True):
        alone = make_pools(1)
        (ref,) = run_step(params, alone, [x], [0], [0])
        assert rel_err(out, ref) <= TOL
        assert rel_err(pools[0][slot], alone[0][0]) <= TOL  # raw projections: BLAS rounds per batch shape
        assert rel_err(pools[1][slot], alone[1][0]) <= TOL


@pytest.mark.parametrize("prefill", [1, 2, 67], ids=lambda n: f"prefill{n}")
def test_prefill_then_decode_equals_whole(prefill: int) -> None:
    weights = make_layer_weights(seed=4)
    params = layer_params(weights)
    total = prefill + 6
    x = hidden(total, seed=2)
    whole_pools = make_pools(1)
    (whole,) = run_step(params, whole_pools, [x], [0], [0])
    pools = make_pools(4)
    parts = run_step(params, pools, [x[:prefill]], [0], [3])
    for t in range(prefill, total):
        parts += run_step(params, pools, [x[t : t + 1]], [t], [3])
    stepped = np.concatenate(parts)
    print(f"prefill{prefill}+decode: out {rel_err(stepped, whole):.1e}")
    assert rel_err(stepped, whole) <= TOL
    assert rel_err(pools[1][3], whole_pools[1][0]) <= TOL
    assert rel_err(pools[0][3], whole_pools[0][0]) <= TOL
    ref, _ = kda_layer_ref(weights, x, HEADS, HEAD_DIM, RMS_EPS)
    assert rel_err(stepped, ref) <= TOL


def test_mixed_batch_continuations() -> None:
    """A batch mixing decode steps and prefill continuations (with history) equals each sequence whole."""
    params = layer_params(make_layer_weights(seed=6))
    steps = [[2, 40, 1], [1, 30, 66], [3, 1, 1]]  # new tokens of each of 3 sequences per step
    totals = [sum(s[b] for s in steps) for b in range(3)]
    xs = [hidden(n, seed=10 + b) for b, n in enumerate(totals)]
    slots, pools, done = [1, 2, 0], make_pools(3), [0, 0, 0]
    outs: list[list[np.ndarray]] = [[], [], []]
    for step in steps:
        chunk = [xs[b][done[b] : done[b] + step[b]] for b in range(3)]
        for b, out in enumerate(run_step(params, pools, chunk, list(done), slots)):
            outs[b].append(out)
        done = [d + n for d, n in zip(done, step, strict=True)]
    for b in range(3):
        (whole,) = run_step(params, make_pools(1), [xs[b]], [0], [0])
        assert rel_err(np.concatenate(outs[b]), whole) <= TOL, b


# ---------------------------------------------------------------------------------------------
# parity with transformers (CPU, float64)


class _Float64Torch:
    """Stands in for `torch` inside transformers' modeling module: `torch.float32` means float64, so its
    fp32 casts (gate, KDA core, gated norm, cached state) keep float64 and parity can be checked at 1e-10."""

    def __init__(self, torch_module) -> None:
        self._torch = torch_module
        self.float32 = torch_module.float64

    def __getattr__(self, name: str):
        return getattr(self._torch, name)


def transformers_layer(monkeypatch, core_precision: str):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.kimi_linear import modeling_kimi_linear as mkl
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    if core_precision == "float64":  # its fp32 casts: `.to(torch.float32)` and `Tensor.float()`
        monkeypatch.setattr(mkl, "torch", _Float64Torch(torch))
        monkeypatch.setattr(torch.Tensor, "float", torch.Tensor.double)
    config = KimiLinearConfig(
        hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=RMS_EPS,
        linear_attn_config={"num_heads": HEADS, "head_dim": HEAD_DIM, "short_conv_kernel_size": WIDTH},
        num_attention_heads=HEADS, vocab_size=64, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    module = mkl.KimiLinearDeltaAttention(config, layer_idx=0).double()
    weights = make_layer_weights(seed=8)
    ours_to_theirs = {n: n for n in weights if "conv1d" not in n}
    ours_to_theirs |= {n: "forget_gate." + n for n in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log")}
    state_dict = {theirs: torch.from_numpy(weights[ours]) for ours, theirs in ours_to_theirs.items()}
    state_dict["conv1d.weight"] = torch.from_numpy(np.concatenate([weights[f"{n}_conv1d.weight"] for n in "qkv"]))
    module.load_state_dict(state_dict, strict=True)
    return torch, config, module, weights


PARITY_TOL = {"float64": TOL, "float32": 1e-5}  # "float32": transformers' own fp32 core, unpatched


@pytest.mark.parity
@pytest.mark.parametrize("core_precision", ["float64", "float32"], ids=lambda c: f"tf-core-{c}")
def test_parity_with_transformers_prefill_and_decode(monkeypatch, core_precision: str) -> None:
    torch, config, module, weights = transformers_layer(monkeypatch, core_precision)
    from transformers import DynamicCache

    prefill, decode = 70, 3
    x = hidden(prefill + decode, seed=5)
    params, pools = layer_params(weights), make_pools(1)
    with torch.no_grad():
        theirs_nocache = module(torch.from_numpy(x[None, :prefill])).numpy()[0]
        cache = DynamicCache(config=config)
        theirs = [module(torch.from_numpy(x[None, :prefill]), cache=cache).numpy()[0]]
        theirs += [
            module(torch.from_numpy(x[None, t : t + 1]), cache=cache).numpy()[0]
            for t in range(prefill, prefill + decode)
        ]
    ours = run_step(params, pools, [x[:prefill]], [0], [0])
    ours += [run_step(params, pools, [x[t : t + 1]], [t], [0])[0] for t in range(prefill, prefill + decode)]
    errs = [rel_err(ours[0], theirs_nocache)] + [rel_err(o, t) for o, t in zip(ours, theirs, strict=True)]
    print(f"transformers parity ({core_precision} core): " + " ".join(f"{e:.1e}" for e in errs))
    assert max(errs) <= PARITY_TOL[core_precision], errs


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-s"]))
