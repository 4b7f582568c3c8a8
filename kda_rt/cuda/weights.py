"""The weight schema on the GPU: each field of `kda_rt.loader.schema.ModelWeights`, uploaded.

Names, shapes and the fusions (q|k|v, f_a|g_a|b, q|kv_a, gate|up, per-expert w1|w3 and w2
stacks, conv taps) are defined once by the schema; here each field or `Stack` is copied to the
device, a stack part by part into its rows of one device buffer (nothing big is concatenated on
the host).  Matmul weights are bf16 (cast if stored otherwise); the router, its bias and the KDA
conv taps, A_log, dt_bias and o_norm are fp32; the RMSNorm weights bf16.

Letters: D hidden, H KDA heads, K head dim, P = H*K, W conv width, Rf / Rg f / g low ranks,
E experts, M expert width, F dense / shared width.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from tqdm import tqdm

from kda_rt import env
from kda_rt.cuda.ops.check import BF16
from kda_rt.cuda.ops.moe_route import split_router
from kda_rt.cuda.upload import Uploader
from kda_rt.loader.config import DENSE, KDA, MLA, MOE, ModelConfig
from kda_rt.loader.schema import KDAWeights, MLAWeights, MLPWeights, MoEWeights, Stack, read_weights

__all__ = ["DeviceKDA", "DeviceLayer", "DeviceMLA", "DeviceMLP", "DeviceMoE", "E4m3Rows", "ModelWeights", "decode_rows",
           "upload_weights"]

logger = logging.getLogger(__name__)

F32 = np.float32


class E4m3Rows(NamedTuple):
    """A dense projection's rows as e4m3 codes with an fp32 scale a row, for the one-sequence decode GEMVs of fp8
    models (KDA_RT_FP8_DECODE_GEMV; ops/gemv.gemv_dense with scale=): codes uint8 [N, K], scale fp32 [N] (views of
    the prefill's E4m3Dense rows where those hold them without gaps)."""

    codes: Any
    scale: Any


@dataclass
class DeviceKDA:
    qkv: Any  # [3P, D] q|k|v proj (rows of qkv_fgb when that is set)
    fgb: Any  # [Rf+Rg+H, D] f_a | g_a | b_proj (one small GEMM; the rows of qkv_fgb after qkv)
    f_b: Any  # [P, Rf]  (with Rf = Rg: fg_b[0])
    g_b: Any  # [P, Rg]  (with Rf = Rg: fg_b[1])
    conv_w: Any  # [3P, W] fp32
    A_log: Any  # [H] fp32
    dt_bias: Any  # [P] fp32
    o_norm: Any  # [K] fp32
    o_proj: Any  # [D, P]
    rank_f: int
    rank_g: int
    fg_b: Any = None  # [2, P, R]: f_b and g_b side by side (Rf = Rg), one strided-batched GEMM applies both
    qkv_fgb: Any = None  # [3P+Rf+Rg+H (+ zero rows to a multiple of 8), D]: q|k|v then f_a|g_a|b, one decode
    #                      GEMM for all six projections of x, its output rows 16-byte aligned
    # quantization="fp8" (KDA_RT_FP8_DENSE): e4m3 copies of qkv and o_proj for large prefill steps (ops/dense_w8a8)
    qkv_e4m3: Any = None
    o_proj_e4m3: Any = None
    # KDA_RT_FP8_DECODE_GEMV: e4m3 rows of qkv_fgb (all of its rows; qkv_e4m3 then a view of its first 3P) and o_proj
    qkv_fgb_rows: E4m3Rows | None = None
    o_proj_rows: E4m3Rows | None = None


@dataclass
class DeviceMLA:
    q_kva: Any  # [Hm*(Dn+Dr) + R+Dr, D] q_proj | kv_a_proj_with_mqa
    kv_norm: Any  # [R]
    kv_b: Any  # [Hm*(Dn+Dv), R]
    o_proj: Any  # [D, Hm*Dv]
    q_kva_e4m3: Any = None  # quantization="fp8": e4m3 copies for large prefill steps (ops/dense_w8a8)
    o_proj_e4m3: Any = None
    q_kva_rows: E4m3Rows | None = None  # KDA_RT_FP8_DECODE_GEMV: e4m3 rows for one-sequence decode steps
    o_proj_rows: E4m3Rows | None = None


@dataclass
class DeviceMLP:
    gate_up: Any  # [2F, D]
    down: Any  # [D, F]
    gate_up_e4m3: Any = None  # the dense layer's, quantization="fp8": e4m3 copies for large prefill steps
    down_e4m3: Any = None
    gate_up_rows: E4m3Rows | None = None  # KDA_RT_FP8_DECODE_GEMV: e4m3 rows for one-sequence decode steps


@dataclass
class DeviceMoE:
    router: Any  # [E, D] fp32
    bias: Any  # [E] fp32
    w13: Any  # [E, 2M, D] experts' w1 | w3 ([E + 1, ...] when shared_in_stack)
    w2: Any  # [E, D, M]
    shared: DeviceMLP | None
    # the shared expert (one, of width M) is expert E of w13 / w2 (`shared` holds views of it), so the
    # grouped GEMMs compute it with the routed experts (one more pair per token, weight 1)
    shared_in_stack: bool = False
    # [3E, D] bf16, the router as three bf16 parts summing to it exactly (ops/moe_route.split_router):
    # prefill steps compute the logits on the tensor cores; None: made on first use (eager steps only)
    router_split: Any = None
    # e4m3 experts (loader/quant.py): w13 / w2 hold uint8 e4m3 codes and these their fp32 row scales, [E', 2M] and
    # [E', D] (E' as the stacks); None: bf16 stacks.  A shared expert apart (`shared` not in the stack) stays bf16.
    scale13: Any = None
    scale2: Any = None

    @property
    def e4m3(self) -> bool:
        return self.scale13 is not None


@dataclass
class DeviceLayer:
    in_norm: Any  # [D]
    mixer: DeviceKDA | DeviceMLA
    post_norm: Any  # [D]
    mlp: DeviceMLP | DeviceMoE

    @property
    def kind(self) -> str:
        return KDA if isinstance(self.mixer, DeviceKDA) else MLA

    @property
    def mlp_kind(self) -> str:
        return MOE if isinstance(self.mlp, DeviceMoE) else DENSE


@dataclass
class ModelWeights:
    embed: Any  # [V, D]
    norm: Any  # [D]
    lm_head: Any  # [V, D] (the embed array when tied)
    layers: list[DeviceLayer]
    nbytes: int


def _put(up: Uploader, src: np.ndarray | Stack, dtype=BF16, *, pad_rows: int = 0):
    """Device array of a host array, or of a `Stack` uploaded part by part into its rows (then `pad_rows`
    zero rows after them)."""
    import cupy

    if not isinstance(src, Stack):
        return up.new(np.asarray(src), dtype=dtype)
    dst = cupy.empty((src.shape[0] + pad_rows, *src.shape[1:]), dtype=dtype)
    rows = dst.reshape(-1, *src.parts[0].shape[1:])  # a view: the stack's rows
    r = 0
    for p in src.parts:
        up.copy(rows[r:r + p.shape[0]], p)
        r += p.shape[0]
    if r != rows.shape[0] - pad_rows:
        raise ValueError(f"stack parts fill {r} of {rows.shape[0] - pad_rows} rows")
    with up.stream:  # ordered with the copies: up.finish() waits for both
        rows[r:] = 0
    return dst


def _pair(up: Uploader, a: np.ndarray, b: np.ndarray):
    """One [2, *shape] device array holding a and b (same shape): f_b and g_b side by side, so a decode step
    applies both in one strided-batched GEMM (cuda/model.py)."""
    import cupy

    dst = cupy.empty((2, *np.shape(a)), dtype=BF16)
    up.copy(dst[0], a)
    up.copy(dst[1], b)
    return dst


def _kda(up: Uploader, w: KDAWeights) -> DeviceKDA:
    fg_b = _pair(up, w.f_b_proj, w.g_b_proj) if np.shape(w.f_b_proj) == np.shape(w.g_b_proj) else None
    f_b, g_b = (fg_b[0], fg_b[1]) if fg_b is not None else (_put(up, w.f_b_proj), _put(up, w.g_b_proj))
    qkv, fgb = w.qkv, w.fgb
    # one allocation, qkv and fgb its row blocks, zero rows after them up to a multiple of 8 (16-byte output rows)
    both = _put(up, Stack.rows(*qkv.parts, *fgb.parts), pad_rows=-(qkv.shape[0] + fgb.shape[0]) % 8)
    qkv_d, fgb_d = both[:qkv.shape[0]], both[qkv.shape[0]:qkv.shape[0] + fgb.shape[0]]
    return DeviceKDA(
        qkv=qkv_d, fgb=fgb_d, qkv_fgb=both, f_b=f_b, g_b=g_b, fg_b=fg_b,
        conv_w=_put(up, w.conv_taps, F32), A_log=_put(up, np.ravel(w.A_log), F32),
        dt_bias=_put(up, np.ravel(w.dt_bias), F32), o_norm=_put(up, w.o_norm, F32), o_proj=_put(up, w.o_proj),
        rank_f=w.rank_f, rank_g=w.rank_g,
    )


def _mla(up: Uploader, w: MLAWeights) -> DeviceMLA:
    return DeviceMLA(q_kva=_put(up, w.q_kva), kv_norm=_put(up, w.kv_a_layernorm), kv_b=_put(up, w.kv_b_proj),
                     o_proj=_put(up, w.o_proj))


def _mlp(up: Uploader, w: MLPWeights) -> DeviceMLP:
    return DeviceMLP(gate_up=_put(up, w.gate_up), down=_put(up, w.down))


def _split_router(up: Uploader, router):
    """The router's three-bf16 split (ops/moe_route.split_router), derived on the device on the
    uploader's stream, so it runs after the router's copy has landed; None (the fp32 routing kernel
    serves every step) when the router holds values three bf16 parts cannot represent (subnormals)."""
    try:
        with up.stream:
            return split_router(router)
    except ValueError as exc:
        logger.warning("%s: routing logits stay on the fp32 kernel", exc)
        return None


def _moe(up: Uploader, w: MoEWeights) -> DeviceMoE:
    router, bias = _put(up, w.gate, F32), _put(up, w.e_score_correction_bias, F32)
    router_split = _split_router(up, router)
    if w.shared is not None and w.shared.gate.shape == w.experts[0].gate.shape:  # one shared expert of width M
        stacks = MoEWeights(w.gate, w.e_score_correction_bias, [*w.experts, w.shared], None)
        w13, w2 = _put(up, stacks.w13), _put(up, stacks.w2)
        E = len(w.experts)
        return DeviceMoE(router, bias, w13, w2, DeviceMLP(w13[E], w2[E]), shared_in_stack=True,
                         router_split=router_split)
    return DeviceMoE(router=router, bias=bias, w13=_put(up, w.w13), w2=_put(up, w.w2),
                     shared=_mlp(up, w.shared) if w.shared is not None else None, router_split=router_split)


def _quantize_moe(up: Uploader, m: DeviceMoE) -> DeviceMoE:
    """`m` with its expert stacks in e4m3 (ops/quant.quantize_rows_e4m3 per row, on the uploader's stream after the
    stacks' copies: the codes and scales loader/quant.quantize_experts gives the NumPy backend); the bf16 stacks are
    released.  A shared expert in the stack goes with it; one apart stays bf16 (quantize_experts then leaves it too:
    it quantizes a shared expert only when there is one, which is when the stack carries it)."""
    from kda_rt.cuda.ops.quant import quantize_rows_e4m3

    q13, s13 = quantize_rows_e4m3(m.w13, "w13", stream=up.stream)
    q2, s2 = quantize_rows_e4m3(m.w2, "w2", stream=up.stream)
    # the weights' device bytes (the runner plans its pools from them): the e4m3 stacks, not the bf16 ones uploaded
    up.bytes_uploaded -= m.w13.nbytes + m.w2.nbytes - (q13.nbytes + s13.nbytes + q2.nbytes + s2.nbytes)
    E = q13.shape[0] - 1
    shared = DeviceMLP(q13[E], q2[E]) if m.shared_in_stack else m.shared
    return DeviceMoE(m.router, m.bias, q13, q2, shared, shared_in_stack=m.shared_in_stack,
                     router_split=m.router_split, scale13=s13, scale2=s2)


def _e4m3_products() -> bool:
    """This device runs the e4m3 x e4m3 wgmma GEMMs (sm_90a, KDA_RT_WGMMA on)."""
    from kda_rt.cuda.ops.compile import device_arch

    return env.wgmma() and device_arch() == "sm_90a"


def _quantize_dense(up: Uploader, mixer: DeviceKDA | DeviceMLA, mlp: DeviceMLP | DeviceMoE, decode: bool) -> None:
    """e4m3 copies (ops/dense_w8a8.quantize_dense) of the layer's large dense projections, set on `mixer` and a dense
    `mlp`; a projection whose shape the e4m3 GEMM does not take keeps cuBLAS bf16 alone.  `decode`
    (KDA_RT_FP8_DECODE_GEMV): also the rows the one-sequence decode GEMVs read (E4m3Rows), views of those copies where
    they hold the rows without gaps, else quantized here (KDA's q|k|v|f_a|g_a|b, whose prefill copy of q|k|v is then a
    view of its first rows: quantize_rows_e4m3 treats each row alone, so the same codes)."""
    from kda_rt.cuda.ops.dense_w8a8 import E4m3Dense, fits, quantize_dense
    from kda_rt.cuda.ops.gemv import fits_e4m3
    from kda_rt.cuda.ops.quant import quantize_rows_e4m3

    def copy(w, name, fuse_silu=False, pad=True):
        if not fits(*w.shape, fuse_silu, pad=pad):
            return None
        q = quantize_dense(w, name, fuse_silu=fuse_silu, stream=up.stream)
        up.bytes_uploaded += q.nbytes
        return q

    def rows(w, name, prefill: E4m3Dense | None):
        if not (decode and fits_e4m3(*w.shape)):
            return None
        if prefill is not None and not prefill.fuse_silu:  # (its padding rows, if any, after the nout rows)
            return E4m3Rows(prefill.codes[0, :prefill.nout], prefill.scale[0, :prefill.nout])
        if prefill is not None and prefill.codes.shape[1] == prefill.nout:  # gate|up without padding: in order
            return E4m3Rows(prefill.codes[0], prefill.scale[0])
        q, scale = quantize_rows_e4m3(w, name, stream=up.stream)
        up.bytes_uploaded += int(q.nbytes + scale.nbytes)
        return E4m3Rows(q, scale)

    # (q|k|v and the MLP's h feed consumers of contiguous rows only: no padded copies of those; MLA's q|kv_a feeds
    # row-strided views, o_proj and down write through the caller's `out`)
    if isinstance(mixer, DeviceKDA):
        mixer.qkv_fgb_rows = rows(mixer.qkv_fgb, "q|k|v|f_a|g_a|b", None) if mixer.qkv_fgb is not None else None
        P3 = mixer.qkv.shape[0]
        if mixer.qkv_fgb_rows is not None and fits(*mixer.qkv.shape, pad=False):
            q, scale = mixer.qkv_fgb_rows
            mixer.qkv_e4m3 = E4m3Dense(q[:P3].reshape(1, *mixer.qkv.shape), scale[:P3].reshape(1, P3), P3)
        else:
            mixer.qkv_e4m3 = copy(mixer.qkv, "q|k|v", pad=False)
        mixer.o_proj_e4m3 = copy(mixer.o_proj, "o_proj")
        mixer.o_proj_rows = rows(mixer.o_proj, "o_proj", mixer.o_proj_e4m3)
    else:
        mixer.q_kva_e4m3, mixer.o_proj_e4m3 = copy(mixer.q_kva, "q|kv_a"), copy(mixer.o_proj, "o_proj")
        mixer.q_kva_rows = rows(mixer.q_kva, "q|kv_a", mixer.q_kva_e4m3)
        mixer.o_proj_rows = rows(mixer.o_proj, "o_proj", mixer.o_proj_e4m3)
    if isinstance(mlp, DeviceMLP):
        mlp.gate_up_e4m3 = copy(mlp.gate_up, "gate|up", True, pad=False)
        mlp.down_e4m3 = copy(mlp.down, "down") if mlp.gate_up_e4m3 is not None else None
        mlp.gate_up_rows = rows(mlp.gate_up, "gate|up", mlp.gate_up_e4m3)


def decode_rows(weights: ModelWeights) -> list[E4m3Rows]:
    """Every E4m3Rows of `weights` (the fp8 one-sequence decode GEMVs' rows, KDA_RT_FP8_DECODE_GEMV; none unless the
    switch was on at upload)."""
    names = ("qkv_fgb_rows", "o_proj_rows", "q_kva_rows", "gate_up_rows")
    return [r for L in weights.layers for part in (L.mixer, L.mlp) for n in names
            if (r := getattr(part, n, None)) is not None]


def upload_weights(config: ModelConfig, raw: Mapping[str, np.ndarray], *,
                   progress: bool | None = None, quantization: str | None = None) -> ModelWeights:
    """The checkpoint `raw` (hub name -> host array, as `load_checkpoint` returns) on the device; quantization
    "fp8": the MoE experts' stacks in e4m3 with a scale a row (EngineConfig.quantization), and on sm_90a
    (KDA_RT_FP8_DENSE) e4m3 copies of the large dense projections for prefill."""
    host = read_weights(config, raw)
    up = Uploader()
    dense_e4m3 = quantization == "fp8" and env.fp8_dense() and _e4m3_products()
    if quantization == "fp8" and os.environ.get("KDA_RT_FP8_DECODE_GEMV") == "1" and not dense_e4m3:
        # (asked for by name: the default applies quietly where it can)
        logger.warning("KDA_RT_FP8_DECODE_GEMV=1 ignored: the decode GEMVs' e4m3 rows are made with the dense e4m3 "
                       "copies, which need sm_90a with KDA_RT_WGMMA and KDA_RT_FP8_DENSE on")
    total = sum(np.asarray(v).nbytes for v in raw.values())
    show = progress if progress is not None else total > (1 << 30)
    bar = tqdm(total=config.num_hidden_layers + 1, desc="upload weights", unit="layer", disable=not show)
    embed = _put(up, host.embed_tokens)
    norm = _put(up, host.norm)
    lm_head = embed if host.lm_head is None else _put(up, host.lm_head)
    bar.update(1)
    layers = []
    for L in host.layers:
        mixer = _kda(up, L.mixer) if isinstance(L.mixer, KDAWeights) else _mla(up, L.mixer)
        mlp = _moe(up, L.mlp) if isinstance(L.mlp, MoEWeights) else _mlp(up, L.mlp)
        if quantization == "fp8" and isinstance(mlp, DeviceMoE):
            mlp = _quantize_moe(up, mlp)
        if dense_e4m3:
            _quantize_dense(up, mixer, mlp, decode=env.fp8_decode_gemv())
        layers.append(DeviceLayer(_put(up, L.input_layernorm), mixer, _put(up, L.post_attention_layernorm), mlp))
        bar.update(1)
    up.finish()
    bar.close()
    return ModelWeights(embed, norm, lm_head, layers, up.bytes_uploaded)
