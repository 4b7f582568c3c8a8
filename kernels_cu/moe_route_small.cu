// moe_route_small.cu — the whole MoE routing of a small decode batch in one launch: router logits,
// top-k selection and the bucketing of the pairs for the grouped GEMMs (moe_route.cu's
// moe_route_logits + moe_route_select_warp and moe_align.cu's moe_bucket, same math, same outputs).
// At batch 1-8 those were three launches of a few microseconds each, per MoE layer.
//
// moe_route_small — grid (ceil(E / 32)), block 1024 (32 warps), num_groups == 1 only, T <= MAX_T:
//   1. every block: warp w computes the logits of expert 32·blockIdx.x + w for the T tokens, staged in
//      shared memory (the loop of moe_route_logits: per lane 4-wide fp32 products in d order, then a
//      warp sum), into the fp32 scratch logits [T, E];
//   2. the block that finishes last (an atomic ticket after a __threadfence) resets the ticket for the
//      next call, reads the logits back past L1 (__ldcg) and selects per token, warp t for token t,
//      with moe_route_select_warp's rounds (ids in descending score, lower index on ties; weights
//      from the unbiased score, or the biased one; renormalised in k order; × scaling);
//   3. the same block buckets the T·(A + SHARED) pairs (moe_bucket.cuh) from the ids in shared memory.
// The ticket must be 0 before the first call (the launcher zeroes it outside graph capture); each call
// leaves it 0, so graph replays need no reset.  NaN scores rank as -inf, as in moe_route.cu.
// Shapes: x [T, D] bf16; w_router [E, D] fp32; bias [E] fp32; logits [T, E] fp32 scratch; ids [T, A]
//   int32; w [T, A] fp32; the plan arrays of moe_align.cu with BINS = E (+ 1 with the shared slot).
// Compile-time constants: D (multiple of 4), E (<= 1023), MAX_T (<= 32), MAX_TOP_K (<= 32), BT, SHARED_A.
#include "common.cuh"
#include "moe_bucket.cuh"
#include "moe_select.cuh"

#if !defined(D) || !defined(E) || !defined(MAX_T) || !defined(MAX_TOP_K) || !defined(BT) || !defined(SHARED_A)
#error "moe_route_small.cu needs -DD -DE -DMAX_T -DMAX_TOP_K -DBT -DSHARED_A"
#endif
#define BINS (SHARED_A ? E + 1 : E)
static_assert(D % 4 == 0 && MAX_T <= 32 && MAX_TOP_K <= 32 && BINS <= BUCKET_BLOCK, "moe_route_small: shape limits");

extern "C" __global__ void __launch_bounds__(BUCKET_BLOCK)
moe_route_small(const bf16* __restrict__ x, const float* __restrict__ w_router, const float* __restrict__ bias,
                float* __restrict__ logits, int* __restrict__ out_ids, float* __restrict__ out_w,
                int* __restrict__ ticket, int* __restrict__ expert_off, int* __restrict__ sorted_pair,
                int* __restrict__ pair_pos, int* __restrict__ tile_expert, int* __restrict__ tile_row,
                int* __restrict__ num_tiles, int* __restrict__ stats, int num_tokens, int top_k, int renormalize,
                int biased, float scaling) {
    __shared__ __align__(16) bf16 xs[MAX_T][D];
    __shared__ int ids_sh[MAX_T * MAX_TOP_K];
    __shared__ int count_sh[BINS], off_sh[BINS], fill_sh[BINS], warp_tot[32];
    __shared__ int last_sh;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int T = num_tokens;

    // 1. logits of this block's 32 experts
    for (int i = threadIdx.x; i < T * (D / 4); i += BUCKET_BLOCK) {
        const int t = i / (D / 4), d = (i % (D / 4)) * 4;
        *reinterpret_cast<uint2*>(&xs[t][d]) = *reinterpret_cast<const uint2*>(x + (size_t)t * D + d);
    }
    __syncthreads();
    const int e = blockIdx.x * 32 + warp;
    if (e < E) {
        const float* row = w_router + (size_t)e * D;
        float acc[MAX_T];
#pragma unroll
        for (int t = 0; t < MAX_T; ++t) acc[t] = 0.f;
        for (int d = lane * 4; d < D; d += 128) {
            const float4 wv = *reinterpret_cast<const float4*>(row + d);
#pragma unroll
            for (int t = 0; t < MAX_T; ++t) {
                if (t < T) {
                    const uint2 raw = *reinterpret_cast<const uint2*>(&xs[t][d]);
                    const bf16* xv = reinterpret_cast<const bf16*>(&raw);
                    acc[t] += wv.x * to_f32(xv[0]) + wv.y * to_f32(xv[1]) + wv.z * to_f32(xv[2]) + wv.w * to_f32(xv[3]);
                }
            }
        }
#pragma unroll
        for (int t = 0; t < MAX_T; ++t) {
            if (t < T) {
                const float v = warp_sum(acc[t]);
                if (lane == 0) logits[(size_t)t * E + e] = v;
            }
        }
    }

    // 2. the last block to finish selects
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last_sh = atomicAdd(ticket, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last_sh) return;
    if (threadIdx.x == 0) *ticket = 0;  // every other block has taken its ticket
    __threadfence();
    if (warp < T) {
        const int t = warp;
        const float* l = logits + (size_t)t * E;
        int id;
        float w;
        warp_route_token<E>([&](int e) { return __ldcg(l + e); }, bias, top_k, renormalize, biased, scaling, &id, &w);
        if (lane < top_k) {
            out_ids[(size_t)t * top_k + lane] = id;
            out_w[(size_t)t * top_k + lane] = w;
            ids_sh[t * top_k + lane] = id;
        }
    }
    __syncthreads();

    // 3. bucket the pairs (pair p = t·(A + 1) + k with the shared slot, k = A its shared-expert pair)
    const int pairs = SHARED_A ? top_k + 1 : top_k;
    bucket_block(
        [&](int p) {
            const int t = p / pairs, k = p % pairs;
            return (SHARED_A && k == top_k) ? E : ids_sh[t * top_k + k];
        },
        T * pairs, BINS, BT, E, expert_off, sorted_pair, pair_pos, tile_expert, tile_row, num_tiles, stats, count_sh,
        off_sh, fill_sh, warp_tot);
}
