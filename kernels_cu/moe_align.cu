// moe_align.cu — MoE pair bookkeeping: bucket the T·A (token, expert) pairs by expert for the
// grouped GEMM, and gather the expert outputs back per token.
//
// Letters: T tokens, A active experts per token, E experts, N = T·A pairs (pair p = t·A + k),
// D hidden, BT rows per GEMM tile.
//
// moe_bucket — grid (1), block BUCKET_THREADS = 1024 (one block: decode steps and small prefills; from 8192
//   pairs the launcher takes moe_bucket_count / _plan / _scatter below, which write the same plan).
//   counts[e]       = #{p : ids[p] = e}                       (shared-memory atomics)
//   expert_off[e]   = Σ_{f<e} counts[f],  expert_off[E] = N    (block scan)
//   tiles           = for each expert, ceil(counts[e] / BT) tiles of BT rows, in expert order:
//                     tile_expert[i] = e, tile_row[i] = first sorted row;  num_tiles[0] = total
//   sorted_pair[r]  = p and pair_pos[p] = r, r in [expert_off[e], expert_off[e+1])
//   SHARED_A = A > 0 (the shared expert rides in the expert stacks as expert E - 1): every token has
//   A + 1 pairs p = t·(A+1) + k, pair k = A goes to expert E - 1 and pair k < A to ids[t·A + k].
//   stats (may be null): stats[0] += #{e : counts[e] > 0} (routed experts this call touched), stats[1] += 1,
//   so a caller can average the experts actually routed per step (the decode bytes floor).
//   sync (may be null, sync_words = 0): zeroed, for the counters of moe_decode_fused (moe_gemm_tc.cu).
//   The order of pairs inside one expert's rows depends on atomics, but every row of the
//   grouped GEMM is computed independently and moe_combine reads rows through pair_pos in a
//   fixed k order, so the block output is bitwise deterministic all the same.
// moe_bucket_count / moe_bucket_plan / moe_bucket_scatter — the same plan for prefill-sized N in three
//   launches over G blocks instead of one block (one block walked the 147 K pairs of a 16384-token step in
//   ~150 us).  Block g takes pairs [g·chunk, min(N, (g + 1)·chunk)), chunk a multiple of the pairs per token:
//   count: per-bin counts in shared memory, then base[g·E + e] = atomicAdd(&counts[e], count) (one global
//     atomic per bin and block; counts zeroed by the launcher): the block's first row inside bin e;
//   plan (one block): expert_off, tiles, num_tiles, stats from counts (plan_from_counts), sync zeroed;
//   scatter: r = expert_off[e] + base[g·E + e] + the pair's rank inside the block (shared atomics).
//   The shared expert's pairs (SHARED_A) are every (A+1)-th pair: their counts and ranks are arithmetic, no
//   atomics on that one hot bin.  Which block's rows come first inside a bin depends on the global atomics;
//   as in moe_bucket that order does not change any output.
//   Measured (H200, 2026-12-01, tests/gpu/bench_bucket.py: E = 256 + the shared slot, top-8, graph replays),
//   one block -> three launches: T = 512 7.3 -> 8.3 us, 2048 22.4 -> 9.2, 8192 83.4 -> 10.8, 16384 164.1 ->
//   13.1, 32768 326.8 -> 19.6 (ops/moe_align.py takes the three launches from 8192 pairs).
// moe_combine — grid (T, ceil(D / (4·THREADS))), block THREADS: each thread owns 4 columns of one
//   token and issues all its A (+1) 8-byte row loads (4 bf16) at once (at T = 1 the old grid (T) x 256
//   threads left one SM to walk 9 rows: ~7.5 us; now D / 4 threads on D / (4·THREADS) SMs).
//   out[t, :] = bf16( shared[t, :] + Σ_k w[t, k] · y[pair_pos[t·A + k], :] )
//   fp32 sum in k order of the bf16 expert rows (HF's expert outputs are bf16, summed in fp32: spec §5);
//   `shared` (fp32, the shared expert's output) only when HAS_SHARED = 1; with
//   HAS_SHARED = 2 the shared expert's row is y[pair_pos[t·(A+1) + A]] (SHARED_A bucketing).
//   Measured (H200, graph replay, D = 2304, A = 8 + shared; tests/gpu/bench_moe_route.py, 2026-11-30):
//   T = 1 1.5 us, 32 2.0, 128 3.0, 8192 169 us (4.0 TB/s of y read, y then fp32); the previous one-block-per-token
//   kernel took 7.5 us at T = 1 (ncu).
// moe_combine_norm (NORM = 1) — the combine, the residual add and the next RMSNorm in one launch (below).
// Shapes: ids, sorted_pair, pair_pos [N] int32; expert_off [E + 1] int32; tile_expert,
//   tile_row [max_tiles] int32 with max_tiles = ceil(N / BT) + min(E, N); num_tiles [1] int32;
//   y [N, D] bf16; w [T, A] fp32; shared [T, D] fp32; out [T, D] bf16; residual, residual_in [T, D] bf16 (may be
//   one array), norm_w [D] bf16.
// Compile-time constants: E (≤ 1024 bins), BT, BUCKET_THREADS, SHARED_A (bucket); D (multiple of 4), A,
// THREADS, HAS_SHARED, NORM (combine).
#include "common.cuh"

