"""Whole model on the CUDA backend against the NumPy backend (the oracle).

The oracle is the NumPy backend with dtype="bfloat16": float32 math with activations rounded to
bf16 where the bf16 references (and our kernels) round them, so the two differ by accumulation
order, the occasional 1-ulp rounding flip, and the KDA prefill kernel's bf16 operands in its chunk
products (as fla rounds them, spec §3.7; the oracle keeps them fp32: ~4e-3 on each KDA layer's
output, tests/kernels/test_kda_prefill.py).  Per-position relative error ||cuda - numpy|| / ||numpy||:
median <= 2e-2 (issue 4), every position <= 3e-2 (H200, demo architecture with stable routing:
worst position 2.59e-2, median 1.29e-2 since the bf16 chunk products; 1.15e-2 worst on the 48B shape).

A sigmoid top-k router is discontinuous: when two experts' biased scores are within rounding noise,
the two backends may pick different experts for that token, and that position's logits legitimately
differ by far more than 2e-2 (seen: 0.5 on the demo, and later positions of the same sequence
then differ by ~0.06 through the recurrent state).  So the strict checks (every position within
2e-2, identical greedy tokens) run on checkpoints whose correction biases are 2 apart, which fixes
the expert selection (the router, its unbiased weights and the experts still run in full; only ties
are gone), and the shipped demo checkpoint is checked on its median, with near-ties reported.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest

import kda_rt.reference.moe as np_moe
from kda_rt import LLM, SamplingParams
from kda_rt.demo import demo_path

pytestmark = pytest.mark.gpu

NEAR_TIE = 5e-3  # router margin (in sigmoid-score units) within bf16 noise of the router logits
TOL = 2e-2  # median over positions
TOL_MAX = 3e-2  # every position (the bf16 chunk products of KDA prefill, see above)


def row_rel_err(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


def assert_near_oracle(gpu_logits: np.ndarray, err: np.ndarray, margins: np.ndarray) -> None:
    """The bound of the lossy (FP8) paths against an oracle run the same way: finite logits, per-position relative
    error (row_rel_err) <= 0.1 median and <= 0.25 wherever no router margin is within NEAR_TIE (a near tie can route
    a token to other experts)."""
    assert np.all(np.isfinite(gpu_logits)), "non-finite logits"
    assert np.median(err) <= 0.1 and not (err[margins >= NEAR_TIE] > 0.25).any(), err


def score_with_margins(llm: LLM, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(logits [L, V], min router margin per position over all MoE layers) from the NumPy oracle."""
    margins = np.full(len(ids), np.inf)
    route = np_moe.route

    def spy(x, weight, bias, cfg):
        s = 1.0 / (1.0 + np.exp(-(x.astype(np.float64) @ weight.T.astype(np.float64))))
        sel = np.sort(s + bias, axis=-1)[:, ::-1]
        gap = sel[:, cfg.top_k - 1] - sel[:, cfg.top_k]
        np.minimum(margins[: len(gap)], gap, out=margins[: len(gap)])
        return route(x, weight, bias, cfg)

    np_moe.route = spy
    try:
        logits = llm.score(ids)
    finally:
        np_moe.route = route
    return logits, margins


def check_positions(gpu_logits, ref_logits, margins, label):
    err = row_rel_err(gpu_logits, ref_logits)
    tie = margins < NEAR_TIE
    print(f"{label}: per-position rel err max {err.max():.2e} median {np.median(err):.2e}; "
          f"{tie.sum()} near-tie positions (errs {np.round(err[tie], 3).tolist()})")
    assert tie.mean() <= 0.10, f"{tie.sum()} of {len(tie)} positions are router near-ties"
    assert np.median(err) <= TOL, f"median per-position error {np.median(err):.3e} exceeds {TOL}"
    bad = np.flatnonzero(~tie & (err > TOL_MAX))
    assert bad.size == 0, f"positions {bad.tolist()} exceed {TOL_MAX}: {err[bad]}"


KW = dict(max_num_seqs=8, max_model_len=512, num_blocks=64)
BF16_NP = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def demo_pair():
    """The shipped demo checkpoint (router bias std 0.3: near-ties happen)."""
    return (LLM(str(demo_path()), backend="numpy", dtype="bfloat16", **KW),
            LLM(str(demo_path()), backend="cuda", **KW))


@pytest.fixture(scope="module")
def stable_pair(tmp_path_factory):
    """The demo architecture with a dominant correction bias: expert selection has no near-ties."""
    from kda_rt.demo.make_demo import DEMO_CONFIG
    from kda_rt.random_checkpoint import write_random_checkpoint

    path = write_random_checkpoint(DEMO_CONFIG, tmp_path_factory.mktemp("stable"), seed=3, tokenizer_dir=demo_path(),
                                   fixed_routing=True)
    return LLM(str(path), backend="numpy", dtype="bfloat16", **KW), LLM(str(path), backend="cuda", **KW)


def test_stable_logits_every_position(stable_pair):
    ref, gpu = stable_pair
    ids = list(np.random.default_rng(0).integers(0, 768, size=150))  # crosses chunk-64 boundaries
    ref_logits, margins = score_with_margins(ref, ids)
    assert margins.min() > NEAR_TIE
    check_positions(gpu.score(ids), ref_logits, margins, "demo-arch, stable routing")


