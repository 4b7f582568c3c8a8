"""kda_rt.floors against numbers derived independently (by hand, in the issues) for the full
Kimi-Linear-48B-A3B shape: decode ≈ 1.47 ms at batch 1 and ≈ 15.3 ms at batch 32 (≈ 162 experts per
MoE layer under uniform routing), prefill of 32 × 2048 ≈ 0.46 s (≈ 2.7 B active parameters per token).
Tolerance 3%: the hand numbers were rounded and leave out the logits and conv state."""

from __future__ import annotations

import pytest

from kda_rt.demo.presets import kimi_linear_48b_a3b
from kda_rt.floors import decode_floor, prefill_floor, weight_bytes
from kda_rt.loader.config import parse_config


@pytest.fixture(scope="module")
def full():
    return parse_config(kimi_linear_48b_a3b(27), source="preset")


def test_expert_bytes(full):
    assert weight_bytes(full).per_expert == 3 * 2304 * 1024 * 2


def test_decode_floor_matches_hand_numbers(full):
    one = decode_floor(full, 1, 2048 + 64)
    assert one["experts_per_moe_layer"] == pytest.approx(8.0)  # batch 1 touches exactly top-k
    assert one["seconds"] == pytest.approx(1.47e-3, rel=0.03)
    b32 = decode_floor(full, 32, 2048 + 256)
    assert b32["experts_per_moe_layer"] == pytest.approx(162, abs=2)
    assert b32["seconds"] == pytest.approx(15.3e-3, rel=0.03)


def test_decode_floor_follows_counted_experts(full):
    moe = [i for i, k in enumerate(full.mlp_types) if k == "moe"]
    lo = decode_floor(full, 32, 2048, {i: 100.0 for i in moe})
    hi = decode_floor(full, 32, 2048, {i: 200.0 for i in moe})
    assert hi["bytes"] - lo["bytes"] == pytest.approx(len(moe) * 100 * weight_bytes(full).per_expert)
    assert lo["experts_per_moe_layer"] == pytest.approx(100.0)


def test_prefill_floor_matches_hand_numbers(full):
    pre = prefill_floor(full, [2048] * 32)
    assert pre["active_params_per_token"] == pytest.approx(2.7e9, rel=0.03)
    assert pre["seconds"] == pytest.approx(0.46, rel=0.03)
    # causal MLA attention grows with the square of the prompt: 128K costs far more per token than 2K
    assert prefill_floor(full, [131072])["seconds"] / 131072 > 1.2 * pre["seconds"] / (32 * 2048)


def test_prefill_floor_fp8_counts_the_e4m3_products_by_hand(full):
    """quantization "fp8": the products fp8 models run on e4m3 (per token: 8 routed + 1 shared experts of 3 x 2304 x
    1024 in 26 MoE layers, KDA q|k|v + o_proj 4 x 4096 x 2304 in 20 layers, MLA (32 x 192 + 576) x 2304 + 2304 x 4096
    in 7, the dense MLP 3 x 9216 x 2304) at twice the rate; the rest (attention, KDA's small projections, kv_b,
    lm_head) at the bf16 rate."""
    from kda_rt.floors import BF16_FLOPS

    pre = prefill_floor(full, [2048] * 32, quantization="fp8")
    tokens = 32 * 2048
    e4m3 = (26 * 9 * 3 * 2304 * 1024 + 20 * 4 * 4096 * 2304 + 7 * ((32 * 192 + 576) * 2304 + 2304 * 4096)
            + 3 * 9216 * 2304)
    want = 2.0 * e4m3 * tokens / (2 * BF16_FLOPS) + (pre["flops"] - 2.0 * e4m3 * tokens) / BF16_FLOPS
    assert pre["seconds_fp8"] == pytest.approx(want, rel=1e-12)
    assert 0.5 * pre["seconds"] < pre["seconds_fp8"] < 0.55 * pre["seconds"]  # ~95% of the FLOPs at twice the rate
    assert "seconds_fp8" not in prefill_floor(full, [2048] * 32)


