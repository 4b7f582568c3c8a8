"""Launcher for kernels_cu/moe_gemv.cu: the gate/up projection of a one-token MoE step over its routed rows,
h = SiLU(x · W_gate) · (x · W_up), as a GEMV whose features are spread evenly over every warp of a one-wave grid
(at batch 1 the tiled kernel's 2.18 CTAs per SM leave some SMs a block more to stream than others).
moe_forward takes it where `fits` (one token, KDA_RT_MOE_GEMV not 0).  Also moe_gemv_down, the same step's down
projection as a GEMV whose warps copy their first weight rows before the programmatic-launch wait (where
`down_fits`, KDA_RT_DOWN_GEMV not 0).

Letters: E experts, N routed rows (pairs), D hidden (the reduction width), I expert width."""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from kda_rt import env
from kda_rt.cuda.ops.check import BF16, expect, i32
from kda_rt.cuda.ops.compile import get_kernel, sm_count, smem_optin
from kda_rt.cuda.ops.gemv import DEFAULT, MAX_K, GemvConfig, check_e4m3_arch, check_weight_dtype, grid
from kda_rt.cuda.ops.moe_align import MoEPlan
from kda_rt.cuda.ops.moe_route import MAX_TOP_K

__all__ = ["DEFAULT", "MAX_K", "GemvConfig", "GemvRouting", "down_fits", "down_kernel", "down_shape", "fits",
           "gate_up_config", "gemv_kernel", "moe_gemv_down", "moe_gemv_gate_up", "routed_kernel"]

# KDA_RT_GEMV_ROUTED (H200, 2026-12-01, tests/gpu/bench_ab.py --env KDA_RT_GEMV_ROUTED --values 1,0 --rounds 3
# --prompts 0 --replays 1,2, full 27-layer graph replays): batch 1 2.2822 -> 2.2475 ms (-1.5%); batch 2 does not
# take the GEMV.  In the timeline (trace_decode.py --timeline) the GEMV now ends 2.7 us sooner after the routing
# kernel, whose last block (select + bucketing, under the GEMV's stream) ends ~1.4 us later, and the down GEMM waits
# for it.
class GemvRouting(NamedTuple):
    """The routed GEMV's inputs (moe_gemv.cu ROUTED): it starts on the fused routing kernel's logits (launched just
    before it with signal_ready) instead of waiting for its plan.  logits [1, >= E] fp32 and bias [E] fp32 as the
    routing kernel reads them, top_k, done (the routing kernel's int32 counters, >= 3 words), ready_target (its
    number of blocks), num_experts E, shared (the shared expert rides as bin E)."""

    logits: object
    bias: object
    top_k: int
    done: object
    ready_target: int
    num_experts: int
    shared: bool


def fits(tokens: int, hidden: int, e4m3: bool = False) -> bool:
    """A MoE step of `tokens` tokens with hidden width `hidden` takes moe_gemv_gate_up (e4m3 weights: 16 a piece)."""
    return tokens == 1 and hidden % (16 if e4m3 else 8) == 0 and hidden <= MAX_K and env.moe_gemv()


def gate_up_config(e4m3: bool = False) -> GemvConfig:
    """The gate/up GEMV's launch shape for the weight format (KDA_RT_GEMV_WARPS overrides its warps): e4m3 at 12
    warps (full-model batch-1 replays, H200, 2026-12-02, with moe_gemv_down at 16 x 3: 8 warps 1.8760 ms, 10
    1.8778, 12 1.8375, 16 1.8678); bf16 at 8 (12: 2.4769 against 2.1403 ms)."""
    return DEFAULT._replace(warps=env.gemv_warps(12 if e4m3 else DEFAULT.warps))


def gemv_kernel(hidden: int, inter: int, cfg: GemvConfig | None = None, routed: tuple[int, bool] | None = None,
                e4m3: bool = False):
    """The kernel variant (built on first use; the runner builds it at start); routed = (E, shared): the variant
    that selects the token's experts itself (GemvRouting), with a shared expert its units first (SHARED_FIRST,
    KDA_RT_GEMV_SHARED_FIRST); e4m3: w13 in e4m3 with a scale a row (moe_gemv.cu WFMT = 1)."""
    extra = {} if routed is None else dict(ROUTED=1, NE=routed[0], MAX_TOP_K=MAX_TOP_K, SHARED=int(routed[1]),
                                           SHARED_FIRST=int(routed[1] and env.gemv_shared_first()),
                                           SIGNAL_OVERLAP=int(env.gemv_signal_overlap()))
    if e4m3:
        extra["WFMT"] = 1
    cfg = cfg or gate_up_config(e4m3)
    probe = env.chain_probe() if routed is not None else 0  # bench only: the routing chain's timer stamps
    if probe:
        extra["CHAIN_PROBE"] = probe
    return get_kernel("moe_gemv.cu", "moe_gemv_gate_up", KW=hidden, INTER=inter, WARPS=cfg.warps, PIPE=int(cfg.pipe),
                      **extra)


