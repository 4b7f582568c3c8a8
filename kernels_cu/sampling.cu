// sampling.cu — next-token sampling on the GPU, one CTA per row (sampler/reference.py is the oracle).
//
// Per row b (letters: B rows, V vocabulary, N top logprobs):
//   x_i  = penalised logit:  r = repetition[b] on tokens seen in the prompt or the output
//          (x > 0 ? x / r : x * r), then x -= frequency[b] * count_i + presence[b] * (count_i > 0)
//   logZ = log sum_i exp(x_i)                          (log-softmax of the untempered x, for logprobs)
//   greedy (temperature < 1e-5):  id = argmax x (lowest index on ties)
//   else   z_i = x_i / T,  kept = top-k ∩ top-p ∩ min-p, all thresholds on x:
//          top-k: x_i >= k-th largest x                           (ties at the threshold kept)
//          top-p: smallest prefix of the descending order whose mass (over the top-k set) reaches
//                 top_p; every token tied with the last one of that prefix is kept too
//          min-p: exp(z_i - z_max) >= min_p
//          id = argmax_{kept} (z_i - log E_i),  E_i = -log U_i ~ Exp(1)
//             = argmax p_i / E_i, which is a draw from p restricted to the kept set (renormalised).
//   U_i: Philox-4x32-10 (Salmon et al., SC'11) with key (seed lo32, seed hi32) and counter
//        (i / 4, step, 0, 0); word i % 4 of the output, top 23 bits: U = ((w >> 9) + 0.5) * 2^-23.
//        So a row's draw depends only on its seed, its step and its logits.
//
// Grammar mask (HAS_MASK): allowed [B, ceil(V / 32)] uint32, bit i % 32 of word i / 32 set when token
// i is allowed; a disallowed token's x is -inf before everything above (as the reference applies it
// after the penalties).  Flags (out_flags [B] int32, optional): 1 when a raw logit of the row is NaN
// or +-inf, 2 when no token is allowed (the masked maximum is -inf); the caller re-samples flagged
// rows on the host, which ends them with an error naming the cause.
//
// Thresholds come from a radix search on order-preserving keys of the float bits: 8 bits per pass,
// a 256-bin shared histogram (token counts for top-k, fixed-point probability mass for top-p), so the
// kept set is exact (no sorting, no approximation).  Masses are integers (e * 2^40), so the atomics
// are associative and the result does not depend on thread timing.  Top-N logprobs use the same
// search on a 64-bit key (value bits, then inverted index): every key is distinct, so exactly N
// tokens are selected, ranked by value and then by lower index (the reference's stable argsort).
//
// Grid: (B).  Block: THREADS.  Each pass reads the row (from L2 after the first), up to
// 1 stats + 4 top-k + 4 top-p + 1 draw + 4..8 top-N passes.
// Shapes / dtypes: logits [B, V] f32; temperature, top_p, min_p [B] f32; top_k [B] i32 (<= 0 or
// >= V: off); seeds [B] u64; steps [B] i32; counts [B, V] i32 (output tokens); prompt_mask [B, V] u8;
// repetition, presence, frequency [B] f32; out_ids [B] i32; out_logprobs [B] f32;
// out_top_ids [B, N] i32; out_top_logprobs [B, N] f32.
// out_flags [B] int32; allowed [B, ceil(V / 32)] uint32.
// Compile-time constants: V, THREADS, HAS_PENALTIES (0/1), HAS_MASK (0/1), WRITE_LOGPROB (0/1),
// NUM_TOP (N, 0..32).
#include "common.cuh"

#ifndef V
#error "sampling.cu needs -DV=<vocabulary size>"
#endif
#ifndef THREADS
#define THREADS 1024
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

#define NUM_WARPS (THREADS / 32)
#define NUM_GROUPS ((V + 3) / 4)
#define GREEDY_EPS 1e-5f
#define MASS_SCALE 1099511627776.f  // 2^40: a token's mass e in [0, 1] as an integer; V * 2^40 < 2^64

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
#if HAS_MASK
    const unsigned* allowed;      // [ceil(V / 32)]