#include "moe_bucket.cuh"  // bucket_block: the bucketing by one block (also moe_route.cu's fused kernel)

#if defined(BT) && !defined(BUCKET_THREADS)
#error "moe_bucket needs -DBUCKET_THREADS"
#endif
#ifdef BT
static_assert(BUCKET_THREADS % 32 == 0 && E <= BUCKET_THREADS, "moe_bucket: full warps, one thread per bin");
#endif

// ---------------------------------------------------------------------------------------------
// helpers

#ifdef BT
// moe_route never produces an id outside [0, E); clamping anyway keeps every later index in
// bounds whatever the ids buffer holds (a memory fault would poison the whole CUDA context)
#ifndef SHARED_A
#define SHARED_A 0
#endif
#define ROUTED (SHARED_A ? E - 1 : E)  // routed experts; bin E - 1 is the shared expert when SHARED_A
__device__ __forceinline__ int clamp_expert(int e) { return min(max(e, 0), ROUTED - 1); }

// pair p is a token's shared-expert pair (the last of its SHARED_A + 1; never without SHARED_A)
__device__ __forceinline__ bool is_shared_pair(int p) { return SHARED_A && p % (SHARED_A + 1) == SHARED_A; }

// expert of pair p (see SHARED_A above)
__device__ __forceinline__ int expert_of(const int* __restrict__ ids, int p) {
#if SHARED_A
    const int k = p % (SHARED_A + 1);
    return is_shared_pair(p) ? E - 1 : clamp_expert(ids[(p / (SHARED_A + 1)) * SHARED_A + k]);
#else
    return clamp_expert(ids[p]);
#endif
}
#endif

// ---------------------------------------------------------------------------------------------
// kernels

#ifdef BT
extern "C" __global__ void __launch_bounds__(BUCKET_THREADS)
moe_bucket(const int* __restrict__ ids, int num_pairs, int* __restrict__ expert_off, int* __restrict__ sorted_pair,
           int* __restrict__ pair_pos, int* __restrict__ tile_expert, int* __restrict__ tile_row,
           int* __restrict__ num_tiles, int* __restrict__ stats, int* __restrict__ sync, int sync_words LIVE_PARAM) {
    KDA_PDL_ENTRY();
#ifdef LIVE_PAIRS
    num_pairs = LIVE_NUM_PAIRS(num_pairs);
#endif
    __shared__ int count_sh[E], off_sh[E], fill_sh[E], warp_tot[32];
    for (int i = threadIdx.x; i < sync_words; i += BUCKET_THREADS) sync[i] = 0;  // moe_decode_fused's counters
    bucket_block<BUCKET_THREADS>([&](int p) { return expert_of(ids, p); }, num_pairs, E, BT, ROUTED, expert_off, sorted_pair,
                 pair_pos, tile_expert, tile_row, num_tiles, stats, count_sh, off_sh, fill_sh, warp_tot);
}
#endif

#ifdef BT
extern "C" __global__ void __launch_bounds__(BUCKET_THREADS)
moe_bucket_count(const int* __restrict__ ids, int num_pairs, int chunk, int* __restrict__ counts,
                 int* __restrict__ base LIVE_PARAM) {
    KDA_PDL_ENTRY();
    __shared__ int count_sh[E];
#ifdef LIVE_PAIRS
    num_pairs = LIVE_NUM_PAIRS(num_pairs);
    const int tid = threadIdx.x, p0 = blockIdx.x * chunk, p1 = max(p0, min(num_pairs, p0 + chunk));  // (none: 0 rows)
#else
    const int tid = threadIdx.x, p0 = blockIdx.x * chunk, p1 = min(num_pairs, p0 + chunk);
#endif
    for (int e = tid; e < E; e += BUCKET_THREADS) count_sh[e] = 0;
    __syncthreads();
    for (int p = p0 + tid; p < p1; p += BUCKET_THREADS)
        if (!is_shared_pair(p)) atomicAdd(&count_sh[expert_of(ids, p)], 1);
    __syncthreads();
    for (int e = tid; e < E; e += BUCKET_THREADS) {
        const int c = SHARED_A && e == E - 1 ? (p1 - p0) / (SHARED_A + 1) : count_sh[e];
        base[blockIdx.x * E + e] = c ? atomicAdd(counts + e, c) : 0;
    }
}

