// moe_gemm.cu — grouped GEMM over expert-bucketed rows with bf16 tensor cores (mma.sync m16n8k16,
// fp32 accumulate), for the two MoE projections (spec §5.1):
//
//   FUSE_SILU = 1 (gate/up):  g = x[tok(r)] · W[e, f]ᵀ,  u = x[tok(r)] · W[e, HALF + f]ᵀ
//                             h[r, f] = bf16( bf16(SiLU(bf16(g))) · bf16(u) )      (as silu_mul.cu)
//                             W = w13 [E, 2·HALF, K] (gate rows first), x [T, K], tok(r) = sorted_pair[r] / TOPK
//   FUSE_SILU = 0 (down):     y[r, f] = bf16(h[r] · W[e, f]ᵀ)                       W = w2 [E, NOUT, K]
//
// Rows r are the expert-sorted pair rows of moe_align.cu; tile i covers rows
// [tile_row[i], min(tile_row[i] + BT, expert_off[e + 1])) of expert e = tile_expert[i].
//
// Geometry.  Grid (max_tiles, feature blocks); a block whose tile index is ≥ num_tiles[0] (read
// on the device) exits at once, so the grid is sized from (T, A, E) alone and the launch can be
// captured in a CUDA graph.  Block: WARPS warps.  Each warp owns MT m16 tiles of weight rows
// (output features; the MT/2 gate tiles and the matching MT/2 up tiles when FUSE_SILU) and all
// NT n8 tiles of rows (BT = 8·NT), i.e. we compute (W·Xᵀ): weights are the A operand, so a
// decode tile with one or two rows wastes MMA work, not weight bytes — decode is bound by
// reading each touched expert's weights once.
//
// K split (KSPLIT > 1, decode): the block has WARPS·KSPLIT warps; warp w computes the features of
// warp w % WARPS over the K slice w / WARPS, and the slices are summed in shared memory (fixed
// order, so the result does not depend on timing) before the epilogue.  At batch 1 only 8 experts
// are touched: without the split one wave holds ~4 warps per SM with ~8 KB of loads in flight each,
// too few bytes in flight to reach the copy bandwidth.
//
// Operand loads need no shared memory: the dot product over K does not care about the order of
// k, so each lane loads 8 consecutive k (16 bytes) of its weight rows and of its x row and feeds
// them to two k16 MMAs — logical k {2c, 2c+1, 2c+8, 2c+9} of lane c = lane % 4 map to physical
// k {8c..8c+3} in the first MMA and {8c+4..8c+7} in the second, the same for A and B.  KU such
// 32-k chunks are loaded before the first MMA so several 16-byte loads per thread are in flight.
// x rows are shared by all warps of the block through L1.
//
// Shapes / dtypes: src bf16 ([T, K] x when FUSE_SILU, else [N, K] h); weight bf16 [E, NOUT, K];
//   dst bf16 [N, HALF] (FUSE_SILU) or bf16 [N, NOUT] (y, one bf16 rounding per expert row as HF's expert output).
// Compile-time constants: K (multiple of 32·KU·KSPLIT), NOUT, FUSE_SILU, TOPK, MT, NT, KU, WARPS, KSPLIT.
//   NOUT (or HALF = NOUT / 2) is a multiple of WARPS·16·MT (resp. WARPS·16·MT/2).
// Measured on H200 (MT=2, WARPS=4, KU=4, NT=1; untuned): the whole moe_forward at T=32, E=256,
// D=2304, I=1024 takes 601 us per graph replay for 1418 MB of touched weights = 2.36 TB/s, 55% of
// the 4.3 TB/s copy ceiling.  Not yet used: cp.async / TMA pipelining and wgmma; prefill-sized
// tiles (NT = 4) re-read an expert's weights once per 32-row tile, from L2 when they fit there.
#include "common.cuh"

#if !defined(K) || !defined(NOUT) || !defined(MT) || !defined(NT) || !defined(KU) || !defined(WARPS)
#error "moe_gemm.cu needs -DK -DNOUT -DMT -DNT -DKU -DWARPS (and FUSE_SILU, TOPK)"
#endif
#ifndef KSPLIT
#define KSPLIT 1
#endif
#if K % (32 * KU * KSPLIT) != 0
#error "moe_gemm.cu: K must be a multiple of 32·KU·KSPLIT"
#endif
#if FUSE_SILU && (MT % 2 != 0)
#error "moe_gemm.cu: FUSE_SILU needs an even MT (gate and up tiles in pairs)"
#endif
#define BT (8 * NT)
#define HALF (NOUT / 2)

// ---------------------------------------------------------------------------------------------
// kernels

