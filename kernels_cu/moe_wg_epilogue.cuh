// moe_wg_epilogue.cuh — the epilogue shared by the wgmma grouped GEMMs (moe_gemm_wg.cu, moe_gemm_ws.cu):
// one warpgroup's 64 x BN accumulators to bf16 rows (gate/up: SiLU(gate)·up pairs, down: plain).  Expects the
// including kernel's constants ACC, BN, HALF, NOUT and FUSE_SILU.
#pragma once
#include "common.cuh"

// Epilogue of one warpgroup (thread t of it) whose 64 rows start at tile row `rbase`: accumulator
// 4j + q of thread (warp w of the warpgroup, lane l) is row 16w + l/4 + 8·(q/2), column
// 8j + 2·(l mod 4) + (q mod 2) of the warpgroup's 64 x BN tile.  Rows ≥ nrows are not stored.
__device__ __forceinline__ void store_rows(const float (&acc)[ACC], void* __restrict__ dst, int row0, int nrows, int f0,
                                           int rbase, int t) {
    if (rbase >= nrows) return;  // no rows of this warpgroup (their products were of zero rows)
    const int lane = t & 31, wq = t >> 5;
    const int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
        const int rl = rbase + wq * 16 + g + 8 * hrow;
        if (rl >= nrows) continue;
        const size_t r = (size_t)(row0 + rl);
#if FUSE_SILU
#pragma unroll
        for (int j = 0; j < BN / 16; ++j) {
            const int f = f0 + 8 * j + 2 * c;
            float hv[2];
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const float gate = round_bf16(acc[4 * j + 2 * hrow + q]);
                const float up = round_bf16(acc[4 * (j + BN / 16) + 2 * hrow + q]);
                hv[q] = round_bf16(silu(gate)) * up;
            }
            *reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(dst) + r * HALF + f) = __floats2bfloat162_rn(hv[0], hv[1]);
        }
#else
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int f = f0 + 8 * j + 2 * c;
            *reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(dst) + r * NOUT + f) =
                __floats2bfloat162_rn(acc[4 * j + 2 * hrow], acc[4 * j + 2 * hrow + 1]);
        }
#endif
    }
}
