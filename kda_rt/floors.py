"""Lower bounds for a step's time, computed from the model config: the bytes a decode step must move
and the FLOPs a prefill must do.  The bench prints them beside every measured time (with the ratio),
so a number never stands without its floor.

Decode (bytes at the copy bandwidth): every weight except the routed experts and the embedding table
once, the routed experts the step actually touched (counted on the GPU per MoE layer), each
sequence's KDA state (fp32 recurrent state and bf16 conv state, read and written), each sequence's
MLA latent cache up to its context (read), and the fp32 logits (written, then read by the sampler).

Prefill (FLOPs at the bf16 tensor-core peak): 2 FLOP per active weight per token (the routed top-k
and the shared experts; the lm_head only for the rows that are sampled) plus causal MLA attention
(q·k over qk_head_dim and p·v over v_head_dim per head, L(L+1)/2 pairs per prompt).  KDA's chunk
products (~6 MFLOP per token per layer at the 48B shape, a few % of the weights' FLOPs) are left out,
so the floor is a little low, never high.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kda_rt.loader.config import ModelConfig

__all__ = ["COPY_BYTES_PER_S", "BF16_FLOPS", "WeightBytes", "weight_bytes", "decode_floor", "prefill_floor", "op_work"]

COPY_BYTES_PER_S = 4.3e12  # H200 device-to-device copy, measured (../shared/docs/gpu_facts.md)
BF16_FLOPS = 790e12  # H200 dense bf16 tensor-core peak, measured with cuBLAS (gpu_facts.md)

_EXPERT = ".block_sparse_moe.experts."


@dataclass(frozen=True)
class WeightBytes:
    """Device bytes of the weights, split the way a decode step reads them."""

    dense: int  # read once per step: everything but the routed experts and the embedding table
    per_expert: int  # one routed expert (w1, w3, w2)
    embed_row: int  # one row of the embedding table
    dense_params: int  # parameters every token uses (not the routed experts, embedding or lm_head)
    lm_head_params: int
    expert_params: int  # one routed expert


def weight_bytes(config: ModelConfig) -> WeightBytes:
    from kda_rt.loader.weights import MATMUL_KINDS, expected_tensors

    stored = 4 if config.dtype == "float32" else 2
    dense = dense_params = lm_head = embed_row = 0
    expert_params = 3 * config.hidden_size * config.moe.intermediate_size if config.moe is not None else 0
    for name, (shape, kind) in expected_tensors(config).items():
        n = int(np.prod(shape))
        size = 4 if name.endswith(".gate.weight") or kind not in MATMUL_KINDS else stored  # routers upload fp32
        if _EXPERT in name:
            continue
        elif name == "model.embed_tokens.weight":
            embed_row = shape[1] * size
            if config.tie_word_embeddings:  # the lm_head reads the whole table
                dense += n * size
                lm_head = n
        elif name == "lm_head.weight":
            dense += n * size
            lm_head = n
        else:
            dense += n * size
            dense_params += n
    return WeightBytes(dense, expert_params * stored, embed_row, dense_params, lm_head, expert_params)


def _moe_layers(config: ModelConfig) -> list[int]:
    return [i for i, kind in enumerate(config.mlp_types) if kind == "moe"]


def decode_floor(config: ModelConfig, batch: int, context: float, touched: dict[int, float] | None = None,
                 *, bandwidth: float = COPY_BYTES_PER_S) -> dict:
    """Bytes and seconds one decode step of `batch` sequences at mean `context` tokens must move.
    `touched`: MoE layer id -> mean experts routed per step (as counted in the run); default: the
    expected number of distinct experts under uniform routing, E(1 - (1 - A/E)^batch)."""
    w = weight_bytes(config)
    moe = _moe_layers(config)
    if touched is None and config.moe is not None:
        E, A = config.moe.num_experts, config.moe.top_k
        touched = {i: E * (1 - (1 - A / E) ** batch) for i in moe}
    experts = sum((touched or {}).get(i, 0.0) for i in moe)
    state = 0
    if config.kda is not None:
        kc = config.kda
        P = kc.num_heads * kc.head_dim
        per_seq = kc.num_heads * kc.head_dim * kc.head_dim * 4 + 3 * P * (kc.conv_kernel_size - 1) * 2
        state = 2 * per_seq * batch * len(config.kda_layer_ids)  # read and write
    cache = 0
    if config.mla is not None:
        cache = int(batch * (context + 1) * config.mla.cache_width * 2 * len(config.mla_layer_ids))
    logits = 2 * batch * config.vocab_size * 4
    parts = {"dense_weights": w.dense, "experts": experts * w.per_expert, "kda_state": state, "mla_cache": cache,
             "logits": logits, "embed": batch * w.embed_row}
    total = sum(parts.values())
    return {"bytes": total, "seconds": total / bandwidth, "experts_per_moe_layer": experts / max(1, len(moe)),
            "parts": parts}


def prefill_floor(config: ModelConfig, prompt_lens: list[int], *, flops_rate: float = BF16_FLOPS) -> dict:
    """FLOPs and seconds of prefilling prompts of these lengths (one sampled row each)."""
    w = weight_bytes(config)
    tokens = sum(prompt_lens)
    per_token = w.dense_params
    if config.moe is not None:
        per_token += len(_moe_layers(config)) * config.moe.top_k * w.expert_params
    flops = 2.0 * per_token * tokens + 2.0 * w.lm_head_params * len(prompt_lens)
    if config.mla is not None:
        mc = config.mla
        pairs = sum(L * (L + 1) / 2 for L in prompt_lens)
        flops += 2.0 * mc.num_heads * (mc.qk_head_dim + mc.v_head_dim) * pairs * len(config.mla_layer_ids)
    return {"flops": flops, "seconds": flops / flops_rate, "active_params_per_token": per_token}


def _layer_params(config: ModelConfig) -> dict[str, int]:
    """Parameters of the ops the profile times, summed over layers: 'kda', 'mla' (mixer weights),
    'dense' (dense MLPs), 'router', 'shared' (MoE layers), 'lm_head', 'norm' (all norm weights)."""
    from kda_rt.loader.weights import expected_tensors

    out = dict.fromkeys(("kda", "mla", "dense", "router", "shared", "lm_head", "norm"), 0)
    for name, (shape, _) in expected_tensors(config).items():
        n = int(np.prod(shape))
        if _EXPERT in name or name == "model.embed_tokens.weight":
            continue
        if name == "lm_head.weight":
            out["lm_head"] += n
        elif "layernorm" in name or name == "model.norm.weight":
            out["norm"] += n
        elif ".self_attn." in name:
            layer = int(name.split(".")[2])
            out["kda" if config.layer_types[layer] == "kda" else "mla"] += n
        elif ".block_sparse_moe.gate." in name:
            out["router"] += n
        elif ".block_sparse_moe.shared_experts." in name:
            out["shared"] += n
        elif ".mlp." in name:
            out["dense"] += n
    if config.tie_word_embeddings:
        out["lm_head"] = config.vocab_size * config.hidden_size
    return out


def op_work(config: ModelConfig, *, decode: bool, batch: int, tokens: int, context: float,
            touched: dict[int, float] | None = None, prompt_lens: list[int] | None = None) -> dict[str, tuple[float, str]]:
    """What each profiled op (`bench --profile`'s scopes) must at least do in one step: bytes moved
    ('B') for a decode step of `batch` sequences at mean `context`, FLOPs ('FLOP') for a prefill step
    of `tokens` new tokens (whole prompts `prompt_lens`).  Same models as `decode_floor` /
    `prefill_floor`, split by op; norms, embed and the KDA chunk products are left out of prefill."""
    p = _layer_params(config)
    w = weight_bytes(config)
    size = 4 if config.dtype == "float32" else 2
    moe_layers = _moe_layers(config)
    D = config.hidden_size
    if decode:
        kda = mla = 0.0
        if config.kda is not None:
            kc = config.kda
            P = kc.num_heads * kc.head_dim
            state = 2 * batch * (kc.num_heads * kc.head_dim * kc.head_dim * 4 + 3 * P * (kc.conv_kernel_size - 1) * 2)
            kda = p["kda"] * size + state * len(config.kda_layer_ids)
        if config.mla is not None:
            mla = p["mla"] * size + batch * (context + 1) * config.mla.cache_width * 2 * len(config.mla_layer_ids)
        if touched is None and config.moe is not None:
            E, A = config.moe.num_experts, config.moe.top_k
            touched = {i: E * (1 - (1 - A / E) ** batch) for i in moe_layers}
        experts = sum((touched or {}).get(i, 0.0) for i in moe_layers)
        moe = experts * w.per_expert + p["shared"] * size + p["router"] * 4
        work = {"kda.decode": kda, "mla.decode": mla, "moe": moe, "dense": p["dense"] * size,
                "final norm+lm_head": p["lm_head"] * size + 2 * batch * config.vocab_size * 4,
                "norm+residual": p["norm"] * 4 + 3 * 2 * batch * D * 2 * config.num_hidden_layers,
                "embed": 2 * batch * D * 2}
        return {op: (float(v), "B") for op, v in work.items()}
    rows = len(prompt_lens) if prompt_lens else batch
    mla_attn = 0.0
    if config.mla is not None and prompt_lens:
        mc = config.mla
        pairs = sum(L * (L + 1) / 2 for L in prompt_lens)
        mla_attn = 2.0 * mc.num_heads * (mc.qk_head_dim + mc.v_head_dim) * pairs * len(config.mla_layer_ids)
    routed = len(moe_layers) * config.moe.top_k * w.expert_params if config.moe is not None else 0
    work = {"kda.prefill": 2.0 * p["kda"] * tokens, "mla.prefill": 2.0 * p["mla"] * tokens + mla_attn,
            "moe": 2.0 * (routed + p["shared"] + p["router"]) * tokens, "dense": 2.0 * p["dense"] * tokens,
            "final norm+lm_head": 2.0 * p["lm_head"] * rows}
    return {op: (float(v), "FLOP") for op, v in work.items()}
