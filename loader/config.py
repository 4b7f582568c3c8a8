"""`config.json` -> frozen `ModelConfig`.

Accepts the hub layout (`linear_attn_config` with 1-based `kda_layers` / `full_attn_layers`,
`num_experts`, `num_experts_per_token`, `moe_renormalize`, ...) and the layout transformers >= 5
writes (`layer_types`, `mlp_layer_types`, and the attribute aliases such as `n_group`,
`num_local_experts`, `norm_topk_prob`).  A required field that is missing, a value of the wrong
type, or two spellings of one field that disagree raise `ConfigError` naming the field.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
from dataclasses import dataclass
from typing import Any

__all__ = ["ConfigError", "KDAConfig", "MLAConfig", "MoEConfig", "ModelConfig", "load_config", "parse_config"]

SUPPORTED_MODEL_TYPES = ("kimi_linear",)

# canonical name -> other spellings seen in the wild (hub config / transformers attribute_map)
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_experts": ("num_local_experts",),
    "num_experts_per_token": ("num_experts_per_tok",),
    "num_shared_experts": ("n_shared_experts",),
    "num_expert_group": ("n_group",),
    "moe_renormalize": ("norm_topk_prob",),
    "model_max_length": ("max_position_embeddings",),
}

KDA, MLA = "kda", "mla"
DENSE, MOE = "dense", "moe"
_LAYER_TYPE_NAMES = {"linear_attention": KDA, "full_attention": MLA, "kda": KDA, "mla": MLA}
_MLP_TYPE_NAMES = {"dense": DENSE, "sparse": MOE, "moe": MOE}


class ConfigError(ValueError):
    """config.json is missing a field, has a wrong value, or contradicts itself."""


# Bounds checked before anything is built from a value: any int field, and the fields that size
# loops and lists (a config of 10**9 layers must fail at once, not after building the schedule).
MAX_INT_FIELD = 1 << 24
_INT_LIMITS = {"num_hidden_layers": 1024, "num_experts": 4096}


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
# field access helpers


class _Fields:
    """Reads fields from the raw dict, resolving aliases and checking types."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def has(self, name: str) -> bool:
        return any(self.raw.get(n) is not None for n in (name, *_ALIASES.get(name, ())))

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = ..., *, positive: bool = False) -> Any:
        found = [(n, self.raw[n]) for n in (name, *_ALIASES.get(name, ())) if self.raw.get(n) is not None]
        if not found:
            if default is ...:
                raise ConfigError(f"{self.source}: required field '{name}' is missing")
            return default
        values = {json.dumps(v, sort_keys=True) for _, v in found}
        if len(values) > 1:
            desc = ", ".join(f"'{n}'={_short(v)}" for n, v in found)
            raise ConfigError(f"{self.source}: contradictory values for field '{name}': {desc}")
        key, value = found[0]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value) if abs(value) < 1 << 64 else math.inf
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            want = " or ".join(k.__name__ for k in kinds)
            raise ConfigError(f"{self.source}: field '{key}' must be {want}, got {_short(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{self.source}: field '{key}' must be a finite number, got {value!r}")
        if isinstance(value, int) and not isinstance(value, bool):
            _check_int_bound(self.source, key, value, _INT_LIMITS.get(name, MAX_INT_FIELD))
        if positive and not value > 0:
            raise ConfigError(f"{self.source}: field '{key}' must be positive, got {_short(value)}")
        return value


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 3, 60, 60, 6, 4


def _short(value: Any) -> str:
    """A bounded repr for error messages (values may be huge or deeply nested)."""
    if isinstance(value, int) and value.bit_length() > 256:
        return f"an int of {value.bit_length()} bits"
    return _REPR.repr(value)


def _check_int_bound(source: str, key: str, value: int, limit: int) -> None:
    if not -limit <= value <= limit:
        raise ConfigError(f"{source}: field '{key}' = {_short(value)} is out of range (|value| <= {limit})")


