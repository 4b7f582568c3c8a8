"""`config.json` -> frozen `ModelConfig`.

Accepts the hub layout (`linear_attn_config` with 1-based `kda_layers` / `full_attn_layers`,
`num_experts`, `num_experts_per_token`, `moe_renormalize`, ...) and the layout transformers >= 5
writes (`layer_types`, `mlp_layer_types`, and the attribute aliases such as `n_group`,
`num_local_experts`, `norm_topk_prob`).  A required field that is missing, a value of the wrong
type, or two spellings of one field that disagree raise `ConfigError` naming the field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .fields import (
    DENSE,
    KDA,
    MAX_INT_FIELD,
    MLA,
    MOE,
    ConfigError,
    Fields,
    check_int_bound,
    layer_schedule,
    mlp_schedule,
    short,
)
from .jsonfile import read_json

__all__ = ["ConfigError", "KDAConfig", "MLAConfig", "MoEConfig", "ModelConfig", "load_config", "parse_config"]

SUPPORTED_MODEL_TYPES = ("kimi_linear",)
# routed expert MLPs over all MoE layers (3 tensors each): Kimi Linear has 256 x 26, Kimi K2 384 x 60; past this the
# schema alone (expected_tensors) takes seconds and GBs (4096 x 1024 layers: 45 s, 4.4 GB) before any tensor is checked
MAX_ROUTED_EXPERTS = 1 << 16
# config.json 'dtype' ('torch_dtype' in older configs): the storage types of the weights kda_rt loads
CONFIG_DTYPES = ("bfloat16", "float16", "float32")

@dataclass(frozen=True)
class KDAConfig:
    num_heads: int  # H
    head_dim: int  # K = V
    conv_kernel_size: int  # W, causal depthwise conv width


@dataclass(frozen=True)
class MLAConfig:
    num_heads: int
    kv_lora_rank: int  # latent width (512)
    qk_nope_head_dim: int  # 128
    qk_rope_head_dim: int  # 64 (NoPE: never rotated)
    v_head_dim: int  # 128
    kv_a_layernorm_eps: float = 1e-6  # HF/transformers use the RMSNorm class default, not rms_norm_eps

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values cached per token per MLA layer: normalised latent + shared k_pe (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int  # E
    top_k: int  # A
    num_shared_experts: int
    intermediate_size: int  # per expert
    renormalize: bool
    routed_scaling_factor: float
    num_expert_group: int
    topk_group: int
    # HF remote code gathers weights from the *biased* scores; vLLM / transformers use the unbiased
    # sigmoid.  False (unbiased) is the default; True reproduces the HF remote code.
    biased_weights: bool = False


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int  # dense MLP width
    rms_norm_eps: float
    layer_types: tuple[str, ...]  # per layer: "kda" | "mla"
    mlp_types: tuple[str, ...]  # per layer: "dense" | "moe"
    kda: KDAConfig | None
    mla: MLAConfig | None
    moe: MoEConfig | None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    max_model_len: int = 1048576
    dtype: str = "bfloat16"

    @property
    def kda_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == KDA)

    @property
    def mla_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == MLA)


# ---------------------------------------------------------------------------------------------


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a `ModelConfig` from the parsed JSON object of a Kimi Linear `config.json`."""
    try:
        return _parse(raw, source)
    except RecursionError:
        raise ConfigError(f"{source}: a field is nested too deeply") from None
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{source}: a field holds a value that cannot be handled ({exc})") from None


