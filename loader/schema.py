"""The weight schema: typed host weights of a Kimi Linear checkpoint, named from the checkpoint here only.

Every checkpoint key is spelled once, in a `read` classmethod below, next to its shape and kind.
One walk over the model (`_read_model`) serves both directions:

    expected_tensors(config)        the walk with a recording getter: hub name -> (shape, kind)
    read_weights(config, tensors)   the walk over loaded tensors: a `ModelWeights` tree

    ModelWeights   embed_tokens, layers: [LayerWeights], norm, lm_head (None when tied)
    LayerWeights   input_layernorm, mixer: KDAWeights | MLAWeights, post_attention_layernorm,
                   mlp: MLPWeights (dense) | MoEWeights
    MoEWeights     gate, e_score_correction_bias, experts: [MLPWeights], shared: MLPWeights | None

Fields hold the loaded host arrays as they are (memory-mapped matmul weights in their stored
dtype, small tensors float32), under the checkpoint's own names.  The fusions the CUDA backend
uploads (q|k|v, f_a|g_a|b, q|kv_a, gate|up, per-expert w1|w3 and w2 stacks, conv taps) are
properties returning a `Stack`: the parts and the shape of their row-wise stack, so an uploader
copies each part into its rows of one device buffer and nothing big is concatenated on the host.
The NumPy backend reads the plain fields.

Letters: D hidden, V vocab, H KDA heads, K KDA head dim, P = H*K, W conv width, E experts,
I dense MLP width, M expert width, S shared experts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .config import DENSE, KDA

if TYPE_CHECKING:
    from .config import KDAConfig, MLAConfig, ModelConfig, MoEConfig

__all__ = [
    "A_LOG", "CONV", "DT_BIAS", "EMBEDDING", "MATMUL", "MATMUL_KINDS", "NORM", "ROUTER", "ROUTER_BIAS", "KDAWeights",
    "LayerWeights", "MLAWeights", "MLPWeights", "ModelWeights", "MoEWeights", "Reader", "Stack", "expected_tensors",
    "read_weights", "transformers_to_hub",
]

# tensor kinds: the first three are matmul weights that stay memory-mapped in their stored dtype (ROUTER, the MoE
# router's [E, D], apart because the loader reads its values: a NaN there hides an expert); the rest are small and
# come back as float32
EMBEDDING, MATMUL, ROUTER = "embedding", "matmul", "router"
NORM, CONV, A_LOG, DT_BIAS, ROUTER_BIAS = "norm", "conv", "a_log", "dt_bias", "router_bias"
MATMUL_KINDS = (EMBEDDING, MATMUL, ROUTER)

Shape = tuple[int, ...]
Array = Any  # a host np.ndarray (a placeholder None while `expected_tensors` walks the schema)

_LAYER = "model.layers.{}."
_DENSE_MLP, _MOE_MLP = "mlp.", "block_sparse_moe."
_MLP_STEMS = ("gate_proj", "up_proj", "down_proj")  # dense MLP and shared experts
_EXPERT_STEMS = ("w1", "w3", "w2")  # routed expert: (gate, up, down)


class Reader:
    """Getter for one subtree of the checkpoint: `get(key, shape, kind)` -> tensors[prefix + key].

    `on_read(name, shape, kind)`, when given, replaces the lookup (and returns the value to store).
    """

    def __init__(self, tensors: Mapping[str, np.ndarray] | None = None, prefix: str = "",
                 on_read: Callable[[str, Shape, str], Array] | None = None) -> None:
        self.tensors, self.prefix, self.on_read = tensors, prefix, on_read

    def sub(self, prefix: str) -> Reader:
        return Reader(self.tensors, self.prefix + prefix, self.on_read)

    def __call__(self, key: str, shape: Shape, kind: str = MATMUL) -> Array:
        name = self.prefix + key
        if self.on_read is not None:
            return self.on_read(name, shape, kind)
        value = self.tensors[name]
        if tuple(value.shape) != shape:
            raise ValueError(f"tensor '{name}': shape {list(value.shape)}, the config implies {list(shape)}")
        return value


@dataclass(frozen=True)
class Stack:
    """Rows of `parts` (each [r_i, *rest]) stacked in order and viewed as `shape`; never built on the host."""
    parts: tuple[np.ndarray, ...]
    shape: Shape

    @classmethod
    def rows(cls, *parts: np.ndarray) -> Stack:
        return cls(parts, (sum(p.shape[0] for p in parts), *parts[0].shape[1:]))


# ---------------------------------------------------------------------------------------------
# mixers


@dataclass
class KDAWeights:
    q_proj: Array  # [P, D]
    k_proj: Array  # [P, D]
    v_proj: Array  # [P, D]
    q_conv1d: Array  # [P, 1, W]
    k_conv1d: Array  # [P, 1, W]
    v_conv1d: Array  # [P, 1, W]
    A_log: Array  # [1, 1, H, 1]
    f_a_proj: Array  # [K, D]   (low rank: K in every released config)
    f_b_proj: Array  # [P, K]
    dt_bias: Array  # [P]
    b_proj: Array  # [H, D]
    g_a_proj: Array  # [K, D]
    g_b_proj: Array  # [P, K]
    o_norm: Array  # [K]
    o_proj: Array  # [D, P]

    @classmethod
    def read(cls, get: Reader, cfg: KDAConfig, D: int) -> KDAWeights:
        H, K, W = cfg.num_heads, cfg.head_dim, cfg.conv_kernel_size
        P = H * K
        return cls(
            q_proj=get("q_proj.weight", (P, D)), k_proj=get("k_proj.weight", (P, D)),
            v_proj=get("v_proj.weight", (P, D)),
            q_conv1d=get("q_conv1d.weight", (P, 1, W), CONV), k_conv1d=get("k_conv1d.weight", (P, 1, W), CONV),
            v_conv1d=get("v_conv1d.weight", (P, 1, W), CONV),
            A_log=get("A_log", (1, 1, H, 1), A_LOG),
            f_a_proj=get("f_a_proj.weight", (K, D)), f_b_proj=get("f_b_proj.weight", (P, K)),
            dt_bias=get("dt_bias", (P,), DT_BIAS),
            b_proj=get("b_proj.weight", (H, D)),
            g_a_proj=get("g_a_proj.weight", (K, D)), g_b_proj=get("g_b_proj.weight", (P, K)),
            o_norm=get("o_norm.weight", (K,), NORM),
            o_proj=get("o_proj.weight", (D, P)),
        )

    @property
    def qkv(self) -> Stack:  # [3P, D]
        return Stack.rows(self.q_proj, self.k_proj, self.v_proj)

    @property
    def fgb(self) -> Stack:  # [rank_f + rank_g + H, D]: the three small projections of x in one GEMM
        return Stack.rows(self.f_a_proj, self.g_a_proj, self.b_proj)

    @property
    def conv_taps(self) -> Stack:  # [3P, W]: q | k | v depthwise taps
        return Stack.rows(*(c.reshape(c.shape[0], -1) for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)))

    @property
    def rank_f(self) -> int:
        return int(self.f_a_proj.shape[0])

    @property
    def rank_g(self) -> int:
        return int(self.g_a_proj.shape[0])


@dataclass
class MLAWeights:
    q_proj: Array  # [Hm*(Dn+Dr), D]
    kv_a_proj_with_mqa: Array  # [R+Dr, D]
    kv_a_layernorm: Array  # [R]
    kv_b_proj: Array  # [Hm*(Dn+Dv), R]
    o_proj: Array  # [D, Hm*Dv]

    @classmethod
    def read(cls, get: Reader, cfg: MLAConfig, D: int) -> MLAWeights:
        Hm, R = cfg.num_heads, cfg.kv_lora_rank
        return cls(
            q_proj=get("q_proj.weight", (Hm * cfg.qk_head_dim, D)),
            kv_a_proj_with_mqa=get("kv_a_proj_with_mqa.weight", (R + cfg.qk_rope_head_dim, D)),
            kv_a_layernorm=get("kv_a_layernorm.weight", (R,), NORM),
            kv_b_proj=get("kv_b_proj.weight", (Hm * (cfg.qk_nope_head_dim + cfg.v_head_dim), R)),
            o_proj=get("o_proj.weight", (D, Hm * cfg.v_head_dim)),
        )

    @property
    def q_kva(self) -> Stack:  # [Hm*(Dn+Dr) + R+Dr, D]
        return Stack.rows(self.q_proj, self.kv_a_proj_with_mqa)


# ---------------------------------------------------------------------------------------------
# MLPs


@dataclass
class MLPWeights:
    """SiLU-gated MLP: the dense layer, a shared expert block or one routed expert."""
    gate: Array  # [F, D]  gate_proj | w1
    up: Array  # [F, D]    up_proj | w3
    down: Array  # [D, F]  down_proj | w2

    @classmethod
    def read(cls, get: Reader, D: int, width: int, stems: tuple[str, str, str] = _MLP_STEMS) -> MLPWeights:
        gate, up, down = stems
        return cls(gate=get(f"{gate}.weight", (width, D)), up=get(f"{up}.weight", (width, D)),
                   down=get(f"{down}.weight", (D, width)))

    @property
    def gate_up(self) -> Stack:  # [2F, D]
        return Stack.rows(self.gate, self.up)


@dataclass
class MoEWeights:
    gate: Array  # [E, D] router
    e_score_correction_bias: Array  # [E]
    experts: Sequence[MLPWeights]  # E routed experts
    shared: MLPWeights | None  # width M*S; None without shared experts

    @classmethod
    def read(cls, get: Reader, cfg: MoEConfig, D: int) -> MoEWeights:
        E, M = cfg.num_experts, cfg.intermediate_size
        return cls(
            gate=get("gate.weight", (E, D), ROUTER),
            e_score_correction_bias=get("gate.e_score_correction_bias", (E,), ROUTER_BIAS),
            experts=[MLPWeights.read(get.sub(f"experts.{e}."), D, M, _EXPERT_STEMS) for e in range(E)],
            shared=(MLPWeights.read(get.sub("shared_experts."), D, M * cfg.num_shared_experts)
                    if cfg.num_shared_experts else None),
        )

    @property
    def w13(self) -> Stack:  # [E, 2M, D]: per expert [w1 (gate) ; w3 (up)] rows
        parts = tuple(p for x in self.experts for p in (x.gate, x.up))
        M, D = self.experts[0].gate.shape
        return Stack(parts, (len(self.experts), 2 * M, D))

    @property
    def w2(self) -> Stack:  # [E, D, M]
        D, M = self.experts[0].down.shape
        return Stack(tuple(x.down for x in self.experts), (len(self.experts), D, M))


# ---------------------------------------------------------------------------------------------
# layers and model


@dataclass
class LayerWeights:
    input_layernorm: Array  # [D]
    mixer: KDAWeights | MLAWeights
    post_attention_layernorm: Array  # [D]
    mlp: MLPWeights | MoEWeights


@dataclass
class ModelWeights:
    embed_tokens: Array  # [V, D]
    layers: list[LayerWeights]
    norm: Array  # [D]
    lm_head: Array | None  # [V, D]; None when tied to embed_tokens

    @property
    def output(self) -> Array:
        """The lm_head matrix actually used (embed_tokens when tied)."""
        return self.embed_tokens if self.lm_head is None else self.lm_head


def _read_model(config: ModelConfig, get: Reader) -> ModelWeights:
    D = config.hidden_size
    embed = get("model.embed_tokens.weight", (config.vocab_size, D), EMBEDDING)
    layers = []
    for i in range(config.num_hidden_layers):
        g = get.sub(_LAYER.format(i))
        in_norm = g("input_layernorm.weight", (D,), NORM)
        attn = g.sub("self_attn.")
        mixer = (KDAWeights.read(attn, config.kda, D) if config.layer_types[i] == KDA
                 else MLAWeights.read(attn, config.mla, D))
        post_norm = g("post_attention_layernorm.weight", (D,), NORM)
        mlp = (MLPWeights.read(g.sub(_DENSE_MLP), D, config.intermediate_size) if config.mlp_types[i] == DENSE
               else MoEWeights.read(g.sub(_MOE_MLP), config.moe, D))
        layers.append(LayerWeights(in_norm, mixer, post_norm, mlp))
    norm = get("model.norm.weight", (D,), NORM)
    lm_head = None if config.tie_word_embeddings else get("lm_head.weight", (config.vocab_size, D), MATMUL)
    return ModelWeights(embed, layers, norm, lm_head)


def expected_tensors(config: ModelConfig) -> dict[str, tuple[Shape, str]]:
    """Hub checkpoint name -> (shape, kind) for every tensor the model needs, in a stable order."""
    out: dict[str, tuple[Shape, str]] = {}

    def record(name: str, shape: Shape, kind: str) -> None:
        if name in out:
            raise AssertionError(f"schema reads '{name}' twice")
        out[name] = (shape, kind)

    _read_model(config, Reader(on_read=record))
    return out


def read_weights(config: ModelConfig, tensors: Mapping[str, np.ndarray]) -> ModelWeights:
    """The typed host weights over `tensors` (hub name -> array, e.g. from `load_checkpoint`)."""
    return _read_model(config, Reader(tensors))


_TRANSFORMERS_DENSE = re.compile("^" + re.escape(_LAYER).replace(r"\{\}", r"(\d+)") + re.escape(_MOE_MLP)
                                 + "((?:" + "|".join(_MLP_STEMS) + r")\.weight)$")


def transformers_to_hub(config: ModelConfig, name: str) -> str | None:
    """The hub name of a tensor transformers' save_pretrained spells differently (the dense MLP
    under `block_sparse_moe.` instead of `mlp.`), or None when `name` is not such a tensor."""
    m = _TRANSFORMERS_DENSE.match(name)
    layer = int(m.group(1)) if m else -1
    if not m or layer >= config.num_hidden_layers or config.mlp_types[layer] != DENSE:
        return None
    return _LAYER.format(layer) + _DENSE_MLP + m.group(2)
