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
so the floor is a little low, never high.  For fp8 models a second prefill floor takes the products they run on
e4m3 tensor cores at twice the bf16 rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kda_rt.loader.config import ModelConfig

__all__ = ["COPY_BYTES_PER_S", "BF16_FLOPS", "WeightBytes", "weight_bytes", "decode_floor", "e4m3_gemv_savings",
           "prefill_floor", "op_work"]

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


def _weight_split(config: ModelConfig, quantization: str | None = None) -> dict[str, list[int]]:
    """[parameters, device bytes] of the weights per profiled op: 'kda', 'mla' (mixer weights), 'dense'
    (dense MLPs), 'router', 'shared' (MoE layers), 'lm_head', 'norm' (every norm weight), 'other';
    the routed experts and the embedding table are left out (`weight_bytes` has them).  Matmuls are
    stored in the config's dtype, routers and small tensors in fp32 (as cuda/weights.py uploads them); with
    quantization "fp8" a shared expert of the experts' width in e4m3 (a byte a weight, an fp32 scale a row)."""
    from kda_rt.loader.weights import MATMUL_KINDS, ROUTER, expected_tensors

    stored = 4 if config.dtype == "float32" else 2
    out = {k: [0, 0] for k in ("kda", "mla", "dense", "router", "shared", "lm_head", "norm", "other")}
    for name, (shape, kind) in expected_tensors(config).items():
        if _EXPERT in name or (name == "model.embed_tokens.weight" and not config.tie_word_embeddings):
            continue
        n = int(np.prod(shape))
        size = 4 if kind == ROUTER or kind not in MATMUL_KINDS else stored
        if name in ("lm_head.weight", "model.embed_tokens.weight"):  # the embedding only when tied
            key = "lm_head"
        elif "layernorm" in name or name == "model.norm.weight":
            key = "norm"
        elif ".self_attn." in name:
            key = "kda" if config.layer_types[int(name.split(".")[2])] == "kda" else "mla"
        elif ".block_sparse_moe.gate." in name:
            key = "router"
        elif ".block_sparse_moe.shared_experts." in name:
            key = "shared"
        elif ".mlp." in name:
            key = "dense"
        else:
            key = "other"
        out[key][0] += n
        out[key][1] += n * size
    if quantization == "fp8" and config.moe is not None and config.moe.num_shared_experts == 1:
        rows = 2 * config.moe.intermediate_size + config.hidden_size  # (loader/quant.expert_weight_names)
        n = out["shared"][0]
        out["shared"][1] = n + 4 * rows * len(_moe_layers(config))
    return out


def weight_bytes(config: ModelConfig, quantization: str | None = None) -> WeightBytes:
    """quantization "fp8" (EngineConfig.quantization): the experts (and a shared expert of their width) as one byte a
    weight plus an fp32 scale a row."""
    split = _weight_split(config, quantization)
    stored = 4 if config.dtype == "float32" else 2
    expert_params = 3 * config.hidden_size * config.moe.intermediate_size if config.moe is not None else 0
    if quantization == "fp8" and config.moe is not None:
        rows = 2 * config.moe.intermediate_size + config.hidden_size  # w1 | w3 rows, w2 rows: a scale each
        dense = sum(b for _, b in split.values())
        return WeightBytes(dense, expert_params + 4 * rows, config.hidden_size * stored,
                           sum(n for key, (n, _) in split.items() if key != "lm_head"), split["lm_head"][0],
                           expert_params)
    dense = sum(b for _, b in split.values())
    dense_params = sum(n for key, (n, _) in split.items() if key != "lm_head")
    embed_row = config.hidden_size * stored
    return WeightBytes(dense, expert_params * stored, embed_row, dense_params, split["lm_head"][0], expert_params)


# the dense projections an fp8 model's decode steps of one sequence (up to KDA_RT_FP8_DECODE_GEMV_MAX_T rows) read as
# e4m3 rows with KDA_RT_FP8_DECODE_GEMV (cuda/model.py: KDA q|k|v|f_a|g_a|b and o_proj, MLA q|kv_a and o_proj, the
# dense layers' gate|up)
_GEMV_E4M3 = {"kda": ("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj", "o_proj"),
              "mla": ("q_proj", "kv_a_proj_with_mqa", "o_proj"), "dense": ("gate_proj", "up_proj")}


