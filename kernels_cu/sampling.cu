// sampling.cu — next-token sampling on the GPU, CLUSTER CTAs per row (sampler/reference.py is the oracle).
//
// Per row b (letters: B rows, V vocabulary, N top logprobs):
//   x_i  = penalised logit:  + the logit_bias of token i (HAS_BIAS), then r = repetition[b] on tokens seen in
//          the prompt or the output (x > 0 ? x / r : x * r), then x -= frequency[b] * count_i + presence[b] * (count_i > 0)
//   logZ = log sum_i exp(x_i)                          (log-softmax of the untempered x, for logprobs)
//   greedy (temperature < 1e-5):  id = argmax x (lowest index on ties)
//   else   z_i = x_i / T,  kept = top-k ∩ min-p ∩ top-p, all thresholds on x:
//          top-k: x_i >= k-th largest x                           (ties at the threshold kept)
//          min-p: exp(z_i - z_max) >= min_p
//          top-p: smallest prefix of the descending order whose mass (over the top-k ∩ min-p set, as
//                 vLLM's v1 sampler, which applies min-p before top-k / top-p) reaches top_p; every
//                 token tied with the last one of that prefix is kept too
//          id = argmax_{kept} (z_i - log E_i),  E_i = -log U_i ~ Exp(1)   (lowest index on ties)
//             = argmax p_i / E_i, which is a draw from p restricted to the kept set (renormalised).
//   U_i: Philox-4x32-10 (Salmon et al., SC'11) with key (seed lo32, seed hi32) and counter
//        (i / 4, step, 0, 0); word i % 4 of the output, top 23 bits: U = ((w >> 9) + 0.5) * 2^-23.
//        So a row's draw depends only on its seed, its step and its logits.
//
// Mask (HAS_MASK; a grammar's, and with the runner's GPU sampling extras also min_tokens / bad_words bans and
// allowed_token_ids): allowed [B, ceil(V / 32)] uint32, bit i % 32 of word i / 32 set when token
// i is allowed; a disallowed token's x is -inf before everything above (as the reference applies it
// after the penalties).  Flags (out_flags [B] int32, optional): 1 when a raw logit of the row is NaN
// or +-inf, 3 when only a penalised one is (a penalty that overflows), 2 when no token is allowed (the
// masked maximum is -inf); the CUDA runner gives flag-1 and flag-3 rows the reference's errors and
// re-samples flag-2 rows on the host, which ends them with an error naming the cause.
//
// Split rows.  One SM streams a 655 KB row (V = 163840) at a small fraction of HBM bandwidth, so a row
// is cut into CLUSTER slices of SLICE tokens, one CTA each, and the CLUSTER CTAs of a row form a
// thread-block cluster (sm_90+).  Each CTA reads its slice once into shared memory (CACHE_X; the
// penalised, masked x) while it accumulates its (max, argmax, max-relative sum exp) partials; every
// later pass reads shared memory.  Cross-CTA steps go through distributed shared memory: a CTA writes
// its partial (stats, a 256-bin histogram, a draw winner) into its own shared memory, all CTAs pass
// a cluster barrier, and then every CTA pulls the CLUSTER partials and merges them in rank order, so
// all CTAs hold the same result and take the same branches.  Histograms are double-buffered (a peer
// may still read pass p's while this CTA fills pass p+1's), and a last barrier keeps each CTA's
// shared memory alive until its peers have read it.  CLUSTER == 1 is one CTA per row (any arch);
// CACHE_X == 0 rereads x from global memory (slices too large for shared memory).
//
// Thresholds come from a radix search on order-preserving keys of the float bits, so the kept set is
// exact (no sorting, no approximation) and does not depend on CLUSTER or THREADS:
//   top-k threshold: the largest key t with #{key_i >= t} >= k
//   top-p threshold: the largest key t with sum_{key_i >= t, key_i >= top-k threshold} m_i >= ceil(p M),
//                    m_i = round(e_i 2^40), e_i = exp(z_i - z_max) (m_i = 0 where e_i < min_p: min-p's
//                    drops weigh nothing), M = sum of the m_i; masses are
//                    integers, so the sums are associative and independent of the split and of timing
//   top-N logprobs: the same search on the 64-bit key (value bits, then inverted index): every key is
//                   distinct, so exactly N tokens are selected, ranked by value and then by lower index
//                   (the reference's stable argsort).
// A plain 8-bit radix on the float bits puts most tokens in two or three top digits (sign and
// exponent), and those shared-memory atomics serialise.  So the search first bins the tokens by their
// distance below the row maximum, q = min(255, floor((zc - x w) 8)) (zc = x_max w; w = 1 for counts,
// 1/T for masses; rounded products, so q is a monotone function of the key and every bin is a
// contiguous key range), picks the bin where the cumulative weight from the top reaches the target,
// and then resolves the exact key with 8-bit digit passes over that bin's tokens only (kept in a
// per-CTA list of at most LIST_CAP; a fuller bin is rescanned from the slice).  Histogram adds are
// aggregated per warp when several lanes hit one bin.
// Work skipped without changing a result: a token with z < z_max - 32 (with a relative margin) has
// m_i = 0 (no exp needed); a token with z < z_max - 20 can never beat the row maximum in the draw
// (log E lies in [-16.64, 2.82]), so no Philox / log is computed for it whenever the maximum is kept.
//
// Grid: (B * CLUSTER), cluster (CLUSTER); CTA rank r of row b owns tokens [r SLICE, min(V, (r+1) SLICE)).
// Block: THREADS.  Passes over the slice: 1 load + stats, then for a sampled row 1 coarse + <= 4 fine
// (top-k), 1 coarse + <= 4 fine (top-p), 1 draw; 1 coarse + 4..8 fine for top-N logprobs.
// Shapes / dtypes: logits [B, V] f32; temperature, top_p, min_p [B] f32; top_k [B] i32 (<= 0 or
// >= V: off); seeds [B] u64; steps [B] i32; counts [R, V] i32 (output tokens); prompt_mask [R, V] u8;
// repetition, presence, frequency [B] f32; pen_rows [B] i32 or null: row b's counts / prompt_mask row (null:
// row b, R = B; the CUDA runner keeps one row a penalised sequence, sampler/penalties.py); bias [R, V] f32 (HAS_BIAS:
// the request's logit_bias, 0 elsewhere, added before the penalties, through the same rows); out_ids [B] i32;
// out_logprobs [B] f32; out_top_ids [B, N] i32; out_top_logprobs [B, N] f32.
// out_flags [B] int32; allowed [B, ceil(V / 32)] uint32.
// Compile-time constants (chosen in sampler/sampling.py): V, THREADS, MIN_BLOCKS, CLUSTER (1..8;
// > 1 needs sm_90+), CACHE_X (0/1: dynamic shared memory of SLICE floats), VEC (0/1: 16-byte row
// loads; V % 4 == 0 and an aligned logits pointer), HAS_PENALTIES, HAS_BIAS (needs HAS_PENALTIES), HAS_MASK,
// WRITE_LOGPROB (0/1),
// NUM_TOP (N, 0..32).
// Measured (H200, ncu) before the split, one 1024-thread CTA per row: 74-76 us for one greedy row of
// V = 163840 (41.5 us in graph replay).  Split kernel (tests/gpu/check_sampling.sh, graph replay,
// 2026-11-30), us per call, before -> now: greedy B=1 41.5 -> 11.0, B=32 42.8 -> 22.3, B=256 118;
// top-p B=1 2132 -> 56, B=32 2145 -> 134, B=256 672; ids identical to the previous kernel (A/B run).
#include "common.cuh"