def _parse(raw: dict[str, Any], source: str) -> ModelConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: top level must be a JSON object")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: unsupported model_type {short(model_type)}; kda_rt runs {', '.join(SUPPORTED_MODEL_TYPES)} only"
        )
    f = Fields(raw, source)
    num_layers = f.get("num_hidden_layers", int, positive=True)
    hidden = f.get("hidden_size", int, positive=True)
    layer_types = layer_schedule(f, num_layers)
    mlp_types = mlp_schedule(f, num_layers)

    quant = raw.get("quantization_config")
    if quant is not None:  # (was: its weight_scale tensors refused one by one as "unexpected tensors for this config")
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ConfigError(f"{source}: field 'quantization_config' (quant_method {short(method)}): pre-quantized "
                          "checkpoints are not supported; load the bf16 checkpoint (quantization='fp8' / --quantization "
                          "fp8 quantizes the experts at load)")

    act = f.get("hidden_act", str, "silu")
    if act != "silu":
        raise ConfigError(f"{source}: field 'hidden_act' must be 'silu' for Kimi Linear, got {short(act)}")

    kda = None
    if KDA in layer_types:
        lac = raw.get("linear_attn_config") or {}
        # prefer linear_attn_config; the flat transformers fields are the alternative spelling
        def pick(name: str, flat: str) -> int:
            a, b = lac.get(name), raw.get(flat)
            if a is not None and b is not None and a != b:
                raise ConfigError(f"{source}: contradictory values for 'linear_attn_config.{name}'={short(a)} and '{flat}'={short(b)}")
            value = a if a is not None else b
            if value is None:
                raise ConfigError(f"{source}: required field 'linear_attn_config.{name}' is missing")
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{source}: field 'linear_attn_config.{name}' must be a positive int, got {short(value)}")
            check_int_bound(source, f"linear_attn_config.{name}", value, MAX_INT_FIELD)
            return value

        num_v = lac.get("num_v_heads")
        kda = KDAConfig(
            num_heads=pick("num_heads", "linear_num_heads"),
            head_dim=pick("head_dim", "linear_head_dim"),
            conv_kernel_size=pick("short_conv_kernel_size", "linear_conv_kernel_dim"),
        )
        if num_v is not None and num_v != kda.num_heads:
            raise ConfigError(f"{source}: 'linear_attn_config.num_v_heads'={short(num_v)} != num_heads={kda.num_heads} (GVA unsupported)")
        for key, want in (("use_full_rank_gate", False), ("gate_lower_bound", None)):
            if lac.get(key) not in (None, want):
                raise ConfigError(f"{source}: 'linear_attn_config.{key}'={short(lac[key])} is a Kimi K3 option kda_rt does not support")

    mla = None
    if MLA in layer_types:
        if f.get("q_lora_rank", (int, type(None)), None) is not None:
            raise ConfigError(f"{source}: field 'q_lora_rank' must be null (Kimi Linear MLA has a plain q_proj)")
        if f.get("mla_use_nope", bool, True) is not True:
            raise ConfigError(f"{source}: field 'mla_use_nope' must be true (rotary MLA is not supported)")
        heads = f.get("num_attention_heads", int, positive=True)
        kv_heads = f.get("num_key_value_heads", int, heads, positive=True)
        if kv_heads != heads:
            raise ConfigError(f"{source}: field 'num_key_value_heads'={kv_heads} must equal num_attention_heads={heads}")
        mla = MLAConfig(
            num_heads=heads,
            kv_lora_rank=f.get("kv_lora_rank", int, positive=True),
            qk_nope_head_dim=f.get("qk_nope_head_dim", int, positive=True),
            qk_rope_head_dim=f.get("qk_rope_head_dim", int, positive=True),
            v_head_dim=f.get("v_head_dim", int, positive=True),
        )

    moe = None
    if MOE in mlp_types:
        act_fn = f.get("moe_router_activation_func", str, "sigmoid")
        if act_fn != "sigmoid":
            raise ConfigError(f"{source}: field 'moe_router_activation_func' must be 'sigmoid', got {short(act_fn)}")
        num_experts = f.get("num_experts", int, positive=True)
        top_k = f.get("num_experts_per_token", int, positive=True)
        groups = f.get("num_expert_group", int, 1, positive=True)
        topk_group = f.get("topk_group", int, 1, positive=True)
        moe_layers = mlp_types.count(MOE)
        if num_experts * moe_layers > MAX_ROUTED_EXPERTS:
            raise ConfigError(f"{source}: field 'num_experts'={num_experts} over {moe_layers} MoE layers is "
                              f"{num_experts * moe_layers} expert MLPs, over the {MAX_ROUTED_EXPERTS} kda_rt loads")
        if top_k > num_experts:
            raise ConfigError(f"{source}: field 'num_experts_per_token'={top_k} exceeds 'num_experts'={num_experts}")
        if num_experts % groups:
            raise ConfigError(f"{source}: field 'num_expert_group'={groups} does not divide 'num_experts'={num_experts}")
        grouped_topk = f.get("use_grouped_topk", bool, True)
        if groups > 1 and not grouped_topk:  # (was: routed within the groups anyway, silently)
            raise ConfigError(f"{source}: field 'use_grouped_topk' is false but 'num_expert_group'={groups}: kda_rt "
                              "routes within the expert groups only (use_grouped_topk true, or num_expert_group 1)")
        if topk_group > groups:
            raise ConfigError(f"{source}: field 'topk_group'={topk_group} exceeds 'num_expert_group'={groups}")
        if topk_group * (num_experts // groups) < top_k:
            raise ConfigError(f"{source}: 'topk_group' groups hold fewer experts than 'num_experts_per_token'={top_k}")
        moe = MoEConfig(
            num_experts=num_experts,
            top_k=top_k,
            num_shared_experts=f.get("num_shared_experts", int, 0, nonnegative=True),
            intermediate_size=f.get("moe_intermediate_size", int, positive=True),
            renormalize=f.get("moe_renormalize", bool, True),
            routed_scaling_factor=f.get("routed_scaling_factor", float, 1.0, positive=True),
            num_expert_group=groups,
            topk_group=topk_group,
        )

    eos = f.get("eos_token_id", (int, list), None)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in eos_ids):
        raise ConfigError(f"{source}: field 'eos_token_id' must be an int or a list of ints")
    vocab_size = f.get("vocab_size", int, positive=True)
    bad = next((i for i in eos_ids if not 0 <= i < vocab_size), None)
    if bad is not None:  # generation could never stop on it
        raise ConfigError(f"{source}: field 'eos_token_id' holds {bad}, outside the vocabulary [0, {vocab_size})")
    dtype_key = "dtype" if f.has("dtype") else "torch_dtype"
    dtype = f.get(dtype_key, str, "bfloat16")
    if dtype not in CONFIG_DTYPES:
        raise ConfigError(f"{source}: field '{dtype_key}' must be one of {', '.join(CONFIG_DTYPES)}, got {short(dtype)}")
    eps = f.get("rms_norm_eps", float, positive=True)
    if eps > 1.0:  # (1e300 loaded and zeroed every norm's output: greedy decoding gave token 0 forever)
        raise ConfigError(f"{source}: field 'rms_norm_eps' is {eps!r}: a variance epsilon (1e-5 or 1e-6 in Kimi Linear) "
                          "must be at most 1")
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        intermediate_size=f.get("intermediate_size", int, positive=True) if DENSE in mlp_types else 0,
        rms_norm_eps=eps,
        layer_types=layer_types,
        mlp_types=mlp_types,
        kda=kda,
        mla=mla,
        moe=moe,
        tie_word_embeddings=f.get("tie_word_embeddings", bool, False),
        bos_token_id=f.get("bos_token_id", int, None),
        eos_token_ids=eos_ids,
        pad_token_id=f.get("pad_token_id", int, None),
        max_model_len=f.get("model_max_length", int, 1048576, positive=True),
        dtype=dtype,
    )


def load_config(model_dir: str | os.PathLike[str]) -> ModelConfig:
    """Read and parse `<model_dir>/config.json`."""
    path = os.path.join(os.fspath(model_dir), "config.json")
    raw = read_json(path, ConfigError, missing=f"not found (is '{model_dir}' a Kimi Linear checkpoint directory?)",
                    want_object=False)  # parse_config names a top level that is not an object
    return parse_config(raw, source=path)