def test_stable_fp8_experts_every_position(stable_pair, tmp_path_factory, monkeypatch):
    """quantization="fp8" on both backends (the CUDA one quantizes its expert stacks on upload, the NumPy oracle runs
    their dequantized values: the same e4m3 codes and scales): the same per-position bound as bf16, and the fp8
    model is not the bf16 one (its logits differ from the bf16 oracle's by more than that bound's median).  The
    prefill GEMMs' e4m3 sources are off here (the oracle keeps bf16 sources; test_moe_block.py checks them)."""
    import cupy

    monkeypatch.setenv("KDA_RT_FP8_PREFILL", "0")

    from kda_rt.cuda.ops.compile import arch_number, device_arch
    from kda_rt.demo.make_demo import DEMO_CONFIG
    from kda_rt.loader.quant import quantize_rows
    from kda_rt.random_checkpoint import write_random_checkpoint

    if arch_number(device_arch()) < 89:
        pytest.skip("e4m3 weights need sm_89 or newer")
    ref_bf16, _ = stable_pair
    path = write_random_checkpoint(DEMO_CONFIG, tmp_path_factory.mktemp("stable-fp8"), seed=3,
                                   tokenizer_dir=demo_path(), fixed_routing=True)  # (stable_pair's checkpoint)
    ref = LLM(str(path), backend="numpy", dtype="bfloat16", quantization="fp8", **KW)
    gpu = LLM(str(path), backend="cuda", quantization="fp8", **KW)
    # every MoE layer's stacks hold exactly the host quantizer's codes and scales of the bf16 rows they uploaded
    from kda_rt.cuda.weights import DeviceMoE
    from kda_rt.loader.weights import load_checkpoint

    raw = load_checkpoint(path, gpu.model_config)
    for i, layer in enumerate(gpu.runner.weights.layers):
        if not isinstance(layer.mlp, DeviceMoE):
            continue
        m = layer.mlp
        assert m.e4m3, f"layer {i}: the MoE stacks are not e4m3"
        base = f"model.layers.{i}.block_sparse_moe."
        E = gpu.model_config.moe.num_experts
        for e in range(m.w13.shape[0]):
            stem = f"{base}experts.{e}." if e < E else f"{base}shared_experts."
            names = ("w1", "w3", "w2") if e < E else ("gate_proj", "up_proj", "down_proj")
            w13 = np.concatenate([np.asarray(raw[f"{stem}{n}.weight"]) for n in names[:2]]).astype(BF16_NP)
            q, s = quantize_rows(w13, "w13")
            assert np.array_equal(cupy.asnumpy(m.w13[e]), q.view(np.uint8)), f"layer {i} expert {e}: w13 codes"
            assert np.array_equal(cupy.asnumpy(m.scale13[e]), s), f"layer {i} expert {e}: w13 scales"
            q, s = quantize_rows(np.asarray(raw[f"{stem}{names[2]}.weight"]).astype(BF16_NP), "w2")
            assert np.array_equal(cupy.asnumpy(m.w2[e]), q.view(np.uint8)), f"layer {i} expert {e}: w2 codes"
            assert np.array_equal(cupy.asnumpy(m.scale2[e]), s), f"layer {i} expert {e}: w2 scales"
    ids = list(np.random.default_rng(0).integers(0, 768, size=150))
    ref_logits, margins = score_with_margins(ref, ids)
    assert margins.min() > NEAR_TIE
    check_positions(gpu.score(ids), ref_logits, margins, "demo-arch, stable routing, fp8 experts")
    moved = row_rel_err(ref_logits, score_with_margins(ref_bf16, ids)[0])
    assert np.median(moved) > TOL, f"the fp8 oracle is within {np.median(moved):.2e} of the bf16 one: not quantized?"


def test_stable_fp8_prefill_products(tmp_path_factory, monkeypatch):
    """quantization="fp8" with the FP8 prefill products on (KDA_RT_FP8_PREFILL, the default): a 150-token prompt's
    one prefill step has 128-row expert tiles (150 x 3 pairs over 9 bins: 50 a bin, >= 48), so on sm_90a its expert
    GEMMs take e4m3 sources (counted; skipped where the step does not), against the oracle with bf16 sources.  The
    bound comes from the NumPy model itself (CPU, 2026-12-02, this checkpoint and prompt): with each expert GEMM's
    source rows quantized as the kernels quantize them (reference.moe.e4m3_rows) its logits move from the bf16-source
    ones by 5.5e-2 median, 0.118 max per position, and by 5.5-5.8e-2 median, 0.12-0.15 max with 2e-3 to 8e-3 of noise
    on the rows before the rounding (the kernels' drift and the bf16 oracle's own differences move some codes by a
    step, and this random model carries that as far as the whole rounding); so median <= 0.1 and every position
    <= 0.25.  The kernels' numerics are checked tightly in test_moe_gemm_tc.py / test_moe_block.py (w8a8 cases);
    this catches a wrong path in the model (a scale, a layer, the workspace)."""
    import kda_rt.cuda.moe as cuda_moe
    from kda_rt.cuda.ops.compile import device_arch
    from kda_rt.demo.make_demo import DEMO_CONFIG
    from kda_rt.random_checkpoint import write_random_checkpoint

    if device_arch() != "sm_90a":
        pytest.skip("the e4m3-source GEMMs run on the wgmma kernel (sm_90a)")
    monkeypatch.setenv("KDA_RT_FP8_PREFILL", "1")
    path = write_random_checkpoint(DEMO_CONFIG, tmp_path_factory.mktemp("stable-fp8-w8a8"), seed=3,
                                   tokenizer_dir=demo_path(), fixed_routing=True)
    ref = LLM(str(path), backend="numpy", dtype="bfloat16", quantization="fp8", **KW)
    gpu = LLM(str(path), backend="cuda", quantization="fp8", **KW)
    e4m3_src = []  # expert GEMMs on e4m3 sources (src_scale given)
    real_gemm = cuda_moe.moe_gemm_wg
    monkeypatch.setattr(cuda_moe, "moe_gemm_wg", lambda *a, **k: (k.get("src_scale") is not None
                                                                   and e4m3_src.append(1)) or real_gemm(*a, **k))
    ids = list(np.random.default_rng(1).integers(0, 768, size=150))
    gpu_logits = gpu.score(ids)
    if not e4m3_src:
        pytest.skip("this GPU's prefill step did not take the e4m3-source GEMMs (sm_90a wgmma, 128-row tiles)")
    ref_logits, margins = score_with_margins(ref, ids)
    err = row_rel_err(gpu_logits, ref_logits)
    print(f"fp8 prefill products: per-position rel err median {np.median(err):.2e}, max {err.max():.2e}")
    assert_near_oracle(gpu_logits, err, margins)


