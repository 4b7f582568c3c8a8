"""The Kimi Linear decoder (NumPy backend): embeddings, KDA / MLA mixers, dense / MoE MLPs, lm_head.

Wiring (spec §6), for every layer i of the schedule in `ModelConfig`:

    h = embed_tokens[ids]                                            no scaling
    a = RMSNorm(h; layers.i.input_layernorm, eps)
    h = h + (KDA(a) if layer_types[i] == "kda" else MLA(a))
    m = RMSNorm(h; layers.i.post_attention_layernorm, eps)
    h = h + (DenseMLP(m) if mlp_types[i] == "dense" else MoE(m))
    logits = RMSNorm(h[logits_indices]; model.norm, eps) · lm_headᵀ   (embed_tokens when tied)

The model sees only a `ForwardBatch` and the two cache pools; it writes the KDA states and the
MLA pages of this step in place.  Letters: T tokens, D hidden, N logits rows, V vocab.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kda_rt.engine.batch import ForwardBatch
from kda_rt.loader.config import ModelConfig
from kda_rt.loader.schema import KDAWeights, MLPWeights, ModelWeights, read_weights
from kda_rt.reference.cache import KDAStatePool, MLAKVPool
from kda_rt.reference.kda import kda_forward
from kda_rt.reference.layers import gated_mlp, linear, rms_norm
from kda_rt.reference.mla import mla_forward
from kda_rt.reference.moe import moe_forward
from kda_rt.reference.params import Compute

__all__ = ["KimiLinearModel", "make_pools"]


def make_pools(
    config: ModelConfig, num_slots: int, num_blocks: int, block_size: int, dtype: np.dtype | type = np.float32
) -> tuple[KDAStatePool, MLAKVPool]:
    """Fresh (KDA state pool with `num_slots` slots, MLA pool of `num_blocks` × `block_size` tokens)."""
    return KDAStatePool(config, num_slots, dtype), MLAKVPool(config, num_blocks, block_size, dtype)


class KimiLinearModel:
    """Kimi Linear forward pass over the typed host weights (`kda_rt.loader.schema.ModelWeights`).

    `weights` is a `ModelWeights` or the hub name -> array mapping of `load_checkpoint` (read into
    one here); each weight is converted to `dtype` (the compute dtype: float32, or float64 in
    tests) when first used.
    """

    def __init__(
        self, config: ModelConfig, weights: ModelWeights | Mapping[str, np.ndarray],
        dtype: np.dtype | type = np.float32, *, bf16_activations: bool = False,
    ) -> None:
        self.config = config
        self.dtype = np.dtype(dtype)
        self.weights = weights if isinstance(weights, ModelWeights) else read_weights(config, weights)
        self.num = Compute(self.dtype, bf16_activations=bf16_activations)

    def embed(self, input_ids: np.ndarray) -> np.ndarray:
        """[T] ids -> [T, D] rows of embed_tokens in the compute dtype (only those rows are converted)."""
        vocab = self.config.vocab_size
        ids = np.asarray(input_ids)
        bad = (ids < 0) | (ids >= vocab)
        if bad.any():
            raise ValueError(f"input id {int(ids[np.argmax(bad)])} is out of range for vocab size {vocab}")
        table = np.asarray(self.weights.embed_tokens)
        return table[ids.astype(np.int64)].astype(self.dtype)

    def forward(self, batch: ForwardBatch, kda_pool: KDAStatePool, mla_pool: MLAKVPool) -> np.ndarray:
        """One model step over `batch`.  Returns float32 logits [N, V] for `batch.logits_indices`."""
        cfg, num = self.config, self.num
        eps, p = cfg.rms_norm_eps, num.w
        act = num.act  # bf16 rounding of activations when emulating a bf16 run, else identity
        h = self.embed(batch.input_ids)  # [T, D]
        for i, layer in enumerate(self.weights.layers):
            a = rms_norm(h, p(layer.input_layernorm), eps, act)
            if isinstance(layer.mixer, KDAWeights):
                conv, rec = kda_pool.layer(i)
                h = act(h + act(kda_forward(layer.mixer, a, batch, conv, rec, cfg.kda, eps, num)))
            else:
                h = act(h + act(mla_forward(layer.mixer, a, batch, mla_pool.layer(i), cfg.mla, num)))
            m = rms_norm(h, p(layer.post_attention_layernorm), eps, act)
            mlp = layer.mlp
            y = gated_mlp(mlp, m, num, dense=True) if isinstance(mlp, MLPWeights) else moe_forward(mlp, m, cfg.moe, num)
            h = act(h + act(y))
        rows = rms_norm(h[np.asarray(batch.logits_indices, dtype=np.int64)], p(self.weights.norm), eps, act)
        return linear(rows, p(self.weights.output)).astype(np.float32)  # [N, V]