def _layer_schedule(f: _Fields, num_layers: int) -> tuple[str, ...]:
    lac = f.raw.get("linear_attn_config")
    from_lists = None
    if lac is not None:
        if not isinstance(lac, dict):
            raise ConfigError(f"{f.source}: field 'linear_attn_config' must be an object")
        if "kda_layers" in lac or "full_attn_layers" in lac:
            types: list[str | None] = [None] * num_layers
            for key, kind in (("kda_layers", KDA), ("full_attn_layers", MLA)):
                ids = lac.get(key)
                if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                    raise ConfigError(f"{f.source}: field 'linear_attn_config.{key}' must be a list of ints")
                for one_based in ids:
                    if not 1 <= one_based <= num_layers:
                        raise ConfigError(
                            f"{f.source}: 'linear_attn_config.{key}' entry {one_based} is outside 1..{num_layers} "
                            "(the lists are 1-based)"
                        )
                    if types[one_based - 1] is not None:
                        raise ConfigError(
                            f"{f.source}: layer {one_based} (1-based) is listed twice in "
                            "'linear_attn_config.kda_layers'/'full_attn_layers'"
                        )
                    types[one_based - 1] = kind
            missing = [i + 1 for i, t in enumerate(types) if t is None]
            if missing:
                shown = f"{missing[:10]}"[:-1] + (f", ... ({len(missing)} layers)]" if len(missing) > 10 else "]")
                raise ConfigError(
                    f"{f.source}: layers {shown} (1-based) are in neither 'linear_attn_config.kda_layers' "
                    "nor 'linear_attn_config.full_attn_layers'"
                )
            from_lists = tuple(types)  # type: ignore[arg-type]
    from_types = None
    if f.raw.get("layer_types") is not None:
        lt = f.raw["layer_types"]
        if not isinstance(lt, list) or len(lt) != num_layers:
            raise ConfigError(f"{f.source}: field 'layer_types' must be a list of {num_layers} entries")
        bad = [_short(t) for t in lt if not isinstance(t, str) or t not in _LAYER_TYPE_NAMES]
        if bad:
            raise ConfigError(f"{f.source}: field 'layer_types' has unknown entries {bad}")
        from_types = tuple(_LAYER_TYPE_NAMES[t] for t in lt)
    if from_lists is not None and from_types is not None and from_lists != from_types:
        raise ConfigError(
            f"{f.source}: contradictory fields 'layer_types' and 'linear_attn_config.kda_layers/full_attn_layers'"
        )
    schedule = from_lists or from_types
    if schedule is None:
        raise ConfigError(
            f"{f.source}: required field 'linear_attn_config.kda_layers' / 'full_attn_layers' "
            "(or 'layer_types') is missing"
        )
    return schedule