def test_stable_mla_fp8_attention(tmp_path_factory, monkeypatch):
    """KDA_RT_MLA_FP8=1 (the MLA prefill attention on e4m3 products, mla_prefill_fp8.cu; opt-in and lossy) on a bf16
    model: a 150-token prompt's MLA layers take the FP8 attention (counted), and the logits stay within the bounds the
    fp8 weight tests use against the exact NumPy oracle (median <= 0.1, every position away from a router near-tie
    <= 0.25): the kernel's outputs are ~5e-2 (relative RMS) from exact attention (test_mla_prefill.py), here in the
    MLA layers only.  Also checks that the switch moves the logits (the path was taken)."""
    import kda_rt.cuda.model as cuda_model
    import kda_rt.cuda.ops.mla_prefill as mla_prefill_mod
    from kda_rt.cuda.ops.mla_prefill import use_fp8
    from kda_rt.demo.make_demo import DEMO_CONFIG
    from kda_rt.random_checkpoint import write_random_checkpoint

    if not use_fp8(128, 64, 128):
        pytest.skip("the FP8 attention needs sm_90a")
    path = write_random_checkpoint(DEMO_CONFIG, tmp_path_factory.mktemp("stable-mla-fp8"), seed=3,
                                   tokenizer_dir=demo_path(), fixed_routing=True)
    gpu = LLM(str(path), backend="cuda", **KW)
    ids = list(np.random.default_rng(1).integers(0, 768, size=150))
    monkeypatch.setenv("KDA_RT_MLA_FP8", "0")
    bf16_logits = gpu.score(ids)
    calls, rounds = [], []
    real, real_round = cuda_model.mla_prefill, mla_prefill_mod._fp8_round
    monkeypatch.setattr(cuda_model, "mla_prefill", lambda *a, **k: calls.append(k.get("fp8")) or real(*a, **k))
    monkeypatch.setattr(mla_prefill_mod, "_fp8_round", lambda *a, **k: rounds.append(1) or real_round(*a, **k))
    monkeypatch.setenv("KDA_RT_MLA_FP8", "1")
    gpu_logits = gpu.score(ids)
    mla_layers = len(DEMO_CONFIG["linear_attn_config"]["full_attn_layers"])
    assert calls and all(calls) and len(rounds) == mla_layers, (calls, rounds)  # the FP8 kernel ran in every layer
    ref = LLM(str(path), backend="numpy", dtype="bfloat16", **KW)
    ref_logits, margins = score_with_margins(ref, ids)
    err = row_rel_err(gpu_logits, ref_logits)
    moved = row_rel_err(gpu_logits, bf16_logits)
    print(f"MLA fp8 attention: per-position rel err median {np.median(err):.2e}, max {err.max():.2e}; against the "
          f"bf16 attention {np.median(moved):.2e} median")
    assert_near_oracle(gpu_logits, err, margins)
    assert np.median(moved) > 0, "KDA_RT_MLA_FP8=1 left every logit as it was"


def _fp8_switch_logits(tmp_path_factory, monkeypatch, switch: str):
    """The fp8 demo-shape model's logits of a 150-token prompt (one prefill step whose expert GEMMs take e4m3
    sources on sm_90a, else skipped) with the KDA_RT_* `switch` at 0 and at 1, and
    per value the calls of the MoE's activation quantizer and of its GEMMs on e4m3 sources."""
    import kda_rt.cuda.moe as cuda_moe
    from kda_rt.cuda.ops.compile import device_arch
    from kda_rt.demo.make_demo import DEMO_CONFIG
    from kda_rt.random_checkpoint import write_random_checkpoint

    if device_arch() != "sm_90a":
        pytest.skip("the e4m3-source GEMMs run on the wgmma kernel (sm_90a)")
    monkeypatch.setenv("KDA_RT_FP8_PREFILL", "1")
    path = write_random_checkpoint(DEMO_CONFIG, tmp_path_factory.mktemp("fp8-switch"), seed=3,
                                   tokenizer_dir=demo_path(), fixed_routing=True)
    gpu = LLM(str(path), backend="cuda", quantization="fp8", **KW)
    calls = []
    real_q, real_gemm = cuda_moe.quantize_activations_e4m3, cuda_moe.moe_gemm_wg
    monkeypatch.setattr(cuda_moe, "quantize_activations_e4m3", lambda *a, **k: calls.append("quant") or real_q(*a, **k))
    monkeypatch.setattr(cuda_moe, "moe_gemm_wg", lambda *a, **k: calls.append(
        "e4m3" if k.get("src_scale") is not None else "bf16") or real_gemm(*a, **k))
    ids = list(np.random.default_rng(1).integers(0, 768, size=150))
    logits, counts = {}, {}
    for value in ("0", "1"):
        monkeypatch.setenv(switch, value)
        calls.clear()
        logits[value] = gpu.score(ids)
        counts[value] = {kind: calls.count(kind) for kind in ("quant", "e4m3")}
        if not counts[value]["e4m3"]:
            pytest.skip("this GPU's prefill step did not take the e4m3-source GEMMs")
    return logits, counts


def test_fp8_norm_codes_same_logits(tmp_path_factory, monkeypatch):
    """KDA_RT_NORM_E4M3 (the norm before an fp8 MoE block writes x's e4m3 codes, so the block does not quantize x
    again): the same codes, so the same logits bit for bit as with it off, on a prefill step whose expert GEMMs take
    e4m3 sources; and the blocks then quantize only h (one call a block instead of two)."""
    logits, counts = _fp8_switch_logits(tmp_path_factory, monkeypatch, "KDA_RT_NORM_E4M3")
    assert counts["1"]["quant"] * 2 == counts["0"]["quant"] > 0, counts
    assert np.array_equal(logits["0"], logits["1"]), "the norm's codes changed the logits"