#ifndef V
#error "sampling.cu needs -DV=<vocabulary size>"
#endif
#ifndef THREADS
#define THREADS 1024
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
#ifndef CLUSTER
#define CLUSTER 1
#endif
#ifndef CACHE_X
#define CACHE_X 0
#endif
#ifndef VEC
#define VEC 0
#endif
#ifndef HAS_BIAS
#define HAS_BIAS 0
#endif
#if HAS_BIAS && !HAS_PENALTIES
#error "sampling.cu: HAS_BIAS reads its rows through the penalties' row map (HAS_PENALTIES = 1)"
#endif
#ifndef HAS_PENALTIES
#define HAS_PENALTIES 0
#endif
#ifndef WRITE_LOGPROB
#define WRITE_LOGPROB 0
#endif
#ifndef HAS_MASK
#define HAS_MASK 0
#endif
#ifndef NUM_TOP
#define NUM_TOP 0
#endif
#if NUM_TOP > 32
#error "NUM_TOP must be at most 32"
#endif
#if CLUSTER > 1 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "sampling.cu: CLUSTER > 1 uses thread-block clusters (sm_90+); use CLUSTER=1 on older GPUs"
#endif
#if VEC && V % 4
#error "sampling.cu: VEC needs V % 4 == 0"
#endif

#define NUM_WARPS (THREADS / 32)
#define SLICE ((((V) + CLUSTER - 1) / CLUSTER + 3) / 4 * 4)  // tokens per CTA, a multiple of 4
#define LIST_CAP 2048                                         // candidate tokens a CTA lists per search
#define LOAD_UNROLL 8                                         // groups of 4 tokens in flight per thread
#define GREEDY_EPS 1e-5f
#define MASS_SCALE 1099511627776.f  // 2^40: a token's mass e in [0, 1] as an integer; V * 2^40 < 2^64
#define COARSE_SCALE 8.f            // coarse bins per unit of (tempered) distance below the maximum
#define MASS_CUT 32.f               // z_max - z beyond this: e < 2e-14, round(e 2^40) = 0
#define DRAW_CUT 20.f               // z_max - z beyond this: z - log E < z_max - 2.82 <= the max's score
#define CUT_REL 1.52587890625e-5f   // 2^-16: relative margin on those cuts for the rounded x / T
#define FULL_MASK 0xffffffffu
static_assert(THREADS % 32 == 0 && THREADS >= 256, "sampling.cu: whole warps, >= 256 threads (one per bin)");
static_assert(CLUSTER >= 1 && CLUSTER <= 8, "sampling.cu: CLUSTER must be 1..8 (portable cluster sizes)");
static_assert(CLUSTER * NUM_TOP <= THREADS, "sampling.cu: one thread per gathered top-N entry");