def e4m3_gemv_savings(config: ModelConfig) -> int:
    """Bytes a decode step of an fp8 model with KDA_RT_FP8_DECODE_GEMV does not read (one sequence, or up to
    KDA_RT_FP8_DECODE_GEMV_MAX_T rows): the e4m3 rows of those projections (a byte a weight, an fp32 scale a row) in
    place of their stored weights, for each whose width the e4m3 GEMV takes (ops/gemv.py takes_e4m3_width; the KDA
    q|k|v|f_a|g_a|b matrix's zero padding rows, under 8 a layer, left out)."""
    from kda_rt.cuda.ops.gemv import takes_e4m3_width  # (imports no CuPy)
    from kda_rt.loader.weights import expected_tensors

    stored = 4 if config.dtype == "float32" else 2
    saved = 0
    for name, (shape, _) in expected_tensors(config).items():
        parts = name.split(".")
        if len(parts) != 6 or parts[0] != "model" or parts[1] != "layers" or parts[5] != "weight":
            continue
        i, block, proj = int(parts[2]), parts[3], parts[4]
        kind = config.layer_types[i] if block == "self_attn" else config.mlp_types[i] if block == "mlp" else None
        if kind not in _GEMV_E4M3 or proj not in _GEMV_E4M3[kind]:
            continue
        rows, k = shape
        if takes_e4m3_width(k):
            saved += rows * k * (stored - 1) - 4 * rows
    return saved


def _moe_layers(config: ModelConfig) -> list[int]:
    return [i for i, kind in enumerate(config.mlp_types) if kind == "moe"]


def _touched(config: ModelConfig, batch: int, touched: dict[int, float] | None) -> dict[int, float]:
    """Experts routed per MoE layer: as counted, else the uniform-routing expectation E(1 - (1 - A/E)^batch)."""
    if touched is not None or config.moe is None:
        return touched or {}
    E, A = config.moe.num_experts, config.moe.top_k
    return {i: E * (1 - (1 - A / E) ** batch) for i in _moe_layers(config)}


def _state_bytes(config: ModelConfig, batch: int, context: float) -> tuple[int, int]:
    """(KDA states read and written: fp32 recurrent + bf16 conv, MLA latent cache read up to the context)
    of one decode step over all layers."""
    state = cache = 0
    if config.kda is not None:
        kc = config.kda
        P = kc.num_heads * kc.head_dim
        per_seq = kc.num_heads * kc.head_dim * kc.head_dim * 4 + 3 * P * (kc.conv_kernel_size - 1) * 2
        state = 2 * per_seq * batch * len(config.kda_layer_ids)
    if config.mla is not None:
        cache = int(batch * (context + 1) * config.mla.cache_width * 2 * len(config.mla_layer_ids))
    return state, cache


def decode_floor(config: ModelConfig, batch: int, context: float, touched: dict[int, float] | None = None,
                 *, bandwidth: float = COPY_BYTES_PER_S, quantization: str | None = None,
                 e4m3_gemv: bool = False) -> dict:
    """Bytes and seconds one decode step of `batch` sequences at mean `context` tokens must move.
    `touched`: MoE layer id -> mean experts routed per step (as counted in the run); default: the
    expected number of distinct experts under uniform routing, E(1 - (1 - A/E)^batch).  quantization: as
    weight_bytes.  e4m3_gemv: the step reads the dense projections of `e4m3_gemv_savings` as e4m3 rows
    (KDA_RT_FP8_DECODE_GEMV: fp8 models' steps of up to KDA_RT_FP8_DECODE_GEMV_MAX_T rows)."""
    w = weight_bytes(config, quantization)
    moe = _moe_layers(config)
    experts = sum(_touched(config, batch, touched).get(i, 0.0) for i in moe)
    state, cache = _state_bytes(config, batch, context)
    logits = 2 * batch * config.vocab_size * 4
    dense = w.dense - (e4m3_gemv_savings(config) if e4m3_gemv else 0)
    parts = {"dense_weights": dense, "experts": experts * w.per_expert, "kda_state": state, "mla_cache": cache,
             "logits": logits, "embed": batch * w.embed_row}
    total = sum(parts.values())
    return {"bytes": total, "seconds": total / bandwidth, "experts_per_moe_layer": experts / max(1, len(moe)),
            "parts": parts}


def _attention_flops(config: ModelConfig, prompt_lens: list[int]) -> float:
    """Causal MLA attention of whole prompts: q·k over qk_head_dim and p·v over v_head_dim per head and pair."""
    if config.mla is None:
        return 0.0
    mc = config.mla
    pairs = sum(L * (L + 1) / 2 for L in prompt_lens)
    return 2.0 * mc.num_heads * (mc.qk_head_dim + mc.v_head_dim) * pairs * len(config.mla_layer_ids)