extern "C" __global__ void __launch_bounds__(WARPS * KSPLIT * 32)
moe_grouped_gemm(const bf16* __restrict__ src, const int* __restrict__ sorted_pair, const bf16* __restrict__ weight,
                 const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                 const int* __restrict__ expert_off, const int* __restrict__ num_tiles, void* __restrict__ dst) {
    KDA_PDL_ENTRY();
    const int tile = blockIdx.x;
    if (tile >= num_tiles[0]) return;
    const int e = tile_expert[tile], row0 = tile_row[tile], row_end = expert_off[e + 1];
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) % WARPS, kslice = (threadIdx.x >> 5) / WARPS;
    const int g = lane >> 2, c = lane & 3;
    constexpr int KS = K / KSPLIT;  // this warp's K range: [kslice·KS, (kslice + 1)·KS)

    // B operand: the row of n-tile nt this lane feeds (rows past the tile end repeat row0; their
    // results are never stored)
    const bf16* brow[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        int r = row0 + nt * 8 + g;
        r = r < row_end ? r : row0;
#if FUSE_SILU
        const int s = sorted_pair[r] / TOPK;
#else
        const int s = r;
#endif
        brow[nt] = src + (size_t)s * K + 8 * c;
    }
    // A operand: weight rows g (and g + 8) of each m16 tile
#if FUSE_SILU
    const int f0 = (blockIdx.y * WARPS + warp) * 16 * (MT / 2);  // first h feature of this warp
#else
    const int f0 = (blockIdx.y * WARPS + warp) * 16 * MT;
#endif
    const bf16* wexp = weight + (size_t)e * NOUT * K;
    const bf16* wrow[MT];
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#if FUSE_SILU
        const int m = i < MT / 2 ? f0 + 16 * i : HALF + f0 + 16 * (i - MT / 2);
#else
        const int m = f0 + 16 * i;
#endif
        wrow[i] = wexp + (size_t)(m + g) * K + 8 * c;
    }

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][nt][j] = 0.f;

    for (int k0 = kslice * KS; k0 < (kslice + 1) * KS; k0 += 32 * KU) {
        uint4 a[KU][MT][2], b[KU][NT];
#pragma unroll
        for (int u = 0; u < KU; ++u) {
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                a[u][i][0] = __ldg(reinterpret_cast<const uint4*>(wrow[i] + k0 + 32 * u));
                a[u][i][1] = __ldg(reinterpret_cast<const uint4*>(wrow[i] + 8 * K + k0 + 32 * u));
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) b[u][nt] = __ldg(reinterpret_cast<const uint4*>(brow[nt] + k0 + 32 * u));
        }
#pragma unroll
        for (int u = 0; u < KU; ++u)
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const uint4 lo = a[u][i][0], hi = a[u][i][1], bb = b[u][nt];
                    const unsigned a0[4] = {lo.x, hi.x, lo.y, hi.y}, a1[4] = {lo.z, hi.z, lo.w, hi.w};
                    mma_bf16(acc[i][nt], a0, bb.x, bb.y);
                    mma_bf16(acc[i][nt], a1, bb.z, bb.w);
                }
    }

#if KSPLIT > 1
    // sum the K slices: slices 1.. park their partial sums, slice 0 adds them in slice order
    __shared__ float part[KSPLIT - 1][WARPS][MT * NT * 4][32];
    if (kslice > 0) {
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int j = 0; j < 4; ++j) part[kslice - 1][warp][(i * NT + nt) * 4 + j][lane] = acc[i][nt][j];
    }
    __syncthreads();
    if (kslice > 0) return;
#pragma unroll
    for (int s = 0; s < KSPLIT - 1; ++s)
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][nt][j] += part[s][warp][(i * NT + nt) * 4 + j][lane];
#endif

    // epilogue: acc[i][nt] = {(g, 2c), (g, 2c+1), (g+8, 2c), (g+8, 2c+1)} as (feature, row)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int r = row0 + nt * 8 + 2 * c + (j & 1);
            if (r >= row_end) continue;
#if FUSE_SILU
#pragma unroll
            for (int i = 0; i < MT / 2; ++i) {
                const int f = f0 + 16 * i + g + (j >> 1) * 8;
                const float gate = round_bf16(acc[i][nt][j]), up = round_bf16(acc[i + MT / 2][nt][j]);
                const float act = round_bf16(silu(gate));
                static_cast<bf16*>(dst)[(size_t)r * HALF + f] = to_bf16(act * up);
            }
#else
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const int f = f0 + 16 * i + g + (j >> 1) * 8;
                static_cast<bf16*>(dst)[(size_t)r * NOUT + f] = to_bf16(acc[i][nt][j]);
            }
#endif
        }
}