def routed_kernel(w13, pairs: int, r: GemvRouting, cfg: GemvConfig | None = None, scale=None):
    """Checks a routed call's inputs (w13 [E', 2I, D], `pairs` rows of h; with `scale` [E', 2I] fp32, w13 in e4m3)
    and builds its kernel: moe_forward calls it before it launches the routing kernel with signal_ready, so that no
    refusal here can leave that kernel's signal set with no GEMV to reset it."""
    E_stack, two_i, D = w13.shape
    if not 1 <= r.top_k <= min(MAX_TOP_K, r.num_experts) or pairs != r.top_k + int(r.shared) or r.ready_target < 1:
        raise ValueError(f"moe_gemv_gate_up: routed needs 1 <= top_k <= min({MAX_TOP_K}, E), one row a pair (N = "
                         f"{pairs}, top_k {r.top_k}, shared {r.shared}) and ready_target >= 1 (got {r.ready_target})")
    if E_stack < r.num_experts + int(r.shared):
        raise ValueError(f"moe_gemv_gate_up: routed over {r.num_experts} experts{' + the shared slot' * r.shared} "
                         f"needs that many w13 stacks, got {E_stack}")
    expect(r.logits, "routed.logits", ndim=2, dtype=np.float32)
    expect(r.bias, "routed.bias", shape=(r.num_experts,), dtype=np.float32)
    expect(r.done, "routed.done", ndim=1, dtype=np.int32)
    if r.logits.shape[0] < 1 or r.logits.shape[1] < r.num_experts or not r.logits.flags.c_contiguous or r.done.size < 3:
        raise ValueError(f"moe_gemv_gate_up: routed.logits must be C-contiguous [>= 1, >= {r.num_experts}] (got "
                         f"{r.logits.shape}) and routed.done >= 3 words (got {r.done.size})")
    e4m3 = scale is not None
    check_weight_dtype("moe_gemv_gate_up", "w13", w13, e4m3)
    if e4m3:
        expect(scale, "scale", shape=(E_stack, two_i), dtype=np.float32)
        check_e4m3_arch("moe_gemv_gate_up")
        if D % 16:
            raise ValueError(f"moe_gemv_gate_up: hidden width {D} must be a multiple of 16 (16 e4m3 weights a piece)")
    return gemv_kernel(D, two_i // 2, cfg, routed=(r.num_experts, r.shared), e4m3=e4m3)


def moe_gemv_gate_up(x, w13, plan: MoEPlan, *, out, scale=None, cfg: GemvConfig | None = None, stream=None,
                     routed: GemvRouting | None = None):
    """x [1, D] bf16, w13 [E, 2I, D] bf16 ([gate; up] rows), plan of the token's pairs -> out h [N, I] bf16,
    row tile_row[t] = SiLU(x · gate_e) · (x · up_e) for e = tile_expert[t], t < num_tiles (one row a tile).
    With scale [E, 2I] fp32, w13 holds e4m3 values as uint8 bits (loader/quant.quantize_rows per expert; D % 16 == 0,
    sm_89+): gate and up are then each their row's scale times the fp32 sum, rounded as above.
    routed (GemvRouting): the experts come from the routing kernel's logits instead (the same choice and rows:
    the t-th smallest of the token's bins at row t); the plan is then only written, by that kernel, for the
    kernels after this one."""
    _, D = expect(x, "x", shape=(1, None), dtype=BF16)
    e4m3 = scale is not None
    E_w, two_i, _ = expect(w13, "w13", shape=(None, None, D))
    check_weight_dtype("moe_gemv_gate_up", "w13", w13, e4m3)
    N = plan.sorted_pair.shape[0]
    expect(out, "out", shape=(N, two_i // 2), dtype=BF16)
    piece = 16 if e4m3 else 8  # weights a 16-byte piece
    if D % piece or D > MAX_K:
        raise ValueError(f"moe_gemv_gate_up: hidden width {D} must be a multiple of {piece} ({piece} "
                         f"{'e4m3' if e4m3 else 'bf16'} weights a 16-byte piece) and at most {MAX_K}")
    if e4m3:
        expect(scale, "scale", shape=(E_w, two_i), dtype=np.float32)
        check_e4m3_arch("moe_gemv_gate_up")
    if two_i % 2 or x.data.ptr % 16 or w13.data.ptr % 16:
        raise ValueError(f"moe_gemv_gate_up: w13 needs an even row count (got {two_i}) and x, w13 16-byte aligned")
    if N == 0:
        return out
    null = np.uint64(0)
    cfg = cfg or gate_up_config(e4m3)
    if routed is None:
        kernel = gemv_kernel(D, two_i // 2, cfg, e4m3=e4m3)
        extra, warps = (null, null, i32(0), null, i32(0)), cfg.warps
    else:
        kernel = routed_kernel(w13, N, routed, cfg, scale)
        r = routed
        extra, warps = (r.logits, r.bias, i32(r.top_k), r.done, i32(r.ready_target)), cfg.warps + 1
    kernel((grid(kernel, cfg, warps, routed is not None),), (32 * warps,),
           (x, w13, plan.tile_expert, plan.tile_row, plan.num_tiles, out, *extra, scale if e4m3 else null),
           stream=stream)
    return out


# moe_gemv_down (moe_gemv.cu DOWN = 1): the weight rows stream through per-warp shared-memory rings, STAGES units a
# warp copied before the programmatic-launch wait (KDA_RT_DOWN_GEMV=0: the tiled down GEMM instead)
MAX_DOWN_TILES = 32
_DOWN_SMEM_MAX = 200 * 1024
# (warps, stages) of moe_gemv_down by weight format (bf16, e4m3); KDA_RT_DOWN_WARPS / KDA_RT_DOWN_STAGES override.
# e4m3: a unit's rows are half the bytes but its dot products (and their conversions) take as long, so at 4 warps an
# SM each warp's chain of units sets the pace; H200, 2026-12-02, tests/gpu/bench_ab.py --quantization fp8 --env
# KDA_RT_DOWN_WARPS,KDA_RT_DOWN_STAGES,KDA_RT_GEMV_WARPS --replays 1 --prompts 0 (full 27-layer batch-1 graph
# replays, medians of 3 rounds): 4:6:8 2.0973 ms, 8:6:8 1.9069, 16:3:8 1.8760, 4:12:8 2.0037, 8:4:8 1.9679;
# with the gate/up GEMV at 12 warps 8:6:12 1.8735, 16:3:12 1.8375, 16:4:12 1.8622, 24:2:12 1.8443, 8:8:12 1.8866.
# bf16 (same call, default 4:6:8 2.1436): 8:3:8 2.1403 (within its rounds' spread), so it stays.
_DOWN_SHAPE = {False: (4, 6), True: (16, 3)}


def down_shape(e4m3: bool = False) -> tuple[int, int]:
    """(warps a CTA, ring stages a warp) of moe_gemv_down for the weight format."""
    warps, stages = _DOWN_SHAPE[e4m3]
    return env.down_warps(warps), env.down_stages(stages)


def _down_smem(inter: int, rows: int, e4m3: bool = False) -> int:
    """Ring stages (two weight rows each: bf16 2 bytes a weight, e4m3 1), the CTA's h rows (bf16), and with e4m3 each
    stage's pair of row scales (moe_gemv.cu DOWN's layout)."""
    warps, stages = down_shape(e4m3)
    ring = warps * stages * 2 * inter * (1 if e4m3 else 2)
    return ring + rows * inter * 2 + (warps * stages * 8 if e4m3 else 0)


@functools.lru_cache(maxsize=8)
def _smem_cap(device_id: int | None) -> int:
    """_DOWN_SMEM_MAX, or less on a GPU whose blocks may opt in to less (its maximum less 1 KB for the kernel's static
    arrays: sm_86 / sm_89 allow ~99 KB); device_id None (no GPU): _DOWN_SMEM_MAX."""
    if device_id is None:
        return _DOWN_SMEM_MAX
    return min(_DOWN_SMEM_MAX, smem_optin(device_id) - 1024)


def _device_id() -> int | None:
    try:
        import cupy
    except ImportError:
        return None
    try:
        return cupy.cuda.Device().id if cupy.cuda.runtime.getDeviceCount() else None
    except cupy.cuda.runtime.CUDARuntimeError:
        return None


def down_fits(inter: int, hidden: int, e4m3: bool = False) -> bool:
    """moe_gemv_down can run a one-token step's down projection of expert width `inter` to `hidden` features (e4m3
    weights: 16 a piece) within the shared memory this GPU lets a block take."""
    return (inter % (16 if e4m3 else 8) == 0 and 0 < inter <= MAX_K and hidden % 2 == 0
            and _down_smem(inter, MAX_DOWN_TILES, e4m3) <= _smem_cap(_device_id()))


def down_kernel(inter: int, hidden: int, e4m3: bool = False):
    """moe_gemv_down for expert width `inter` and output width `hidden` (built on first use; precompiled); e4m3: w2
    in e4m3 with a scale a row (moe_gemv.cu WFMT = 1)."""
    fmt = {"WFMT": 1} if e4m3 else {}
    warps, stages = down_shape(e4m3)
    return get_kernel("moe_gemv.cu", "moe_gemv_down", max_dynamic_smem=_down_smem(inter, MAX_DOWN_TILES, e4m3),
                      DOWN=1, KW=inter, NOUT=hidden, WARPS=warps, MAX_TILES=MAX_DOWN_TILES, STAGES=stages, **fmt)


def moe_gemv_down(h, w2, plan: MoEPlan, *, out, scale=None, stream=None):
    """h [N, I] bf16 (the gate/up GEMV's rows), w2 [E, D, I] bf16, plan of one token's N pairs -> out y [N, D] bf16,
    row tile_row[t] = bf16(h[tile_row[t]] · w2[tile_expert[t]]ᵀ) for t < num_tiles (fp32 sums; moe_gemm_tc's down
    GEMM rounds the same way, only its summation order differs).  One CTA an SM; each warp's first units of weight
    rows are loaded before the programmatic-launch wait (moe_gemv.cu DOWN).
    With scale [E, D] fp32, w2 holds e4m3 values as uint8 bits (loader/quant.quantize_rows per expert; I % 16 == 0,
    sm_89+): each output is its row's scale times the fp32 sum, rounded as above."""
    N, inter = expect(h, "h", ndim=2, dtype=BF16)
    e4m3 = scale is not None
    E_w, D, _ = expect(w2, "w2", shape=(None, None, inter))
    check_weight_dtype("moe_gemv_down", "w2", w2, e4m3)
    expect(out, "out", shape=(N, D), dtype=BF16)
    if e4m3 and inter % 16:
        raise ValueError(f"moe_gemv_down: e4m3 w2 needs an expert width % 16 == 0 (16 weights a 16-byte "
                         f"piece), got {inter}")
    if not down_fits(inter, D, e4m3) or h.data.ptr % 16 or w2.data.ptr % 16 or out.data.ptr % 4:
        raise ValueError(f"moe_gemv_down: needs an expert width % 8 == 0 and <= {MAX_K} "
                         f"(got {inter}) whose tiles fit this GPU's per-block shared memory "
                         f"({_smem_cap(_device_id())} bytes), an even output width (got {D}), h, w2 16-byte and "
                         f"out 4-byte aligned")
    if e4m3:
        expect(scale, "scale", shape=(E_w, D), dtype=np.float32)
        if scale.data.ptr % 8:  # (the kernel copies each unit's two scales as one 8-byte piece)
            raise ValueError("moe_gemv_down: scale must start on an 8-byte boundary")
        check_e4m3_arch("moe_gemv_down")
    if N > MAX_DOWN_TILES or N != plan.sorted_pair.shape[0]:
        raise ValueError(f"moe_gemv_down: one token's pairs, at most {MAX_DOWN_TILES} (one tile and h row each) and "
                         f"the plan's (got {N} rows of h, a plan of {plan.sorted_pair.shape[0]} pairs)")
    if N == 0:
        return out
    import cupy

    kernel = down_kernel(inter, D, e4m3)
    kernel((sm_count(cupy.cuda.Device().id),), (32 * down_shape(e4m3)[0],),
           (h, w2, plan.tile_expert, plan.tile_row, plan.num_tiles, i32(N), out, scale if e4m3 else np.uint64(0)),
           shared_mem=_down_smem(inter, N, e4m3), stream=stream)
    return out