def test_stable_fp8_dense_prefill_products(tmp_path_factory, monkeypatch):
    """quantization="fp8" with the dense projections on e4m3 products (KDA_RT_FP8_DENSE; the step-size threshold
    lowered so the 150-token prompt takes them: every KDA q|k|v and o_proj, MLA q|kv_a and o_proj and the dense
    layer's MLP, counted) against the NumPy oracle quantizing the same rows (Compute.e4m3_dense, and the MoE's
    sources by reference.moe.e4m3_rows).  On CPU (2026-12-02, this checkpoint and prompt) the NumPy model's logits
    move from its bf16-source ones by 5.6e-2 median, 0.113 max with the MoE's sources quantized and by 9.4e-2 median,
    0.18 max with the dense projections too; against the oracle that quantizes the same rows what is left is the
    kernels' drift and the codes it moves by a step, which this random model carries about as far as the MoE-only
    case (test_stable_fp8_prefill_products): median <= 0.1 and every position away from a router near-tie <= 0.25.
    A wrong scale, layer or padding column moves the logits by more than the whole quantization does."""
    import functools

    import kda_rt.cuda.model as cuda_model
    import kda_rt.reference.kimi_linear as np_model
    from kda_rt.cuda.ops.compile import device_arch
    from kda_rt.demo.make_demo import DEMO_CONFIG
    from kda_rt.random_checkpoint import write_random_checkpoint

    if device_arch() != "sm_90a":
        pytest.skip("the e4m3 products run on the wgmma kernel (sm_90a)")
    monkeypatch.setenv("KDA_RT_FP8_PREFILL", "1")
    monkeypatch.setenv("KDA_RT_FP8_DENSE", "1")
    monkeypatch.setattr(cuda_model, "FP8_DENSE_MIN_TOKENS", 1)
    path = write_random_checkpoint(DEMO_CONFIG, tmp_path_factory.mktemp("stable-fp8-dense"), seed=3,
                                   tokenizer_dir=demo_path(), fixed_routing=True)
    gpu = LLM(str(path), backend="cuda", quantization="fp8", **KW)
    calls = []
    real = cuda_model.dense_w8a8
    monkeypatch.setattr(cuda_model, "dense_w8a8", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = list(np.random.default_rng(1).integers(0, 768, size=150))
    gpu_logits = gpu.score(ids)
    cfg = DEMO_CONFIG["linear_attn_config"]
    kda, mla = len(cfg["kda_layers"]), len(cfg["full_attn_layers"])
    assert len(calls) == 2 * kda + 2 * mla + 2 * DEMO_CONFIG["first_k_dense_replace"], len(calls)
    ref = LLM(str(path), backend="numpy", dtype="bfloat16", quantization="fp8", **KW)
    bf16_logits = ref.score(ids)
    ref.runner.model.num.e4m3_dense = True
    monkeypatch.setattr(np_model, "moe_forward", functools.partial(np_model.moe_forward, e4m3_sources=True,
                                                                    shared_e4m3_sources=True))
    ref_logits, margins = score_with_margins(ref, ids)
    err = row_rel_err(gpu_logits, ref_logits)
    moved = row_rel_err(ref_logits, bf16_logits)
    print(f"fp8 dense products: rel err median {np.median(err):.2e}, max {err.max():.2e}; the oracle's own move "
          f"{np.median(moved):.2e} median")
    assert_near_oracle(gpu_logits, err, margins)
    assert np.median(moved) > TOL, "the oracle did not quantize (e4m3_dense not applied?)"


_GEMV_WEIGHTS = ("qkv_fgb", "o_proj", "q_kva", "gate_up")  # the weights whose e4m3 rows are NAME_rows beside them


def _dequantized_rows_into_bf16(llm: LLM) -> int:
    """Overwrite the bf16 weights of every projection that has e4m3 decode rows (KDA_RT_FP8_DECODE_GEMV) with those
    rows' values, bf16(code x scale), on the device; returns the number of projections.  First each row's values are
    checked against the weight row they replace: relative error of the row's norm <= 0.04 (e4m3 keeps 3 mantissa
    bits: a value's rounding error is uniform within half a step of 2^-3 relative, ~0.025 RMS over a row; a row
    taken from another row, another projection or with another row's scale is off by ~1 or more), zero rows zero."""
    import cupy

    count = 0
    for layer in llm.runner.weights.layers:
        for part in (layer.mixer, layer.mlp):
            for weight_name in _GEMV_WEIGHTS:
                rows = getattr(part, f"{weight_name}_rows", None)
                if rows is None:
                    continue
                codes = cupy.asnumpy(rows.codes).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
                values = (codes * cupy.asnumpy(rows.scale)[:, None]).astype(BF16_NP)
                weight = getattr(part, weight_name)
                assert weight.shape == values.shape, (weight_name, weight.shape, values.shape)
                w = cupy.asnumpy(weight).astype(np.float64)
                norm = np.linalg.norm(w, axis=1)
                err = np.linalg.norm(values.astype(np.float64) - w, axis=1)
                assert np.all(err[norm == 0] == 0), f"{weight_name}: a zero row's e4m3 values are not zero"
                rel = err[norm > 0] / norm[norm > 0]
                assert rel.max() <= 0.04, f"{weight_name}: e4m3 rows off their weight rows by {rel.max():.3f}"
                weight[...] = cupy.asarray(values)
                count += 1
    cupy.cuda.Device().synchronize()
    return count


def test_fp8_decode_gemv_against_the_dequantized_weights(tmp_path_factory, monkeypatch):
    """KDA_RT_FP8_DECODE_GEMV=1 (the default): an fp8 model's one-sequence decode steps run the dense projections (KDA
    q|k|v|f_a|g_a|b and o_proj, MLA q|kv_a and o_proj, the dense layer's gate|up) as e4m3 GEMVs (bf16 x, e4m3 rows
    times their fp32 scales).  Three engines of one fp8 checkpoint, each with those projections' bf16 weights
    overwritten by the e4m3 rows' values, bf16(code x scale) (so every prefill is the same bf16 computation): A the
    switch on, eager; B the switch on, decode graphs; C the switch off, eager (the bf16 path on those values).  Greedy
    tokens and logprobs of 12 decode steps after a 20-token prompt:
    - A takes the GEMV for every such projection of every decode step (counted: 2 a KDA or MLA layer, 1 the dense
      layer) and none in the prefill; B's tokens are A's and its logprobs within 0.02 (the decode graphs may pick
      other variants of the other kernels: a capture that dropped the GEMV or its scales moves them far more);
    - A against C: the same tokens until a step where C's two best logprobs lie within 0.05 (a near tie, after which
      the sequences may part), at least 4 steps, and the chosen tokens' logprobs within 0.05: the two multiply the
      same x by weights apart by bf16's rounding of code x scale (<= 2^-9 relative) and sum in other orders, so the
      logits move by ~1e-3 relative (bf16 noise through 4 layers); a scale on the wrong row or a missing one moves
      them by far more (rows' scales span orders of magnitude);
    - upload: every e4m3 row holds its weight row (_dequantized_rows_into_bf16's check, so a row offset, a gate|up
      order or a scale on the wrong row shows, which the comparison of A and C, both on those values, cannot see);
      the prefill's e4m3 copy of q|k|v (KDA_RT_FP8_DENSE) is a view of the decode rows' first 3P rows and holds the
      codes and scales of the copy made without the switch."""
    import cupy

    import kda_rt.cuda.model as cuda_model
    from kda_rt.cuda.ops.compile import device_arch
    from kda_rt.demo.make_demo import DEMO_CONFIG
    from kda_rt.random_checkpoint import write_random_checkpoint

    if device_arch() != "sm_90a":
        pytest.skip("the fp8 dense copies are made on sm_90a (the e4m3 prefill GEMMs' arch)")
    monkeypatch.setenv("KDA_RT_FP8_DENSE", "1")
    path = write_random_checkpoint(DEMO_CONFIG, tmp_path_factory.mktemp("fp8-decode-gemv"), seed=5,
                                   tokenizer_dir=demo_path(), fixed_routing=True)
    engines = {}
    for name, value, eager in (("A", "1", True), ("B", "1", False), ("C", "0", True)):
        monkeypatch.setenv("KDA_RT_FP8_DECODE_GEMV", value)
        engines[name] = LLM(str(path), backend="cuda", quantization="fp8", enforce_eager=eager, **KW)
    monkeypatch.setenv("KDA_RT_FP8_DECODE_GEMV", "1")  # (each eager forward reads it again; C has no rows)
    cfg = DEMO_CONFIG["linear_attn_config"]
    kda, mla, dense = len(cfg["kda_layers"]), len(cfg["full_attn_layers"]), DEMO_CONFIG["first_k_dense_replace"]
    per_step = 2 * kda + 2 * mla + dense
    with_rows = engines["A"].runner.weights.layers[1].mixer  # (layer 1: KDA, demo config)
    plain = engines["C"].runner.weights.layers[1].mixer
    assert with_rows.qkv_fgb_rows is not None and plain.qkv_fgb_rows is None
    P3 = with_rows.qkv.shape[0]
    assert with_rows.qkv_e4m3 is not None and plain.qkv_e4m3 is not None, "no prefill copy of q|k|v to compare"
    assert with_rows.qkv_e4m3.codes.data.ptr == with_rows.qkv_fgb_rows.codes.data.ptr, "q|k|v copy not a view"
    assert cupy.array_equal(with_rows.qkv_e4m3.codes, plain.qkv_e4m3.codes)
    assert cupy.array_equal(with_rows.qkv_e4m3.scale, plain.qkv_e4m3.scale)
    assert with_rows.qkv_e4m3.codes.shape == (1, P3, with_rows.qkv.shape[1])
    rows_a = _dequantized_rows_into_bf16(engines["A"])
    assert rows_a == per_step, (rows_a, per_step)
    # (the same rows: B quantized the same weights; C has no rows, so it takes A's values)
    assert _dequantized_rows_into_bf16(engines["B"]) == per_step
    for la, lc in zip(engines["A"].runner.weights.layers, engines["C"].runner.weights.layers, strict=True):
        for part_a, part_c in ((la.mixer, lc.mixer), (la.mlp, lc.mlp)):
            for name in _GEMV_WEIGHTS:
                if getattr(part_a, f"{name}_rows", None) is not None:
                    getattr(part_c, name)[...] = getattr(part_a, name)
    calls = []
    real = cuda_model.gemv_dense
    monkeypatch.setattr(cuda_model, "gemv_dense",
                        lambda *a, **k: calls.append(k.get("scale") is not None) or real(*a, **k))
    ids = list(np.random.default_rng(2).integers(0, 768, size=20))
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    outs = {}
    for name in ("A", "B", "C"):
        calls.clear()
        outs[name] = engines[name].generate({"prompt_token_ids": ids}, p)[0].outputs[0]
        if name == "A":  # (the first token is the prefill's: 11 decode steps)
            assert calls.count(True) == 11 * per_step and all(calls), (calls.count(True), len(calls), per_step)
        if name == "C":
            assert not any(calls), "the switch off still ran the e4m3 GEMV"
    a, b, c = outs["A"], outs["B"], outs["C"]
    assert a.token_ids == b.token_ids, "graph replay changed the tokens"
    for i, tok in enumerate(a.token_ids):
        assert abs(a.logprobs[i][tok] - b.logprobs[i][tok]) <= 0.02, f"step {i}: graph replay moved the logprob"
    assert _steps_until_near_tie(a, c) >= 4, "too few steps compared before a near tie: pick another prompt"


def _steps_until_near_tie(a, c, tol: float = 0.05) -> int:
    """Greedy outputs a (e4m3 GEMVs) and c (the bf16 path on the same values): the same tokens and the chosen tokens'
    logprobs within `tol` until a step where c's two best logprobs lie within `tol` (a near tie, after which the
    sequences may part); returns the decode steps compared (step 0 is the prefill's, the same computation in both)."""
    steps = 0
    for i, (ta, tc) in enumerate(zip(a.token_ids, c.token_ids, strict=True)):
        best = sorted(c.logprobs[i].values(), reverse=True)
        if ta != tc:
            assert best[0] - best[1] <= tol, f"step {i}: tokens {ta} / {tc} part without a near tie ({best[:2]})"
            break
        diff = abs(a.logprobs[i][ta] - c.logprobs[i][tc])
        print(f"step {i}: token {ta}, logprob {a.logprobs[i][ta]:.4f} vs {c.logprobs[i][tc]:.4f}")
        assert diff <= tol, f"step {i}: logprob {a.logprobs[i][ta]:.4f} against {c.logprobs[i][tc]:.4f}"
        steps += i > 0
        if len(best) > 1 and best[0] - best[1] <= tol:  # a near tie here: the next steps may part
            break
    return steps


def test_fp8_decode_gemv_several_sequences(tmp_path_factory, monkeypatch):
    """KDA_RT_FP8_DECODE_GEMV_MAX_T=4 (prepared): decode steps of up to 4 sequences run the fp8 model's dense
    projections as e4m3 GEMVs of that many rows (moe_gemv.cu MROWS).  One fp8 engine, eager, its projections' bf16
    weights overwritten by the e4m3 rows' values (as the one-sequence test), three prompts of different lengths:
    - with MAX_T=4 every decode step (the 3 sequences, all 12 tokens long: 11 steps of 3 rows) takes the GEMV for
      every such projection (counted, with x of 3 rows) and the prefill none; with MAX_T=2 none of them;
    - each sequence's tokens and logprobs against the MAX_T=2 run (the bf16 path on the same values) by the
      one-sequence test's rule (_steps_until_near_tie), at least 2 steps each and 8 in all;
    - an engine with decode graphs captured under MAX_T=4: its captures of 1, 2 and 4 rows take the GEMV (counted:
      the replays run what was captured, and with the bf16 weights overwritten by the same values a capture on the
      bf16 path would give the same tokens), none larger; its tokens those of the eager run, logprobs within 0.02."""
    import kda_rt.cuda.model as cuda_model
    from kda_rt.cuda.ops.compile import device_arch
    from kda_rt.demo.make_demo import DEMO_CONFIG
    from kda_rt.random_checkpoint import write_random_checkpoint

    if device_arch() != "sm_90a":
        pytest.skip("the fp8 dense copies are made on sm_90a (the e4m3 prefill GEMMs' arch)")
    monkeypatch.setenv("KDA_RT_FP8_DENSE", "1")
    monkeypatch.setenv("KDA_RT_FP8_DECODE_GEMV", "1")
    monkeypatch.setenv("KDA_RT_FP8_DECODE_GEMV_MAX_T", "4")
    path = write_random_checkpoint(DEMO_CONFIG, tmp_path_factory.mktemp("fp8-decode-gemv-rows"), seed=5,
                                   tokenizer_dir=demo_path(), fixed_routing=True)
    rows = []
    real = cuda_model.gemv_dense
    monkeypatch.setattr(cuda_model, "gemv_dense",
                        lambda x, *a, **k: rows.append(int(x.shape[0])) or real(x, *a, **k))
    eager = LLM(str(path), backend="cuda", quantization="fp8", enforce_eager=True, **KW)
    assert not rows, "an eager engine's start ran the GEMV"
    graphs = LLM(str(path), backend="cuda", quantization="fp8", enforce_eager=False, **KW)
    cfg = DEMO_CONFIG["linear_attn_config"]
    per_step = 2 * len(cfg["kda_layers"]) + 2 * len(cfg["full_attn_layers"]) + DEMO_CONFIG["first_k_dense_replace"]
    # the start's warm-up and capture forwards (graphs of 1, 2 and 4 rows take it, each a whole number of steps'
    # worth of calls; from 6 rows none): a capture that dropped the switch fails here
    counts = {m: rows.count(m) for m in set(rows)}
    assert set(counts) == {1, 2, 4} and all(c % per_step == 0 for c in counts.values()), (counts, per_step)
    rows.clear()
    assert _dequantized_rows_into_bf16(eager) == per_step and _dequantized_rows_into_bf16(graphs) == per_step
    rng = np.random.default_rng(4)
    prompts = [{"prompt_token_ids": list(rng.integers(0, 768, size=n))} for n in (20, 7, 33)]
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    gemv = [o.outputs[0] for o in eager.generate(prompts, p)]
    assert rows and set(rows) == {3}, f"GEMV rows per call {sorted(set(rows))}"
    assert len(rows) == 11 * per_step, (len(rows), per_step)
    rows.clear()
    monkeypatch.setenv("KDA_RT_FP8_DECODE_GEMV_MAX_T", "2")  # (read at each forward: 3 sequences take bf16 now)
    plain = [o.outputs[0] for o in eager.generate(prompts, p)]
    assert not rows, "3 sequences took the GEMV with MAX_T=2"
    compared = [_steps_until_near_tie(a, c) for a, c in zip(gemv, plain, strict=True)]
    assert min(compared) >= 2 and sum(compared) >= 8, f"too few steps compared before near ties: {compared}"
    monkeypatch.setattr(cuda_model, "gemv_dense", real)
    for k, (a, o) in enumerate(zip(gemv, graphs.generate(prompts, p), strict=True)):
        b = o.outputs[0]
        assert a.token_ids == b.token_ids, f"prompt {k}: graph replay changed the tokens"
        for i, tok in enumerate(a.token_ids):
            assert abs(a.logprobs[i][tok] - b.logprobs[i][tok]) <= 0.02, f"prompt {k} step {i}: graph replay moved it"


def test_kda_norm_codes_same_logits(tmp_path_factory, monkeypatch):
    """KDA_RT_KDA_NORM_E4M3 (the KDA prefill's gated norm writes o_proj's e4m3 codes, so o_proj does not quantize y
    again): the same codes, so the fp8 model's logits bit for bit the same with it on and off, on a prefill step whose
    dense projections run on e4m3 products (the step-size threshold lowered)."""
    import kda_rt.cuda.model as cuda_model
    from kda_rt.cuda.ops.compile import device_arch
    from kda_rt.demo.make_demo import DEMO_CONFIG
    from kda_rt.random_checkpoint import write_random_checkpoint

    if device_arch() != "sm_90a":
        pytest.skip("the e4m3 products run on the wgmma kernel (sm_90a)")
    monkeypatch.setenv("KDA_RT_FP8_DENSE", "1")
    monkeypatch.setattr(cuda_model, "FP8_DENSE_MIN_TOKENS", 1)
    path = write_random_checkpoint(DEMO_CONFIG, tmp_path_factory.mktemp("kda-norm-codes"), seed=3,
                                   tokenizer_dir=demo_path(), fixed_routing=True)
    gpu = LLM(str(path), backend="cuda", quantization="fp8", **KW)
    quantized = []  # dense_w8a8 calls given codes made before (the norms')
    real = cuda_model.dense_w8a8
    monkeypatch.setattr(cuda_model, "dense_w8a8", lambda *a, **k: quantized.append(k["quantized"]) or real(*a, **k))
    ids = list(np.random.default_rng(1).integers(0, 768, size=150))
    logits, counts = {}, {}
    for value in ("0", "1"):
        monkeypatch.setenv("KDA_RT_KDA_NORM_E4M3", value)
        quantized.clear()
        logits[value] = gpu.score(ids)
        counts[value] = sum(quantized)
    kda = len(DEMO_CONFIG["linear_attn_config"]["kda_layers"])
    assert counts["1"] == counts["0"] + kda, counts  # each KDA layer's o_proj takes the norm's codes
    assert np.array_equal(logits["0"], logits["1"]), "the gated norm's codes changed the logits"


def test_demo_logits_statistics(demo_pair):
    """Shipped demo: the median position is within the bound; the worst positions and their router
    margins are printed (near-ties and the positions after them)."""
    ref, gpu = demo_pair
    ids = list(np.random.default_rng(0).integers(0, 768, size=150))
    ref_logits, margins = score_with_margins(ref, ids)
    err = row_rel_err(gpu.score(ids), ref_logits)
    worst = np.argsort(err)[-5:]
    print(f"demo: median {np.median(err):.2e}, {np.mean(err <= TOL):.0%} within {TOL}; worst positions "
          f"{worst.tolist()} errs {np.round(err[worst], 3).tolist()} router margins {margins[worst].tolist()}")
    assert np.median(err) <= TOL


def test_stable_greedy_32_steps(stable_pair):
    ref, gpu = stable_pair
    prompts = ["The quick brown fox", "Kimi Delta Attention", "naïve café 東京"]
    p = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, p)]
    got = [o.outputs[0].token_ids for o in gpu.generate(prompts, p)]
    tok = ref.get_tokenizer()
    for prompt, w, g in zip(prompts, want, got, strict=True):
        if w == g:
            continue
        i = next(j for j in range(len(w)) if w[j] != g[j])
        row = ref.score(tok.encode(prompt) + w[:i])[-1].astype(np.float64)
        top2 = np.sort(row)[-2:]
        noise = 3 * TOL * np.linalg.norm(row) / np.sqrt(row.size)  # 3x the allowed per-element error
        print(f"{prompt!r}: diverges at step {i}; oracle top-2 gap {top2[1] - top2[0]:.4f}, noise {noise:.4f}")
        assert row[g[i]] >= top2[1] - noise, f"step {i}: cuda token {g[i]} is not a near-tie of the argmax {w[i]}"