typedef unsigned long long u64;

// ---------------------------------------------------------------------------------------------
// helpers: keys, penalties, Philox

// Order-preserving map float -> uint32 (larger float, larger key); -0 is folded into +0.
__device__ __forceinline__ unsigned order_key(float x) {
    unsigned u = __float_as_uint(x);
    if (u == 0x80000000u) u = 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(unsigned key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

struct Row {
    const float* logits;          // [V] of this row
#if HAS_PENALTIES
    const int* counts;            // [V]
    const unsigned char* prompt;  // [V]
    float repetition, presence, frequency;
#endif
#if HAS_BIAS
    const float* bias;            // [V]
#endif
#if HAS_MASK
    const unsigned* allowed;      // [ceil(V / 32)]
#endif
    const float* xs;              // [SLICE] shared: this CTA's penalised x (CACHE_X)
    int start, n;                 // first token of this CTA's slice, tokens in it
    float temperature, z_max, min_p;
};

// Penalised logit of token i from its raw logit, rounded as the float32 NumPy reference rounds (no FMA
// contraction).
__device__ __forceinline__ float penalties_only(const Row& row, int i, float x) {
#if HAS_BIAS  // before the penalties, as vLLM and the reference
    // (0 off the request's logit_bias ids: left as it is, as the reference leaves it; a listed bias of 0 leaves a
    // -0.0 logit -0.0 here where the reference's add makes it +0.0: the same value for every pick and logprob)
    const float bias = row.bias[i];
    if (bias != 0.f) x = __fadd_rn(x, bias);
#endif
#if HAS_PENALTIES
    const int c = row.counts[i];
    if (c > 0 || row.prompt[i]) x = x > 0.f ? __fdiv_rn(x, row.repetition) : __fmul_rn(x, row.repetition);
    const float sub = __fadd_rn(__fmul_rn(row.frequency, (float)c), c > 0 ? row.presence : 0.f);
    x = __fsub_rn(x, sub);
#endif
    return x;
}

__device__ __forceinline__ float mask_only(const Row& row, int i, float x) {
#if HAS_MASK
    if (!((row.allowed[i >> 5] >> (i & 31)) & 1u)) x = neg_inf();
#endif
    return x;
}

// Penalised and masked logit of token i from its raw logit.
__device__ __forceinline__ float penalise(const Row& row, int i, float x) {
    return mask_only(row, i, penalties_only(row, i, x));
}

__device__ __forceinline__ float load_logit(const Row& row, int i) { return penalise(row, i, row.logits[i]); }

// x of local token j (0 <= j < row.n)
__device__ __forceinline__ float local_x(const Row& row, int j) {
#if CACHE_X
    return row.xs[j];
#else
    return load_logit(row, row.start + j);
#endif
}

// x of local tokens 4q .. 4q+3; -inf past the slice (callers also test 4q + c < row.n)
__device__ __forceinline__ void local_group(const Row& row, int q, float (&x)[4]) {
#if CACHE_X
    const float4 v = reinterpret_cast<const float4*>(row.xs)[q];
    x[0] = v.x; x[1] = v.y; x[2] = v.z; x[3] = v.w;
#else
#pragma unroll
    for (int c = 0; c < 4; ++c) x[c] = 4 * q + c < row.n ? local_x(row, 4 * q + c) : neg_inf();
#endif
}

// Philox-4x32-10 from its published definition: 10 rounds of two 32x32->64 multiplies, key bumped
// by the Weyl constants between rounds.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, unsigned k0, unsigned k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        const unsigned lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
        const unsigned lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

// log E with E = -log U ~ Exp(1).  U = ((w >> 9) + 0.5) * 2^-23 is exact in float32 and lies in
// [2^-24, 1 - 2^-24], never 0 or 1 (24 bits would need 25 for the +0.5 and could round to 1); so
// log E lies in [-16.64, 2.82].
__device__ __forceinline__ float log_exp_noise(unsigned w) {
    const float u = ((float)(w >> 9) + 0.5f) * 1.1920928955078125e-7f;  // 2^-23
    return logf(-logf(u));
}

// top-p mass of a token as an integer: round(e 2^40), e = exp(x / T - z_max); 0 where min-p drops the token
// (e < min_p, the draw's test to the bit: top-p's masses are over what min-p keeps)
__device__ __forceinline__ u64 token_mass(const Row& row, float x) {
    const float e = expf(__fdiv_rn(x, row.temperature) - row.z_max);
    return e < row.min_p ? 0ull : (u64)__float2ull_rn(e * MASS_SCALE);
}

// Coarse search digit: 255 - min(255, floor((zc - x w) COARSE_SCALE)), non-decreasing in the key of x
// (explicitly rounded products: the same x gives the same digit in every pass).
__device__ __forceinline__ int coarse_digit(float x, float zc, float w) {
    const float d = __fmul_rn(__fsub_rn(zc, __fmul_rn(x, w)), COARSE_SCALE);
    return 255 - (int)fminf(fmaxf(d, 0.f), 255.f);
}

// ---------------------------------------------------------------------------------------------
// thread-block cluster helpers (common.cuh's, sm_90 PTX); with CLUSTER == 1 they are CTA-local

#if CLUSTER > 1
__device__ __forceinline__ unsigned cta_rank() { return cluster_rank(); }
// every thread of every CTA of the cluster calls it (uniform control flow)
__device__ __forceinline__ void cluster_sync() {
    cluster_arrive();
    cluster_wait();
}
// the shared variable `p` of the CTA of cluster rank `rank` (peer_addr: common.cuh)
__device__ __forceinline__ u64 ld_peer(const u64* p, unsigned rank) {
    u64 v;
    asm volatile("ld.shared::cluster.u64 %0, [%1];" : "=l"(v) : "r"(peer_addr(p, rank)) : "memory");
    return v;
}
__device__ __forceinline__ float ld_peer(const float* p, unsigned rank) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(peer_addr(p, rank)) : "memory");
    return v;
}
__device__ __forceinline__ int ld_peer(const int* p, unsigned rank) {
    int v;
    asm volatile("ld.shared::cluster.s32 %0, [%1];" : "=r"(v) : "r"(peer_addr(p, rank)) : "memory");
    return v;
}
#else
__device__ __forceinline__ unsigned cta_rank() { return 0u; }
__device__ __forceinline__ void cluster_sync() { __syncthreads(); }
template <class T>
__device__ __forceinline__ T ld_peer(const T* p, unsigned) { return *p; }
#endif

