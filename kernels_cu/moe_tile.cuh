// moe_tile.cuh — the tile-loading geometry shared by the grouped expert GEMMs (moe_gemm_tc.cu on
// mma.sync, moe_gemm_wg.cu on wgmma): which source row each copying thread reads for a tile of an
// expert's bucketed rows, and which weight row each copy pass reads.  Expects the including kernel's
// constants K, NOUT (via HALF), BN, TOPK, FUSE_SILU and RPP (rows copied per pass of all threads).
#pragma once
#include "common.cuh"

// Sources of the A rows that a thread copies (chunk lch of rows lrow + i·RPP of the tile starting at
// bucketed row row0): gate/up (FUSE_SILU) reads the token's x row, tok = sorted_pair[r] / TOPK, down
// reads h row r.  Rows at or past nrows get 0 bytes (cp.async zero-fills; the source is clamped to
// the tile's first row, never out of bounds, and nothing is read).
template <int PASSES>
__device__ __forceinline__ void tile_row_sources(const bf16* (&a_src)[PASSES], int (&a_bytes)[PASSES],
                                                 const bf16* __restrict__ src, const int* __restrict__ sorted_pair,
                                                 int row0, int nrows, int lrow, int lch) {
#pragma unroll
    for (int i = 0; i < PASSES; ++i) {
        a_bytes[i] = lrow + i * RPP < nrows ? 16 : 0;
        const int r = a_bytes[i] ? row0 + lrow + i * RPP : row0;
#if FUSE_SILU
        const int s = sorted_pair[r] / TOPK;
#else
        const int s = r;
#endif
        a_src[i] = src + (size_t)s * K + lch * 8;
    }
}

// Weight row (relative to the block's first gate / output feature) copied by pass i: with FUSE_SILU
// the first BN/2 tile rows are gate features, the rest the matching up features HALF rows further on
__device__ __forceinline__ constexpr int b_pass_offset(int i) {
#if FUSE_SILU
    return i * RPP < BN / 2 ? i * RPP : HALF - BN / 2 + i * RPP;
#else
    return i * RPP;
#endif
}
