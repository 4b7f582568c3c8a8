// moe_bucket.cuh — bucketing the (token, expert) pairs of a step by expert, as one 1024-thread block:
// the body of moe_align.cu's moe_bucket.
//
//   counts[e]       = #{p : expert(p) = e}                     (shared-memory atomics)
//   expert_off[e]   = Σ_{f<e} counts[f],  expert_off[BINS] = N  (block scan)
//   tiles           = for each bin, ceil(counts[e] / BT) tiles of BT rows, in bin order:
//                     tile_expert[i] = e, tile_row[i] = first sorted row;  num_tiles[0] = total
//   sorted_pair[r]  = p and pair_pos[p] = r, r in [expert_off[e], expert_off[e+1])
//   stats (may be null): stats[0] += bins among the first `routed` that got a pair, stats[1] += 1.
// The order of pairs inside one bin follows the atomics; every grouped-GEMM row is independent and
// moe_combine reads rows through pair_pos in k order, so outputs stay bitwise deterministic.
#pragma once

#define BUCKET_BLOCK 1024  // threads of the block that runs bucket_block (32 full warps for the scan)

// Exclusive prefix sum over a block of BUCKET_BLOCK threads (one value each); `warp_tot` holds 32 ints
// of shared memory.  *total gets the block sum.  Ends with a barrier.
__device__ __forceinline__ int block_exclusive_scan(int v, int* warp_tot, int* total) {
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
        int w = warp_tot[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int n = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += n;
        }
        warp_tot[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const int result = (warp > 0 ? warp_tot[warp - 1] : 0) + inc - v;
    *total = warp_tot[31];
    __syncthreads();
    return result;
}

// The whole bucketing of `num_pairs` pairs into `bins` bins (bins <= BUCKET_BLOCK) of `bt`-row tiles,
// by one block of BUCKET_BLOCK threads.  SharedA = 0: pair q's bin is expert_of(q).  SharedA = A > 0:
// token t has pairs p = t·(A+1) + k; its routed pairs k < A are routed pair q = t·A + k with bin
// expert_of(q) (< bins - 1), and its pair k = A goes to the last bin at row expert_off[bins - 1] + t
// without an atomic (token order: one bin in nine at the 48B shape, which the atomics serialized on).
// Shared scratch: count_sh, off_sh, fill_sh of `bins` ints, warp_tot of 32.
template <int SharedA, typename ExpertOf>
__device__ __forceinline__ void bucket_block(ExpertOf expert_of, int num_pairs, int bins, int bt, int routed,
                                             int* __restrict__ expert_off, int* __restrict__ sorted_pair,
                                             int* __restrict__ pair_pos, int* __restrict__ tile_expert,
                                             int* __restrict__ tile_row, int* __restrict__ num_tiles,
                                             int* __restrict__ stats, int* count_sh, int* off_sh, int* fill_sh,
                                             int* warp_tot) {
    const int tid = threadIdx.x;
    const int tokens = SharedA ? num_pairs / (SharedA + 1) : 0, routed_pairs = num_pairs - tokens;
    for (int e = tid; e < bins; e += BUCKET_BLOCK) { count_sh[e] = 0; fill_sh[e] = 0; }
    __syncthreads();
    for (int q = tid; q < routed_pairs; q += BUCKET_BLOCK) atomicAdd(&count_sh[expert_of(q)], 1);
    if (SharedA && tid == 0) atomicAdd(&count_sh[bins - 1], tokens);
    __syncthreads();
    const int cnt = tid < bins ? count_sh[tid] : 0;
    const int ntile = (cnt + bt - 1) / bt;
    int total_rows, total_tiles;
    const int row0 = block_exclusive_scan(cnt, warp_tot, &total_rows);
    const int tile0 = block_exclusive_scan(ntile, warp_tot, &total_tiles);
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
    for (int q = tid; q < routed_pairs; q += BUCKET_BLOCK) {
        const int e = expert_of(q), p = SharedA ? q + q / SharedA : q;  // t·(A+1) + k for q = t·A + k
        const int r = off_sh[e] + atomicAdd(&fill_sh[e], 1);
        sorted_pair[r] = p;
        pair_pos[p] = r;
    }
    if (SharedA) {
        const int r0 = off_sh[bins - 1];
        for (int t = tid; t < tokens; t += BUCKET_BLOCK) {
            const int p = t * (SharedA + 1) + SharedA;
            sorted_pair[r0 + t] = p;
            pair_pos[p] = r0 + t;
        }
    }
}