extern "C" __global__ void __launch_bounds__(BUCKET_THREADS)
moe_bucket_plan(const int* __restrict__ counts, int* __restrict__ expert_off, int* __restrict__ tile_expert,
                int* __restrict__ tile_row, int* __restrict__ num_tiles, int* __restrict__ stats,
                int* __restrict__ sync, int sync_words) {
    KDA_PDL_ENTRY();
    __shared__ int off_sh[E], warp_tot[32];
    for (int i = threadIdx.x; i < sync_words; i += BUCKET_THREADS) sync[i] = 0;
    plan_from_counts<BUCKET_THREADS>(threadIdx.x < E ? counts[threadIdx.x] : 0, E, BT, ROUTED, expert_off, tile_expert,
                                     tile_row, num_tiles, stats, off_sh, warp_tot);
}

extern "C" __global__ void __launch_bounds__(BUCKET_THREADS)
moe_bucket_scatter(const int* __restrict__ ids, int num_pairs, int chunk, const int* __restrict__ expert_off,
                   const int* __restrict__ base, int* __restrict__ sorted_pair, int* __restrict__ pair_pos LIVE_PARAM) {
    KDA_PDL_ENTRY();
#ifdef LIVE_PAIRS
    num_pairs = LIVE_NUM_PAIRS(num_pairs);
#endif
    __shared__ int start_sh[E], fill_sh[E];
    const int tid = threadIdx.x, p0 = blockIdx.x * chunk, p1 = min(num_pairs, p0 + chunk);
    for (int e = tid; e < E; e += BUCKET_THREADS) {
        start_sh[e] = expert_off[e] + base[blockIdx.x * E + e];
        fill_sh[e] = 0;
    }
    __syncthreads();
    for (int p = p0 + tid; p < p1; p += BUCKET_THREADS) {
        int r;
        if (is_shared_pair(p)) {
            r = start_sh[E - 1] + (p - p0) / (SHARED_A + 1);
        } else {
            const int e = expert_of(ids, p);
            r = start_sh[e] + atomicAdd(&fill_sh[e], 1);
        }
        sorted_pair[r] = p;
        pair_pos[p] = r;
    }
}
#endif

#ifdef THREADS
static_assert(THREADS >= A + 1, "moe_combine: one thread per pair of a token loads its row index");
constexpr int PAIRS = HAS_SHARED == 2 ? A + 1 : A;  // pairs per token in pair_pos

// Token t's sorted-row indices and routing weights into shared memory (the callers sync after).
__device__ __forceinline__ void load_token_pairs(const int* __restrict__ pair_pos, const float* __restrict__ w, int t,
                                                 int* pos_sh, float* w_sh) {
    if (threadIdx.x < PAIRS) pos_sh[threadIdx.x] = pair_pos[t * PAIRS + threadIdx.x];
    if (threadIdx.x < A) w_sh[threadIdx.x] = w[t * A + threadIdx.x];
}

// fp32 combine of 4 columns c .. c + 3 of token t: the shared expert's part plus Σ_k w_k · y[row_k], in k order
__device__ __forceinline__ float4 combine_cols(const bf16* __restrict__ y, const float* __restrict__ shared,
                                               const int* pos_sh, const float* w_sh, int t, int c) {
#if HAS_SHARED == 1
    float4 acc = *reinterpret_cast<const float4*>(shared + (size_t)t * D + c);
#elif HAS_SHARED == 2
    float4 acc = ld_bf16x4(y + (size_t)pos_sh[A] * D + c);
#else
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#endif
    uint2 v[A];  // all row loads (4 bf16 each) in flight before the first FMA
#pragma unroll
    for (int k = 0; k < A; ++k) v[k] = *reinterpret_cast<const uint2*>(y + (size_t)pos_sh[k] * D + c);
#pragma unroll
    for (int k = 0; k < A; ++k) {
        const float wk = w_sh[k];
        const float2 lo = bf16x2_to_float2(v[k].x), hi = bf16x2_to_float2(v[k].y);
        acc.x += wk * lo.x; acc.y += wk * lo.y; acc.z += wk * hi.x; acc.w += wk * hi.y;
    }
    return acc;
}

