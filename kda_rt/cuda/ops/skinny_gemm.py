"""Launcher for kernels_cu/skinny_gemm.cu: y = x · Wᵀ for up to MAX_ROWS rows and MAX_N outputs (the
narrow decode projections: o_proj, f_a|g_a|b, the dense MLP's down), bf16 in, fp32 accumulate, bf16 or
fp32 out, one CTA per 16 output features with the reduction split over its 8 warps; and on sm_90+ for
MAX_ROWS < M <= WIDE_MAX_ROWS rows (decode batches up to 32) skinny_gemm_cl, x staged in shared memory and
the reduction split over a thread-block cluster (`wide_plan` picks the features per CTA and the split), by default
in its producer-warp form skinny_gemm_ws (tensor-map copies of the weights and x through a shared-memory ring;
`ws_applies`, KDA_RT_SKINNY_WS=0: skinny_gemm_cl).
Where the weight rows of one CTA per SM fit in shared memory (o_proj at up to 8 rows),
skinny_gemm_staged copies them there before the programmatic-launch wait, so the weight stream can run
under the kernel before it (KDA_RT_SKINNY_STAGED=0: the streaming kernel; 2: bulk copies, a bench variant).
`fits` says whether a call qualifies; `gemm.linear` takes this path for those and cuBLAS for the rest
(KDA_RT_SKINNY=0 sends everything to cuBLAS).  The limits are measured (tests/gpu/bench_skinny.py, H200):
wider outputs stream as fast through cuBLAS.

Letters: M rows (tokens), K reduction width, N output features."""

from __future__ import annotations

import numpy as np

from kda_rt import env
from kda_rt.cuda.ops.check import BF16, i32, leading_dim
from kda_rt.cuda.ops.compile import arch_number, clusters_supported, device_arch, get_kernel, sm_count

__all__ = ["MAX_N", "MAX_ROWS", "WIDE_MAX_ROWS", "fits", "precompile", "skinny_gemm", "staged_plan", "wide_plan",
           "ws_applies"]

MAX_ROWS = 8  # rows of one call (one n-tile of 8 tokens)
MAX_N = 4096  # output features
WIDE_MAX_ROWS = 32  # skinny_gemm_cl: up to 4 n-tiles of tokens
_WARPS = 8
_UNROLL = 8  # 32-wide k chunks of loads in flight per warp (106 registers: two CTAs per SM)
_WIDE_UNROLL = 4  # skinny_gemm_cl: chunks per register buffer (two buffers)
_WIDE_MAX_K = 4096  # the dense MLP's down (K = 9216) ran slower than cuBLAS (H200, M = 16 / 32)
_SPLITS = (1, 2, 3, 4, 6, 8)  # cluster sizes (portable: at most 8)
_TARGET_CTAS = 128  # about one CTA per SM: the smallest split that reaches it
_WIDE_SMEM_MAX = 200 * 1024
# skinny_gemm_staged: at most this much shared memory a CTA, so that it fits on an SM beside the kernel before
# it (kda_decode_step: ~21 KB a CTA; 228 KB an SM on sm_90)
_STAGED_SMEM_MAX = 176 * 1024


