"""config.json parsing: hub layout, transformers >= 5 layout, and every refusal names its field."""

from __future__ import annotations

import copy
import json
import re

import pytest

from kda_rt.loader.config import ConfigError, load_config, parse_config

HUB = {
    "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 27,
    "intermediate_size": 9216, "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839, "model_max_length": 1048576,
    "linear_attn_config": {
        "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
    },
    "num_attention_heads": 32, "num_key_value_heads": 32, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True, "head_dim": 72,
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 1024,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "moe_router_activation_func": "sigmoid",
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
}


def _hf5_layout() -> dict:
    """The same model as transformers >= 5 writes it: aliases, layer_types, mlp_layer_types."""
    raw = copy.deepcopy(HUB)
    lac = raw.pop("linear_attn_config")
    for old, new in (("num_experts", "num_local_experts"), ("num_experts_per_token", "num_experts_per_tok"),
                     ("num_shared_experts", "n_shared_experts"), ("num_expert_group", "n_group"),
                     ("moe_renormalize", "norm_topk_prob"), ("model_max_length", "max_position_embeddings")):
        raw[new] = raw.pop(old)
    raw.pop("first_k_dense_replace")
    raw.pop("moe_layer_freq")
    raw["layer_types"] = ["linear_attention" if i + 1 in lac["kda_layers"] else "full_attention" for i in range(27)]
    raw["mlp_layer_types"] = ["dense"] + ["sparse"] * 26
    raw.update(linear_num_heads=32, linear_head_dim=128, linear_conv_kernel_dim=4)
    return raw


def test_hub_layout_schedule_and_fields():
    cfg = parse_config(HUB)
    assert cfg.mla_layer_ids == (3, 7, 11, 15, 19, 23, 26)
    assert len(cfg.kda_layer_ids) == 20 and 24 in cfg.kda_layer_ids and 25 in cfg.kda_layer_ids
    assert cfg.mlp_types == ("dense",) + ("moe",) * 26
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.routed_scaling_factor) == (256, 8, 2.446)
    assert cfg.mla.cache_width == 576 and cfg.mla.kv_a_layernorm_eps == 1e-6
    assert cfg.kda.head_dim == 128 and cfg.eos_token_ids == (163586,)


def test_transformers_layout_equals_hub_layout():
    assert parse_config(_hf5_layout()) == parse_config(HUB)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda r: r.pop("hidden_size"), "hidden_size"),
        (lambda r: r.pop("vocab_size"), "vocab_size"),
        (lambda r: r["linear_attn_config"].pop("kda_layers"), "kda_layers"),
        (lambda r: r.pop("num_experts"), "num_experts"),
        (lambda r: r.pop("kv_lora_rank"), "kv_lora_rank"),
        (lambda r: r.update(num_local_experts=128), "num_experts"),
        (lambda r: r.update(layer_types=["full_attention"] * 27), "layer_types"),
        (lambda r: r["linear_attn_config"].update(full_attn_layers=[4, 8, 12, 16, 20, 24, 28]), "full_attn_layers"),
        (lambda r: r["linear_attn_config"].update(full_attn_layers=[3, 8, 12, 16, 20, 24, 27]), "listed twice"),
        (lambda r: r.update(hidden_size="2304"), "hidden_size"),
        (lambda r: r.update(num_experts_per_token=300), "num_experts_per_token"),
        (lambda r: r.update(q_lora_rank=1536), "q_lora_rank"),
        (lambda r: r.update(mla_use_nope=False), "mla_use_nope"),
        (lambda r: r.update(moe_router_activation_func="softmax"), "moe_router_activation_func"),
        (lambda r: r.update(mlp_layer_types=["sparse"] * 27), "mlp_layer_types"),
        (lambda r: r.update(num_expert_group=3), "num_expert_group"),
        (lambda r: r.update(rms_norm_eps=1e300), "rms_norm_eps"),
        (lambda r: r.update(rms_norm_eps=0.0), "rms_norm_eps"),
    ],
    ids=["no-hidden", "no-vocab", "no-kda-list", "no-experts", "no-kv-rank", "alias-conflict", "layer-types-conflict",
         "layer-out-of-range", "layer-twice", "wrong-type", "topk-gt-experts", "q-lora", "rope", "softmax-router",
         "mlp-types-conflict", "groups-not-dividing", "eps-huge", "eps-zero"],
)
def test_bad_config_names_the_field(mutate, field):
    raw = copy.deepcopy(HUB)
    mutate(raw)
    with pytest.raises(ConfigError, match=field):
        parse_config(raw)


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("num_shared_experts", -1, "field 'num_shared_experts' must be non-negative, got -1"),
    ("n_shared_experts", -2, "field 'n_shared_experts' must be non-negative, got -2"),
    ("first_k_dense_replace", -1, "field 'first_k_dense_replace' must be non-negative, got -1"),
    ("routed_scaling_factor", 0, "field 'routed_scaling_factor' must be positive, got 0.0"),
    ("routed_scaling_factor", -2.446, "field 'routed_scaling_factor' must be positive, got -2.446"),
])
def test_negative_counts_and_scales_name_the_field(field, value, needle):
    """Was: accepted.  num_shared_experts -1 reached the weight schema (the shared expert's tensors then refused as
    'the config implies [-1024, 2304]'), first_k_dense_replace -1 meant 0, and a routed_scaling_factor of 0 or below
    loaded and ran, silently zeroing or negating every routed expert's output."""
    raw = copy.deepcopy(HUB)
    if field == "n_shared_experts":
        raw.pop("num_shared_experts")
    raw[field] = value
    with pytest.raises(ConfigError, match=re.escape(needle)):
        parse_config(raw)