def prefill_floor(config: ModelConfig, prompt_lens: list[int], *, flops_rate: float = BF16_FLOPS,
                  quantization: str | None = None) -> dict:
    """FLOPs and seconds of prefilling prompts of these lengths (one sampled row each).  quantization "fp8": also
    "seconds_fp8", the same FLOPs with the products that fp8 models run on e4m3 tensor cores (`_fp8_params`) at twice
    `flops_rate` (the e4m3 tensor cores' nominal rate is twice bf16's; not measured here), and "fp8_share", their
    share of the FLOPs."""
    w = weight_bytes(config)
    tokens = sum(prompt_lens)
    per_token = w.dense_params
    if config.moe is not None:
        per_token += len(_moe_layers(config)) * config.moe.top_k * w.expert_params
    flops = 2.0 * per_token * tokens + 2.0 * w.lm_head_params * len(prompt_lens) + _attention_flops(config, prompt_lens)
    out = {"flops": flops, "seconds": flops / flops_rate, "active_params_per_token": per_token}
    if quantization == "fp8":
        fp8 = 2.0 * _fp8_params(config) * tokens
        out.update(seconds_fp8=fp8 / (2 * flops_rate) + (flops - fp8) / flops_rate, fp8_share=fp8 / flops)
    return out


_FP8_MIXER = (".q_proj.", ".k_proj.", ".v_proj.", ".o_proj.", ".kv_a_proj_with_mqa.")


def _fp8_params(config: ModelConfig) -> int:
    """Active parameters a token multiplies on e4m3 tensor cores in a large prefill step of an fp8 model on sm_90a
    (cuda/weights.py): the routed top-k experts and the shared experts, each KDA layer's q / k / v and o_proj, each
    MLA layer's q and kv_a and o_proj, the dense MLPs.  (Counting the shared experts even where a shared expert apart
    stays bf16 only lowers the floor.)"""
    from kda_rt.loader.weights import expected_tensors

    n = 0
    for name, (shape, _) in expected_tensors(config).items():
        if _EXPERT in name:
            continue
        if ((".self_attn." in name and any(p in name for p in _FP8_MIXER)) or ".mlp." in name
                or ".block_sparse_moe.shared_experts." in name):
            n += int(np.prod(shape))
    if config.moe is not None:
        n += len(_moe_layers(config)) * config.moe.top_k * weight_bytes(config).expert_params
    return n


def op_work(config: ModelConfig, *, decode: bool, batch: int, tokens: int, context: float,
            touched: dict[int, float] | None = None, prompt_lens: list[int] | None = None,
            quantization: str | None = None) -> dict[str, tuple[float, str]]:
    """What each profiled op (`bench --profile`'s scopes) must at least do in one step: bytes moved
    ('B') for a decode step of `batch` sequences at mean `context`, FLOPs ('FLOP') for a prefill step
    of `tokens` new tokens (whole prompts `prompt_lens`).  Same models as `decode_floor` /
    `prefill_floor`, split by op; norms, embed and the KDA chunk products are left out of prefill.  quantization:
    as weight_bytes (the experts' bytes of a decode step)."""
    split = _weight_split(config, quantization)
    p = {k: n for k, (n, _) in split.items()}  # parameters (prefill FLOPs)
    nbytes = {k: b for k, (_, b) in split.items()}  # device bytes (decode)
    w = weight_bytes(config, quantization)
    moe_layers = _moe_layers(config)
    D = config.hidden_size
    if decode:
        state, cache = _state_bytes(config, batch, context)
        kda, mla = nbytes["kda"] + state, nbytes["mla"] + cache
        experts = sum(_touched(config, batch, touched).get(i, 0.0) for i in moe_layers)
        moe = experts * w.per_expert + nbytes["shared"] + nbytes["router"]
        work = {"kda.decode": kda, "mla.decode": mla, "moe": moe, "dense": nbytes["dense"],
                "final norm+lm_head": nbytes["lm_head"] + 2 * batch * config.vocab_size * 4,
                "norm+residual": nbytes["norm"] + 3 * 2 * batch * D * 2 * config.num_hidden_layers,
                "embed": 2 * batch * D * 2}
        return {op: (float(v), "B") for op, v in work.items()}
    rows = len(prompt_lens) if prompt_lens else batch
    mla_attn = _attention_flops(config, prompt_lens or [])
    routed = len(moe_layers) * config.moe.top_k * w.expert_params if config.moe is not None else 0
    work = {"kda.prefill": 2.0 * p["kda"] * tokens, "mla.prefill": 2.0 * p["mla"] * tokens + mla_attn,
            "moe": 2.0 * (routed + p["shared"] + p["router"]) * tokens, "dense": 2.0 * p["dense"] * tokens,
            "final norm+lm_head": 2.0 * p["lm_head"] * rows}
    return {op: (float(v), "FLOP") for op, v in work.items()}
