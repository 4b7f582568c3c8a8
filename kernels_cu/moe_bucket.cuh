// moe_bucket.cuh — the bucketing of MoE (token, expert) pairs by expert for the grouped GEMMs, done by one
// block: moe_align.cu's moe_bucket (1024 threads) and moe_route.cu's moe_route_fused (its last block, 512
// threads) run it.  Contract (outputs, tiles, stats) in moe_align.cu's header.
#pragma once

// LIVE_PAIRS (moe_align.cu's bucketing kernels; its value: the pairs a token) and LIVE_TOKENS (moe_route_fused, the
// combines), KDA_RT_SKIP_PAD (default on since 2026-12-04): the kernel takes one more, last argument `live`
// (int32 [1] on the device: the live rows of a decode graph's step, the others padding rows).  The bucketing then
// plans the live tokens' pairs alone (pairs are token-major: the first live x pairs-a-token of them), so the
// GEMMs never run a padding row, and the combines write zeros for the padding tokens instead of reading rows no
// plan has.  Absent, the builds are the ones before them.
#if defined(LIVE_PAIRS) || defined(LIVE_TOKENS)
#define LIVE_PARAM , const int* __restrict__ live
#define LIVE_COUNT() max(0, __ldg(live))
#ifdef LIVE_PAIRS
// the pairs of the live tokens among num_pairs (token-major, LIVE_PAIRS a token; no overflow, whatever `live` holds)
#define LIVE_NUM_PAIRS(num_pairs) (min(LIVE_COUNT(), (num_pairs) / LIVE_PAIRS) * LIVE_PAIRS)
#endif
#else
#define LIVE_PARAM
#endif

// Exclusive prefix sum over a block of NT threads (NT / 32 full warps, one value each); `warp_tot` holds 32
// ints of shared memory.  *total gets the block sum.  Ends with a barrier.
template <int NT>
__device__ __forceinline__ int block_exclusive_scan(int v, int* warp_tot, int* total) {
    static_assert(NT % 32 == 0 && NT <= 1024, "block_exclusive_scan: 1 to 32 full warps");
    constexpr int NW = NT / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
    }
    if (lane == 31) warp_tot[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        int w = lane < NW ? warp_tot[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int n = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += n;
        }
        if (lane < NW) warp_tot[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const int result = (warp > 0 ? warp_tot[warp - 1] : 0) + inc - v;
    *total = warp_tot[NW - 1];
    __syncthreads();
    return result;
}

// The plan from the per-bin counts (thread b < bins holds bin b's count in cnt), by one block of NT threads:
// expert_off, the tiles of `bt` rows (tile_expert, tile_row, num_tiles), the optional stats; off_sh[b] gets bin
// b's first row (shared scratch of `bins` ints; warp_tot of 32).  Ends with a barrier.
template <int NT>
__device__ __forceinline__ void plan_from_counts(int cnt, int bins, int bt, int routed, int* __restrict__ expert_off,
                                                 int* __restrict__ tile_expert, int* __restrict__ tile_row,
                                                 int* __restrict__ num_tiles, int* __restrict__ stats, int* off_sh,
                                                 int* warp_tot) {
    const int tid = threadIdx.x;
    const int ntile = (cnt + bt - 1) / bt;
    int total_rows, total_tiles;
    const int row0 = block_exclusive_scan<NT>(cnt, warp_tot, &total_rows);
    const int tile0 = block_exclusive_scan<NT>(ntile, warp_tot, &total_tiles);
    if (tid < bins) {
        off_sh[tid] = row0;
        expert_off[tid] = row0;
        for (int j = 0; j < ntile; ++j) {
            tile_expert[tile0 + j] = tid;
            tile_row[tile0 + j] = row0 + j * bt;
        }
    }
    if (tid == 0) {
        expert_off[bins] = total_rows;
        num_tiles[0] = total_tiles;
    }
    if (stats != nullptr) {  // bins touched by this call: one atomic per warp
        const int touched = __popc(__ballot_sync(0xffffffffu, cnt > 0 && tid < routed));
        if ((tid & 31) == 0 && touched) atomicAdd(stats, touched);
        if (tid == 0) atomicAdd(stats + 1, 1);
    }
    __syncthreads();
}

// The whole bucketing of `num_pairs` pairs into `bins` bins (bins <= NT) of `bt`-row tiles, by one block
// of NT threads; expert_of(p) gives pair p's bin.  Shared scratch: count_sh, off_sh, fill_sh of `bins`
// ints, warp_tot of 32.
template <int NT, typename ExpertOf>
__device__ __forceinline__ void bucket_block(ExpertOf expert_of, int num_pairs, int bins, int bt, int routed,
                                             int* __restrict__ expert_off, int* __restrict__ sorted_pair,
                                             int* __restrict__ pair_pos, int* __restrict__ tile_expert,
                                             int* __restrict__ tile_row, int* __restrict__ num_tiles,
                                             int* __restrict__ stats, int* count_sh, int* off_sh, int* fill_sh,
                                             int* warp_tot) {
    const int tid = threadIdx.x;
    for (int e = tid; e < bins; e += NT) { count_sh[e] = 0; fill_sh[e] = 0; }
    __syncthreads();
    for (int p = tid; p < num_pairs; p += NT) atomicAdd(&count_sh[expert_of(p)], 1);
    __syncthreads();
    plan_from_counts<NT>(tid < bins ? count_sh[tid] : 0, bins, bt, routed, expert_off, tile_expert, tile_row,
                         num_tiles, stats, off_sh, warp_tot);
    for (int p = tid; p < num_pairs; p += NT) {
        const int e = expert_of(p);
        const int r = off_sh[e] + atomicAdd(&fill_sh[e], 1);
        sorted_pair[r] = p;
        pair_pos[p] = r;
    }
}