// ---------------------------------------------------------------------------------------------
// reductions: argmax with lowest-index ties, and an online (max, sum exp) merge

__device__ __forceinline__ void argmax_merge(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
}

__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
    const float mm = fmaxf(m, m2);
    if (mm == neg_inf()) return;  // both empty
    s = s * expf(m - mm) + s2 * expf(m2 - mm);
    m = mm;
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_merge(v, i, __shfl_xor_sync(FULL_MASK, v, o), __shfl_xor_sync(FULL_MASK, i, o));
}

__device__ __forceinline__ void warp_lse(float& m, float& s) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        lse_merge(m, s, __shfl_xor_sync(FULL_MASK, m, o), __shfl_xor_sync(FULL_MASK, s, o));
}

__device__ __forceinline__ u64 warp_sum_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// ---------------------------------------------------------------------------------------------
// shared state

struct SearchState {
    u64 prefix, above, bin, target;  // digits found so far; weight above them; weight in the chosen bin
    int digit;                       // the digit picked last
};

struct Partial {  // one CTA's contribution, read by its peers after a cluster barrier
    float best, m, s;
    int best_i, bad;
};

struct Shared {
    u64 hist[2][256];  // this CTA's histogram, double-buffered: peers read pass p while it fills p + 1
    u64 total[256];    // the cluster's histogram of the current pass
    SearchState search;
    Partial stats, draw;
    float x_max, log_z;
    int arg_max, bad, pick, list_count;
    int list[LIST_CAP];  // local indices of the chosen coarse bin's tokens
#if NUM_TOP > 0
    u64 top[NUM_TOP], top_all[CLUSTER * NUM_TOP];
    int top_count;
#endif
};

// ---------------------------------------------------------------------------------------------
// radix threshold search

// h[d] += w for the lanes with `on`; lanes sharing the first active lane's digit add once, as a warp
// sum (the top digits of a row are crowded: this keeps their shared-memory atomics from serialising).
// Counts (w = 1, < 2^32 per CTA) add to the low word of the bin with a 32-bit atomic; sm_90 has no
// native 64-bit shared atomic add (it is a compare-and-swap loop), which masses need.  Every lane of
// the warp calls it.
template <bool MASS>
__device__ __forceinline__ void hist_add(u64* h, bool on, int d, u64 w) {
    const unsigned act = __ballot_sync(FULL_MASK, on);
    if (!act) return;
    const int d0 = __shfl_sync(FULL_MASK, d, __ffs(act) - 1);
    const bool same = on && d == d0;
    const unsigned grp = __ballot_sync(FULL_MASK, same);
    const bool lead = (threadIdx.x & 31) == __ffs(act) - 1;  // an active lane of the group
    if (MASS) {
        if (__popc(grp) > 2) {
            const u64 sum = warp_sum_u64(same ? w : 0ull);
            if (lead) atomicAdd(&h[d0], sum);
            if (on && !same) atomicAdd(&h[d], w);
        } else if (on) {
            atomicAdd(&h[d], w);
        }
    } else {  // little-endian: the low word of bin d is word 2d
        unsigned* h32 = reinterpret_cast<unsigned*>(h);
        if (lead) atomicAdd(&h32[2 * d0], (unsigned)__popc(grp));
        if (on && !same) atomicAdd(&h32[2 * d], 1u);
    }
}

