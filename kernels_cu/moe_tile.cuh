// moe_tile.cuh — the tile-loading geometry shared by the grouped expert GEMMs (moe_gemm_tc.cu on
// mma.sync, moe_gemm_wg.cu on wgmma): which source row each copying thread reads for a tile of an
// expert's bucketed rows, and which weight row each copy pass reads.  Expects the including kernel's
// constants BN, TOPK and RPP (rows copied per pass of all threads); the GEMM's shape comes as template
// arguments (moe_gemm_tc.cu's fused decode kernel runs both GEMMs of a layer).
#pragma once
#include "common.cuh"

// Sources of the A rows that a thread copies (chunk lch of rows lrow + i·RPP of the tile starting at
// bucketed row row0) of a [., K_] source: gate/up (GATHER) reads the token's x row, tok = sorted_pair[r] /
// TOPK, down reads h row r.  Rows at or past nrows get 0 bytes (cp.async zero-fills; the source is clamped
// to the tile's first row, never out of bounds, and nothing is read).  T: the source's element type (bf16, or
// 8-bit codes: chunk lch is then elements 16·lch ..).
template <int K_, bool GATHER, int PASSES, typename T>
__device__ __forceinline__ void tile_row_sources(const T* (&a_src)[PASSES], int (&a_bytes)[PASSES],
                                                 const T* __restrict__ src, const int* __restrict__ sorted_pair,
                                                 int row0, int nrows, int lrow, int lch) {
#pragma unroll
    for (int i = 0; i < PASSES; ++i) {
        a_bytes[i] = lrow + i * RPP < nrows ? 16 : 0;
        const int r = a_bytes[i] ? row0 + lrow + i * RPP : row0;
        const int s = GATHER ? sorted_pair[r] / TOPK : r;
        a_src[i] = src + (size_t)s * K_ + lch * (16 / (int)sizeof(T));
    }
}

// Weight row (relative to the block's first gate / output feature) copied by pass i: for gate/up (SILU)
// the first BN/2 tile rows are gate features, the rest the matching up features HALF_ rows further on
template <bool SILU, int HALF_>
__device__ __forceinline__ constexpr int b_pass_offset(int i) {
    return SILU ? (i * RPP < BN / 2 ? i * RPP : HALF_ - BN / 2 + i * RPP) : i * RPP;
}