#endif
    float temperature, z_max;
};

// Penalised logit of token i, rounded as the float32 NumPy reference rounds (no FMA contraction).
__device__ __forceinline__ float load_logit(const Row& row, int i) {
    float x = row.logits[i];
#if HAS_PENALTIES
    const int c = row.counts[i];
    if (c > 0 || row.prompt[i]) x = x > 0.f ? __fdiv_rn(x, row.repetition) : __fmul_rn(x, row.repetition);
    const float sub = __fadd_rn(__fmul_rn(row.frequency, (float)c), c > 0 ? row.presence : 0.f);
    x = __fsub_rn(x, sub);
#endif
#if HAS_MASK
    if (!((row.allowed[i >> 5] >> (i & 31)) & 1u)) x = neg_inf();
#endif
    return x;
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
// [2^-24, 1 - 2^-24], never 0 or 1 (24 bits would need 25 for the +0.5 and could round to 1).
__device__ __forceinline__ float log_exp_noise(unsigned w) {
    const float u = ((float)(w >> 9) + 0.5f) * 1.1920928955078125e-7f;  // 2^-23
    return logf(-logf(u));
}

// ---------------------------------------------------------------------------------------------
// block reductions: argmax with lowest-index ties, and an online (max, sum exp) merge

__device__ __forceinline__ void argmax_merge(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
}

__device__ __forceinline__ void block_argmax(float& v, int& i, float* sv, int* si) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_merge(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    v = sv[0]; i = si[0];
    for (int w = 1; w < NUM_WARPS; ++w) argmax_merge(v, i, sv[w], si[w]);
    __syncthreads();
}

__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
    const float mm = fmaxf(m, m2);
    if (mm == neg_inf()) return;  // both empty
    s = s * expf(m - mm) + s2 * expf(m2 - mm);
    m = mm;
}

__device__ __forceinline__ float block_logsumexp(float m, float s, float* sm, float* ss) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        lse_merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sm[warp] = m; ss[warp] = s; }
    __syncthreads();
    m = sm[0]; s = ss[0];
    for (int w = 1; w < NUM_WARPS; ++w) lse_merge(m, s, sm[w], ss[w]);
    __syncthreads();
    return m + logf(s);
}

// ---------------------------------------------------------------------------------------------
// radix threshold search

struct Search {
    u64 hist[256];
    u64 prefix, above, bin, target;  // digits found so far; weight above them; weight in the chosen bin
};

// Warp 0: the highest digit d whose cumulative weight (from the top, plus `above`) reaches target.
// With frac >= 0 the target is first set to ceil(frac * total weight of this histogram).
__device__ void pick_digit(Search& s, int shift, float frac) {
    const int lane = threadIdx.x & 31;
    u64 w[8], lane_sum = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) { w[j] = s.hist[255 - 8 * lane - j]; lane_sum += w[j]; }
    u64 incl = lane_sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
    }
    u64 target = s.target;
    if (frac >= 0.f) {
        const u64 total = __shfl_sync(0xffffffffu, incl, 31);
        target = (u64)ceil((double)frac * (double)total);
        if (target < 1) target = 1;
    }
    const u64 above = s.above;
    unsigned ball = __ballot_sync(0xffffffffu, above + incl >= target);
    if (!ball) ball = 0x80000000u;  // unreachable while the invariants hold; keeps the search in range
    if (lane == __ffs(ball) - 1) {
        u64 cum = above + incl - lane_sum;
        int j = 0;
        for (; j < 7; ++j) {
            if (cum + w[j] >= target) break;
            cum += w[j];
        }
        s.prefix |= (u64)(255 - 8 * lane - j) << shift;
        s.above = cum;
        s.bin = w[j];
        s.target = target;
    }
}