// Warp 0: the highest digit d whose cumulative weight (from the top, plus `above`) reaches target.
// With frac >= 0 the target is first set to max(1, ceil(frac * total weight of this histogram)).
// shift >= 0: the digit is appended to the prefix at that shift (fine passes); < 0: coarse pass.
__device__ void pick_digit(const u64* h, SearchState& s, int shift, float frac) {
    const int lane = threadIdx.x & 31;
    u64 w[8], lane_sum = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) { w[j] = h[255 - 8 * lane - j]; lane_sum += w[j]; }
    u64 incl = lane_sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 t = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += t;
    }
    u64 target = s.target;
    if (frac >= 0.f) {
        const u64 total = __shfl_sync(FULL_MASK, incl, 31);
        target = (u64)ceil((double)frac * (double)total);
        if (target < 1) target = 1;
    }
    const u64 above = s.above;
    unsigned ball = __ballot_sync(FULL_MASK, above + incl >= target);
    if (!ball) ball = 0x80000000u;  // unreachable while the invariants hold; keeps the search in range
    if (lane == __ffs(ball) - 1) {
        u64 cum = above + incl - lane_sum, bin = w[7];
        int j = 7;
        bool found = false;
#pragma unroll
        for (int k = 0; k < 7; ++k) {  // first k reaching the target (else 7); no dynamic index into w
            if (!found && cum + w[k] >= target) { found = true; j = k; bin = w[k]; }
            if (!found) cum += w[k];
        }
        const int digit = 255 - 8 * lane - j;
        if (shift >= 0) s.prefix |= (u64)digit << shift;
        s.digit = digit;
        s.above = cum;
        s.bin = bin;
        s.target = target;
    }
}

// The cluster's histogram of this pass (this CTA's is sh.hist[buf]), then the digit pick.
__device__ void cluster_pick(Shared& sh, int buf, int shift, float frac) {
    cluster_sync();  // every CTA's sh.hist[buf] is complete
    for (int d = threadIdx.x; d < 256; d += THREADS) {
        u64 t = 0;
#pragma unroll
        for (int r = 0; r < CLUSTER; ++r) t += ld_peer(&sh.hist[buf][d], (unsigned)r);
        sh.total[d] = t;
    }
    __syncthreads();
    if (threadIdx.x < 32) pick_digit(sh.total, sh.search, shift, frac);
    __syncthreads();
}

// Largest t such that the weight of {c_i >= t : key_i >= min_key} reaches the target, over
// c_i = key_i << 32 | ~i.  MASS weights are token_mass (target from frac of the total), else 1.
// The coarse pass picks the distance bin (zc, w: see coarse_digit) holding the threshold; fine passes
// 0-3 resolve the value bits over that bin's tokens; with `exact`, passes 4-7 resolve index bits only
// if the value threshold is tied (then exactly `target` tokens have c_i >= t).  `hp` counts the
// histogram passes (cluster-uniform) to alternate the buffers.
template <bool MASS>
__device__ u64 radix_search(const Row& row, Shared& sh, int& hp, unsigned min_key, u64 target, float frac,
                            bool exact, float zc, float w) {
    const int tid = threadIdx.x, lane = tid & 31;
    if (tid == 0) {
        sh.search.prefix = 0; sh.search.above = 0; sh.search.bin = 0; sh.search.target = target;
        sh.list_count = 0;
    }
    const int num_groups = (row.n + 3) >> 2;

    // coarse pass: weight per distance bin
    u64* h = sh.hist[hp & 1];
    for (int d = tid; d < 256; d += THREADS) h[d] = 0;
    __syncthreads();
    const bool cut = MASS && isfinite(zc);
    const float mass_floor = zc - MASS_CUT - fabsf(zc) * CUT_REL;
    for (int q0 = 0; q0 < num_groups; q0 += THREADS) {  // same trip count in every thread (warp votes)
        const int q = q0 + tid;
        float x[4];
        if (q < num_groups) local_group(row, q, x);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            bool on = q < num_groups && 4 * q + c < row.n && order_key(x[c]) >= min_key;
            u64 weight = 1;
            if (MASS) {
                weight = on && !(cut && __fmul_rn(x[c], w) < mass_floor) ? token_mass(row, x[c]) : 0ull;
                on = weight != 0;
            }
            hist_add<MASS>(h, on, on ? coarse_digit(x[c], zc, w) : 0, weight);
        }
    }
    cluster_pick(sh, hp & 1, -1, frac);
    ++hp;
    const int bin = sh.search.digit;

    // list this CTA's tokens of the chosen bin
    for (int j0 = 0; j0 < row.n; j0 += THREADS) {
        const int j = j0 + tid;
        bool take = false;
        if (j < row.n) {
            const float x = local_x(row, j);
            take = order_key(x) >= min_key && coarse_digit(x, zc, w) == bin;
        }
        const unsigned ball = __ballot_sync(FULL_MASK, take);
        int base = 0;
        if (lane == 0 && ball) base = atomicAdd(&sh.list_count, __popc(ball));
        base = __shfl_sync(FULL_MASK, base, 0);
        const int pos = base + __popc(ball & ((1u << lane) - 1u));
        if (take && pos < LIST_CAP) sh.list[pos] = j;
    }
    __syncthreads();
    const bool use_list = sh.list_count <= LIST_CAP;  // else rescan the slice (a crowded bin)
    const int items = use_list ? sh.list_count : row.n;

    for (int pass = 0; pass < 8; ++pass) {
        if (pass == 4 && (!exact || sh.search.above + sh.search.bin == sh.search.target)) break;
        const int shift = 56 - 8 * pass;
        const u64 prefix = sh.search.prefix, high = pass ? ~0ull << (shift + 8) : 0ull;
        h = sh.hist[hp & 1];
        for (int d = tid; d < 256; d += THREADS) h[d] = 0;
        __syncthreads();
        for (int e0 = 0; e0 < items; e0 += THREADS) {
            const int e = e0 + tid;
            bool on = false;
            int digit = 0;
            u64 weight = 1;
            if (e < items) {
                const int j = use_list ? sh.list[e] : e;
                const float x = local_x(row, j);
                const unsigned key = order_key(x);
                const u64 c = ((u64)key << 32) | (u64)(0xffffffffu - (unsigned)(row.start + j));
                on = (use_list || (key >= min_key && coarse_digit(x, zc, w) == bin)) && (c & high) == prefix;
                digit = (int)((c >> shift) & 255);
                if (MASS && on) {
                    weight = token_mass(row, x);
                    on = weight != 0;
                }
            }
            hist_add<MASS>(h, on, digit, weight);
        }
        cluster_pick(sh, hp & 1, shift, -1.f);
        ++hp;
    }
    const u64 t = sh.search.prefix;
    __syncthreads();  // everyone has read sh.search before the next search resets it
    return t;
}