def test_graph_replay_equals_eager():
    eager = LLM(str(demo_path()), backend="cuda", enforce_eager=True, **KW)
    graph = LLM(str(demo_path()), backend="cuda", **KW)
    prompts = ["one", "two three", "four five six", "seven"]
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in eager.generate(prompts, p)]
    b = [o.outputs[0].token_ids for o in graph.generate(prompts, p)]
    assert a == b
    assert graph.runner.graphs, "decode steps should have replayed a captured graph"


def test_cuda_graph_sizes_pick_the_graph(monkeypatch):
    """EngineConfig.cuda_graph_sizes (vLLM's --cuda-graph-sizes): only the given sizes are captured (those above
    max_num_seqs left out); a decode batch replays the smallest graph that holds it (5 sequences: the 7-row graph,
    two padding rows) and one larger than every graph runs eagerly (8 sequences); the tokens are the eager engine's
    either way.  (5 and 7 rows take the same kernel variants: every batch-size threshold of the decode kernels lies
    at 4 or 8 rows or past them.)"""
    import kda_rt.cuda.runner as runner_mod

    eager = LLM(str(demo_path()), backend="cuda", enforce_eager=True, **KW)
    sized = LLM(str(demo_path()), backend="cuda", cuda_graph_sizes=[7, 1, 999], **KW)
    assert sized.runner.buckets == [1, 7] and sorted(sized.runner.graphs) == [1, 7]
    replays = []
    real = runner_mod.CudaRunner._graph
    monkeypatch.setattr(runner_mod.CudaRunner, "_graph", lambda self, rows: replays.append(rows) or real(self, rows))
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for n, want in ((5, {7}), (8, set())):
        prompts = [f"p{i} q r{'s' * i}" for i in range(n)]
        replays.clear()
        rows0 = list(sized.runner.graph_rows)
        a = [o.outputs[0].token_ids for o in eager.generate(prompts, p)]
        b = [o.outputs[0].token_ids for o in sized.generate(prompts, p)]
        assert a == b, f"{n} prompts: graph replays {sorted(set(replays))} changed the tokens"
        assert set(replays) == want, f"{n} prompts (they finish together) replayed the graphs {replays}"
        live, pad = (x - y for x, y in zip(sized.runner.graph_rows, rows0, strict=True))
        assert (live, pad) == (n * len(replays), (7 - n) * len(replays)), (live, pad, len(replays))


