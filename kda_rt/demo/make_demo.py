"""Rebuild the bundled demo checkpoint: `python -m kda_rt.demo.make_demo`.

A 4-layer Kimi Linear in hub layout with the real per-head sizes (KDA 128, MLA 128+64 / 512
latent) but 2 heads, hidden 128, 8 experts (top-2) and the demo's 1024-token vocabulary, so every
code path of the full model runs in a few MB.  Weights are random (seed 0): the text it generates
is meaningless.  The tokenizer files (tiktoken.model, tokenizer_config.json) come from
`make_vocab.py` and are left as they are.
"""

from __future__ import annotations

from kda_rt.demo import demo_path
from kda_rt.random_checkpoint import write_random_checkpoint

__all__ = ["DEMO_CONFIG", "main"]

DEMO_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "dtype": "bfloat16",
    "vocab_size": 1024,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "intermediate_size": 256,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 768,
    "eos_token_id": 770,
    "pad_token_id": 1023,
    "model_max_length": 4096,
    "linear_attn_config": {
        "num_heads": 2, "head_dim": 128, "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 4], "full_attn_layers": [3],
    },
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "moe_intermediate_size": 128,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "moe_router_activation_func": "sigmoid",
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
}


def main() -> None:
    out = write_random_checkpoint(DEMO_CONFIG, demo_path(), seed=0)
    print(f"wrote the demo checkpoint to {out}")


if __name__ == "__main__":
    main()