def _wide_smem(fpc: int, ks: int, nt: int, splits: int) -> int:
    """skinny_gemm_cl's dynamic shared memory: x rows [8·NT][KS + 32] bf16, warp partials [8][8·NT][16] and
    the owners' slots [SPLITS][ceil(8·NT·FPC / SPLITS)] fp32."""
    rows = 8 * nt
    return rows * (ks + 32) * 2 + _WARPS * rows * 16 * 4 + splits * -(-rows * fpc // splits) * 4


# skinny_gemm_ws: ring entries (k steps of 128: FPC weight rows and 8·NT x rows of 256 bytes each)
_WS_RING = 4
_WS_STEP = 128


def _ws_smem(fpc: int, splits: int, nt: int) -> int:
    """skinny_gemm_ws's dynamic shared memory: 1024 bytes of alignment slack, the ring, the owners' slots."""
    rows = 8 * nt
    return 1024 + _WS_RING * (fpc + rows) * _WS_STEP * 2 + splits * -(-rows * fpc // splits) * 4


def ws_applies(plan: tuple[int, int, int], K: int) -> bool:
    """skinny_gemm_ws takes skinny_gemm_cl's plan (FPC, SPLITS, NT) for this K: k slices of whole 128-wide steps,
    2 or 4 n-tiles, the warps' partials within the ring, sm_90 to sm_11x (tensor maps, and the ~107 KB of shared
    memory a CTA that sm_12x's 99 KB would refuse) and KDA_RT_SKINNY_WS not 0."""
    fpc, splits, nt = plan
    ring = _WS_RING * (fpc + 8 * nt) * _WS_STEP * 2
    return ((K // splits) % _WS_STEP == 0 and K % splits == 0 and nt in (2, 4) and _WARPS * 8 * nt * (fpc + 4) * 4 <= ring
            and env.skinny_ws() and K >= env.skinny_ws_min_k() and 90 <= arch_number(device_arch()) < 120)


def _plan_fits(M: int, N: int, K: int, fpc: int, splits: int, nt: int) -> bool:
    """skinny_gemm_cl with (FPC, SPLITS, NT) covers [M, K] x [N, K]: whole feature blocks, whole 32-wide
    chunks per warp, every row, and its shared memory within _WIDE_SMEM_MAX."""
    wpm = _WARPS // (fpc // 16)  # warps per 16-feature m-tile
    return (N % fpc == 0 and K % (splits * wpm * 32) == 0 and M <= 8 * nt <= WIDE_MAX_ROWS
            and _wide_smem(fpc, K // splits, nt, splits) <= _WIDE_SMEM_MAX)


def wide_plan(M: int, N: int, K: int) -> tuple[int, int, int] | None:
    """(features per CTA, cluster split of K, n-tiles) of skinny_gemm_cl for M rows, or None: FPC 64 where
    it divides N, else 32; the smallest split whose grid reaches _TARGET_CTAS, else the largest that divides
    K into whole 32-wide chunks per warp."""
    if not (MAX_ROWS < M <= WIDE_MAX_ROWS) or N > MAX_N or K > _WIDE_MAX_K:
        return None
    nt = 2 if M <= 16 else 4
    for fpc in (64, 32):
        best = None
        for splits in _SPLITS:
            if not _plan_fits(M, N, K, fpc, splits, nt):
                continue
            best = splits
            if N // fpc * splits >= _TARGET_CTAS:
                break
        if best is not None:
            return fpc, best, nt
    return None


def _staged_smem(rows: int, K: int) -> int:
    """skinny_gemm_staged's dynamic shared memory: `rows` weight rows of 2K + 64 bytes and the warp partials
    [8][16·ceil(rows / 16)][8] fp32."""
    return rows * (2 * K + 64) + _WARPS * 16 * -(-rows // 16) * 8 * 4


def staged_plan(N: int, K: int, sms: int) -> tuple[int, int] | None:
    """(grid, weight rows per CTA at most) of skinny_gemm_staged for [N, K] weights on `sms` SMs: one CTA
    per SM (fewer when N is smaller), or None when those rows do not fit in _STAGED_SMEM_MAX."""
    grid = min(sms, N)
    rows = -(-N // grid)
    if grid < 1 or K % (32 * _WARPS) or _staged_smem(rows, K) > _STAGED_SMEM_MAX:
        return None
    return grid, rows


def fits(x, weight, out, accumulate: bool) -> bool:
    """One of the kernels can compute out = x · weightᵀ (shapes already checked by the caller)."""
    M, K = x.shape
    N = weight.shape[0]
    if (accumulate or not weight.flags.c_contiguous or weight.data.ptr % 16 or x.data.ptr % 16
            or leading_dim(x) % 8 or out.dtype not in (BF16, np.dtype(np.float32))):
        return False
    if M <= MAX_ROWS:
        return 1 <= M and N <= MAX_N and N % 16 == 0 and K % (32 * _WARPS) == 0
    return wide_plan(M, N, K) is not None and env.skinny_wide() and clusters_supported()


def _kernel(out_f32: bool):
    return get_kernel("skinny_gemm.cu", "skinny_gemm", OUT_F32=int(out_f32), UNROLL=_UNROLL, WARPS=_WARPS)


def precompile(shapes=()) -> int:
    """Build every variant a decode step can pick (so no step waits for NVRTC): the kernel of up to 8 rows
    by output dtype, and on sm_90+ skinny_gemm_cl for each (N, K, out_f32) in `shapes` (the model's dense
    decode projections) and both of its row classes (9-16 and 17-32 rows) where wide_plan takes it (skinny_gemm_ws
    where ws_applies), and
    skinny_gemm_staged where staged_plan takes the shape.  Returns the number of variants."""
    for out_f32 in (False, True):
        _kernel(out_f32)
    count = 2
    if shapes and env.skinny_staged() and clusters_supported():
        for n, k, out_f32 in sorted(set(shapes)):
            if n <= MAX_N and n % 16 == 0 and (sp := staged_plan(n, k, _sms())):
                _staged_kernel(out_f32, sp[1], k, env.skinny_staged_bulk())
                count += 1
    if shapes and env.skinny_wide() and clusters_supported():
        for n, k, out_f32 in sorted(set(shapes)):
            for rows in (2 * MAX_ROWS, WIDE_MAX_ROWS):
                if plan := wide_plan(rows, n, k):
                    if ws_applies(plan, k):
                        _ws_kernel(out_f32, *plan, k)
                    else:
                        _wide_kernel(out_f32, *plan, k)
                    count += 1
    return count


def _sms() -> int:
    import cupy

    return sm_count(cupy.cuda.Device().id)


def _staged_kernel(out_f32: bool, rows: int, K: int, bulk: bool = False):
    return get_kernel("skinny_gemm.cu", "skinny_gemm_staged", max_dynamic_smem=_staged_smem(rows, K),
                      OUT_F32=int(out_f32), WARPS=_WARPS, SROWS=rows, SK=K, SBULK=int(bulk))


def _wide_kernel(out_f32: bool, fpc: int, splits: int, nt: int, K: int):
    ks = K // splits
    plain = {} if env.pdl_dep() else {"PDL_DEP": 0}  # bench switch (kernels_cu/common.cuh KDA_PDL_WAIT_AFTER)
    return get_kernel("skinny_gemm.cu", "skinny_gemm_cl", max_dynamic_smem=_wide_smem(fpc, ks, nt, splits),
                      OUT_F32=int(out_f32), UNROLL=_WIDE_UNROLL, WARPS=_WARPS, SPLITS=splits, FPC=fpc, KS=ks, NT=nt,
                      **plain)


def _ws_kernel(out_f32: bool, fpc: int, splits: int, nt: int, K: int):
    return get_kernel("skinny_gemm.cu", "skinny_gemm_ws", max_dynamic_smem=_ws_smem(fpc, splits, nt),
                      OUT_F32=int(out_f32), WARPS=_WARPS, SKWS=1, SPLITS=splits, FPC=fpc, KS=K // splits, NT=nt,
                      RING=_WS_RING)


def skinny_gemm(x, weight, out, *, stream=None, plan: tuple[int, int, int] | None = None):
    """out [M, N] (bf16 or fp32, rows may be strided) = x [M, K] bf16 (rows may be strided) · weight [N, K]ᵀ;
    the caller checked shapes and `fits`.  `plan` overrides wide_plan's (FPC, SPLITS, NT) (benchmarks; with a
    plan, M <= 8 rows also run on skinny_gemm_cl)."""
    M, K = x.shape
    N = weight.shape[0]
    if M > MAX_ROWS or plan is not None:
        fpc, splits, nt = plan or wide_plan(M, N, K)
        if plan and not _plan_fits(M, N, K, fpc, splits, nt):
            raise ValueError(f"skinny_gemm: plan {plan} does not fit M={M}, N={N}, K={K}")
        if ws_applies((fpc, splits, nt), K):
            import cupy

            from kda_rt.cuda.ops.tma import map_2d_swizzled

            stream = stream if stream is not None else cupy.cuda.get_current_stream()
            # the weight's map encoded once per weight and stream and never evicted, x's kept where a CUDA graph
            # captures this call (the graph keeps the maps' addresses); x's boxes of 8·NT rows, the rows past M zeros
            wmap = map_2d_swizzled(weight, fpc, "weight", stream=stream, keep=True)
            xmap = map_2d_swizzled(x, 8 * nt, "x", stream=stream, keep=stream.is_capturing(), box_past_rows=True)
            kernel = _ws_kernel(out.dtype == np.float32, fpc, splits, nt, K)
            kernel((N // fpc, splits), (32 * (_WARPS + 1),), (np.uint64(xmap.data.ptr), np.uint64(wmap.data.ptr), out,
                                                               i32(leading_dim(out)), i32(M)),
                   shared_mem=_ws_smem(fpc, splits, nt), stream=stream)
            return out
        kernel = _wide_kernel(out.dtype == np.float32, fpc, splits, nt, K)
        kernel((N // fpc, splits), (32 * _WARPS,), (x, i32(leading_dim(x)), weight, out, i32(leading_dim(out)), i32(M),
                                                   i32(K)), shared_mem=_wide_smem(fpc, K // splits, nt, splits),
               stream=stream)
        return out
    if env.skinny_staged() and clusters_supported() and (sp := staged_plan(N, K, _sms())):
        grid, rows = sp
        kernel = _staged_kernel(out.dtype == np.float32, rows, K, env.skinny_staged_bulk())
        kernel((grid,), (32 * _WARPS,), (x, i32(leading_dim(x)), weight, out, i32(leading_dim(out)), i32(M), i32(N)),
               shared_mem=_staged_smem(rows, K), stream=stream)
        return out
    kernel = _kernel(out.dtype == np.float32)
    kernel((N // 16,), (32 * _WARPS,), (x, i32(leading_dim(x)), weight, out, i32(leading_dim(out)), i32(M), i32(K)),
           stream=stream)
    return out