// Largest digit-aligned t such that the weight of {c_i >= t : key_i >= min_key} reaches the target,
// over c_i = key_i << 32 | ~i.  MASS weights are e_i * 2^40 (target from frac of the total), else 1.
// Passes 0-3 resolve the value bits; with `exact`, passes 4-7 resolve index bits only if the value
// threshold is tied (then exactly `target` tokens have c_i >= t).
template <bool MASS>
__device__ u64 radix_search(const Row& row, Search& s, unsigned min_key, u64 target, float frac, bool exact) {
    if (threadIdx.x == 0) { s.prefix = 0; s.above = 0; s.bin = 0; s.target = target; }
    for (int pass = 0; pass < 8; ++pass) {
        __syncthreads();
        if (pass == 4 && (!exact || s.above + s.bin == s.target)) break;
        const int shift = 56 - 8 * pass;
        for (int d = threadIdx.x; d < 256; d += THREADS) s.hist[d] = 0;
        const u64 prefix = s.prefix, high = pass ? ~0ull << (shift + 8) : 0ull;
        __syncthreads();
#pragma unroll 4
        for (int i = threadIdx.x; i < V; i += THREADS) {
            const float x = load_logit(row, i);
            const unsigned key = order_key(x);
            const u64 c = ((u64)key << 32) | (u64)(0xffffffffu - (unsigned)i);
            if (key < min_key || (c & high) != prefix) continue;
            u64 weight = 1;
            if (MASS) weight = (u64)__float2ull_rn(expf(__fdiv_rn(x, row.temperature) - row.z_max) * MASS_SCALE);
            atomicAdd(&s.hist[(c >> shift) & 255], weight);
        }
        __syncthreads();
        if (threadIdx.x < 32) pick_digit(s, shift, pass == 0 ? frac : -1.f);
    }
    __syncthreads();
    const u64 t = s.prefix;
    __syncthreads();
    return t;
}

// ---------------------------------------------------------------------------------------------
// kernels

extern "C" __global__ void __launch_bounds__(THREADS)
sample_rows(const float* __restrict__ logits, const float* __restrict__ temperature, const int* __restrict__ top_k,
            const float* __restrict__ top_p, const float* __restrict__ min_p,
            const unsigned long long* __restrict__ seeds, const int* __restrict__ steps,
            const int* __restrict__ counts, const unsigned char* __restrict__ prompt_mask,
            const float* __restrict__ repetition, const float* __restrict__ presence,
            const float* __restrict__ frequency, int* __restrict__ out_ids, float* __restrict__ out_logprobs,
            int* __restrict__ out_top_ids, float* __restrict__ out_top_logprobs, const unsigned* __restrict__ allowed,
            int* __restrict__ out_flags, int num_rows) {
    __shared__ Search search;
    __shared__ float red_v[NUM_WARPS], red_s[NUM_WARPS];
    __shared__ int red_i[NUM_WARPS];
    const int b = blockIdx.x;
    if (b >= num_rows) return;
    const size_t base = (size_t)b * V;
    Row row;
    row.logits = logits + base;
#if HAS_PENALTIES
    row.counts = counts + base;
    row.prompt = prompt_mask + base;
    row.repetition = repetition[b];
    row.presence = presence[b];
    row.frequency = frequency[b];
#endif
#if HAS_MASK
    row.allowed = allowed + (size_t)b * ((V + 31) / 32);
#endif
    row.temperature = temperature[b];

    // pass 1: max / argmax and log-sum-exp of the penalised logits (and whether a raw logit is not finite)
    float best = neg_inf(), m = neg_inf(), s = 0.f;
    int best_i = 0x7fffffff, bad = 0;
#pragma unroll 4
    for (int i = threadIdx.x; i < V; i += THREADS) {
        bad |= !isfinite(row.logits[i]);
        const float x = load_logit(row, i);
        if (x > best || best_i == 0x7fffffff) { best = x; best_i = i; }  // i grows: the first max wins
        if (x == neg_inf()) continue;
        if (x > m) { s = s * expf(m - x) + 1.f; m = x; } else { s += expf(x - m); }
    }
    bad = __syncthreads_or(bad);
    block_argmax(best, best_i, red_v, red_i);
    const float log_z = block_logsumexp(m, s, red_v, red_s);
    const float x_max = best;
    if (out_flags != nullptr && threadIdx.x == 0) out_flags[b] = bad ? 1 : x_max == neg_inf() ? 2 : 0;
    int id = best_i;

    if (!(row.temperature < GREEDY_EPS)) {
        row.z_max = __fdiv_rn(x_max, row.temperature);  // division by T > 0 is monotone: max(x / T)
        const int k = top_k[b];
        const float p = top_p[b], mp = min_p[b];
        unsigned thr = 0;
        if (k > 0 && k < V) thr = (unsigned)(radix_search<false>(row, search, 0u, (u64)k, -1.f, false) >> 32);
        if (p < 1.f) thr = (unsigned)(radix_search<true>(row, search, thr, 0, p, false) >> 32);

        // draw: argmax over kept tokens of z - log E (Gumbel form of argmax p / E)
        const unsigned long long seed = seeds[b];
        const unsigned k0 = (unsigned)seed, k1 = (unsigned)(seed >> 32), step = (unsigned)steps[b];
        float score = neg_inf();
        int pick = 0x7fffffff;
        for (int g = threadIdx.x; g < NUM_GROUPS; g += THREADS) {
            const uint4 r = philox4x32_10(make_uint4((unsigned)g, step, 0u, 0u), k0, k1);
            const unsigned words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int i = 4 * g + j;
                if (i >= V) break;
                const float x = load_logit(row, i);
                if (order_key(x) < thr) continue;
                const float z = __fdiv_rn(x, row.temperature);
                if (expf(z - row.z_max) < mp) continue;
                const float sc = z - log_exp_noise(words[j]);
                if (sc > score) { score = sc; pick = i; }
            }
        }
        block_argmax(score, pick, red_v, red_i);
        if (pick < V) id = pick;  // else every kept score was -inf: fall back to the argmax
    }

    if (threadIdx.x == 0) {
        out_ids[b] = id;
#if WRITE_LOGPROB
        out_logprobs[b] = load_logit(row, id) - log_z;
#endif
    }

