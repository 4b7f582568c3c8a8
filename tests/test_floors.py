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
