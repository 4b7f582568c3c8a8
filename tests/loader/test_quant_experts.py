"""EngineConfig.quantization = "fp8": loader/quant.quantize_experts (what the NumPy backend runs: the experts'
e4m3 values, dequantized), the switch's refusals, the fp8 model on the NumPy backend against the bf16 one, and the
decode floor in e4m3 bytes (kda_rt/floors.py).  The CUDA backend quantizes the same bf16 values on upload
(ops/quant.quantize_rows_e4m3, bit for bit as quantize_rows: tests/kernels/test_quant_e4m3.py) and its fp8 model is
compared with this oracle by the GPU tests."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from kda_rt.demo import demo_path
from kda_rt.engine.config import EngineConfig
from kda_rt.loader.config import load_config
from kda_rt.loader.quant import dequantize_rows, expert_weight_names, quantize_experts, quantize_rows
from kda_rt.loader.weights import load_checkpoint

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def demo():
    config = load_config(demo_path())
    return config, load_checkpoint(demo_path(), config)


def test_expert_weight_names(demo):
    """Every routed expert's w1, w3, w2 of every MoE layer; the shared expert's three only when there is one."""
    config, raw = demo
    names = expert_weight_names(config)
    moe_layers = [i for i, kind in enumerate(config.mlp_types) if kind == "moe"]
    per_layer = 3 * config.moe.num_experts + (3 if config.moe.num_shared_experts == 1 else 0)
    assert moe_layers and len(names) == per_layer * len(moe_layers) and len(set(names)) == len(names)
    assert all(name in raw for name in names)
    two = dataclasses.replace(config, moe=dataclasses.replace(config.moe, num_shared_experts=2))
    assert not any("shared_experts" in n for n in expert_weight_names(two))


def test_quantize_experts_values(demo):
    """Each named weight becomes dequantize(quantize_rows(bf16(w))); every other entry is passed through as it is."""
    config, raw = demo
    out = quantize_experts(config, raw)
    names = set(expert_weight_names(config))
    assert set(out) == set(raw)
    for name, value in out.items():
        if name not in names:
            assert value is raw[name], f"{name} should be passed through"
            continue
        w = np.asarray(raw[name])
        q, scale = quantize_rows(w if w.dtype == BF16 else w.astype(BF16), name)
        assert np.array_equal(value, dequantize_rows(q, scale)), name
        assert not np.array_equal(value, np.asarray(raw[name], dtype=np.float32)), f"{name} unchanged"


def test_quantization_switch_refused():
    with pytest.raises(ValueError, match=r"quantization must be one of \('fp8',\) or None, got 'int8'"):
        EngineConfig(quantization="int8")
    assert EngineConfig(quantization="fp8").quantization == "fp8"


def test_fp8_numpy_model_close_to_bf16():
    """The demo model's logits with fp8 experts on the NumPy backend: not the bf16 model's (the experts changed), and
    within e4m3's precision of them: each expert weight moves by up to 2^-4 of itself (~2-3% RMS), which through the
    demo's random layers moves the logits by 8.1% of their spread (measured); the bound, 20%, is passed by that and
    fails for a scale off by a power of two or more (every expert output scaled) or for experts left as they were
    (0)."""
    from kda_rt.llm import LLM

    ids = list(range(3, 40))
    ref = LLM(demo_path(), backend="numpy", skip_tokenizer_init=True).score(ids)
    got = LLM(demo_path(), backend="numpy", skip_tokenizer_init=True, quantization="fp8").score(ids)
    diff = np.sqrt(np.mean((got - ref) ** 2)) / np.sqrt(np.mean((ref - ref.mean()) ** 2))
    assert 0 < diff < 0.2, f"fp8 logits against bf16: {diff:.3e} of their spread"


def test_fp8_decode_floor(demo):
    """The experts' bytes in e4m3: one a weight plus an fp32 scale a row, against two a weight in bf16."""
    from kda_rt.floors import decode_floor, weight_bytes

    config, _ = demo
    bf, f8 = weight_bytes(config), weight_bytes(config, "fp8")
    M, D = config.moe.intermediate_size, config.hidden_size
    assert bf.per_expert == 2 * bf.expert_params and f8.per_expert == f8.expert_params + 4 * (2 * M + D)
    assert f8.dense <= bf.dense
    assert decode_floor(config, 8, 100, quantization="fp8")["bytes"] < decode_floor(config, 8, 100)["bytes"]
