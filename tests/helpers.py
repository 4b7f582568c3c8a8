"""Shared test helpers: a tiny Kimi Linear config in the hub layout of `config.json`."""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["tiny_config"]

_TINY: dict[str, Any] = {
    "model_type": "kimi_linear",
    "architectures": ["KimiLinearForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,  # transformers defaults to 163839, outside the tiny vocab
    "linear_attn_config": {
        "num_heads": 2,
        "head_dim": 32,
        "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 4],
        "full_attn_layers": [3],
    },
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "mla_use_nope": True,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "moe_router_activation_func": "sigmoid",
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
}


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """A fresh copy of the tiny hub-layout config dict, with top-level keys replaced by `overrides`."""
    cfg = copy.deepcopy(_TINY)
    cfg.update(copy.deepcopy(overrides))
    return cfg