#if NUM_TOP > 0
    // top-N of the untempered penalised logits: exactly NUM_TOP tokens have a 64-bit key >= t
    __shared__ u64 top[NUM_TOP];
    __shared__ int top_count;
    const u64 t = radix_search<false>(row, search, 0u, (u64)NUM_TOP, -1.f, true);
    if (threadIdx.x == 0) top_count = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < V; i += THREADS) {
        const u64 c = ((u64)order_key(load_logit(row, i)) << 32) | (u64)(0xffffffffu - (unsigned)i);
        if (c >= t) {
            const int slot = atomicAdd(&top_count, 1);
            if (slot < NUM_TOP) top[slot] = c;
        }
    }
    __syncthreads();
    if (threadIdx.x < NUM_TOP) {
        const u64 c = top[threadIdx.x];
        int rank = 0;
        for (int j = 0; j < NUM_TOP; ++j) rank += top[j] > c;
        out_top_ids[(size_t)b * NUM_TOP + rank] = (int)(0xffffffffu - (unsigned)c);
        out_top_logprobs[(size_t)b * NUM_TOP + rank] = key_value((unsigned)(c >> 32)) - log_z;
    }
#endif
}

// counts[b, ids[b]] += 1 after each step (rows with an id outside [0, V) are left alone).
extern "C" __global__ void update_counts(int* __restrict__ counts, const int* __restrict__ ids, int num_rows) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= num_rows) return;
    const int id = ids[b];
    if (id >= 0 && id < V) counts[(size_t)b * V + id] += 1;
}

// prompt_mask[row, ids[j]] = 1 for j < num_ids (ids outside [0, V) are skipped).
extern "C" __global__ void mark_prompt_tokens(unsigned char* __restrict__ prompt_mask, const int* __restrict__ ids,
                                              int row, int num_ids) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= num_ids) return;
    const int id = ids[j];
    if (id >= 0 && id < V) prompt_mask[(size_t)row * V + id] = 1;
}