#if !NORM
extern "C" __global__ void __launch_bounds__(THREADS)
moe_combine(const bf16* __restrict__ y, const int* __restrict__ pair_pos, const float* __restrict__ w,
            const float* __restrict__ shared, bf16* __restrict__ out, int num_tokens LIVE_PARAM) {
    KDA_PDL_ENTRY();
    __shared__ int pos_sh[A + 1];
    __shared__ float w_sh[A];
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
#ifdef LIVE_TOKENS
    if (t >= LIVE_COUNT()) {  // a padding token: no plan rows; zeros (LIVE_PARAM's note)
        const int c = (blockIdx.y * THREADS + threadIdx.x) * 4;
        if (c < D) st_bf16x4(out + (size_t)t * D + c, 0.f, 0.f, 0.f, 0.f);
        return;
    }
#endif
    load_token_pairs(pair_pos, w, t, pos_sh, w_sh);
    __syncthreads();
    const int c = (blockIdx.y * THREADS + threadIdx.x) * 4;
    if (c < D) {
        const float4 acc = combine_cols(y, shared, pos_sh, w_sh, t, c);
        st_bf16x4(out + (size_t)t * D + c, acc.x, acc.y, acc.z, acc.w);
    }
}
#else
// moe_combine_norm — the combine, the residual add and the next RMSNorm of the block in one launch (a
// decode step's MoE layer ends in one kernel instead of two): grid (T), block THREADS >= D / 4, thread i
// owns columns 4i .. 4i + 3 of its token.  Same roundings as moe_combine followed by rmsnorm.cu:
//   delta = bf16(combine)          h = bf16(delta + residual_in)  (into residual: the new residual stream;
//                                  residual_in is residual itself, or the stream that moe_route_fused's
//                                  pre-MoE norm wrote aside while others still read residual)
//   out   = bf16( bf16(h · rsqrt(mean(h²) + eps)) · norm_w )   (mean in fp32; only its summation order
//                                                               differs from rmsnorm.cu's)
static_assert(THREADS * 4 >= D && THREADS % 32 == 0, "moe_combine_norm: one block covers the row, whole warps");
extern "C" __global__ void __launch_bounds__(THREADS)
moe_combine_norm(const bf16* __restrict__ y, const int* __restrict__ pair_pos, const float* __restrict__ w,
                 const float* __restrict__ shared, bf16* residual, const bf16* __restrict__ norm_w,
                 bf16* __restrict__ out, int num_tokens, float eps, const bf16* residual_in LIVE_PARAM) {
    KDA_PDL_ENTRY();
    __shared__ int pos_sh[A + 1];
    __shared__ float w_sh[A];
    __shared__ float scratch[THREADS / 32];
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
#ifdef LIVE_TOKENS
    if (t >= LIVE_COUNT()) {  // a padding token: its normed row zeros, its residual row as it was (LIVE_PARAM's note)
        const int c = threadIdx.x * 4;
        if (c < D) st_bf16x4(out + (size_t)t * D + c, 0.f, 0.f, 0.f, 0.f);
        return;
    }
#endif
    load_token_pairs(pair_pos, w, t, pos_sh, w_sh);
    __syncthreads();
    const int c = threadIdx.x * 4;
    float4 h = make_float4(0.f, 0.f, 0.f, 0.f);
    if (c < D) {
        const float4 acc = combine_cols(y, shared, pos_sh, w_sh, t, c);
        bf16* res = residual + (size_t)t * D + c;
        const float4 r = ld_bf16x4(residual_in + (size_t)t * D + c);  // each element read, then written, by one thread
        h = make_float4(round_bf16(round_bf16(acc.x) + r.x), round_bf16(round_bf16(acc.y) + r.y),
                        round_bf16(round_bf16(acc.z) + r.z), round_bf16(round_bf16(acc.w) + r.w));
        st_bf16x4(res, h.x, h.y, h.z, h.w);
    }
    const float ss = h.x * h.x + h.y * h.y + h.z * h.z + h.w * h.w;
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)D + eps);
    if (c < D) {
        const float4 g = ld_bf16x4(norm_w + c);
        st_bf16x4(out + (size_t)t * D + c, round_bf16(h.x * inv) * g.x, round_bf16(h.y * inv) * g.y,
                  round_bf16(h.z * inv) * g.z, round_bf16(h.w * inv) * g.w);
    }
}
#endif
#endif
