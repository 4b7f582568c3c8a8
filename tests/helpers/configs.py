"""Model configs for the tests, in the hub layout of `config.json`, all derived from the demo's
`DEMO_CONFIG` (kda_rt/demo/make_demo.py) so that there is one source of truth for the architecture.

`tiny_config()`: the demo architecture (4 layers KDA, KDA, MLA, KDA; dense MLP then MoE, 8 experts
top-2) shrunk to hidden 64, head dims 32 / 16+8 / latent 32 and vocab 512: a step takes about a
millisecond on the NumPy backend.

`k48_config()`: the demo architecture at Kimi-Linear-48B shapes (D 2304, 32 heads, 256 experts
top-8), used by the GPU tests and benchmarks.  As a script it writes that config:
`python tests/helpers/configs.py OUT.json [NUM_LAYERS]`.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

from kda_rt.demo.make_demo import DEMO_CONFIG
from kda_rt.demo.presets import kimi_linear_48b_a3b

__all__ = ["k48_config", "tiny_config"]

_TINY_OVERRIDES: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,  # transformers defaults to 163839, outside the tiny vocab
    "linear_attn_config": {**DEMO_CONFIG["linear_attn_config"], "head_dim": 32},
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "moe_intermediate_size": 32,
}


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """A fresh tiny config dict (no `model_max_length`: limits come from the engine arguments), with
    top-level keys replaced by `overrides`."""
    cfg = copy.deepcopy({k: v for k, v in DEMO_CONFIG.items() if k != "model_max_length"})
    cfg.update(copy.deepcopy(_TINY_OVERRIDES))
    cfg.update(copy.deepcopy(overrides))
    return cfg


def k48_config(num_layers: int = 4) -> dict[str, Any]:
    """Kimi-Linear-48B-A3B's shapes and layer schedule cut to `num_layers` (kda_rt/demo/presets.py)."""
    return kimi_linear_48b_a3b(num_layers)


if __name__ == "__main__":
    with open(sys.argv[1], "w") as fh:
        json.dump(k48_config(int(sys.argv[2]) if len(sys.argv) > 2 else 4), fh, indent=1)
