"""NumPy cache pools: KDA state slots and the paged MLA latent-KV pool.

The model writes into these in place; the engine owns slot and page allocation.  Layout
(per KDA layer l, slot s):
  conv[l, s]       [3, W-1, P]  previous W-1 raw (pre-conv, pre-SiLU) q|k|v projections, oldest first
  recurrent[l, s]  [H, K, V]    fp32 delta-rule state, rows = key channel
MLA (per MLA layer l, page p):
  kv[l, p]         [block_size, R+Dr]  normalised latent c (R) then raw k_pe (Dr), one row per token
"""

from __future__ import annotations

import numpy as np

from kda_rt.loader.config import ModelConfig

__all__ = ["KDAStatePool", "MLAKVPool"]


class KDAStatePool:
    """Fixed per-sequence KDA state: one slot per running sequence, for every KDA layer."""

    def __init__(self, config: ModelConfig, num_slots: int, dtype: np.dtype = np.float32) -> None:
        kda = config.kda
        num_layers = len(config.kda_layer_ids)
        self.num_slots = num_slots
        self.layer_index = {layer: i for i, layer in enumerate(config.kda_layer_ids)}
        if kda is None or num_layers == 0:
            self.conv = np.zeros((0, num_slots, 3, 0, 0), dtype=dtype)
            self.recurrent = np.zeros((0, num_slots, 0, 0, 0), dtype=dtype)
            return
        p = kda.num_heads * kda.head_dim
        self.conv = np.zeros((num_layers, num_slots, 3, kda.conv_kernel_size - 1, p), dtype=dtype)
        self.recurrent = np.zeros((num_layers, num_slots, kda.num_heads, kda.head_dim, kda.head_dim), dtype=dtype)

    def layer(self, layer_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(conv [S, 3, W-1, P], recurrent [S, H, K, V]) views for decoder layer `layer_id`."""
        i = self.layer_index[layer_id]
        return self.conv[i], self.recurrent[i]


class MLAKVPool:
    """Paged latent KV cache: `num_blocks` pages of `block_size` tokens per MLA layer."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: np.dtype = np.float32) -> None:
        num_layers = len(config.mla_layer_ids)
        width = config.mla.cache_width if config.mla is not None else 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layer_index = {layer: i for i, layer in enumerate(config.mla_layer_ids)}
        self.kv = np.zeros((num_layers, num_blocks, block_size, width), dtype=dtype)

    def layer(self, layer_id: int) -> np.ndarray:
        """[num_blocks, block_size, R+Dr] view for decoder layer `layer_id`."""
        return self.kv[self.layer_index[layer_id]]
