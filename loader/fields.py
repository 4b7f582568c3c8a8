"""Reading `config.json` fields: aliases, type and range checks, bounded reprs for messages, and the
layer schedules (which layers are KDA / MLA, dense / MoE).  Every refusal is a `ConfigError` naming
the field; `loader/config.py` builds the `ModelConfig` from these."""

from __future__ import annotations

import json
import math
import reprlib
from typing import Any

__all__ = ["ConfigError", "DENSE", "Fields", "KDA", "MAX_INT_FIELD", "MLA", "MOE", "check_int_bound", "layer_schedule",
           "mlp_schedule", "short"]

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


class Fields:
    """Reads fields from the raw dict, resolving aliases and checking types."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def has(self, name: str) -> bool:
        return any(self.raw.get(n) is not None for n in (name, *_ALIASES.get(name, ())))

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = ..., *, positive: bool = False,
            nonnegative: bool = False) -> Any:
        found = [(n, self.raw[n]) for n in (name, *_ALIASES.get(name, ())) if self.raw.get(n) is not None]
        if not found:
            if default is ...:
                raise ConfigError(f"{self.source}: required field '{name}' is missing")
            return default
        values = {json.dumps(v, sort_keys=True) for _, v in found}
        if len(values) > 1:
            desc = ", ".join(f"'{n}'={short(v)}" for n, v in found)
            raise ConfigError(f"{self.source}: contradictory values for field '{name}': {desc}")
        key, value = found[0]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value) if abs(value) < 1 << 64 else math.inf
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            want = " or ".join(k.__name__ for k in kinds)
            raise ConfigError(f"{self.source}: field '{key}' must be {want}, got {short(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{self.source}: field '{key}' must be a finite number, got {value!r}")
        if isinstance(value, int) and not isinstance(value, bool):
            check_int_bound(self.source, key, value, _INT_LIMITS.get(name, MAX_INT_FIELD))
        if positive and not value > 0:
            raise ConfigError(f"{self.source}: field '{key}' must be positive, got {short(value)}")
        if nonnegative and not value >= 0:
            raise ConfigError(f"{self.source}: field '{key}' must be non-negative, got {short(value)}")
        return value


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 3, 60, 60, 6, 4


def short(value: Any) -> str:
    """A bounded repr for error messages (values may be huge or deeply nested)."""
    if isinstance(value, int) and value.bit_length() > 256:
        return f"an int of {value.bit_length()} bits"
    return _REPR.repr(value)


def check_int_bound(source: str, key: str, value: int, limit: int) -> None:
    if not -limit <= value <= limit:
        raise ConfigError(f"{source}: field '{key}' = {short(value)} is out of range (|value| <= {limit})")


def _type_list(f: Fields, field: str, names: dict[str, str], num_layers: int) -> tuple[str, ...] | None:
    """The per-layer list `field` (transformers' layout) through `names`, or None when it is absent."""
    if f.raw.get(field) is None:
        return None
    values = f.raw[field]
    if not isinstance(values, list) or len(values) != num_layers:
        raise ConfigError(f"{f.source}: field '{field}' must be a list of {num_layers} entries")
    bad = [short(t) for t in values if not isinstance(t, str) or t not in names]
    if bad:
        raise ConfigError(f"{f.source}: field '{field}' has unknown entries {bad}")
    return tuple(names[t] for t in values)


def layer_schedule(f: Fields, num_layers: int) -> tuple[str, ...]:
    """Per layer KDA or MLA, from `linear_attn_config` (1-based lists) and / or `layer_types`."""
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
    from_types = _type_list(f, "layer_types", _LAYER_TYPE_NAMES, num_layers)
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


def mlp_schedule(f: Fields, num_layers: int) -> tuple[str, ...]:
    """Per layer DENSE or MOE, from `first_k_dense_replace` / `moe_layer_freq` and / or `mlp_layer_types`."""
    from_rule = None
    if f.raw.get("first_k_dense_replace") is not None or f.raw.get("moe_layer_freq") is not None:
        k = f.get("first_k_dense_replace", int, 0, nonnegative=True)
        freq = f.get("moe_layer_freq", int, 1, positive=True)
        # layers >= first_k_dense_replace are MoE; a config without 'num_experts' is then refused below
        from_rule = tuple(MOE if i >= k and i % freq == 0 else DENSE for i in range(num_layers))
    from_types = _type_list(f, "mlp_layer_types", _MLP_TYPE_NAMES, num_layers)
    if from_rule is not None and from_types is not None and from_rule != from_types:
        raise ConfigError(f"{f.source}: contradictory fields 'mlp_layer_types' and 'first_k_dense_replace'/'moe_layer_freq'")
    schedule = from_types or from_rule
    if schedule is None:
        raise ConfigError(f"{f.source}: required field 'first_k_dense_replace' (or 'mlp_layer_types') is missing")
    return schedule