def _mlp_schedule(f: _Fields, num_layers: int) -> tuple[str, ...]:
    from_rule = None
    if f.raw.get("first_k_dense_replace") is not None or f.raw.get("moe_layer_freq") is not None:
        k = f.get("first_k_dense_replace", int, 0)
        freq = f.get("moe_layer_freq", int, 1, positive=True)
        # layers >= first_k_dense_replace are MoE; a config without 'num_experts' is then refused below
        from_rule = tuple(MOE if i >= k and i % freq == 0 else DENSE for i in range(num_layers))
    from_types = None
    if f.raw.get("mlp_layer_types") is not None:
        mt = f.raw["mlp_layer_types"]
        if not isinstance(mt, list) or len(mt) != num_layers:
            raise ConfigError(f"{f.source}: field 'mlp_layer_types' must be a list of {num_layers} entries")
        bad = [_short(t) for t in mt if not isinstance(t, str) or t not in _MLP_TYPE_NAMES]
        if bad:
            raise ConfigError(f"{f.source}: field 'mlp_layer_types' has unknown entries {bad}")
        from_types = tuple(_MLP_TYPE_NAMES[t] for t in mt)
    if from_rule is not None and from_types is not None and from_rule != from_types:
        raise ConfigError(f"{f.source}: contradictory fields 'mlp_layer_types' and 'first_k_dense_replace'/'moe_layer_freq'")
    schedule = from_types or from_rule
    if schedule is None:
        raise ConfigError(f"{f.source}: required field 'first_k_dense_replace' (or 'mlp_layer_types') is missing")
    return schedule


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
            f"{source}: unsupported model_type {_short(model_type)}; kda_rt runs {', '.join(SUPPORTED_MODEL_TYPES)} only"
        )
    f = _Fields(raw, source)
    num_layers = f.get("num_hidden_layers", int, positive=True)
    hidden = f.get("hidden_size", int, positive=True)
    layer_types = _layer_schedule(f, num_layers)
    mlp_types = _mlp_schedule(f, num_layers)

    act = f.get("hidden_act", str, "silu")
    if act != "silu":
        raise ConfigError(f"{source}: field 'hidden_act' must be 'silu' for Kimi Linear, got {_short(act)}")

    kda = None
    if KDA in layer_types:
        lac = raw.get("linear_attn_config") or {}
        # prefer linear_attn_config; the flat transformers fields are the alternative spelling
        def pick(name: str, flat: str) -> int:
            a, b = lac.get(name), raw.get(flat)
            if a is not None and b is not None and a != b:
                raise ConfigError(f"{source}: contradictory values for 'linear_attn_config.{name}'={_short(a)} and '{flat}'={_short(b)}")
            value = a if a is not None else b
            if value is None:
                raise ConfigError(f"{source}: required field 'linear_attn_config.{name}' is missing")
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{source}: field 'linear_attn_config.{name}' must be a positive int, got {_short(value)}")
            _check_int_bound(source, f"linear_attn_config.{name}", value, MAX_INT_FIELD)
            return value

        num_v = lac.get("num_v_heads")
        kda = KDAConfig(
            num_heads=pick("num_heads", "linear_num_heads"),
            head_dim=pick("head_dim", "linear_head_dim"),
            conv_kernel_size=pick("short_conv_kernel_size", "linear_conv_kernel_dim"),
        )
        if num_v is not None and num_v != kda.num_heads:
            raise ConfigError(f"{source}: 'linear_attn_config.num_v_heads'={_short(num_v)} != num_heads={kda.num_heads} (GVA unsupported)")
        for key, want in (("use_full_rank_gate", False), ("gate_lower_bound", None)):
            if lac.get(key) not in (None, want):
                raise ConfigError(f"{source}: 'linear_attn_config.{key}'={_short(lac[key])} is a Kimi K3 option kda_rt does not support")

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
            raise ConfigError(f"{source}: field 'moe_router_activation_func' must be 'sigmoid', got {_short(act_fn)}")
        num_experts = f.get("num_experts", int, positive=True)
        top_k = f.get("num_experts_per_token", int, positive=True)
        groups = f.get("num_expert_group", int, 1, positive=True)
        topk_group = f.get("topk_group", int, 1, positive=True)
        if top_k > num_experts:
            raise ConfigError(f"{source}: field 'num_experts_per_token'={top_k} exceeds 'num_experts'={num_experts}")
        if num_experts % groups:
            raise ConfigError(f"{source}: field 'num_expert_group'={groups} does not divide 'num_experts'={num_experts}")
        if topk_group > groups:
            raise ConfigError(f"{source}: field 'topk_group'={topk_group} exceeds 'num_expert_group'={groups}")
        if topk_group * (num_experts // groups) < top_k:
            raise ConfigError(f"{source}: 'topk_group' groups hold fewer experts than 'num_experts_per_token'={top_k}")
        moe = MoEConfig(
            num_experts=num_experts,
            top_k=top_k,
            num_shared_experts=f.get("num_shared_experts", int, 0),
            intermediate_size=f.get("moe_intermediate_size", int, positive=True),
            renormalize=f.get("moe_renormalize", bool, True),
            routed_scaling_factor=f.get("routed_scaling_factor", float, 1.0),
            num_expert_group=groups,
            topk_group=topk_group,
        )

    eos = f.get("eos_token_id", (int, list), None)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in eos_ids):
        raise ConfigError(f"{source}: field 'eos_token_id' must be an int or a list of ints")
    return ModelConfig(
        vocab_size=f.get("vocab_size", int, positive=True),
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        intermediate_size=f.get("intermediate_size", int, positive=True) if DENSE in mlp_types else 0,
        rms_norm_eps=f.get("rms_norm_eps", float, positive=True),
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
        dtype=f.get("dtype", str, None) or f.get("torch_dtype", str, "bfloat16"),
    )


def load_config(model_dir: str | os.PathLike[str]) -> ModelConfig:
    """Read and parse `<model_dir>/config.json`."""
    path = os.path.join(os.fspath(model_dir), "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found (is '{model_dir}' a Kimi Linear checkpoint directory?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ConfigError(f"{path}: JSON nested too deeply") from None
    except ValueError as exc:  # e.g. an integer literal past Python's digit limit
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return parse_config(raw, source=path)
