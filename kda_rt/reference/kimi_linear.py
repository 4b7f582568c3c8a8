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
from kda_rt.loader.config import DENSE, KDA, ModelConfig
from kda_rt.reference.cache import KDAStatePool, MLAKVPool
from kda_rt.reference.kda import kda_forward
from kda_rt.reference.layers import gated_mlp, linear, rms_norm
from kda_rt.reference.mla import mla_forward
from kda_rt.reference.moe import moe_forward
from kda_rt.reference.params import Params

__all__ = ["KimiLinearModel", "make_pools"]


def make_pools(
    config: ModelConfig, num_slots: int, num_blocks: int, block_size: int, dtype: np.dtype | type = np.float32
) -> tuple[KDAStatePool, MLAKVPool]:
    """Fresh (KDA state pool with `num_slots` slots, MLA pool of `num_blocks` × `block_size` tokens)."""
    return KDAStatePool(config, num_slots, dtype), MLAKVPool(config, num_blocks, block_size, dtype)


class KimiLinearModel:
    """Kimi Linear forward pass over checkpoint tensors named as on the hub.

    `weights` maps hub keys to arrays in their stored dtype; each weight is converted to `dtype`
    (the compute dtype: float32, or float64 in tests) when first used.  Names are those of
    `loader.weights.load_checkpoint` (dense MLP under `mlp.`, MoE under `block_sparse_moe.`).
    """

    def __init__(
        self, config: ModelConfig, weights: Mapping[str, np.ndarray], dtype: np.dtype | type = np.float32,
        *, bf16_activations: bool = False,
    ) -> None:
        self.config = config
        self.dtype = np.dtype(dtype)
        self.params = Params(weights, self.dtype, bf16_activations=bf16_activations)
        self._mlp_prefix = [
            f"model.layers.{i}.{'mlp' if t == DENSE else 'block_sparse_moe'}." for i, t in enumerate(config.mlp_types)
        ]
        self._lm_head_key = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        for key in ("model.embed_tokens.weight", "model.norm.weight", self._lm_head_key):
            if key not in self.params:
                raise KeyError(f"KimiLinearModel: checkpoint has no tensor '{key}'")

    def embed(self, input_ids: np.ndarray) -> np.ndarray:
        """[T] ids -> [T, D] rows of embed_tokens in the compute dtype (only those rows are converted)."""
        vocab = self.config.vocab_size
        ids = np.asarray(input_ids)
        bad = (ids < 0) | (ids >= vocab)
        if bad.any():
            raise ValueError(f"input id {int(ids[np.argmax(bad)])} is out of range for vocab size {vocab}")
        table = np.asarray(self.params.raw["model.embed_tokens.weight"])
        return table[ids.astype(np.int64)].astype(self.dtype)

    def forward(self, batch: ForwardBatch, kda_pool: KDAStatePool, mla_pool: MLAKVPool) -> np.ndarray:
        """One model step over `batch`.  Returns float32 logits [N, V] for `batch.logits_indices`."""
        cfg, p = self.config, self.params
        eps = cfg.rms_norm_eps
        act = p.act  # bf16 rounding of activations when emulating a bf16 run, else identity
        h = self.embed(batch.input_ids)  # [T, D]
        for i, kind in enumerate(cfg.layer_types):
            layer = f"model.layers.{i}."
            a = rms_norm(h, p[layer + "input_layernorm.weight"], eps, act)
            attn = p.sub(layer + "self_attn.")
            if kind == KDA:
                conv, rec = kda_pool.layer(i)
                h = act(h + act(kda_forward(attn, a, batch, conv, rec, cfg.kda, eps)))
            else:
                h = act(h + act(mla_forward(attn, a, batch, mla_pool.layer(i), cfg.mla)))
            m = rms_norm(h, p[layer + "post_attention_layernorm.weight"], eps, act)
            mlp = p.sub(self._mlp_prefix[i])
            h = act(h + act(gated_mlp(mlp, m) if cfg.mlp_types[i] == DENSE else moe_forward(mlp, m, cfg.moe)))
        rows = rms_norm(h[np.asarray(batch.logits_indices, dtype=np.int64)], p["model.norm.weight"], eps, act)
        return linear(rows, p[self._lm_head_key]).astype(np.float32)  # [N, V]