// ---------------------------------------------------------------------------------------------
// CTA -> cluster merges (all threads call them; every CTA gets the same result)

// block argmax of (v, i), then the cluster's over sh.draw of each CTA; returns the index
__device__ int cluster_argmax(Shared& sh, float v, int i, float* red_v, int* red_i) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    warp_argmax(v, i);
    if (lane == 0) { red_v[warp] = v; red_i[warp] = i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < NUM_WARPS; ++k) argmax_merge(v, i, red_v[k], red_i[k]);
        sh.draw.best = v;
        sh.draw.best_i = i;
    }
    cluster_sync();
    if (warp == 0) {
        float cv = neg_inf();
        int ci = 0x7fffffff;
        if (lane < CLUSTER) { cv = ld_peer(&sh.draw.best, (unsigned)lane); ci = ld_peer(&sh.draw.best_i, (unsigned)lane); }
        warp_argmax(cv, ci);
        if (lane == 0) sh.pick = ci;
    }
    __syncthreads();
    return sh.pick;
}

// ---------------------------------------------------------------------------------------------
// kernels

extern "C" __global__ void
#if CLUSTER > 1
__cluster_dims__(CLUSTER, 1, 1)
#endif
__launch_bounds__(THREADS, MIN_BLOCKS)
sample_rows(const float* __restrict__ logits, const float* __restrict__ temperature, const int* __restrict__ top_k,
            const float* __restrict__ top_p, const float* __restrict__ min_p,
            const unsigned long long* __restrict__ seeds, const int* __restrict__ steps,
            const int* __restrict__ counts, const unsigned char* __restrict__ prompt_mask,
            const float* __restrict__ repetition, const float* __restrict__ presence,
            const float* __restrict__ frequency, const int* __restrict__ pen_rows, const float* __restrict__ bias,
            int* __restrict__ out_ids,
            float* __restrict__ out_logprobs,
            int* __restrict__ out_top_ids, float* __restrict__ out_top_logprobs, const unsigned* __restrict__ allowed,
            int* __restrict__ out_flags, int num_rows) {
    KDA_PDL_ENTRY();
    extern __shared__ float4 xs_dyn[];  // [SLICE / 4] with CACHE_X
    __shared__ Shared sh;
    __shared__ float red_v[NUM_WARPS], red_s[NUM_WARPS];
    __shared__ int red_i[NUM_WARPS];
    const int b = blockIdx.x / CLUSTER;
    if (b >= num_rows) return;  // whole clusters (the grid is B * CLUSTER)
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const unsigned rank = cta_rank();
    const size_t base = (size_t)b * V;
    Row row;
    row.logits = logits + base;
#if HAS_PENALTIES
    const size_t pbase = pen_rows != nullptr ? (size_t)pen_rows[b] * V : base;
    row.counts = counts + pbase;
    row.prompt = prompt_mask + pbase;
    row.repetition = repetition[b];
    row.presence = presence[b];
    row.frequency = frequency[b];
#endif
#if HAS_BIAS
    row.bias = bias + pbase;
#endif
#if HAS_MASK
    row.allowed = allowed + (size_t)b * ((V + 31) / 32);
#endif
    row.xs = reinterpret_cast<const float*>(xs_dyn);
    row.start = (int)rank * SLICE;
    row.n = min(max(V - row.start, 0), SLICE);
    row.temperature = temperature[b];
    row.z_max = 0.f;
    row.min_p = min_p[b];
    const int num_groups = (row.n + 3) >> 2;

    // pass 1: read the slice (into shared memory), max / argmax and max-relative sum exp of the penalised
    // logits, and whether a raw logit is not finite.  Each thread walks its tokens in increasing order.
    float best = neg_inf(), m = neg_inf(), s = 0.f;
    int best_i = 0x7fffffff, bad = 0;
#if HAS_PENALTIES
    int bad_pen = 0;
#endif
    for (int q0 = 0; q0 < num_groups; q0 += LOAD_UNROLL * THREADS) {
        float4 raw[LOAD_UNROLL];
#pragma unroll
        for (int u = 0; u < LOAD_UNROLL; ++u) {
            const int q = q0 + u * THREADS + tid;
            if (q < num_groups) {
#if VEC
                raw[u] = __ldg(reinterpret_cast<const float4*>(row.logits + row.start) + q);
#else
                const int j = row.start + 4 * q;
                raw[u].x = row.logits[j];
                raw[u].y = 4 * q + 1 < row.n ? row.logits[j + 1] : 0.f;
                raw[u].z = 4 * q + 2 < row.n ? row.logits[j + 2] : 0.f;
                raw[u].w = 4 * q + 3 < row.n ? row.logits[j + 3] : 0.f;
#endif
            }
        }
#pragma unroll
        for (int u = 0; u < LOAD_UNROLL; ++u) {
            const int q = q0 + u * THREADS + tid;
            if (q >= num_groups) break;
            const float r4[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
            [[maybe_unused]] float x4[4];  // stored with CACHE_X
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                x4[c] = neg_inf();
                if (4 * q + c >= row.n) continue;
                const int i = row.start + 4 * q + c;
                bad |= !isfinite(r4[c]);
#if HAS_PENALTIES
                // (a penalty that overflows is flagged too, apart: the reference reports it as its own error)
                const float xp = penalties_only(row, i, r4[c]);
                bad_pen |= !isfinite(xp);
                const float x = mask_only(row, i, xp);
#else
                const float x = penalise(row, i, r4[c]);
#endif
                x4[c] = x;
                if (x > best || best_i == 0x7fffffff) { best = x; best_i = i; }  // i grows: the first max wins
                if (x == neg_inf()) continue;
                if (x > m) { s = s * expf(m - x) + 1.f; m = x; } else { s += expf(x - m); }
            }
#if CACHE_X
            xs_dyn[q] = make_float4(x4[0], x4[1], x4[2], x4[3]);
#endif
        }
    }
#if HAS_PENALTIES
    bad = __syncthreads_or(bad) ? 1 : __syncthreads_or(bad_pen) ? 2 : 0;  // (1 raw, 2 penalised only; uniform)
#else
    bad = __syncthreads_or(bad);
#endif
    warp_argmax(best, best_i);
    warp_lse(m, s);
    if (lane == 0) { red_v[warp] = best; red_i[warp] = best_i; }
    __syncthreads();
    if (tid == 0) {
        for (int k = 1; k < NUM_WARPS; ++k) argmax_merge(best, best_i, red_v[k], red_i[k]);
        sh.stats.best = best;
        sh.stats.best_i = best_i;
        sh.stats.bad = bad;
    }
    __syncthreads();
    if (lane == 0) { red_v[warp] = m; red_s[warp] = s; }
    __syncthreads();
    if (tid == 0) {
        for (int k = 1; k < NUM_WARPS; ++k) lse_merge(m, s, red_v[k], red_s[k]);
        sh.stats.m = m;
        sh.stats.s = s;
    }
    cluster_sync();  // every CTA's sh.stats (and its shared x) is complete
    if (warp == 0) {
        float v = neg_inf(), cm = neg_inf(), cs = 0.f;
        int vi = 0x7fffffff, cb = 0;
        if (lane < CLUSTER) {
            const unsigned r = (unsigned)lane;
            v = ld_peer(&sh.stats.best, r); vi = ld_peer(&sh.stats.best_i, r);
            cm = ld_peer(&sh.stats.m, r); cs = ld_peer(&sh.stats.s, r); cb = ld_peer(&sh.stats.bad, r);
        }
        warp_argmax(v, vi);
        warp_lse(cm, cs);
        cb = __reduce_or_sync(FULL_MASK, (unsigned)cb);
        cb = (cb & 1) ? 1 : cb;  // (a raw non-finite logit anywhere in the row comes first)
        if (lane == 0) { sh.x_max = v; sh.arg_max = vi; sh.log_z = cm + logf(cs); sh.bad = cb; }
    }
    __syncthreads();
    const float x_max = sh.x_max, log_z = sh.log_z;
    (void)log_z;  // read by the logprob outputs only
    int id = sh.arg_max;
    int hp = 0;  // histogram passes so far

    if (!(row.temperature < GREEDY_EPS)) {
        row.z_max = __fdiv_rn(x_max, row.temperature);  // division by T > 0 is monotone: max(x / T)
        const float inv_t = __frcp_rn(row.temperature), zc = __fmul_rn(x_max, inv_t);
        const int k = top_k[b];
        const float p = top_p[b], mp = row.min_p;
        unsigned thr = 0;
        if (k > 0 && k < V) thr = (unsigned)(radix_search<false>(row, sh, hp, 0u, (u64)k, -1.f, false, x_max, 1.f) >> 32);
        if (p < 1.f) thr = (unsigned)(radix_search<true>(row, sh, hp, thr, 0, p, false, zc, inv_t) >> 32);

        // draw: argmax over kept tokens of z - log E (Gumbel form of argmax p / E).  While the maximum
        // is kept (always, unless min_p > 1) tokens far below it cannot win and get no noise.
        const unsigned long long seed = seeds[b];
        const unsigned k0 = (unsigned)seed, k1 = (unsigned)(seed >> 32), step = (unsigned)steps[b];
        const bool prune = isfinite(zc) && !(1.f < mp);
        const float draw_floor = zc - DRAW_CUT - fabsf(zc) * CUT_REL;
        float score = neg_inf();
        int pick = 0x7fffffff;
        for (int q = tid; q < num_groups; q += THREADS) {
            float x[4];
            local_group(row, q, x);
            bool keep[4], any = false;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                keep[c] = 4 * q + c < row.n && order_key(x[c]) >= thr && !(prune && __fmul_rn(x[c], inv_t) < draw_floor);
                any |= keep[c];
            }
            if (!any) continue;
            const uint4 r = philox4x32_10(make_uint4((unsigned)((row.start >> 2) + q), step, 0u, 0u), k0, k1);
            const unsigned words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                if (!keep[c]) continue;
                const float z = __fdiv_rn(x[c], row.temperature);
                if (expf(z - row.z_max) < mp) continue;
                const float sc = z - log_exp_noise(words[c]);
                if (sc > score) { score = sc; pick = row.start + 4 * q + c; }
            }
        }
        pick = cluster_argmax(sh, score, pick, red_v, red_i);
        if (pick < V) id = pick;  // else every kept score was -inf: fall back to the argmax
    }

