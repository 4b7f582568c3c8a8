"""Checkpoint -> GPU weights in the layouts the kernels want (fusions happen once, here).

Per KDA layer: w_qkv [3P, D] = q|k|v proj; w_fgb [2R+H, D] = f_a | g_a | b_proj (one small GEMM);
f_b, g_b [P, R]; conv_w [3P, W] fp32; A_log [H], dt_bias [P], o_norm [K] fp32; o_proj [D, P].
Per MLA layer: w_qkva [H*(Dn+Dr) + Rl+Dr, D] = q_proj | kv_a_proj_with_mqa; kv_norm [Rl]; kv_b [H*(Dn+Dv), Rl]; o_proj.
Dense MLP: w_gu [2I, D] = gate | up; w_down [D, I].  MoE: router [E, D] fp32, bias [E] fp32,
w13 [E, 2I, D] (experts' w1 | w3), w2 [E, D, I], shared gate|up [2Is, D] and down [D, Is].
Matmul weights stay bf16 (or are cast to it), small tensors fp32.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from kda_rt.cuda.ops.check import BF16
from kda_rt.cuda.upload import Uploader
from kda_rt.loader.config import KDA, MLA, MOE, ModelConfig

__all__ = ["LayerWeights", "ModelWeights", "upload_weights"]

logger = logging.getLogger(__name__)


@dataclass
class LayerWeights:
    kind: str  # "kda" | "mla"
    mlp: str  # "dense" | "moe"
    t: dict[str, Any] = field(default_factory=dict)  # device arrays by role


@dataclass
class ModelWeights:
    embed: Any
    norm: Any
    lm_head: Any
    layers: list[LayerWeights]
    nbytes: int


def _cat(up: Uploader, parts: list[np.ndarray], dtype=BF16):
    """Device array of the row-wise concatenation of `parts`, uploaded part by part."""
    import cupy

    rows = sum(p.shape[0] for p in parts)
    dst = cupy.empty((rows, *parts[0].shape[1:]), dtype=dtype)
    r = 0
    for p in parts:
        up.copy(dst[r:r + p.shape[0]], p)
        r += p.shape[0]
    return dst


def upload_weights(config: ModelConfig, raw: Mapping[str, np.ndarray], *, progress: bool | None = None) -> ModelWeights:
    import cupy

    up = Uploader()
    total = sum(np.asarray(v).nbytes for v in raw.values())
    show = progress if progress is not None else total > (1 << 30)
    bar = tqdm(total=config.num_hidden_layers + 1, desc="upload weights", unit="layer", disable=not show)
    f32 = np.float32

    def w(name: str, dtype=BF16):
        return up.new(np.asarray(raw[name]), dtype=dtype)

    embed = w("model.embed_tokens.weight")
    norm = w("model.norm.weight")
    lm_head = embed if config.tie_word_embeddings else w("lm_head.weight")
    bar.update(1)
    layers = []
    for i, (kind, mlp) in enumerate(zip(config.layer_types, config.mlp_types, strict=True)):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        L = LayerWeights(kind, mlp)
        t = L.t
        t["in_norm"] = w(p + "input_layernorm.weight")
        t["post_norm"] = w(p + "post_attention_layernorm.weight")
        if kind == KDA:
            kc = config.kda
            H = kc.num_heads
            t["w_qkv"] = _cat(up, [raw[a + "q_proj.weight"], raw[a + "k_proj.weight"], raw[a + "v_proj.weight"]])
            t["w_fgb"] = _cat(up, [raw[a + "f_a_proj.weight"], raw[a + "g_a_proj.weight"], raw[a + "b_proj.weight"]])
            t["rank_f"] = raw[a + "f_a_proj.weight"].shape[0]
            t["rank_g"] = raw[a + "g_a_proj.weight"].shape[0]
            t["f_b"] = w(a + "f_b_proj.weight")
            t["g_b"] = w(a + "g_b_proj.weight")
            conv = [np.asarray(raw[a + f"{n}_conv1d.weight"], dtype=f32)[:, 0, :] for n in ("q", "k", "v")]
            t["conv_w"] = up.new(np.concatenate(conv, axis=0), dtype=f32)
            t["A_log"] = up.new(np.asarray(raw[a + "A_log"], dtype=f32).reshape(H), dtype=f32)
            t["dt_bias"] = up.new(np.asarray(raw[a + "dt_bias"], dtype=f32).reshape(-1), dtype=f32)
            t["o_norm"] = up.new(np.asarray(raw[a + "o_norm.weight"], dtype=f32), dtype=f32)
            t["o_proj"] = w(a + "o_proj.weight")
        elif kind == MLA:
            t["w_qkva"] = _cat(up, [raw[a + "q_proj.weight"], raw[a + "kv_a_proj_with_mqa.weight"]])
            t["kv_norm"] = w(a + "kv_a_layernorm.weight")
            t["kv_b"] = w(a + "kv_b_proj.weight")
            t["o_proj"] = w(a + "o_proj.weight")
        if mlp == MOE:
            m = p + "block_sparse_moe."
            mc = config.moe
            t["router"] = w(m + "gate.weight", dtype=f32)
            t["bias"] = w(m + "gate.e_score_correction_bias", dtype=f32)
            E, inter, D = mc.num_experts, mc.intermediate_size, config.hidden_size
            w13 = cupy.empty((E, 2 * inter, D), dtype=BF16)
            w2 = cupy.empty((E, D, inter), dtype=BF16)
            for e in range(E):
                up.copy(w13[e, :inter], raw[f"{m}experts.{e}.w1.weight"])
                up.copy(w13[e, inter:], raw[f"{m}experts.{e}.w3.weight"])
                up.copy(w2[e], raw[f"{m}experts.{e}.w2.weight"])
            t["w13"], t["w2"] = w13, w2
            if mc.num_shared_experts:
                s = m + "shared_experts."
                t["shared_w13"] = _cat(up, [raw[s + "gate_proj.weight"], raw[s + "up_proj.weight"]])
                t["shared_w2"] = w(s + "down_proj.weight")
            else:
                t["shared_w13"] = t["shared_w2"] = None
        else:
            m = p + "mlp."
            t["w_gu"] = _cat(up, [raw[m + "gate_proj.weight"], raw[m + "up_proj.weight"]])
            t["w_down"] = w(m + "down_proj.weight")
        layers.append(L)
        bar.update(1)
    up.finish()
    bar.close()
    return ModelWeights(embed, norm, lm_head, layers, up.bytes_uploaded)
