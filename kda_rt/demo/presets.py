"""Built-in model configs (hub layout of `config.json`) for benchmarks without a checkpoint.

`kimi_linear_48b_a3b(num_layers)`: Kimi-Linear-48B-A3B's shapes (hidden 2304, 32 KDA heads of 128,
MLA 32 heads with a 512 latent, 256 experts top-8 + 1 shared, vocab 163840, 1M context) with the
released layer schedule cut to `num_layers`: 1-based layer i is MLA when i % 4 == 0 or i is the
last layer (27 layers: MLA at 4, 8, ..., 24, 27, as released), KDA otherwise; layer 1 is the dense
MLP layer, the rest MoE.  `python -m kda_rt.bench --config kimi-linear-48b-a3b --random-weights`.
"""

from __future__ import annotations

import copy
from typing import Any

from kda_rt.demo.make_demo import DEMO_CONFIG

__all__ = ["PRESETS", "kimi_linear_48b_a3b"]


def kimi_linear_48b_a3b(num_layers: int = 27) -> dict[str, Any]:
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
    mla = [i for i in range(1, num_layers + 1) if i % 4 == 0 or (i == num_layers and num_layers >= 4)]
    kda = [i for i in range(1, num_layers + 1) if i not in mla]
    cfg = copy.deepcopy(DEMO_CONFIG)
    cfg.update(vocab_size=163840, hidden_size=2304, intermediate_size=9216, num_attention_heads=32,
               num_key_value_heads=32, num_experts=256, num_experts_per_token=8, moe_intermediate_size=1024,
               num_hidden_layers=num_layers, bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
               model_max_length=1048576,
               linear_attn_config={"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
                                   "kda_layers": kda, "full_attn_layers": mla})
    return cfg


PRESETS = {"kimi-linear-48b-a3b": kimi_linear_48b_a3b}