#if NUM_TOP > 0
    // top-N of the untempered penalised logits: exactly NUM_TOP tokens have a 64-bit key >= t
    const u64 t = radix_search<false>(row, sh, hp, 0u, (u64)NUM_TOP, -1.f, true, x_max, 1.f);
    if (tid == 0) sh.top_count = 0;
    __syncthreads();
    for (int q = tid; q < num_groups; q += THREADS) {
        float x[4];
        local_group(row, q, x);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int j = 4 * q + c;
            if (j >= row.n) continue;
            const u64 key = ((u64)order_key(x[c]) << 32) | (u64)(0xffffffffu - (unsigned)(row.start + j));
            if (key >= t) {
                const int slot = atomicAdd(&sh.top_count, 1);
                if (slot < NUM_TOP) sh.top[slot] = key;
            }
        }
    }
    cluster_sync();  // every CTA's selected keys are listed
    if (rank == 0) {
        for (int e = tid; e < CLUSTER * NUM_TOP; e += THREADS) {
            const unsigned r = (unsigned)(e / NUM_TOP);
            const int slot = e % NUM_TOP;
            sh.top_all[e] = slot < ld_peer(&sh.top_count, r) ? ld_peer(&sh.top[slot], r) : 0ull;  // 0: empty
        }
        __syncthreads();
        if (tid < CLUSTER * NUM_TOP && sh.top_all[tid] != 0ull) {
            const u64 c = sh.top_all[tid];
            int rk = 0;
            for (int e = 0; e < CLUSTER * NUM_TOP; ++e) rk += sh.top_all[e] > c;
            if (rk < NUM_TOP) {
                out_top_ids[(size_t)b * NUM_TOP + rk] = (int)(0xffffffffu - (unsigned)c);
                out_top_logprobs[(size_t)b * NUM_TOP + rk] = key_value((unsigned)(c >> 32)) - log_z;
            }
        }
    }
