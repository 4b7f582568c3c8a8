"""The Kimi Linear forward on the GPU: the same wiring as kda_rt/reference/kimi_linear.py (spec §6),
as kernel launches over one flat batch.  Every intermediate comes from a `Workspace`, so a decode
step can be captured into a CUDA graph.

    h = embed(ids)
    per layer: a = norm(h) ; h += KDA(a) | MLA(a) ; m = norm(h) ; h += MLP(m) | MoE(m)
    logits = lm_head(norm(h)[logits_rows])          (fp32)

Residual adds are fused into the next RMSNorm (bf16 residual stream, as in the references); after a MoE
block of a small step the add and the next norm ride in the MoE's combine kernel (KDA_RT_FUSED_NORM), and
the add and norm before it in its routing kernel (KDA_RT_ROUTE_NORM).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from kda_rt import env
from kda_rt.cuda.gemm import bmm, linear
from kda_rt.cuda.moe import NormBefore, moe_forward, moe_workspace_bytes, takes_norm_before, takes_x_codes
from kda_rt.cuda.ops.check import BF16
from kda_rt.cuda.ops.dense_w8a8 import MIN_TOKENS as FP8_DENSE_MIN_TOKENS
from kda_rt.cuda.ops.dense_w8a8 import E4m3Dense, dense_w8a8
from kda_rt.cuda.ops.embed import embed
from kda_rt.cuda.ops.gemv import gemv_dense
from kda_rt.cuda.ops.kda_decode import fuses_low_rank, kda_decode
from kda_rt.cuda.ops.kda_prefill import kda_prefill
from kda_rt.cuda.ops.mla_attn import LatentStore, decode_workspace_bytes, mla_attention
from kda_rt.cuda.ops.mla_prefill import mla_prefill, use_fp8
from kda_rt.cuda.ops.mla_store import mla_store
from kda_rt.cuda.ops.moe_align import FUSED_NORM_MAX_T, NormAfter, fits_norm
from kda_rt.cuda.ops.rmsnorm import rmsnorm
from kda_rt.cuda.ops.silu_mul import silu_mul
from kda_rt.cuda.ops.trace import trace_scope
from kda_rt.cuda.weights import DeviceKDA, DeviceMLA, DeviceMLP, DeviceMoE, E4m3Rows, ModelWeights
from kda_rt.cuda.workspace import Workspace
from kda_rt.loader.config import ModelConfig

logger = logging.getLogger(__name__)

__all__ = ["DeviceBatch", "CudaModel"]


def _mla_fp8(Dn: int, Dr: int, Dv: int) -> bool:
    """KDA_RT_MLA_FP8 where the FP8 MLA prefill attention can run; where it cannot, a warning (once) and bf16."""
    if not env.mla_fp8():
        return False
    if use_fp8(Dn, Dr, Dv):
        return True
    _warn_once(f"KDA_RT_MLA_FP8=1 ignored: the FP8 MLA prefill attention needs sm_90a with KDA_RT_WGMMA on and head "
               f"dims (128, 64, 128), here (Dn, Dr, Dv) = ({Dn}, {Dr}, {Dv}); running the bf16 attention")
    return False


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


@dataclass
class DeviceBatch:
    """ForwardBatch on the device (int32 arrays) plus the host-side sizes kernels need."""
    input_ids: Any  # [T]
    cu_seqlens: Any  # [B+1]
    context_lens: Any  # [B]
    state_slots: Any  # [B]
    block_tables: Any  # [B, M]
    logits_indices: Any  # [N]
    num_tokens: int
    num_seqs: int
    max_seqlen: int
    decode: bool  # every sequence has exactly one new token
    host_cu_seqlens: Any = None  # [B+1] NumPy copies (eager steps): launchers that plan on the host
    host_context_lens: Any = None  # [B] read these instead of syncing on the device arrays
    num_live: Any = None  # [1] a decode graph's live rows, the rest padding (KDA_RT_SKIP_PAD; else None)
    snapshot: Any = None  # [B, 2] ForwardBatch.snapshot (prefill steps; else None)


class CudaModel:
    def __init__(self, config: ModelConfig, weights: ModelWeights, kda_pools: dict[int, tuple[Any, Any]],
                 mla_pools: dict[int, Any]) -> None:
        self.config = config
        self.w = weights
        self.kda_pools = kda_pools  # layer id -> (conv_pool, rec_pool)
        self.mla_pools = mla_pools  # layer id -> kv_pool [num_blocks, block_size, 576]
        self.skip_pad = 0  # decode steps' negative slots are padding rows (the runner's KDA_RT_SKIP_PAD: 0, 1, 2)
        self.launches = 0
        import cupy

        # decode steps only, per layer: [experts touched summed over calls, calls] (the bench's bytes floor)
        self.expert_stats = cupy.zeros((len(weights.layers), 2), dtype=np.int32)

    # ------------------------------------------------------------------------------------------

    def forward(self, b: DeviceBatch, ws: Workspace, hidden_only: bool = False):
        """[N, vocab] float32 logits (a workspace buffer) for the rows in b.logits_indices; `hidden_only`: the final
        norm's output [T, D] bf16 of every token instead (the prompt-logprob pass projects it a chunk at a time)."""
        cfg, T, D = self.config, b.num_tokens, self.config.hidden_size
        eps = cfg.rms_norm_eps
        with trace_scope("embed"):
            res = embed(b.input_ids, self.w.embed, out=ws.get("res", (T, D), BF16))
        a = ws.get("a", (T, D), BF16)
        delta = ws.get("delta", (T, D), BF16)
        final = ws.get("final", (T, D), BF16)
        fuse_norm = env.fused_norm() and T <= env.fused_norm_max_t(FUSED_NORM_MAX_T) and fits_norm(D)
        layers = self.w.layers
        normed = False  # the previous MoE block already added its output to res and normalised it into a
        # the dense projections on their e4m3 copies (KDA_RT_WGMMA=0 turns them off too: they run on wgmma)
        fp8 = not b.decode and T >= FP8_DENSE_MIN_TOKENS and env.fp8_dense() and env.wgmma()
        # decode steps of fp8 models of up to KDA_RT_FP8_DECODE_GEMV_MAX_T rows (default 2): the dense projections
        # as e4m3 GEMVs where the weights hold e4m3 rows for them (KDA_RT_FP8_DECODE_GEMV, at upload and here)
        gemv8 = b.decode and T <= env.fp8_decode_gemv_max_t() and env.fp8_decode_gemv()
        for i, L in enumerate(layers):
            first = L.mixer.qkv_e4m3 if isinstance(L.mixer, DeviceKDA) else L.mixer.q_kva_e4m3
            # the mixer's first projection on e4m3 products: the norm writes a's codes too (and the mixer takes
            # them); after a fused MoE norm (`normed`, small steps only) there are none
            mix_codes = self._codes(ws, "mix", T, D) if fp8 and first is not None and not normed else None
            if not normed:
                with trace_scope("norm+residual"):
                    if i == 0:
                        rmsnorm(res, L.in_norm, eps, out=a, e4m3_out=mix_codes)
                    else:
                        rmsnorm(delta, L.in_norm, eps, residual=res, out=a, e4m3_out=mix_codes)
            with trace_scope(f"{L.kind}.{'decode' if b.decode else 'prefill'}"):
                if isinstance(L.mixer, DeviceKDA):
                    self._kda(i, L.mixer, a, b, ws, out=delta, fp8=fp8, codes=mix_codes, gemv8=gemv8)
                else:
                    self._mla(i, L.mixer, a, b, ws, out=delta, fp8=fp8, codes=mix_codes, gemv8=gemv8)
            last = i + 1 == len(layers)
            normed = fuse_norm and isinstance(L.mlp, DeviceMoE)
            # small steps: the add and norm before the MoE ride in its routing kernel too (moe_route_fused)
            pre = normed and takes_norm_before(T, cfg.moe, D, L.mlp.shared_in_stack)
            # a large fp8 step: the norm writes the MoE's e4m3 sources as well (the same codes the MoE would make)
            codes = None
            if ((not pre and isinstance(L.mlp, DeviceMoE) and takes_x_codes(T, L.mlp, cfg.moe, D) and env.norm_e4m3())
                    or (fp8 and isinstance(L.mlp, DeviceMLP) and L.mlp.gate_up_e4m3 is not None)):
                codes = self._codes(ws, "x", T, D)
            if not pre:
                with trace_scope("norm+residual"):
                    rmsnorm(delta, L.post_norm, eps, residual=res, out=a, e4m3_out=codes)
            with trace_scope(L.mlp_kind):
                if isinstance(L.mlp, DeviceMoE):
                    # the block's residual add and the next norm (the next layer's, or the final one) ride in
                    # the MoE's last kernel; its output is then the next normalised input (a, or final)
                    norm = NormAfter(res, self.w.norm if last else layers[i + 1].in_norm, eps) if normed else None
                    before = NormBefore(res, L.post_norm, eps, ws.get("h_pre", (T, D), BF16), a) if pre else None
                    self._moe(L.mlp, delta if pre else a, ws, out=(final if last else a) if normed else delta,
                              stats=self.expert_stats[i] if b.decode else None, norm=norm, norm_before=before,
                              x_codes=codes, live=b.num_live)
                else:
                    self._mlp(L.mlp, a, ws, out=delta, codes=codes, gemv8=gemv8)
        with trace_scope("final norm+lm_head"):
            if not normed:
                rmsnorm(delta, self.w.norm, eps, residual=res, out=final)
            if hidden_only:
                return final
            N = int(b.logits_indices.shape[0])
            logits = ws.get("logits", (N, self.w.lm_head.shape[0]), np.float32)
            if N == 0:  # prefill chunks that finish no prompt: nothing to project
                return logits
            rows = final if (b.decode and N == T) else final.take(b.logits_indices, axis=0)
            return linear(rows, self.w.lm_head, out=logits)

    # ------------------------------------------------------------------------------------------

    @staticmethod
    def _codes(ws: Workspace, name: str, T: int, K: int) -> tuple[Any, Any]:
        """Workspace room for T rows of K e4m3 codes and their scales."""
        return ws.get(f"{name}_codes", (T, K), np.uint8), ws.get(f"{name}_code_scales", (T,), np.float32)

    def _proj(self, x, w, w8: E4m3Dense | None, ws: Workspace, name: str, *, fp8: bool, codes=None, out=None,
              rows: E4m3Rows | None = None):
        """x · wᵀ: on e4m3 products when `fp8` and the weight has its e4m3 copy `w8` (x's codes from the norm
        before when `codes` is given, else made here), as an e4m3 GEMV when `rows` are given (1 to 4 rows of x: bf16
        x, w's e4m3 rows times their scales), else cuBLAS bf16; into `out` or the workspace's `name`."""
        T = x.shape[0]
        if rows is not None:
            return gemv_dense(x, rows.codes, out if out is not None else ws.get(name, (T, w.shape[0]), BF16),
                              scale=rows.scale)
        if not (fp8 and w8 is not None):
            return linear(x, w, out=out if out is not None else ws.get(name, (T, w.shape[0]), BF16))
        padded = int(w8.codes.shape[1]) // (2 if w8.fuse_silu else 1)
        width = w8.nout // (2 if w8.fuse_silu else 1)
        # (the bf16 path's buffer of the same name: one allocation, re-viewed at the padded width)
        dst = out if out is not None and padded == width else ws.get(name, (T, padded), BF16)
        dense_w8a8(x, w8, out=dst, codes=codes if codes is not None else self._codes(ws, name, T, x.shape[1]),
                   quantized=codes is not None)
        if dst is out:
            return out
        if out is not None:
            out[...] = dst[:, :width]
            return out
        return dst[:, :width] if padded != width else dst

    def _mlp(self, w: DeviceMLP, a, ws: Workspace, *, out, codes=None, gemv8: bool = False) -> None:
        T, two_f = a.shape[0], w.gate_up.shape[0]
        if codes is not None and w.gate_up_e4m3 is not None:  # fp8 prefill: SiLU · up in the GEMM's epilogue
            act = self._proj(a, w.gate_up, w.gate_up_e4m3, ws, "act", fp8=True, codes=codes)
            self._proj(act, w.down, w.down_e4m3, ws, "down", fp8=True, out=out)
            return
        gu = self._proj(a, w.gate_up, None, ws, "gu", fp8=False, rows=w.gate_up_rows if gemv8 else None)
        act = silu_mul(gu, out=ws.get("act", (T, two_f // 2), BF16))
        linear(act, w.down, out=out)

    def _kda(self, layer: int, w: DeviceKDA, a, b: DeviceBatch, ws: Workspace, *, out, fp8: bool = False,
             codes=None, gemv8: bool = False) -> None:
        kc = self.config.kda
        T, P, H = b.num_tokens, kc.num_heads * kc.head_dim, kc.num_heads
        rf, rg = w.rank_f, w.rank_g
        if b.decode and w.qkv_fgb is not None and env.fused_kda_projection():
            # decode: the six projections of x in one GEMM (a latency-bound f_a|g_a|b launch less a layer);
            # kda_decode reads q|k|v as a row-strided view.  Prefill keeps them apart: kda_prefill's copies
            # take contiguous q|k|v rows.
            both = self._proj(a, w.qkv_fgb, None, ws, "kda_qkv_fgb", fp8=False,
                              rows=w.qkv_fgb_rows if gemv8 else None)
            qkv, small = both[:, :3 * P], both[:, 3 * P:3 * P + rf + rg + H]
        else:
            qkv = self._proj(a, w.qkv, w.qkv_e4m3, ws, "kda_qkv", fp8=fp8, codes=codes)
            small = linear(a, w.fgb, out=ws.get("kda_fgb", (T, rf + rg + H), BF16))
        f_a, g_a, beta = small[:, :rf], small[:, rf:rf + rg], small[:, rf + rg:]
        conv_pool, rec_pool = self.kda_pools[layer]
        y = ws.get("kda_y", (T, P), BF16)
        if b.decode and fuses_low_rank(T, f_a, g_a):  # small decode batches: f_b, g_b applied in the kernel
            f, gate, low_rank = f_a, g_a, {"f_b": w.f_b, "g_b": w.g_b}
        elif b.decode and w.fg_b is not None:
            # f = f_a · f_bᵀ and gate = g_a · g_bᵀ in one strided-batched GEMM (f_a, g_a: adjacent column
            # blocks of `small`; f_b, g_b: one [2, P, R] array); larger decode batches, where the kernel
            # does not take them (a graph-replayed batch-32 step paid ~3.6 us per cuBLAS call, 40 calls)
            from cupy.lib.stride_tricks import as_strided

            fg = ws.get("kda_fg", (2, T, P), BF16)
            bmm(as_strided(small, (2, T, rf), (rf * 2, small.strides[0], 2)), w.fg_b, out=fg, transpose_b=True)
            f, gate, low_rank = fg[0], fg[1], {}
        else:
            f = linear(f_a, w.f_b, out=ws.get("kda_f", (T, P), BF16))
            gate = linear(g_a, w.g_b, out=ws.get("kda_gate", (T, P), BF16))
            low_rank = {}
        args = (qkv, f, beta, gate, w.conv_w, w.A_log, w.dt_bias, w.o_norm, conv_pool, rec_pool,
                b.cu_seqlens, b.context_lens, b.state_slots)
        y_codes = None  # o_proj on e4m3 products: the gated norm writes y's codes too
        if b.decode:
            kda_decode(*args, num_heads=H, head_dim=kc.head_dim, eps=self.config.rms_norm_eps, out=y,
                       skip_pad=self.skip_pad, **low_rank)
        else:
            if fp8 and w.o_proj_e4m3 is not None and H <= 64 and env.kda_norm_e4m3():
                y_codes = self._codes(ws, "o", T, P)
            kda_prefill(*args, num_heads=H, head_dim=kc.head_dim, eps=self.config.rms_norm_eps, out=y,
                        max_seqlen=b.max_seqlen, e4m3_out=y_codes, snapshot=b.snapshot)
        self._proj(y, w.o_proj, w.o_proj_e4m3, ws, "o", fp8=fp8, codes=y_codes, out=out,
                   rows=w.o_proj_rows if gemv8 else None)

    def _moe(self, w: DeviceMoE, a, ws: Workspace, *, out, stats=None, norm=None, norm_before=None,
             x_codes=None, live=None) -> None:
        mc, T, D = self.config.moe, a.shape[0], self.config.hidden_size
        inter_s = w.shared.down.shape[1] if w.shared is not None else 0
        nbytes = moe_workspace_bytes(T, mc, D, mc.intermediate_size, inter_s, w.shared_in_stack, w.e4m3)
        moe_forward(a, w, mc, out=out, workspace=ws.get("moe_ws", (nbytes,), np.uint8), stats=stats, norm=norm,
                    norm_before=norm_before, x_codes=x_codes, live=live)

    def _mla(self, layer: int, w: DeviceMLA, a, b: DeviceBatch, ws: Workspace, *, out, fp8: bool = False,
             codes=None, gemv8: bool = False) -> None:
        mc = self.config.mla
        T, H = b.num_tokens, mc.num_heads
        qdim = H * mc.qk_head_dim
        qkva = self._proj(a, w.q_kva, w.q_kva_e4m3, ws, "mla_qkva", fp8=fp8, codes=codes,
                          rows=w.q_kva_rows if gemv8 else None)
        pool = self.mla_pools[layer]
        store = LatentStore(qkva[:, qdim:], w.kv_norm, mc.kv_a_layernorm_eps)
        fold = b.decode and env.mla_store_fold()  # mla_attention writes the rows (in mla_absorb_q's launch)
        if not fold:
            mla_store(store.kv_a, store.norm_w, store.eps, pool, b.cu_seqlens, b.context_lens, b.block_tables)
        o = ws.get("mla_o", (T, H * mc.v_head_dim), BF16)
        scale = float(mc.qk_head_dim) ** -0.5
        if b.decode:  # absorbed form over the latent pages; preallocated scratch (graph capture)
            M = int(b.block_tables.shape[1])
            nbytes = decode_workspace_bytes(T, H, M, pool.shape[1], mc.kv_lora_rank)
            mla_attention(qkva[:, :qdim], pool, w.kv_b, b.cu_seqlens, b.context_lens, b.block_tables,
                          num_heads=H, scale=scale, max_seqlen=1, decode=True, out=o,
                          workspace=ws.get("mla_ws", (nbytes,), np.uint8),
                          store=store if fold else None)
        else:  # prefill / mixed step (eager): expanded form, ops/mla_prefill.py sizes its own scratch
            mla_prefill(qkva[:, :qdim], pool, w.kv_b, b.cu_seqlens, b.context_lens, b.block_tables,
                        num_heads=H, scale=scale, out=o, host_lens=(b.host_cu_seqlens, b.host_context_lens),
                        fp8=_mla_fp8(mc.qk_nope_head_dim, mc.qk_rope_head_dim, mc.v_head_dim))
        self._proj(o, w.o_proj, w.o_proj_e4m3, ws, "o", fp8=fp8, out=out, rows=w.o_proj_rows if gemv8 else None)
