"""Write the Kimi-Linear-48B-shaped 4-layer config (KDA-dense, KDA-MoE, KDA-MoE, MLA-MoE) used by
the GPU tests and benchmarks: `python tests/gpu/k48_config.py OUT.json`."""

from __future__ import annotations

import json
import sys

from kda_rt.demo import demo_path


def k48_config(num_layers: int = 4) -> dict:
    cfg = json.loads((demo_path() / "config.json").read_text())
    kda = [i + 1 for i in range(num_layers) if (i + 1) % 4 != 0]
    mla = [i + 1 for i in range(num_layers) if (i + 1) % 4 == 0]
    cfg.update(vocab_size=163840, hidden_size=2304, intermediate_size=9216, num_attention_heads=32,
               num_key_value_heads=32, num_experts=256, num_experts_per_token=8, moe_intermediate_size=1024,
               num_hidden_layers=num_layers, bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
               model_max_length=1048576,
               linear_attn_config={"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
                                   "kda_layers": kda, "full_attn_layers": mla})
    return cfg


if __name__ == "__main__":
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    with open(sys.argv[1], "w") as fh:
        json.dump(k48_config(n), fh, indent=1)
