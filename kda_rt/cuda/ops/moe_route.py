"""Launcher for kernels_cu/moe_route.cu: MoE router logits (fp32) and group-limited sigmoid top-k.

From SPLIT_MIN_T tokens the logits come from the tensor cores: the fp32 router is split into three bf16
matrices whose sum is exactly the router (`split_router`), one cuBLAS GEMM gives the three fp32 partial
logits [T, 3E] (every product exact, fp32 sums), and the select kernel adds them.  H200 (2026-11-30,
tests/gpu/bench_moe_route.py, E = 256, D = 2304, graph replay, logits + select): T = 8 12.2 us against
12.9 for the fp32 CUDA-core kernel, T = 32 10.4 against 13.3, T = 128 10.7 against 20.4, T = 8192 192
against 876 (same ids in every case).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

from kda_rt import env
from kda_rt.cuda.gemm import linear
from kda_rt.cuda.ops.check import BF16, expect, f32, i32
from kda_rt.cuda.ops.compile import get_kernel
from kda_rt.cuda.ops.moe_align import MoEPlan, check_plan, live_arg

__all__ = ["FUSED_MAX_T", "MAX_TOP_K", "SPLIT_MIN_T", "WARP_SELECT_MIN_T", "NormBefore", "default_select",
           "fused_kernel", "fused_route_blocks", "fused_route_fits", "fused_route_rows", "logits_tokens_per_block",
           "moe_route", "moe_route_fused", "split_router"]

# tokens from which the logits run as one bf16 GEMM on the split router (when the caller has it)
SPLIT_MIN_T = 32
_SEL_WARPS = 8  # tokens per block of moe_route_select_warp
# tokens from which ungrouped routing selects with one warp per token: every T since its lanes sort their
# experts and take rounds by redux.sync (H200, 2026-12-01, bench_moe_route.py graph replay incl. launch,
# rank / warp: 4.59 / 3.80 us at T = 1, 4.89 / 4.28 at 32, 4.99 / 4.33 at 128, 148 / 13.5 at 8192)
WARP_SELECT_MIN_T = 1

MAX_TOP_K = 16
_WARPS = 8  # one expert per warp in the logits kernel
_SMEM_X_BYTES = 48 * 1024  # static shared memory for the staged x rows

# moe_route_fused: tokens up to which a step's routing and bucketing run as one launch (its last block
# selects and buckets every token alone, so its time grows by a warp select per 16 tokens); its blocks are
# 512 threads of 8 experts, x rows staged 8 at most.  H200 (bench_moe_route.py --fused, graph replay with
# programmatic dependent launch, us per routing + bucketing): T = 1 6.29 against 8.90 for three launches,
# 8 9.14 / 11.31, 16 10.23 / 11.54, 32 13.90 / 12.19, 64 25.57 / 12.47.  With x staged by cp.async (2026-12-01,
# seventeenth session): T = 1 6.12 / 6.66, 4 6.99 / 7.22, 8 8.62 / 8.85, 16 9.57 / 8.90, 32 13.38 / 9.03: at 16
# tokens the three launches are now ahead in this bench; the full model was not measured at that setting.
FUSED_MAX_T = 16
_FR_THREADS, _FR_EPB, _FR_MAX_TPB, _FR_MAX_BINS = 512, 8, 8, 512
_FR_MAX_T = 64  # what the kernel can take (its shared bins), above the policy's FUSED_MAX_T
_FR_X_BYTES = 37 * 1024  # staged x rows (2·8·D bytes): its 48 KB of static shared memory less the bins and scratch


class NormBefore(NamedTuple):
    """The residual add and RMSNorm before the MoE block, done by moe_route_fused (its x is then the mixer's
    output delta [T, D] bf16): h = bf16(delta + residual) -> h_out, a_out = RMSNorm(h) · weight (the MoE's
    input), as rmsnorm(delta, weight, eps, residual=residual, out=a_out) except that residual [T, D] bf16 is
    left as it was (the route kernel's other blocks read it): h_out is the new residual stream."""

    residual: object
    weight: object
    eps: float
    h_out: object
    a_out: object


def logits_tokens_per_block(T: int, D: int) -> int | None:
    """TPB of moe_route_logits: the fewest of 1, 2, 4, 8 that cover T (the staged x rows fit 48 KB);
    fewer rows per block leave ptxas the registers to issue more of a lane's router loads at once (at
    D = 2304: all 18 with TPB 1, 13 with 2, 7 with 4, 4 with 8; the logits of a decode step wait on them)."""
    fits = [t for t in (1, 2, 4, 8) if 2 * t * D <= _SMEM_X_BYTES]
    return next((t for t in fits if t >= T), fits[-1] if fits else None)


def _check_x_aligned(x, D: int, who: str) -> None:
    """The kernels stage x rows by 16-byte copies when D % 8 == 0 (moe_route.cu stage_rows)."""
    if D % 8 == 0 and x.data.ptr % 16:
        raise ValueError(f"{who}: x must start on a 16-byte boundary (address {x.data.ptr:#x})")


def default_select(T: int, num_groups: int) -> str:
    """The select kernel moe_route runs when the caller names none (see moe_route)."""
    return "warp" if num_groups == 1 and T >= WARP_SELECT_MIN_T else "rank"


def split_router(w_router):
    """[E, D] fp32 -> [3E, D] bf16 rows w1 | w2 | w3 with w1 + w2 + w3 == w exactly: each part is the
    round-to-nearest-even bf16 of what the parts before it leave (8 significant bits each cover fp32's
    24).  NumPy or CuPy arrays (integer bit operations, so both give the same bits); the launcher's
    callers split the uploaded router on the device."""
    xp = _array_module(w_router)
    rest = xp.ascontiguousarray(w_router, dtype=xp.float32)
    parts = []
    for _ in range(3):
        u = rest.view(xp.uint32)
        hi = ((u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16).astype(xp.uint16)  # RNE to bf16
        parts.append(hi)
        rest = rest - (hi.astype(xp.uint32) << 16).view(xp.float32)  # exact: hi is rest to 8 bits
    if bool(xp.any(rest != 0)) and bool(xp.all(xp.isfinite(w_router))):
        raise ValueError("split_router: the router is not a sum of three bf16 matrices (subnormal entries?)")
    return xp.concatenate(parts).view(BF16)


def _fused_shape_ok(T: int, E: int, D: int, top_k: int, shared_slot: bool) -> bool:
    """The shapes moe_route_fused's kernel can take."""
    return (1 <= T <= _FR_MAX_T and 1 <= top_k <= min(MAX_TOP_K, E) and E % _FR_EPB == 0
            and E + int(shared_slot) <= _FR_MAX_BINS and D % 8 == 0 and 2 * _FR_MAX_TPB * D <= _FR_X_BYTES)


def fused_route_fits(T: int, E: int, D: int, top_k: int, num_groups: int, shared_slot: bool) -> bool:
    """moe_route_fused handles this step (ungrouped routing, T <= FUSED_MAX_T, the kernel's shape limits) and
    KDA_RT_FUSED_ROUTE is not 0."""
    return (num_groups == 1 and T <= FUSED_MAX_T and _fused_shape_ok(T, E, D, top_k, shared_slot)
            and env.fused_route())


def fused_route_rows(T: int) -> int:
    """Rows of x per block of moe_route_fused for a T-token step (its FR_TPB): the fewest of 1, 2, 4, 8 covering T."""
    return next(t for t in (1, 2, 4, _FR_MAX_TPB) if t >= min(T, _FR_MAX_TPB))


def _fused_route_grid(T: int, E: int) -> tuple[int, int]:
    """moe_route_fused's grid: (token groups of fused_route_rows(T) rows, expert groups of 8)."""
    return -(-T // fused_route_rows(T)), E // _FR_EPB


def fused_route_blocks(T: int, E: int) -> int:
    """Blocks of a moe_route_fused launch: what its signal_ready counts up to (the routed GEMV's ready_target)."""
    gx, gy = _fused_route_grid(T, E)
    return gx * gy


def fused_kernel(T: int, E: int, D: int, tile_rows: int, shared_slot: bool, phases: int = 3, norm: bool = False,
                 live: bool = False):
    """The moe_route_fused variant for T tokens (rows of x per block: the fewest of 1, 2, 4, 8 covering T);
    `phases` < 3 cuts the kernel short (tests/gpu/bench_moe_route.py times the parts); `norm`: the variant
    that also does the residual add and RMSNorm before the block (NormBefore).  KDA_RT_CHAIN_PROBE (bench only)
    builds it with the routing chain's timer stamps (kernels_cu/common.cuh CHAIN_PROBE).  `live`: the variant that
    takes a live token count (moe_bucket.cuh LIVE_TOKENS)."""
    cut = {} if phases == 3 else {"FR_PHASES": phases}
    if live:
        cut["LIVE_TOKENS"] = 1
    if not env.pdl_dep():  # bench switch: the plain programmatic-launch wait (common.cuh KDA_PDL_WAIT_AFTER)
        cut["PDL_DEP"] = 0
    probe = env.chain_probe()  # bench only (tests/gpu/probe_route_chain.py)
    return get_kernel("moe_route.cu", "moe_route_fused", FUSED_ROUTE=1, D=D, E=E, FR_TPB=fused_route_rows(T),
                      MAX_T=_FR_MAX_T, MAX_TOP_K=MAX_TOP_K, BT=tile_rows, SHARED=int(shared_slot),
                      ROUTE_NORM=int(norm), **cut, **({"CHAIN_PROBE": probe} if probe else {}))


def moe_route_fused(x, w_router, bias, plan: MoEPlan, *, top_k: int, renormalize: bool, scaling: float,
                    biased_weights: bool = False, out_ids, out_w, logits, done, stats=None, shared_slot: bool = False,
                    sync=None, stream=None, phases: int = 3, norm_before: NormBefore | None = None,
                    signal_ready: bool = False, live=None):
    """A decode step's routing and bucketing in one launch (kernels_cu/moe_route.cu moe_route_fused):
    moe_route's ids and weights (num_groups == 1) and moe_bucket's plan, stats and zeroed `sync`, from
    x [T, D] bf16, w_router [E, D] fp32, bias [E] fp32.  logits: [T, E] or [T, 3E] fp32 scratch (its first
    T·E floats are used); done: int32 [>= 1] device counters (done[0] the kernel's own; with signal_ready also
    done[1:3], the routed GEMV's) that must be 0 before a CUDA graph captures this call (every eager call zeroes
    them; the kernel leaves done[0] at 0, the GEMV done[1:3]).
    norm_before (NormBefore): x is the mixer's output delta; the routing is then of RMSNorm(delta + residual),
    which the kernel also writes to norm_before.a_out, and the new residual stream to norm_before.h_out.
    signal_ready: every block also counts done[1] up once its logits are stored, the start signal of the routed
    GEMV (ops/moe_gemv.moe_gemv_gate_up with `routed`), which must follow this launch and resets done[1:3].
    live: optional int32 [1] device count of live tokens: the plan holds the pairs of tokens below it alone
    (moe_bucket.cuh LIVE_TOKENS; every token is still routed: ids and weights for all)."""
    import cupy

    T, D = expect(x, "x", ndim=2, dtype=BF16)
    nb = norm_before
    if nb is not None:
        expect(nb.residual, "norm_before.residual", shape=(T, D), dtype=BF16)
        expect(nb.weight, "norm_before.weight", shape=(D,), dtype=BF16)
        expect(nb.h_out, "norm_before.h_out", shape=(T, D), dtype=BF16)
        expect(nb.a_out, "norm_before.a_out", shape=(T, D), dtype=BF16)
        spans = sorted((int(a.data.ptr), int(a.data.ptr) + a.nbytes, name) for a, name in
                       ((x, "x"), (nb.residual, "residual"), (nb.h_out, "h_out"), (nb.a_out, "a_out")))
        for (_, end, a), (start, _, b) in itertools.pairwise(spans):
            if start < end:
                raise ValueError(f"moe_route_fused: norm_before's {a} and {b} overlap (every block reads x and "
                                 "residual while some write h_out and a_out)")
        for name in ("h_out", "a_out"):  # (residual: 16 bytes, checked with x below)
            if getattr(nb, name).data.ptr % 8:
                raise ValueError(f"moe_route_fused: norm_before.{name} must start on an 8-byte boundary")
    E, _ = expect(w_router, "w_router", shape=(None, D), dtype=np.float32)
    expect(bias, "bias", shape=(E,), dtype=np.float32)
    expect(out_ids, "out_ids", shape=(T, top_k), dtype=np.int32)
    expect(out_w, "out_w", shape=(T, top_k), dtype=np.float32)
    expect(logits, "logits", shape=(T, None), dtype=np.float32)
    expect(done, "done", ndim=1, dtype=np.int32)
    if logits.shape[1] < E or not logits.flags.c_contiguous:
        raise ValueError(f"moe_route_fused: logits scratch must be C-contiguous [T, >= {E}], got {logits.shape}")
    if not _fused_shape_ok(T, E, D, top_k, shared_slot):
        raise ValueError(f"moe_route_fused: needs 1 <= T <= {_FR_MAX_T}, 1 <= top_k <= min({MAX_TOP_K}, E), "
                         f"E % {_FR_EPB} == 0, E + shared <= {_FR_MAX_BINS}, D % 8 == 0, "
                         f"D <= {_FR_X_BYTES // (2 * _FR_MAX_TPB)} (T={T}, top_k={top_k}, E={E}, D={D}, "
                         f"shared_slot={shared_slot})")
    check_plan(plan, T * (top_k + int(shared_slot)), E + int(shared_slot), stats, sync, "moe_route_fused")
    largs = live_arg(live)
    _check_x_aligned(x, D, "moe_route_fused")
    if nb is not None:
        _check_x_aligned(nb.residual, D, "moe_route_fused (norm_before.residual)")
    stream = stream if stream is not None else cupy.cuda.get_current_stream()
    if signal_ready and (done.size < 3 or phases < 1):
        raise ValueError(f"moe_route_fused: signal_ready needs done of >= 3 words (the GEMV's counters; got "
                         f"{done.size}) and the kernel's count phase (phases >= 1; got {phases})")
    if not stream.is_capturing():
        cupy.cuda.runtime.memsetAsync(done.data.ptr, 0, 4 * min(int(done.size), 3), stream.ptr)
    kernel = fused_kernel(T, E, D, plan.tile_rows, shared_slot, phases, norm=nb is not None, live=bool(largs))
    null = np.uint64(0)
    norm_args = (nb.residual, nb.weight, nb.h_out, nb.a_out, f32(nb.eps)) if nb is not None else (null,) * 4 + (f32(0),)
    kernel(_fused_route_grid(T, E), (_FR_THREADS,),
           (x, w_router, bias, logits, out_ids, out_w, i32(T), i32(top_k), i32(bool(renormalize)),
            i32(bool(biased_weights)), f32(scaling), plan.expert_off, plan.sorted_pair, plan.pair_pos,
            plan.tile_expert, plan.tile_row, plan.num_tiles, stats if stats is not None else null,
            sync if sync is not None else null, i32(0 if sync is None else sync.size), done, *norm_args,
            i32(bool(signal_ready)), *largs),
           stream=stream)
    return out_ids, out_w


def _array_module(a):
    if isinstance(a, np.ndarray):
        return np
    import cupy

    return cupy


def moe_route(x, w_router, bias, *, top_k: int, num_groups: int, topk_group: int, renormalize: bool,
              scaling: float, biased_weights: bool = False, out_ids=None, out_w=None, logits=None,
              router_split=None, stream=None, select: str | None = None):
    """x: [T, D] bf16, w_router: [E, D] fp32, bias: [E] fp32 -> (ids [T, A] int32, w [T, A] fp32).
    `select`: "rank" (one CTA per token, one thread per expert, rank counting) or "warp" (one warp per
    token, num_groups == 1 only; ids and weights bit-identical to "rank", tests/kernels/test_moe_route.py);
    default (None): "warp" for ungrouped routing from WARP_SELECT_MIN_T tokens, "rank" below and for grouped
    routing.
    `logits` is an optional [T, E] fp32 scratch, or [T, 3E] (preallocate it for CUDA graphs);
    `router_split` ([3E, D] bf16 on the device, `split_router`) with T >= SPLIT_MIN_T and a [T, 3E]
    scratch computes the logits on the tensor cores."""
    import cupy

    T, D = expect(x, "x", ndim=2, dtype=BF16)
    E, _ = expect(w_router, "w_router", shape=(None, D), dtype=np.float32)
    expect(bias, "bias", shape=(E,), dtype=np.float32)
    if not (1 <= top_k <= min(MAX_TOP_K, E)) or E > 1024 or D % 4:
        raise ValueError(f"moe_route: need 1 <= top_k <= min(16, E), E <= 1024, D % 4 == 0 (top_k={top_k}, E={E}, D={D})")
    if num_groups < 1 or E % num_groups or not (1 <= topk_group <= num_groups):
        raise ValueError(f"moe_route: bad grouping num_groups={num_groups}, topk_group={topk_group} for E={E}")
    select = select or default_select(T, num_groups)
    if select not in ("warp", "rank") or (select == "warp" and num_groups != 1):
        raise ValueError(f"moe_route: select must be 'warp' (num_groups == 1) or 'rank', got {select!r} "
                         f"with num_groups={num_groups}")
    tpb = logits_tokens_per_block(T, D)
    if tpb is None:
        raise ValueError(f"moe_route: hidden size {D} too large for the staged-x kernel")
    out_ids = cupy.empty((T, top_k), dtype=np.int32) if out_ids is None else out_ids
    out_w = cupy.empty((T, top_k), dtype=np.float32) if out_w is None else out_w
    split = router_split is not None and T >= SPLIT_MIN_T
    logits = cupy.empty((T, 3 * E if split else E), dtype=np.float32) if logits is None else logits
    expect(out_ids, "out_ids", shape=(T, top_k), dtype=np.int32)
    expect(out_w, "out_w", shape=(T, top_k), dtype=np.float32)
    expect(logits, "logits", shape=(T, None), dtype=np.float32)
    if logits.shape[1] not in (E, 3 * E):
        raise ValueError(f"moe_route: logits scratch must be [T, {E}] or [T, {3 * E}], got {logits.shape}")
    split = split and logits.shape[1] == 3 * E
    if split:
        expect(router_split, "router_split", shape=(3 * E, D), dtype=BF16)
    if T == 0:
        return out_ids, out_w
    if split:
        with stream if stream is not None else cupy.cuda.get_current_stream():
            linear(x, router_split, out=logits)
    else:
        logits = logits.reshape(-1)[:T * E].reshape(T, E)  # a [T, 3E] scratch: its first T·E floats
        _check_x_aligned(x, D, "moe_route")
        k_logits = get_kernel("moe_route.cu", "moe_route_logits", D=D, E=E, TPB=tpb, WARPS=_WARPS)
        k_logits((-(-T // tpb), -(-E // _WARPS)), (_WARPS * 32,), (x, w_router, logits, i32(T)), stream=stream)
    if select == "warp":
        k_select = get_kernel("moe_route.cu", "moe_route_select_warp", E=E, SEL_WARPS=_SEL_WARPS,
                              MAX_TOP_K=MAX_TOP_K, PARTS=3 if split else 1)
        k_select((-(-T // _SEL_WARPS),), (32 * _SEL_WARPS,), (logits, bias, out_ids, out_w, i32(T), i32(top_k),
                 i32(bool(renormalize)), i32(bool(biased_weights)), f32(scaling)), stream=stream)
        return out_ids, out_w
    threads = max(128, -(-E // 32) * 32)
    k_select = get_kernel("moe_route.cu", "moe_route_select", E=E, THREADS=threads, MAX_TOP_K=MAX_TOP_K,
                          PARTS=3 if split else 1)
    k_select((T,), (threads,), (logits, bias, out_ids, out_w, i32(T), i32(top_k), i32(num_groups), i32(topk_group),
                                i32(bool(renormalize)), i32(bool(biased_weights)), f32(scaling)), stream=stream)
    return out_ids, out_w