def test_graph_padding_rows_skip_their_state(monkeypatch):
    """KDA_RT_SKIP_PAD=1: a decode graph's padding rows get the slot -1 (the KDA decode kernel stores
    nothing for them: kda_decode.cu SKIP_PAD) and the step's live row count (the MoE plans the live rows' pairs alone
    and zeroes the others: moe_bucket.cuh LIVE_PAIRS / LIVE_TOKENS).  5 sequences on the 8-row graph (three padding
    rows), then 3 on the 4-row one (one), several steps each: the tokens are those of an engine with the same graphs
    and the switch off (the same kernel variants for the live rows), and the padding slot, filled with a sentinel
    after start, is never written.  The same for KDA_RT_SKIP_PAD=2 (the default: the KDA decode kernel's padding CTAs
    write zeros and leave)."""
    import cupy

    p = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    engines = {}
    for value in ("0", "1", "2"):
        monkeypatch.setenv("KDA_RT_SKIP_PAD", value)
        engines[value] = LLM(str(demo_path()), backend="cuda", cuda_graph_sizes=[1, 4, 8], **KW)
    assert [engines[v].runner.model.skip_pad for v in ("0", "1", "2")] == [0, 1, 2]
    for value in ("1", "2"):
        runner = engines[value].runner
        assert sorted(runner.graphs) == [1, 4, 8]
        pools = list(runner.model.kda_pools.values())
        assert pools, "the demo checkpoint has KDA layers"
        pad = runner.pad_slot
        with runner.stream:
            for conv, rec in pools:
                conv[pad] = cupy.asarray(np.full(conv.shape[1:], 3.0, np.float32).astype(conv.dtype))
                rec[pad] = -5.0
        runner.stream.synchronize()
        for n in (5, 3):
            prompts = [f"s{i} t u{'v' * i}" for i in range(n)]
            rows0 = list(runner.graph_rows)
            a = [o.outputs[0].token_ids for o in engines["0"].generate(prompts, p)]
            b = [o.outputs[0].token_ids for o in engines[value].generate(prompts, p)]
            assert a == b, f"KDA_RT_SKIP_PAD={value}, {n} prompts: skipping the padding rows' work changed the tokens"
            assert runner.graph_rows[1] > rows0[1], "no padding rows were replayed"
        runner.stream.synchronize()
        for conv, rec in pools:  # (compared on the host: bf16 3.0 is exact)
            assert np.all(cupy.asnumpy(conv[pad]).astype(np.float32) == 3.0) and \
                np.all(cupy.asnumpy(rec[pad]) == -5.0), f"KDA_RT_SKIP_PAD={value}: a padding row wrote the padding slot"


