"""Dense projections of large prefill steps on the e4m3 tensor cores (quantization="fp8", KDA_RT_FP8_DENSE).

    y[t, n] = bf16( sx[t] · sw[n] · Σ_k qx[t, k] · qw[n, k] )          (qx, qw: e4m3 codes; sx, sw: fp32 row scales)
    fuse_silu: h[t, f] = bf16( bf16(SiLU(bf16(g[t, f]))) · bf16(u[t, f]) ), g / u the sums of weight rows f and F + f

x's rows are quantized as `quantize_activations_e4m3` quantizes them (or by the RMSNorm before, rmsnorm.cu
E4M3_OUT: the same codes), the weight's rows once at upload (`quantize_rows_e4m3`).  The GEMM is moe_gemm_wg.cu's
(WFMT = 2) over one expert and an identity plan: sorted row r is source row r, in 128-row tiles.  The weight's rows
are padded with zero codes and zero scales to a multiple of the tile width (256), so the output holds that many
columns and the caller takes its first `nout` (a row-strided view: `fits(pad=False)` keeps the copies to shapes
without padding where the consumer takes contiguous rows only).  sm_90a only (wgmma); elsewhere the model keeps
cuBLAS bf16.

Measured (H200, 2026-12-02, `PYTHONPATH=. python tests/gpu/bench_dense_w8a8.py`, T = 16384, quantization of x
included | GEMM alone, against cuBLAS bf16): KDA q|k|v 0.973 | 0.931 ms against 1.363 (-28.6 | -31.7%), o_proj
0.319 | 0.250 against 0.395, MLA q|kv_a 0.518 | 0.485 against 0.723, the dense layer's gate|up with SiLU 1.656 |
1.602 against 2.046 (plus silu_mul), down 0.705 | 0.540 against 0.998.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np

from kda_rt.cuda.ops.moe_align import MoEPlan, max_tiles
from kda_rt.cuda.ops.moe_gemm_wg import BM, E4M3_BK, moe_gemm_wg, wg_tile
from kda_rt.cuda.ops.quant import quantize_activations_e4m3, quantize_rows_e4m3

__all__ = ["E4m3Dense", "MIN_TOKENS", "PAD", "dense_w8a8", "fits", "precompile", "quantize_dense"]

PAD = 256  # weight rows padded to the e4m3 tile's width
# smaller steps keep cuBLAS bf16 (bench_dense_w8a8.py --tokens 1024,2048,4096, H200, 2026-12-02: at 1024 tokens the
# five projections take 0.454 ms with x's quantization against cuBLAS's 0.326, o_proj 0.071 against 0.032; at 2048
# a KDA layer's q|k|v on the norm's codes and o_proj 0.176 against 0.202 ms, MLA's even; at 4096 all win)
MIN_TOKENS = 2048


class E4m3Dense(NamedTuple):
    """A [nout, K] projection's rows as e4m3 codes, padded with zero rows to a multiple of PAD: codes uint8
    [1, padded, K] (one "expert"), scale fp32 [1, padded] (zero on the padding)."""

    codes: Any
    scale: Any
    nout: int
    fuse_silu: bool = False

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.scale.nbytes)


def fits(nout: int, k: int, fuse_silu: bool = False, *, pad: bool = True) -> bool:
    """A [nout, k] weight can run here: k a multiple of 128 codes, and a tile for its padded width; without `pad`
    only when no padding is needed (for consumers of the output that take contiguous rows only: KDA's q|k|v, the
    dense MLP's h).  False, not an error, where KDA_RT_W8A8_TILE names a tile that does not fit."""
    padded = _padded(nout, fuse_silu)
    if k % E4M3_BK or (fuse_silu and nout % 2) or (not pad and padded != nout):
        return False
    try:
        return wg_tile(padded, k, fuse_silu, e4m3_src=True) is not None
    except ValueError:  # (a forced tile that does not fit this shape)
        return False


def _padded(nout: int, fuse_silu: bool) -> int:
    if fuse_silu:  # gate rows [0, F) then up rows [F, 2F): each half padded on its own (the kernel pairs f, F + f)
        return 2 * (-(-(nout // 2) // PAD) * PAD)
    return -(-nout // PAD) * PAD


def quantize_dense(w, name: str, *, fuse_silu: bool = False, stream=None) -> E4m3Dense:
    """w [nout, K] bf16 (C-contiguous) -> its E4m3Dense copy (w itself is kept).  fuse_silu: w is gate|up
    ([2F, K], gate rows first); each half is padded on its own."""
    import cupy

    nout, K = w.shape
    if fuse_silu and nout % 2:
        raise ValueError(f"quantize_dense: {name} has {nout} rows; gate|up needs an even number")
    padded = _padded(nout, fuse_silu)
    q, s = quantize_rows_e4m3(w, name, stream=stream)
    if padded == nout:
        return E4m3Dense(q.reshape(1, nout, K), s.reshape(1, nout), nout, fuse_silu)
    with stream if stream is not None else cupy.cuda.get_current_stream():
        codes = cupy.zeros((1, padded, K), dtype=np.uint8)
        scale = cupy.zeros((1, padded), dtype=np.float32)
        if fuse_silu:
            half, phalf = nout // 2, padded // 2
            codes[0, :half], codes[0, phalf:phalf + half] = q[:half], q[half:]
            scale[0, :half], scale[0, phalf:phalf + half] = s[:half], s[half:]
        else:
            codes[0, :nout], scale[0, :nout] = q, s
    return E4m3Dense(codes, scale, nout, fuse_silu)


class _IdentityPlans:
    """Identity MoEPlans by step size: the row and tile ramps shared (grown as steps grow), the two per-size
    arrays (expert_off, num_tiles) kept for the last few sizes (eager prefill steps repeat a handful)."""

    KEEP = 16

    def __init__(self) -> None:
        self._rows = self._tile_row = self._zeros = None
        self._small: OrderedDict[int, tuple[Any, Any]] = OrderedDict()

    def get(self, T: int) -> MoEPlan:
        import cupy

        tiles = max_tiles(T, 1, BM)
        if self._rows is None or self._rows.shape[0] < T:
            n = max(T, 2 * (0 if self._rows is None else self._rows.shape[0]))
            t = max_tiles(n, 1, BM)
            self._rows = cupy.arange(n, dtype=np.int32)
            self._tile_row = cupy.arange(t, dtype=np.int32) * BM
            self._zeros = cupy.zeros(t, dtype=np.int32)
        small = self._small.pop(T, None)
        if small is None:  # (filled on the device: no copy from pageable host memory, which may wait for the stream)
            off = cupy.zeros(2, dtype=np.int32)
            off[1] = T
            small = (off, cupy.full(1, -(-T // BM), dtype=np.int32))
            while len(self._small) >= self.KEEP:
                self._small.popitem(last=False)
        self._small[T] = small
        rows = self._rows[:T]
        return MoEPlan(small[0], rows, rows, self._zeros[:tiles], self._tile_row[:tiles], small[1], BM)


_PLANS = _IdentityPlans()


def dense_w8a8(x, w: E4m3Dense, *, out, codes, quantized: bool = False, stream=None):
    """out = x · Wᵀ (fuse_silu: SiLU(gate) · up) on e4m3 products; x [T, K] bf16 (unread when `quantized`),
    codes = (q uint8 [T, K], s fp32 [T]): x's e4m3 rows, made here unless `quantized` (the norm before wrote them).
    out: bf16 [T, padded] ([T, padded / 2] with fuse_silu), padded = w.codes.shape[1]; its first nout (nout / 2)
    columns are the projection.  Returns out."""
    import cupy

    q, s = codes
    if not quantized:
        quantize_activations_e4m3(x, out=q, scale_out=s, stream=stream)
    with stream if stream is not None else cupy.cuda.get_current_stream():  # (the plan's arrays in stream order)
        plan = _PLANS.get(int(q.shape[0]))
    return moe_gemm_wg(q, w.codes, plan, top_k=1, fuse_silu=w.fuse_silu, out=out, scale=w.scale, src_scale=s,
                       stream=stream)


def precompile(dense, hidden: int) -> int:
    """Build (or load from the disk cache) the GEMM and quantizer variants of every E4m3Dense in `dense`, and the
    RMSNorms that write the mixers' codes (rows of `hidden`, with and without the residual add), so the first
    large prefill step waits for no NVRTC build.  Returns the number of variants."""
    from kda_rt.cuda.ops.moe_gemm_wg import wg_kernel
    from kda_rt.cuda.ops.quant import activation_kernel
    from kda_rt.cuda.ops.rmsnorm import rmsnorm_kernel

    gemms = {(int(w.codes.shape[1]), int(w.codes.shape[2]), w.fuse_silu) for w in dense}
    for nout, K, fuse in gemms:
        wg_kernel(wg_tile(nout, K, fuse, e4m3_src=True), K, nout, fuse, 1, True, e4m3_src=True)
    sources = {K for _, K, _ in gemms}
    for K in sources:
        activation_kernel(K)
    if gemms:
        rmsnorm_kernel(hidden, False, e4m3_out=True)
        rmsnorm_kernel(hidden, True, e4m3_out=True)
    return len(gemms) + len(sources) + 2 * bool(gemms)
