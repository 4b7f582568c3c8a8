"""MoE block on the GPU (spec §5): router → bucket pairs by expert → grouped gate/up GEMM with SiLU·up
fused → grouped down GEMM → weighted per-token combine (+ shared expert), rounded to bf16 once.

    y[t] = bf16( Σ_k w[t, k] · Expert_{ids[t, k]}(x[t])  +  Shared(x[t]) )       (fp32 sum, k order)

Each expert's output row is rounded to bf16 by the down GEMM (as HF's expert outputs, spec §5
precision notes; half the bytes of an fp32 row for the GEMM to write and the combine to read).

CUDA-graph contract: with `out` and `workspace` given, nothing is allocated, nothing syncs with
the host, and every grid is sized from (T, A, E) alone (tiles past the device-side count exit), so
the whole call can be captured once per T and replayed on new x / weights in the same buffers.
The workspace is one uint8 buffer of `moe_workspace_bytes(T, cfg, D, I, Is, fused, e4m3)` bytes; run one eager call
on it before a capture (it zeroes the counter of moe_route_fused that every launch leaves at 0).

Decode sizes (T <= FUSED_MAX_T, ungrouped routing) route and bucket in one launch (moe_route_fused), and
from FUSED_MIN_TOKENS run both expert GEMMs in one more (moe_decode_fused); larger steps route, bucket and
multiply in separate launches.

Letters: T tokens, D hidden, E experts, A = top_k, N = T·A pairs, I expert width, Is shared width.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import numpy as np

from kda_rt import env
from kda_rt.cuda.gemm import linear
from kda_rt.cuda.ops.check import BF16, expect
from kda_rt.cuda.ops.moe_align import (
    MoEPlan,
    NormAfter,
    bucket_kernel,
    bucket_scratch_words,
    fits_norm,
    live_arg,
    max_tiles,
    moe_bucket,
    moe_combine,
)
from kda_rt.cuda.ops.moe_gemm import moe_gemm, tile_rows_for
from kda_rt.cuda.ops.moe_gemm_tc import (
    FUSED_MIN_TOKENS,
    SMALL_DECODE_TOKENS,
    built_tile_rows,
    check_scale,
    e4m3_tile,
    fused_decode_tile,
    fused_e4m3_tile,
    fused_kernel,
    fused_rows,
    moe_decode_fused,
    moe_gemm_tc,
    prefill_tile_rows,
    tc_kernel,
    tile_config,
)
from kda_rt.cuda.ops.moe_gemm_wg import BM as WG_BM
from kda_rt.cuda.ops.moe_gemm_wg import available as moe_gemm_wg_available
from kda_rt.cuda.ops.moe_gemm_wg import moe_gemm_wg, w8a8_fits, wg_kernel, wg_tile
from kda_rt.cuda.ops.moe_gemv import (
    GemvRouting,
    down_fits,
    down_kernel,
    gemv_kernel,
    moe_gemv_down,
    moe_gemv_gate_up,
    routed_kernel,
)
from kda_rt.cuda.ops.moe_gemv import fits as gemv_fits
from kda_rt.cuda.ops.moe_route import (
    FUSED_MAX_T,
    SPLIT_MIN_T,
    NormBefore,
    fused_route_blocks,
    fused_route_fits,
    fused_route_rows,
    moe_route,
    moe_route_fused,
    split_router,
)
from kda_rt.cuda.ops.moe_route import fused_kernel as fused_route_kernel
from kda_rt.cuda.ops.quant import activation_kernel, quantize_activations_e4m3
from kda_rt.cuda.ops.rmsnorm import rmsnorm_kernel
from kda_rt.cuda.ops.silu_mul import silu_mul

if TYPE_CHECKING:
    from kda_rt.cuda.weights import DeviceMoE
    from kda_rt.loader.config import MoEConfig

__all__ = ["ROUTE_NORM_MAX_T", "NormBefore", "moe_forward", "moe_workspace_bytes", "precompile", "takes_norm_before",
           "takes_x_codes"]

_ALIGN = 256


def _layout(T: int, cfg: MoEConfig, D: int, inter: int, inter_s: int, fused: bool = False,
            e4m3: bool = False) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    E, A = cfg.num_experts, cfg.top_k
    bins = E + 1 if fused else E  # fused: the shared expert is bin E, every token has A + 1 pairs
    N = T * (A + 1) if fused else T * A
    tiles = max_tiles(N, bins, 8)  # BT = 8 gives the most tiles
    i32, f32 = np.dtype(np.int32), np.dtype(np.float32)
    # route_done first: at the same offset for every T, so the 0 that moe_route_fused leaves is found again
    parts = [("route_done", (64,), i32), ("logits", (T, 3 * E), f32), ("ids", (T, A), i32), ("w", (T, A), f32), ("expert_off", (bins + 1,), i32),
             ("sorted_pair", (N,), i32), ("pair_pos", (N,), i32), ("tile_expert", (tiles,), i32),
             ("tile_row", (tiles,), i32), ("num_tiles", (1,), i32), ("h", (N, inter), BF16), ("y", (N, D), BF16),
             ("sync", (1 + tiles,), i32),  # moe_decode_fused's counters (>= sync_words: tiles of 16 rows)
             ("bucket_scratch", (max(1, bucket_scratch_words(N, bins)),), i32)]
    if inter_s and not fused:
        parts += [("gu_s", (T, 2 * inter_s), BF16), ("h_s", (T, inter_s), BF16), ("y_s", (T, D), f32)]
    if e4m3 and env.fp8_prefill():  # the prefill GEMMs' e4m3 sources (e4m3 stacks), codes and row scales
        u8 = np.dtype(np.uint8)
        parts += [("xq", (T, D), u8), ("xs", (T,), f32), ("hq", (N, inter), u8), ("hs", (N,), f32)]
    return parts


def _offsets(parts) -> tuple[list[int], int]:
    offs, pos = [], 0
    for _, shape, dtype in parts:
        offs.append(pos)
        pos += -(-int(np.prod(shape)) * dtype.itemsize // _ALIGN) * _ALIGN
    return offs, pos


def moe_workspace_bytes(T: int, cfg: MoEConfig, D: int, inter: int, inter_s: int = 0, fused: bool = False,
                        e4m3: bool = False) -> int:
    """Bytes of the uint8 workspace moe_forward needs for T tokens: D hidden, `inter` = I expert width,
    `inter_s` = Is shared width (0: no shared expert), `fused`: the shared expert is in the stacks, `e4m3`: the
    stacks hold e4m3 codes (with KDA_RT_FP8_PREFILL, read here as moe_forward reads it: room for the prefill GEMMs'
    e4m3 sources)."""
    return _offsets(_layout(T, cfg, D, inter, inter_s, fused, e4m3))[1]


def precompile(cfg: MoEConfig, D: int, inter: int, fused: bool, e4m3: bool = False) -> int:
    """Build (or load from the disk cache) every bucket and grouped-GEMM variant a step can pick for
    this MoE shape: tiles of 16 (two: batches of up to SMALL_DECODE_TOKENS and larger), 32 and 64 rows (as
    built_tile_rows says: bf16 stacks 64, and 32 too with KDA_RT_MOE_FUSED32=auto or 1; e4m3 stacks 64, on
    moe_decode_fused, or 32 with KDA_RT_MOE_FUSED64=0) and 128 (on wgmma where it runs), so no
    step, e.g. a mixed prefill / decode step whose rows per expert differ from the warm-up's, waits for NVRTC
    (~0.2-0.4 s a variant); `e4m3`: the variants for e4m3 expert stacks (their tiles as moe_forward picks them).
    Returns the number of variants."""
    shapes = [(2 * inter, D, True), (D, inter, False)]
    E, A = cfg.num_experts, cfg.top_k
    pairs, bins = (A + 1, E + 1) if fused else (A, E)
    count = 0
    for bm in built_tile_rows(e4m3):
        gemms = [(nout, k, fuse, tile_config(bm, nout, k, fuse)) for nout, k, fuse in ((2 * inter, D, True),
                                                                                      (D, inter, False))]
        if not all(t for *_, t in gemms):  # as prefill_tile_rows: no tile of bm rows fits (D, I)
            continue
        bucket_kernel(bins, bm, A if fused else 0)
        for nout, k, fuse, tile in gemms:
            if bm == WG_BM and moe_gemm_wg_available(bm, D, inter):
                wg_kernel(wg_tile(nout, k, fuse), k, nout, fuse, pairs, e4m3)
                if e4m3 and env.fp8_prefill() and w8a8_fits(D, inter):  # e4m3 sources too
                    wg_kernel(wg_tile(nout, k, fuse, e4m3_src=True), k, nout, fuse, pairs, e4m3, e4m3_src=True)
                    activation_kernel(k)
                    count += 2
                    if fuse and env.norm_e4m3():  # x's codes from the norm before the block (model.py)
                        rmsnorm_kernel(D, True, e4m3_out=True)
                        count += 1
            else:
                tc_kernel(e4m3_tile(tile, [(nout, k, fuse)]) if e4m3 else tile, k, nout, fuse, pairs, e4m3)
                small = tile_config(bm, nout, k, fuse, tokens=1)
                if small and small != tile:
                    tc_kernel(e4m3_tile(small, [(nout, k, fuse)]) if e4m3 else small, k, nout, fuse, pairs, e4m3)
                    count += 1
        count += 3
        if bm in fused_rows(e4m3):  # both decode GEMMs in one launch, for small and larger batches
            fused_tiles = {fused_e4m3_tile(t, shapes) if e4m3 else t  # (e4m3: one tile for both sizes)
                           for tokens in (FUSED_MIN_TOKENS, SMALL_DECODE_TOKENS + 1)
                           if (t := fused_decode_tile(tokens, D, inter, bm))}
            for tile in fused_tiles - {None}:
                fused_kernel(tile, D, inter, pairs, e4m3)
                count += 1
        if bm == 16:
            if gemv_fits(1, D, e4m3):
                # a one-token step's gate/up (and the variant that selects its own experts), down
                gemv_kernel(D, inter, e4m3=e4m3)
                count += 1
                if env.down_gemv() and down_fits(inter, D, e4m3):
                    down_kernel(inter, D, e4m3=e4m3)
                    count += 1
                if env.gemv_routed() and fused_route_fits(1, E, D, A, cfg.num_expert_group, fused):
                    gemv_kernel(D, inter, routed=(E, fused), e4m3=e4m3)
                    count += 1
            norm_max_t = _route_norm_max_t()
            for tokens in (1, 2, 4, FUSED_MAX_T):  # routing + bucketing in one launch: each rows-per-block variant
                if fused_route_fits(tokens, E, D, A, cfg.num_expert_group, fused):
                    fused_route_kernel(tokens, E, D, bm, fused)
                    count += 1
                    if (env.route_norm() and fits_norm(D) and norm_max_t >= 1
                            and fused_route_rows(tokens) <= fused_route_rows(norm_max_t)):
                        fused_route_kernel(tokens, E, D, bm, fused, norm=True)  # with NormBefore (takes_norm_before)
                        count += 1
    return count


# Steps of up to this many tokens take the add and RMSNorm before the block inside moe_route_fused (NormBefore):
# each route block stages its rows' delta and residual itself, which lengthens its critical path by the loads
# of T rows while it saves the rmsnorm launch.  Graph replays of the full model (tests/gpu/bench_ab.py --env
# KDA_RT_ROUTE_NORM --replays, H200, 2026-12-01): batch 1 2.3560 -> 2.3232 ms (-1.4%) and 2.3687 -> 2.3344 (-1.4%),
# batch 2 3.0474 -> 3.0429 (-0.1%), batch 4 3.8384 -> 3.8680 (+0.8%), batch 8 5.0503 -> 5.1336 (+1.6%), batch 16
# 6.9775 -> 7.0689 (+1.3%).  With delta staged by cp.async and the residual by 16-byte loads (eighteenth session,
# `--env ...,KDA_RT_ROUTE_NORM,KDA_RT_ROUTE_NORM_MAX_T --values ...:1:8,...:0:1`, one call): batch 2 3.0328 ->
# 3.0172 ms (-0.5%), batch 4 3.8205 -> 3.8068 (-0.4%), batch 8 5.1124 -> 5.1508 (+0.8%), batch 1 as before; so 4.
ROUTE_NORM_MAX_T = 4


def _route_norm_max_t() -> int:
    return env.route_norm_max_t(ROUTE_NORM_MAX_T)  # the bench switch KDA_RT_ROUTE_NORM_MAX_T, else the policy


def takes_norm_before(T: int, cfg: MoEConfig, D: int, shared_in_stack: bool) -> bool:
    """moe_forward can take norm_before for a T-token step: T <= ROUTE_NORM_MAX_T, its routing runs as
    moe_route_fused, its combine can carry the norm after the block (fits_norm), and KDA_RT_ROUTE_NORM is not 0."""
    return (T <= _route_norm_max_t() and env.route_norm() and fits_norm(D)
            and fused_route_fits(T, cfg.num_experts, D, cfg.top_k, cfg.num_expert_group, shared_in_stack))


def takes_x_codes(T: int, w: DeviceMoE, cfg: MoEConfig, D: int) -> bool:
    """A step of T tokens runs its gate/up GEMM on e4m3 sources (moe_forward's FP8 prefill products), so the caller
    may hand it x's codes (moe_forward x_codes=, made by the RMSNorm before the block: rmsnorm e4m3_out=)."""
    if not w.e4m3:
        return False
    fused = 1 if w.shared_in_stack else 0
    inter = w.w2.shape[2]
    return _e4m3_sources(prefill_tile_rows(T * (cfg.top_k + fused), cfg.num_experts + fused, D, inter, e4m3=True), D,
                         inter, True)


def _e4m3_sources(bm: int, D: int, inter: int, e4m3: bool) -> bool:
    """The prefill GEMMs of a step with `bm`-row tiles (0: none fits) take e4m3 sources: e4m3 stacks on the wgmma
    kernel with 128-code k steps, and KDA_RT_FP8_PREFILL."""
    return e4m3 and bool(bm) and moe_gemm_wg_available(bm, D, inter) and env.fp8_prefill() and w8a8_fits(D, inter)


def moe_forward(x, w: DeviceMoE, cfg: MoEConfig, *, out=None, workspace=None, stats=None, norm: NormAfter | None = None,
                stream=None, norm_before: NormBefore | None = None, x_codes=None, live=None):
    """x: [T, D] bf16 -> [T, D] bf16.  Weights (cuda/weights.py): w.router [E, D] fp32, w.bias [E] fp32,
    w.w13 [E, 2I, D] bf16 ([w1 gate; w3 up] rows), w.w2 [E, D, I] bf16, w.shared (gate_up [2Is, D],
    down [D, Is], bf16) or None; with w.scale13 / w.scale2 the stacks hold e4m3 codes (uint8) and those their fp32
    row scales (every expert kernel takes them: WFMT = 1; the weight-stationary moe_gemm.cu of the smallest shapes
    does not, so those are refused).  stats: optional int32 [2] device counter of the experts touched
    (ops/moe_align.moe_bucket).  norm (ops/moe_align.NormAfter): the residual add and RMSNorm after the block
    are done here too, by the combine (ops/moe_align.moe_combine): norm.residual += bf16(MoE(x)),
    out = RMSNorm(norm.residual).
    norm_before (ops/moe_route.NormBefore, where takes_norm_before; needs `norm`): x is the mixer's output and
    the residual add and RMSNorm before the block ride in the routing kernel: the block's input is
    RMSNorm(x + norm_before.residual), written to norm_before.a_out, and norm.residual ends as
    x + residual + MoE(...), as rmsnorm(x, ..., residual=...) before this call would give (norm_before.residual
    is norm.residual; norm_before.h_out holds the stream in between).
    x_codes: optional (q [T, D] uint8, scale [T] fp32), x's rows as e4m3 codes (rmsnorm e4m3_out=, the same codes as
    quantize_activations_e4m3 makes); where the step's gate/up GEMM takes e4m3 sources (takes_x_codes) it reads
    them instead of quantizing x again, elsewhere they are not read.
    live: optional int32 [1] device count of live tokens (a decode graph's step; KDA_RT_SKIP_PAD): tokens from it on
    are padding, whose pairs the bucketing leaves out and whose rows the combine writes as zeros (with `norm`, their
    residual rows are not advanced: left as they were, or residual + 0 where the norm runs as its own kernel, and
    with `norm_before` the stream the routing kernel wrote aside is not copied back for them); the live rows'
    outputs are those of the call without it, bit for bit."""
    import cupy

    w_router, bias, w13, w2 = w.router, w.bias, w.w13, w.w2
    shared_w13, shared_w2 = (w.shared.gate_up, w.shared.down) if w.shared is not None else (None, None)

    T, D = expect(x, "x", ndim=2, dtype=BF16)
    E, A = cfg.num_experts, cfg.top_k
    if norm_before is not None:
        if norm is None:
            raise ValueError("moe_forward: norm_before needs `norm` too (the combine writes the new residual stream)")
        if norm_before.residual is not norm.residual:
            raise ValueError("moe_forward: norm_before.residual and norm.residual must be the same array")
        if not takes_norm_before(T, cfg, D, w.shared_in_stack):
            limit = _route_norm_max_t()
            why = (f"T={T} > ROUTE_NORM_MAX_T={limit}" if T > limit else
                   "KDA_RT_ROUTE_NORM=0" if not env.route_norm() else
                   f"hidden size {D} too wide for the combine's one-block norm" if not fits_norm(D) else
                   "this step's routing is not moe_route_fused (grouped routing, KDA_RT_FUSED_ROUTE=0 or its limits)")
            raise ValueError(f"moe_forward: norm_before cannot ride in the routing kernel here: {why}")
        norm = norm._replace(residual_in=norm_before.h_out)
    delta, x = x, (x if norm_before is None else norm_before.a_out)  # the mixer's output; the block's input
    fused = w.shared_in_stack  # the shared expert is expert E of the stacks: one more pair per token
    stacked = E + 1 if fused else E
    wdtype = np.uint8 if w.e4m3 else BF16
    s13, s2 = w.scale13, w.scale2
    if (s13 is None) != (s2 is None):
        raise ValueError("moe_forward: e4m3 expert stacks need both scale13 and scale2 (bf16 stacks: neither)")
    _, two_i, _ = expect(w13, "w13", shape=(stacked, None, D), dtype=wdtype)
    inter = two_i // 2
    expect(w2, "w2", shape=(stacked, D, inter), dtype=wdtype)
    if w.e4m3:  # (every refusal before the routing kernel launches: the routed GEMV waits on its signal)
        check_scale("moe_forward", "scale13", s13, w13)
        check_scale("moe_forward", "scale2", s2, w2)
    if fused and (w.shared is None or w.shared.down.shape != (D, inter)):
        raise ValueError("moe_forward: shared_in_stack needs one shared expert of the experts' width")
    if (shared_w13 is None) != (shared_w2 is None) or (shared_w13 is None) != (cfg.num_shared_experts == 0):
        raise ValueError("moe_forward: give both shared expert weights exactly when cfg.num_shared_experts > 0")
    inter_s = 0
    if shared_w13 is not None:  # (views of the stacks when they carry it: e4m3 codes then)
        sdt = wdtype if fused else BF16
        inter_s = expect(shared_w13, "shared_w13", shape=(None, D), dtype=sdt)[0] // 2
        expect(shared_w2, "shared_w2", shape=(D, inter_s), dtype=sdt)
    parts = _layout(T, cfg, D, inter, inter_s, fused, w.e4m3)
    offs, nbytes = _offsets(parts)
    workspace = cupy.empty(nbytes, dtype=np.uint8) if workspace is None else workspace
    expect(workspace, "workspace", ndim=1, dtype=np.uint8)
    if workspace.size < nbytes:
        raise ValueError(f"moe_forward: workspace has {workspace.size} bytes, needs {nbytes} (moe_workspace_bytes)")
    out = cupy.empty((T, D), dtype=BF16) if out is None else out
    expect(out, "out", shape=(T, D), dtype=BF16)
    if T == 0:
        return out
    ws = {name: cupy.ndarray(shape, dtype, memptr=workspace.data + off)
          for (name, shape, dtype), off in zip(parts, offs, strict=True)}
    # the shared-memory tiled GEMM with BM = 128 / 64 / 16-row tiles by the rows per expert (128-row
    # tiles on wgmma where the arch is sm_90a); the weight-stationary kernel only where no tile fits
    # (D, I) (small test shapes)
    pairs = A + 1 if fused else A
    bm = prefill_tile_rows(T * pairs, stacked, D, inter, e4m3=w.e4m3)
    gemm = (moe_gemm_wg if moe_gemm_wg_available(bm, D, inter) else moe_gemm_tc) if bm else moe_gemm
    if w.e4m3 and not bm:
        raise ValueError(f"moe_forward: e4m3 expert stacks need a tiled GEMM, and no tile fits D={D}, I={inter}")
    # e4m3 stacks on the wgmma GEMMs (prefill): sources quantized a row at a time and e4m3 products (KDA_RT_FP8_PREFILL)
    w8a8 = _e4m3_sources(bm, D, inter, w.e4m3)  # (gemm is then moe_gemm_wg)
    if live_arg(live) and T == 1:  # (checked before any launch)
        live = None  # (one token is never padded: its GEMV path takes no count)
    if x_codes is not None:
        expect(x_codes[0], "x_codes[0]", shape=(T, D), dtype=np.uint8)
        expect(x_codes[1], "x_codes[1]", shape=(T,), dtype=np.float32)
    # decode sizes from FUSED_MIN_TOKENS: both GEMMs in one launch (moe_decode_fused), where one tile fits both
    fused_tile = (fused_decode_tile(T, D, inter, bm) if bm in fused_rows(w.e4m3) and T >= FUSED_MIN_TOKENS
                  and env.fused_moe() else None)
    if fused_tile is not None and w.e4m3:  # (its e4m3 k step: the same weight bytes a stage)
        fused_tile = fused_e4m3_tile(fused_tile, [(two_i, D, True), (D, inter, False)])
    scale_kw = {"scale": s13}, {"scale": s2}  # the gate/up and down GEMMs' (None for bf16)
    plan = MoEPlan(ws["expert_off"], ws["sorted_pair"], ws["pair_pos"], ws["tile_expert"], ws["tile_row"],
                   ws["num_tiles"], bm or tile_rows_for(T * pairs, stacked))
    with stream if stream is not None else contextlib.nullcontext():
        if w.router_split is None and T >= SPLIT_MIN_T and not cupy.cuda.get_current_stream().is_capturing():
            # weights built without upload_weights: split on first eager use (a capture keeps the fp32
            # kernel, and so does a router that three bf16 parts cannot represent)
            with contextlib.suppress(ValueError):
                w.router_split = split_router(w_router)
        sync = ws["sync"] if fused_tile else None
        fused_routing = fused_route_fits(T, E, D, A, cfg.num_expert_group, fused)
        gemv = gemv_fits(T, D, w.e4m3)  # one token: both expert projections as GEMVs (moe_gemv.cu)
        # one token: the GEMV selects its experts from the routing kernel's logits instead of waiting for its plan
        routed = (GemvRouting(ws["logits"], bias, A, ws["route_done"], fused_route_blocks(T, E), E, fused)
                  if fused_routing and gemv and not fused_tile and env.gemv_routed() else None)
        if routed is not None:  # its checks and build before the routing kernel sets the signal it consumes
            routed_kernel(w13, T * pairs, routed, scale=s13)
        if fused_routing:
            moe_route_fused(delta, w_router, bias, plan, top_k=A, renormalize=cfg.renormalize,
                            scaling=cfg.routed_scaling_factor, biased_weights=cfg.biased_weights, out_ids=ws["ids"],
                            out_w=ws["w"], logits=ws["logits"], done=ws["route_done"], stats=stats, shared_slot=fused,
                            sync=sync, stream=stream, norm_before=norm_before, signal_ready=routed is not None,
                            live=live)
        else:
            moe_route(x, w_router, bias, top_k=A, num_groups=cfg.num_expert_group, topk_group=cfg.topk_group,
                      renormalize=cfg.renormalize, scaling=cfg.routed_scaling_factor,
                      biased_weights=cfg.biased_weights, out_ids=ws["ids"], out_w=ws["w"], logits=ws["logits"],
                      router_split=w.router_split, stream=stream)
            moe_bucket(ws["ids"], E, plan, stats=stats, shared_slot=fused, sync=sync, scratch=ws["bucket_scratch"],
                       stream=stream, live=live)
        if fused_tile:
            moe_decode_fused(x, w13, w2, plan, top_k=pairs, h=ws["h"], out=ws["y"], sync=ws["sync"], tile=fused_tile,
                             scale13=s13, scale2=s2, stream=stream)
        else:
            kw13, kw2 = scale_kw if w.e4m3 else ({}, {})  # (moe_gemm.cu, the bf16-only kernel, takes no scale)
            if gemv:  # its routed rows spread evenly over the SMs
                moe_gemv_gate_up(x, w13, plan, out=ws["h"], stream=stream, routed=routed, **kw13)
            elif w8a8:
                xq, xs = x_codes if x_codes is not None else (ws["xq"], ws["xs"])
                if x_codes is None:
                    quantize_activations_e4m3(x, out=xq, scale_out=xs, stream=stream)
                gemm(xq, w13, plan, top_k=pairs, fuse_silu=True, out=ws["h"], stream=stream, src_scale=xs, **kw13)
            else:
                gemm(x, w13, plan, top_k=pairs, fuse_silu=True, out=ws["h"], stream=stream, **kw13)
            if gemv and env.down_gemv() and down_fits(inter, D, w.e4m3):
                moe_gemv_down(ws["h"], w2, plan, out=ws["y"], stream=stream, **kw2)
            elif w8a8:
                quantize_activations_e4m3(ws["h"], out=ws["hq"], scale_out=ws["hs"], stream=stream)
                gemm(ws["hq"], w2, plan, top_k=pairs, fuse_silu=False, out=ws["y"], stream=stream,
                     src_scale=ws["hs"], **kw2)
            else:
                gemm(ws["h"], w2, plan, top_k=pairs, fuse_silu=False, out=ws["y"], stream=stream, **kw2)
        shared = None
        if inter_s and not fused:
            linear(x, shared_w13, out=ws["gu_s"])
            silu_mul(ws["gu_s"], out=ws["h_s"], stream=stream)
            shared = linear(ws["h_s"], shared_w2, out=ws["y_s"])
        moe_combine(ws["y"], plan.pair_pos, ws["w"], shared, shared_in_y=fused, out=out, norm=norm, stream=stream,
                    live=live)
    return out