def test_shared_graph_workspace(monkeypatch):
    """KDA_RT_SHARED_GRAPH_WS=1 (the default, set here all the same): every decode graph's buffers are views of one workspace, sized by the
    largest graph (captured first), so the graphs hold the memory of the largest alone; the tokens are the eager
    engine's at every batch size.  Then a fresh shared workspace with the graphs dropped: the 2-row graph is captured
    on it, the 7-row one needs larger buffers (WorkspaceFull: the 2-row graph is dropped, the buffers grow, the
    7-row graph is captured), and the 2-row graph comes back on use, the tokens still the eager engine's."""
    from kda_rt.cuda.workspace import Workspace

    monkeypatch.setenv("KDA_RT_SHARED_GRAPH_WS", "1")
    eager = LLM(str(demo_path()), backend="cuda", enforce_eager=True, **KW)
    shared = LLM(str(demo_path()), backend="cuda", cuda_graph_sizes=[1, 2, 4, 7], **KW)
    runner = shared.runner
    assert sorted(runner.graphs) == [1, 2, 4, 7] and len({id(g.ws) for g in runner.graphs.values()}) == 1
    assert runner.graph_ws_bytes() == runner.graph_ws.nbytes() > 0  # (bench's decode_graph_ws_bytes: counted once)
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def same(n):
        prompts = [f"w{i} x y{'z' * i}" for i in range(n)]
        a = [o.outputs[0].token_ids for o in eager.generate(prompts, p)]
        b = [o.outputs[0].token_ids for o in shared.generate(prompts, p)]
        assert a == b, f"{n} prompts: the shared-workspace graphs changed the tokens"

    for n in (1, 3, 5, 7):
        same(n)
    runner.graphs.clear()
    runner.graph_ws = Workspace(shared=True)
    same(2)
    assert sorted(runner.graphs) == [2]
    same(6)
    assert sorted(runner.graphs) == [7], sorted(runner.graphs)  # (the 2-row graph dropped when the buffers grew)
    same(2)
    assert sorted(runner.graphs) == [2, 7] and runner.graphs[2].ws is runner.graphs[7].ws is runner.graph_ws