@pytest.mark.parametrize("field", ["dtype", "torch_dtype"])
def test_dtype_must_be_a_known_one(field):
    """Was: any string accepted ("float8" was then taken for float32 by the memory estimates)."""
    for value in ("bfloat16", "float16", "float32"):
        assert parse_config({**HUB, field: value}).dtype == value
    with pytest.raises(ConfigError, match=re.escape(f"field '{field}' must be one of bfloat16, float16, float32, "
                                                    "got 'float8'")):
        parse_config({**HUB, field: "float8"})


def test_unknown_model_type_refused():
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        parse_config({**HUB, "model_type": "llama"})


def test_load_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(HUB))
    assert load_config(tmp_path).num_hidden_layers == 27


@pytest.mark.parametrize("quant", [{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
                                   {"quant_method": "compressed-tensors"}, "fp8"], ids=["fp8", "compressed", "str"])
def test_pre_quantized_checkpoint_refused_by_name(quant):
    """A config.json with a quantization_config (an fp8 / nvfp4 / compressed-tensors export) is refused naming the
    field and method (was: accepted, then its weight_scale_inv tensors refused as 'unexpected tensors for this
    config', or, without them, the first e4m3 weight's dtype)."""
    with pytest.raises(ConfigError, match=re.escape("field 'quantization_config' (quant_method ")):
        parse_config({**HUB, "quantization_config": quant})
    assert parse_config({**HUB, "quantization_config": None}) == parse_config(HUB)


def test_ungrouped_topk_with_expert_groups_refused():
    """use_grouped_topk false with num_expert_group > 1 asks for a plain top-k over all experts (vLLM ignores the
    groups then); kda_rt's router always masks to the topk_group best groups (was: accepted and routed grouped,
    silently picking other experts).  With one group the two are the same top-k, and the field must be a bool."""
    grouped = {**HUB, "num_expert_group": 8, "topk_group": 4}
    parse_config(grouped)
    with pytest.raises(ConfigError, match=re.escape("field 'use_grouped_topk' is false but 'num_expert_group'=8")):
        parse_config({**grouped, "use_grouped_topk": False})
    assert parse_config({**HUB, "use_grouped_topk": False}) == parse_config(HUB)
    with pytest.raises(ConfigError, match=re.escape("field 'use_grouped_topk' must be bool, got 'false'")):
        parse_config({**HUB, "use_grouped_topk": "false"})