#endif

    if (rank == 0 && tid == 0) {
        out_ids[b] = id;
        if (out_flags != nullptr) out_flags[b] = sh.bad == 1 ? 1 : sh.bad ? 3 : x_max == neg_inf() ? 2 : 0;
#if WRITE_LOGPROB
        out_logprobs[b] = load_logit(row, id) - log_z;
#endif
    }
#if CLUSTER > 1
    cluster_sync();  // no CTA leaves while a peer may still read its shared memory
#endif
}

// counts[r, ids[b]] += 1 after each step, r = rows[b] (rows null: r = b); rows with r < 0 or an id outside [0, V) are
// left alone.
extern "C" __global__ void update_counts(int* __restrict__ counts, const int* __restrict__ ids,
                                         const int* __restrict__ rows, int num_rows) {
    KDA_PDL_ENTRY();
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= num_rows) return;
    const int id = ids[b], r = rows != nullptr ? rows[b] : b;
    if (r >= 0 && id >= 0 && id < V) counts[(size_t)r * V + id] += 1;
}

// prompt_mask[row, ids[j]] = 1 for j < num_ids (ids outside [0, V) are skipped).
extern "C" __global__ void mark_prompt_tokens(unsigned char* __restrict__ prompt_mask, const int* __restrict__ ids,
                                              int row, int num_ids) {
    KDA_PDL_ENTRY();
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= num_ids) return;
    const int id = ids[j];
    if (id >= 0 && id < V) prompt_mask[(size_t)row * V + id] = 1;
}