def test_graph_capture_out_of_memory_named(monkeypatch):
    """A decode graph that does not fit at start (its warm-up's workspace allocation fails) is a MemoryError naming
    the graph's size, the sizes asked for and the settings that change it, not CuPy's bare OutOfMemoryError."""
    import cupy

    import kda_rt.cuda.runner as runner_mod

    real = runner_mod.CudaRunner._graph

    def graph(self, rows):
        if rows == 5:
            raise cupy.cuda.memory.OutOfMemoryError(2**40, 2**30)
        return real(self, rows)

    monkeypatch.setattr(runner_mod.CudaRunner, "_graph", graph)
    with pytest.raises(MemoryError, match=r"decode graph for 5 sequences .*\[1, 5\].*--cuda-graph-sizes"):
        LLM(str(demo_path()), backend="cuda", cuda_graph_sizes=[1, 5], **KW)


def test_seeded_sampling_reproducible(demo_pair):
    """The seed decides the draw.  Same seed, same batch -> same tokens, run after run; two copies of
    one request with the same seed in one batch -> the same tokens (identical inputs give identical
    logits rows, and a seeded draw must not depend on the row); the same request with another seed ->
    other tokens (temperature 1.5 over the demo's 1024 tokens: 12 equal draws by chance are
    impossible in practice).  A sampler that ignored the seed fails the second check (a shared RNG
    stream gives the copies different noise) or the third (a fixed noise per row gives the same).

    Alone vs in a different batch is not compared here: given identical logits the sampler's draw
    is independent of batch composition (tests/kernels/test_sampling.py), but across batch
    compositions cuBLAS may pick other GEMM algorithms, so bf16 logits, and rarely tokens, can
    differ: kda_rt does not promise batch-invariant numerics."""
    _, gpu = demo_pair
    hot = dict(temperature=1.5, max_tokens=12, ignore_eos=True)
    prompts = ["x y z", "Once upon a time", "abc", "Once upon a time", "Once upon a time"]
    params = [SamplingParams(max_tokens=4, seed=1), SamplingParams(seed=99, **hot), SamplingParams(max_tokens=7, seed=2),
              SamplingParams(seed=99, **hot), SamplingParams(seed=100, **hot)]
    first = [o.outputs[0].token_ids for o in gpu.generate(prompts, params)]
    again = [o.outputs[0].token_ids for o in gpu.generate(prompts, params)]
    assert first == again
    assert first[1] == first[3], "same request, same seed, another row of the batch: the draw changed"
    assert first[1] != first[4], "seeds 99 and 100 drew the same 12 tokens: the seed is ignored"


@pytest.mark.slow
def test_48b_shaped_4_layer_logits(tmp_path):
    """Kimi-Linear-48B shapes (D 2304, 32 heads, 256 experts top-8), 4 layers KDA-dense, KDA-MoE,
    KDA-MoE, MLA-MoE, random weights written in hub layout."""
    from helpers.configs import k48_config
    from kda_rt.random_checkpoint import write_random_checkpoint

    path = os.environ.get("KDA_RT_TEST_48B_DIR")  # written once per device run (--fixed-routing)
    if not path:
        path = write_random_checkpoint(k48_config(4), tmp_path / "k48", seed=1, fixed_routing=True)
    assert json.loads(open(os.path.join(path, "config.json")).read())["hidden_size"] == 2304
    kw = dict(max_num_seqs=4, max_model_len=256, num_blocks=32)
    ref = LLM(str(path), backend="numpy", dtype="bfloat16", **kw)
    gpu = LLM(str(path), backend="cuda", **kw)
    ids = list(np.random.default_rng(1).integers(0, 163584, size=80))
    ref_logits, margins = score_with_margins(ref, ids)
    assert margins.min() > NEAR_TIE, "the 48B-shaped test checkpoint must have fixed routing"
    check_positions(gpu.score(ids), ref_logits, margins, "48B-shaped")
    # decode path (graph replay): each step's token and logprob against the oracle's prefill of the same tokens
    out = gpu.generate({"prompt_token_ids": ids[:40]},
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0))[0].outputs[0]
    full, margins = score_with_margins(ref, ids[:40] + out.token_ids)
    for i, tok in enumerate(out.token_ids):
        row = full[39 + i].astype(np.float64)
        noise = 3 * TOL * np.sqrt(np.mean(row**2))
        lz = row.max() + np.log(np.exp(row - row.max()).sum())
        print(f"decode step {i}: token {tok} (oracle argmax {int(np.argmax(row))}), "
              f"logprob {out.logprobs[i][tok]:.4f} vs {row[tok] - lz:.4f}, margin {margins[39 + i]:.2e}")
        if margins[39 + i] >= NEAR_TIE:
            assert row[tok] >= row.max() - noise
            assert abs(out.logprobs[i][tok] - (row[tok] - lz)) <= noise + 0.02


def test_weights_over_the_free_memory_are_refused_before_the_upload(monkeypatch):
    """The runner compares the weights' device bytes with the GPU's free memory before uploading any (was: CuPy's
    OutOfMemoryError part way through, e.g. the 48B shape in bf16 on an 80 GB H100): the error names the GiB each
    side; nothing was allocated for them."""
    import cupy

    real = cupy.cuda.runtime.memGetInfo
    monkeypatch.setattr(cupy.cuda.runtime, "memGetInfo", lambda: (4096, real()[1]))
    pool = cupy.get_default_memory_pool()
    before = pool.used_bytes()
    with pytest.raises(ValueError, match=r"the weights need \d+\.\d GiB on the GPU \(bf16\) but .* has 0\.0 GiB free"):
        LLM(str(demo_path()), backend="cuda")
    assert pool.used_bytes() == before