def test_op_work_splits_the_floors(full):
    """The per-op minimum work of `bench --profile` adds up to the step floors (the norms' few MB
    and the embedding rows aside), so each op's rate is measured against its share of the floor."""
    from kda_rt.floors import op_work

    moe = [i for i, k in enumerate(full.mlp_types) if k == "moe"]
    touched = {i: 70.8 for i in moe}
    dec = op_work(full, decode=True, batch=32, tokens=32, context=2049, touched=touched)
    assert all(unit == "B" for _, unit in dec.values())
    total = sum(v for v, _ in dec.values())
    assert total == pytest.approx(decode_floor(full, 32, 2048, touched)["bytes"], rel=2e-3)
    # routed experts + the shared expert + the fp32 router and its correction bias, per MoE layer
    assert dec["moe"][0] == pytest.approx(len(moe) * (70.8 * 3 * 2304 * 1024 * 2 + 3 * 2304 * 1024 * 2 + 256 * 2305 * 4))
    pre = op_work(full, decode=False, batch=4, tokens=8192, context=0, prompt_lens=[2048] * 4)
    assert all(unit == "FLOP" for _, unit in pre.values())
    assert sum(v for v, _ in pre.values()) == pytest.approx(prefill_floor(full, [2048] * 4)["flops"], rel=1e-3)
    # a profile table shows each op's rate: 26.5 GB in 8.08 ms is 3.28 TB/s
    from kda_rt.cuda.ops.trace import format_table

    table = format_table({"moe": (8.076, 26), "kda.decode": (4.63, 20)}, dec)
    assert "3.28 TB/s" in table and "moe" in table.splitlines()[1]


def test_launch_table_counts_launches_per_layer():
    """The fast-path report (issue 12: kernels per step per layer): each op's launches divided by the
    layers that run it, beside the per-step table."""
    from kda_rt.cuda.ops.trace import Trace

    tr = Trace()
    tr.counts.update({("kda.decode", "cublasGemmEx"): 60, ("kda.decode", "kda_decode.cu:kda_decode_step"): 20,
                      ("moe", "moe_route.cu:moe_route_logits"): 26, ("moe", "moe_gemm_tc.cu:moe_grouped_gemm_tc"): 52,
                      ("norm+residual", "rmsnorm.cu:rmsnorm_fwd"): 54})
    table = tr.table({"kda.decode": 20, "mla.decode": 7, "moe": 26, "norm+residual": 27})
    assert table.splitlines()[-2].split() == ["total", "212"]
    assert table.splitlines()[-1] == "launches per layer: kda.decode 4, moe 3, norm+residual 2"
    assert "per layer" not in tr.table()


def test_e4m3_gemv_savings_match_hand_numbers(full):
    """KDA_RT_FP8_DECODE_GEMV's floor: a byte a weight and an fp32 scale a row instead of bf16's two bytes a weight,
    by hand for the 48B shape.  KDA layer (20): q, k, v 3 x 4096 x 2304, f_a and g_a 128 x 2304 each, b 32 x 2304,
    o_proj 2304 x 4096 = 38,412,288 weights in 14,880 rows; MLA layer (7): q 6144 x 2304, kv_a 576 x 2304, o_proj
    2304 x 4096 = 24,920,064 in 9,024 rows; the dense layer's gate and up 2 x 9216 x 2304 = 42,467,328 in 18,432 rows:
    985,153,536 weights (a byte each saved) in 379,200 rows (4 bytes each added)."""
    from kda_rt.floors import e4m3_gemv_savings

    assert e4m3_gemv_savings(full) == 985_153_536 - 4 * 379_200
    plain = decode_floor(full, 1, 2112, quantization="fp8")
    gemv = decode_floor(full, 1, 2112, quantization="fp8", e4m3_gemv=True)
    assert plain["bytes"] - gemv["bytes"] == 985_153_536 - 4 * 379_200
