// moe_route.cu — MoE router (spec §5.2): fp32 logits, sigmoid, group-limited top-k on biased
// scores, weights from the unbiased scores, renormalised and scaled.
//
//   logits[t, e] = Σ_d float(x[t, d]) · w_router[e, d]                      (fp32 products and sums)
//   (large T: three bf16 GEMMs on tensor cores instead, ops/moe_route.py: w_router = w1 + w2 + w3 exactly
//    with w1, w2, w3 bf16, so every product x·w_i is exact in fp32; the select kernel with PARTS = 3
//    reads the three fp32 sums [T, 3E] and adds them, (p1 + p2) + p3)
//   s = sigmoid(logits)          sel = s + bias                             (sel: selection only)
//   num_groups > 1: group score = sum of the two largest sel in the group (the only one when a
//                   group has one expert); experts outside the topk_group best groups get -inf
//   ids[t, :] = the top_k largest sel, in descending order (ties: lower index first)
//   w[t, k]   = s[ids[t, k]]   (sel[...] when biased: the HF remote-code variant)
//               / (Σ_k w + 1e-20) when renormalize;  then × scaling
//
// Letters: T tokens, D hidden, E experts, G groups, A = top_k active experts per token (≤ 16).
//
// moe_route_logits — grid (ceil(T / TPB), ceil(E / WARPS)), block WARPS·32.  The block stages
//   TPB rows of x in shared memory (bf16, 2·TPB·D bytes); each warp computes one expert's logits
//   for those TPB tokens with 16-byte loads of its router row (every router row is read
//   ceil(T / TPB) times in all, so decode spreads the 4·E·D router bytes over E / WARPS blocks).
//   A lane's router pieces are loaded ahead of their FMAs, as many at once as ptxas keeps in registers
//   (the launcher picks the smallest TPB covering T for this: T = 1 had 14 us of dependent loads, ncu).
// moe_route_select — grid (T), block THREADS ≥ E: one thread per expert; ranks are computed by
//   counting (rank_e = #{f : v_f > v_e or (v_f == v_e and f < e)}), which is deterministic and
//   matches a stable descending sort.  A NaN score ranks as -inf, so ids are always valid and
//   distinct (the weights of such a token are NaN: garbage in, visible garbage out).
// moe_route_select_warp — num_groups == 1 only (Kimi Linear), grid ceil(T / SEL_WARPS), block
//   SEL_WARPS·32: one warp per token, lane l holds experts l, l + 32, ... sorted; top_k rounds of a warp
//   argmax (redux.sync) over the lanes' best experts not taken yet (larger score first, lower index on
//   ties: the order of the rank counting above, so ids and weights are bit-identical to moe_route_select);
//   lane k keeps the k-th id and weight, and the renormalising sum adds them in k order as above.
// moe_route_fused (FUSED_ROUTE) — a decode step's whole routing in one launch (num_groups == 1): the logits,
//   the warp select and the bucketing of moe_align.cu's moe_bucket.  Grid (ceil(T / FR_TPB), E / 8), block
//   512 threads: each block loads its router rows' first pieces (before the programmatic-launch wait: a weight),
//   stages FR_TPB rows of x and computes 8 experts' logits for them, two warps per expert
//   (warp 2i + h sums the half h of D, the block adds the halves: logits[t, e] = Σ_{d < D/2} + Σ_{d ≥ D/2},
//   fp32), and stores them.  Then each block bumps done[0] (an acq_rel atomic after a barrier); the block that
//   brings it to the number of blocks is the last one, sees every logit (L2 loads), and alone does the rest: its 16
//   warps select the tokens' experts (warp_route_token, as moe_route_select_warp), the block buckets the
//   pairs (bucket_block of moe_bucket.cuh: same plan, stats and zeroed `sync` words as moe_bucket) and sets
//   done[0] back to 0 for the next launch.  So done[0] must be 0 before the first launch (the launcher
//   zeroes it on every call outside a CUDA-graph capture), and nothing else may touch it.
//   SHARED = 1: the shared expert rides in the stacks as bin E (pairs per token A + 1, as moe_bucket's SHARED_A).
//   ROUTE_NORM = 1: the block's input is also computed here, so the RMSNorm kernel between the mixer and the MoE
//   goes: x is then the mixer's output delta, and each block stages h = bf16(delta + residual) (rmsnorm.cu's
//   residual add) for its rows, sums h^2 per row (fp32; only the summation order differs from rmsnorm.cu) and
//   normalises its staged rows in place, a = bf16(bf16(h rsqrt(mean(h^2) + eps)) norm_w), before the logits.
//   The blocks with blockIdx.y == 0 store their rows' h (h_out) and a (a_out: the MoE GEMMs' x).  residual
//   itself is not written (other blocks still read it): the combine takes h_out as its residual_in.
//   signal_ready = 1: each block also adds 1 to done[1] (release) once its logits (and a_out) are stored, the
//   signal moe_gemv.cu's routed GEMV spins on before it repeats the selection for its own units (it resets done[1]).
// Shapes: x [T, D] bf16, w_router [E, D] fp32, bias [E] fp32, logits [T, E] fp32 ([T, 3E] with PARTS = 3),
//   ids [T, A] int32, w [T, A] fp32.
// Compile-time constants: D (multiple of 4), E, TPB, WARPS (logits); E, THREADS, MAX_TOP_K, PARTS (select);
// E, SEL_WARPS, MAX_TOP_K, PARTS (select_warp); FUSED_ROUTE, D (multiple of 8), E (multiple of 8,
// E + SHARED <= 512), FR_TPB, MAX_T (T <= MAX_T), MAX_TOP_K, BT (tile rows), SHARED, ROUTE_NORM (fused).
// sigmoid is the accurate one of common.cuh (expf): the routing weights are checked to 1e-5 relative.
#include "common.cuh"

#include "moe_select.cuh"

// x rows t0 .. t0 + NT - 1 (zeros past num_tokens) into shared memory by NTHREADS threads; the callers sync
// after.  DX % 8 == 0 (x rows and xs 16-byte aligned: the launchers check x): 16-byte cp.async pieces, all in
// flight at once and no registers held (a loop of 8-byte loads and stores waited on each load: at 8 rows a
// block, 9 round trips); else 8-byte copies (DX % 4 == 0).
template <int NTHREADS, int NT, int DX>
__device__ __forceinline__ void stage_rows(bf16 (&xs)[NT][DX], const bf16* __restrict__ x, int t0, int num_tokens) {
    if constexpr (DX % 8 == 0) {
        constexpr int P = DX / 8;
        for (int i = threadIdx.x; i < NT * P; i += NTHREADS) {
            const int t = i / P, p = i - t * P;
            const bool v = t0 + t < num_tokens;
            cp_async16(&xs[t][8 * p], x + (size_t)(v ? t0 + t : 0) * DX + 8 * p, v ? 16 : 0);  // 0: zero fill
        }
        cp_async_commit();
        cp_async_wait<0>();
    } else {
        for (int i = threadIdx.x; i < NT * (DX / 4); i += NTHREADS) {
            const int t = i / (DX / 4), d = (i % (DX / 4)) * 4;
            uint2 v = make_uint2(0u, 0u);
            if (t0 + t < num_tokens) v = *reinterpret_cast<const uint2*>(x + (size_t)(t0 + t) * DX + d);
            *reinterpret_cast<uint2*>(&xs[t][d]) = v;
        }
    }
}

// rmsnorm.cu's residual add and norm of rows t0 .. t0 + NT - 1 into shared memory (moe_route_fused with
// ROUTE_NORM): xs = h = bf16(delta + residual), per-row fp32 sums of h^2, then xs = a = bf16(bf16(h rsqrt(mean
// + eps)) norm_w) in place; `writer` also stores h and a of the rows < num_tokens.  Thread i works on row
// i / (NTHREADS / NT) only (whole warps a row), on 16-byte pieces: delta by cp.async into xs, the residual into
// registers, up to 3 pieces a thread in flight (one round trip up to 4 rows a block, two at 8).  part: shared
// [NTHREADS / 32]; ends with a barrier.  (The seventeenth session's version loaded both through registers a few
// pieces at a time and lost from 2 tokens on; this one gains up to 4: kda_rt/cuda/moe.py ROUTE_NORM_MAX_T.)
template <int NTHREADS, int NT, int DX>
__device__ __forceinline__ void stage_norm_rows(bf16 (&xs)[NT][DX], const bf16* __restrict__ delta,
                                                const bf16* __restrict__ residual, const bf16* __restrict__ norm_w,
                                                bf16* __restrict__ h_out, bf16* __restrict__ a_out, int t0,
                                                int num_tokens, float eps, bool writer, float* part) {
    constexpr int TPR = NTHREADS / NT, WPR = TPR / 32;  // threads, warps a row
    constexpr int PIECES = DX / 8, RP = (PIECES + TPR - 1) / TPR;  // 16-byte pieces a row, a thread
    static_assert(TPR % 32 == 0 && DX % 8 == 0, "stage_norm_rows: whole warps a row, 16-byte pieces");
    const int t = threadIdx.x / TPR, lane_r = threadIdx.x % TPR;
    const bool valid = t0 + t < num_tokens;
    const size_t row = (size_t)(valid ? t0 + t : 0) * DX;
    constexpr int BATCH = 3;  // pieces in flight a thread (12 registers of residual): one round trip up to 4 rows a block
    float ss = 0.f;
#pragma unroll
    for (int i0 = 0; i0 < RP; i0 += BATCH) {
        uint4 r[BATCH];
#pragma unroll
        for (int i = 0; i < BATCH; ++i) {
            const int p = lane_r + (i0 + i) * TPR;
            if (i0 + i < RP && p < PIECES) {
                cp_async16(&xs[t][8 * p], delta + row + 8 * p, valid ? 16 : 0);
                r[i] = valid ? __ldg(reinterpret_cast<const uint4*>(residual + row + 8 * p)) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
        cp_async_commit();
        cp_async_wait<0>();  // this thread's own pieces: no barrier before it reads them back
#pragma unroll
        for (int i = 0; i < BATCH; ++i) {
            const int p = lane_r + (i0 + i) * TPR;
            if (i0 + i >= RP || p >= PIECES) continue;
            const uint4 dv = *reinterpret_cast<const uint4*>(&xs[t][8 * p]);
            const unsigned dw[4] = {dv.x, dv.y, dv.z, dv.w}, rw[4] = {r[i].x, r[i].y, r[i].z, r[i].w};
            float h[8];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float2 a = bf16x2_to_float2(dw[k]), b = bf16x2_to_float2(rw[k]);
                h[2 * k] = round_bf16(a.x + b.x);
                h[2 * k + 1] = round_bf16(a.y + b.y);
            }
#pragma unroll
            for (int k = 0; k < 8; ++k) ss += h[k] * h[k];
            st_bf16x4(&xs[t][8 * p], h[0], h[1], h[2], h[3]);
            st_bf16x4(&xs[t][8 * p + 4], h[4], h[5], h[6], h[7]);
            if (writer && valid) {
                st_bf16x4(h_out + row + 8 * p, h[0], h[1], h[2], h[3]);
                st_bf16x4(h_out + row + 8 * p + 4, h[4], h[5], h[6], h[7]);
            }
        }
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    ss = 0.f;
#pragma unroll
    for (int w = 0; w < WPR; ++w) ss += part[t * WPR + w];
    const float inv = rsqrtf(ss / (float)DX + eps);
#pragma unroll
    for (int i = 0; i < RP; ++i) {
        const int p = lane_r + i * TPR;
        if (p >= PIECES) continue;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int d = 8 * p + 4 * half;
            const float4 h = ld_bf16x4(&xs[t][d]), g = ld_bf16x4(norm_w + d);
            const float4 a = make_float4(round_bf16(h.x * inv) * g.x, round_bf16(h.y * inv) * g.y,
                                         round_bf16(h.z * inv) * g.z, round_bf16(h.w * inv) * g.w);
            st_bf16x4(&xs[t][d], a.x, a.y, a.z, a.w);
            if (writer && valid) st_bf16x4(a_out + row + d, a.x, a.y, a.z, a.w);
        }
    }
    __syncthreads();
}

// acc[t] += w · (the 4 staged x values of row t at column d), for the NT rows: a lane's router piece
template <int NT, int DX>
__device__ __forceinline__ void fma_rows(float (&acc)[NT], float4 w, const bf16 (&xs)[NT][DX], int d) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        const uint2 raw = *reinterpret_cast<const uint2*>(&xs[t][d]);
        const bf16* xv = reinterpret_cast<const bf16*>(&raw);
        acc[t] += w.x * to_f32(xv[0]) + w.y * to_f32(xv[1]) + w.z * to_f32(xv[2]) + w.w * to_f32(xv[3]);
    }
}

#ifndef E
#error "moe_route.cu needs -DE=<num experts>"
#endif
#if defined(THREADS) && (!defined(MAX_TOP_K) || !defined(PARTS))
#error "moe_route_select needs -DMAX_TOP_K -DPARTS"
#endif
#if defined(SEL_WARPS) && (!defined(PARTS) || !defined(MAX_TOP_K) || MAX_TOP_K > 32)
#error "moe_route_select_warp needs -DPARTS and -DMAX_TOP_K <= 32"
#endif

// ---------------------------------------------------------------------------------------------
// kernels

#ifdef TPB
extern "C" __global__ void __launch_bounds__(WARPS * 32, 1) moe_route_logits(const bf16* __restrict__ x, const float* __restrict__ w_router,
                                            float* __restrict__ logits, int num_tokens) {
    KDA_PDL_ENTRY();
    __shared__ __align__(16) bf16 xs[TPB][D];
    const int t0 = blockIdx.x * TPB;
    // stage TPB rows (zeros past the end)
    stage_rows<WARPS * 32>(xs, x, t0, num_tokens);
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int e = blockIdx.y * WARPS + (threadIdx.x >> 5);
    if (e >= E) return;
    const float* row = w_router + (size_t)e * D;
    float acc[TPB];
#pragma unroll
    for (int t = 0; t < TPB; ++t) acc[t] = 0.f;
    // the lane's 16-byte pieces of the router row, CH at a time: all CH loads are issued before the first
    // FMA (one memory round trip per CH pieces; a rolled loop waited on every piece: 14 us at T = 1, ncu),
    // the sums in the same d order as before
    constexpr int ITER = (D + 127) / 128, CH = ITER <= 24 ? ITER : 16;
    for (int i0 = 0; i0 < ITER; i0 += CH) {
        float4 wv[CH];
#pragma unroll
        for (int i = 0; i < CH; ++i) {
            const int d = (i0 + i) * 128 + lane * 4;
            wv[i] = i0 + i < ITER && d < D ? *reinterpret_cast<const float4*>(row + d) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        asm volatile("" ::: "memory");  // keeps the compiler from sinking each load to its first use
#pragma unroll
        for (int i = 0; i < CH; ++i) {
            const int d = (i0 + i) * 128 + lane * 4;
            if (i0 + i >= ITER || d >= D) continue;
            fma_rows(acc, wv[i], xs, d);
        }
    }
#pragma unroll
    for (int t = 0; t < TPB; ++t) {
        const float v = warp_sum(acc[t]);
        if (lane == 0 && t0 + t < num_tokens) logits[(size_t)(t0 + t) * E + e] = v;
    }
}
#endif

#ifdef THREADS
extern "C" __global__ void __launch_bounds__(THREADS)
moe_route_select(const float* __restrict__ logits, const float* __restrict__ bias, int* __restrict__ out_ids,
                 float* __restrict__ out_w, int num_tokens, int top_k, int num_groups, int topk_group,
                 int renormalize, int biased, float scaling) {
    KDA_PDL_ENTRY();
    __shared__ float s_sh[E], sel_sh[E], group_sh[E];
    __shared__ int keep_sh[E], ids_sh[MAX_TOP_K];
    __shared__ float w_sh[MAX_TOP_K];
    const int t = blockIdx.x, e = threadIdx.x;
    if (t >= num_tokens) return;
    if (e < E) {
#if PARTS == 3
        const float* l = logits + (size_t)t * 3 * E + e;
        const float s = sigmoid((l[0] + l[E]) + l[2 * E]);
#else
        const float s = sigmoid(logits[(size_t)t * E + e]);
#endif
        const float sel = s + bias[e];
        s_sh[e] = s;
        // NaN (from a NaN input row) would compare false both ways and break the ranks: rank it
        // as -inf so the ranks stay a permutation and the ids always lie in [0, E)
        sel_sh[e] = sel == sel ? sel : neg_inf();
    }
    __syncthreads();
    if (num_groups > 1) {
        const int per = E / num_groups;
        if (e < num_groups) {
            float m1 = neg_inf(), m2 = neg_inf();
            for (int j = 0; j < per; ++j) {
                const float v = sel_sh[e * per + j];
                if (v > m1) { m2 = m1; m1 = v; } else if (v > m2) { m2 = v; }
            }
            group_sh[e] = per >= 2 ? m1 + m2 : m1;
        }
        __syncthreads();
        if (e < num_groups) {
            const float g = group_sh[e];
            int rank = 0;
            for (int h = 0; h < num_groups; ++h) rank += (group_sh[h] > g) || (group_sh[h] == g && h < e);
            keep_sh[e] = rank < topk_group;
        }
        __syncthreads();
        if (e < E && !keep_sh[e / per]) sel_sh[e] = neg_inf();
        __syncthreads();
    }
    if (e < E) {
        const float v = sel_sh[e];
        int rank = 0;
        for (int f = 0; f < E; ++f) rank += (sel_sh[f] > v) || (sel_sh[f] == v && f < e);
        if (rank < top_k) {
            ids_sh[rank] = e;
            w_sh[rank] = biased ? v : s_sh[e];
        }
    }
    __syncthreads();
    if (e < top_k) {
        float sum = 0.f;
        for (int j = 0; j < top_k; ++j) sum += w_sh[j];  // fixed order: deterministic
        const float w = renormalize ? w_sh[e] / (sum + 1e-20f) : w_sh[e];
        out_ids[(size_t)t * top_k + e] = ids_sh[e];
        out_w[(size_t)t * top_k + e] = w * scaling;
    }
}
#endif

#ifdef SEL_WARPS
extern "C" __global__ void __launch_bounds__(SEL_WARPS * 32)
moe_route_select_warp(const float* __restrict__ logits, const float* __restrict__ bias, int* __restrict__ out_ids,
                      float* __restrict__ out_w, int num_tokens, int top_k, int renormalize, int biased,
                      float scaling) {
    KDA_PDL_ENTRY();
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * SEL_WARPS + (threadIdx.x >> 5);
    if (t >= num_tokens) return;  // whole warps only: no shuffle in warp_route_token loses a lane
    int id;
    float w;
#if PARTS == 3
    const float* l = logits + (size_t)t * 3 * E;
    warp_route_token<E, MAX_TOP_K>([&](int e) { return (l[e] + l[E + e]) + l[2 * E + e]; }, bias, top_k, renormalize, biased,
                        scaling, &id, &w);
#else
    const float* l = logits + (size_t)t * E;
    warp_route_token<E, MAX_TOP_K>([&](int e) { return l[e]; }, bias, top_k, renormalize, biased, scaling, &id, &w);
#endif
    if (lane < top_k) {
        out_ids[(size_t)t * top_k + lane] = id;
        out_w[(size_t)t * top_k + lane] = w;
    }
}
#endif

#ifdef FUSED_ROUTE
#include "moe_bucket.cuh"

#ifndef FR_PHASES
#define FR_PHASES 3  // tests/gpu/bench_moe_route.py times the kernel cut after phase 0 (logits), 1 (the count), 2 (select)
#endif
#define FR_THREADS 512
#define FR_WARPS (FR_THREADS / 32)
#define FR_EPB (FR_WARPS / 2)  // experts per block: two warps each
#ifndef ROUTE_NORM
#define ROUTE_NORM 0
#endif
#define FR_BINS (E + SHARED)
static_assert(D % 8 == 0 && E % FR_EPB == 0 && FR_BINS <= FR_THREADS && MAX_TOP_K <= 32,
              "moe_route_fused: D % 8, E % 8, E + SHARED <= 512, top_k <= 32");
static_assert(2 * FR_TPB * D + MAX_T * (MAX_TOP_K + SHARED) * 4 + 3 * FR_BINS * 4 + 32 * 4 + FR_WARPS * FR_TPB * 4 <= 48 * 1024,
              "moe_route_fused: static shared memory over 48 KB (fewer FR_TPB or MAX_T)");

extern "C" __global__ void __launch_bounds__(FR_THREADS, 1)
moe_route_fused(const bf16* __restrict__ x, const float* __restrict__ w_router, const float* __restrict__ bias,
                float* __restrict__ logits, int* __restrict__ out_ids, float* __restrict__ out_w, int num_tokens,
                int top_k, int renormalize, int biased, float scaling, int* __restrict__ expert_off,
                int* __restrict__ sorted_pair, int* __restrict__ pair_pos, int* __restrict__ tile_expert,
                int* __restrict__ tile_row, int* __restrict__ num_tiles, int* __restrict__ stats,
                int* __restrict__ sync, int sync_words, int* __restrict__ done, const bf16* __restrict__ residual,
                const bf16* __restrict__ norm_w, bf16* __restrict__ h_out, bf16* __restrict__ a_out, float eps,
                int signal_ready LIVE_PARAM) {
    KDA_PDL_ENTRY_DEFERRED();  // the router is a weight: its first loads go out before the wait below
#ifdef CHAIN_PROBE
    // thread 0's stamps: 0 resident, 1 the wait returned (earliest of the blocks), 2 x staged, 3 logits signalled,
    // 4 selected, 5 bucketed (latest; 4 and 5 the last block's)
    unsigned long long pt[PROBE_EVENTS] = {probe_now()};
    constexpr unsigned PROBE_EARLIEST = 0x3u;
#endif
    __shared__ __align__(16) bf16 xs[FR_TPB][D];
    __shared__ float part_sh[FR_WARPS][FR_TPB];
    __shared__ int bin_sh[MAX_T * (MAX_TOP_K + SHARED)];  // pair p's bin
    __shared__ int count_sh[FR_BINS], off_sh[FR_BINS], fill_sh[FR_BINS], warp_tot[32];
    __shared__ int last_sh;
    const int t0 = blockIdx.x * FR_TPB, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    constexpr int DH = D / 2, ITER = (DH + 127) / 128, CH = ITER <= 24 ? ITER : 16;
    const float* row = w_router + (size_t)(blockIdx.y * FR_EPB + (warp >> 1)) * D + (warp & 1) * DH;
    float4 wv[CH];  // the lane's 16-byte router pieces, CH at a time, all in flight before the first FMA
    auto load_router = [&](int i0) {
#pragma unroll
        for (int i = 0; i < CH; ++i) {
            const int d = (i0 + i) * 128 + lane * 4;
            wv[i] = i0 + i < ITER && d < DH ? *reinterpret_cast<const float4*>(row + d) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        asm volatile("" ::: "memory");
    };
    load_router(0);
    {
        unsigned dep = 0u;  // (every early load feeds the wait: common.cuh KDA_PDL_WAIT_AFTER)
#pragma unroll
        for (int i = 0; i < CH; ++i) dep |= __float_as_uint(wv[i].x);
        KDA_PDL_WAIT_AFTER(dep);  // x, and every output, only after the kernel before has finished
    }
#ifdef CHAIN_PROBE
    pt[1] = probe_now();
#endif
#if ROUTE_NORM
    stage_norm_rows<FR_THREADS>(xs, x, residual, norm_w, h_out, a_out, t0, num_tokens, eps, blockIdx.y == 0, &part_sh[0][0]);
#else
    stage_rows<FR_THREADS>(xs, x, t0, num_tokens);
    __syncthreads();
#endif
#ifdef CHAIN_PROBE
    pt[2] = probe_now();
#endif
    {
        const int h0 = (warp & 1) * DH;
        float acc[FR_TPB];
#pragma unroll
        for (int t = 0; t < FR_TPB; ++t) acc[t] = 0.f;
        for (int i0 = 0; i0 < ITER; i0 += CH) {
            if (i0 > 0) load_router(i0);
#pragma unroll
            for (int i = 0; i < CH; ++i) {
                const int d = (i0 + i) * 128 + lane * 4;
                if (i0 + i >= ITER || d >= DH) continue;
                fma_rows(acc, wv[i], xs, h0 + d);
            }
        }
#pragma unroll
        for (int t = 0; t < FR_TPB; ++t) {
            const float v = warp_sum(acc[t]);
            if (lane == 0) part_sh[warp][t] = v;
        }
    }
    __syncthreads();
    if (tid < FR_EPB * FR_TPB) {
        const int ei = tid / FR_TPB, t = tid % FR_TPB;
        if (t0 + t < num_tokens)
            logits[(size_t)(t0 + t) * E + blockIdx.y * FR_EPB + ei] = part_sh[2 * ei][t] + part_sh[2 * ei + 1][t];
    }
    if (FR_PHASES == 0) return;
    // the count: the barrier orders the block's logit stores before thread 0's atomic, whose release makes
    // them visible GPU-wide with it (cumulativity); its acquire, and the barrier after, order every other
    // block's released logits before this block's loads of them in the last block
    __syncthreads();
    if (tid == 0) {
        // done[1] (the routed GEMV's start signal, moe_gemv.cu ROUTED): released in the same way, counted up to the
        // number of blocks; the GEMV resets it
        if (signal_ready) asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" :: "l"(done + 1) : "memory");
#ifdef CHAIN_PROBE
        pt[3] = probe_now();
#endif
        int old;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(old) : "l"(done) : "memory");
        last_sh = old == (int)(gridDim.x * gridDim.y) - 1;
    }
    __syncthreads();
#ifdef CHAIN_PROBE
    if (tid == 0 && (!last_sh || FR_PHASES == 1)) probe_post(pt, 0xfu, PROBE_EARLIEST, gridDim.x * gridDim.y);
#endif
    if (!last_sh) return;
    if (FR_PHASES == 1) {
        if (tid == 0) *done = 0;
        return;
    }

    // select: warp w routes tokens w, w + 16, ...
    for (int t = warp; t < num_tokens; t += FR_WARPS) {
        const float* l = logits + (size_t)t * E;
        int id;
        float w;
        warp_route_token<E, MAX_TOP_K>([&](int e) { return __ldcg(l + e); }, bias, top_k, renormalize, biased, scaling, &id, &w);
        if (lane < top_k) {
            out_ids[(size_t)t * top_k + lane] = id;
            out_w[(size_t)t * top_k + lane] = w;
            bin_sh[t * (top_k + SHARED) + lane] = min(max(id, 0), E - 1);
        }
        if (SHARED && lane == 0) bin_sh[t * (top_k + SHARED) + top_k] = E;  // the shared expert's bin
    }
    for (int i = tid; i < sync_words; i += FR_THREADS) sync[i] = 0;  // moe_decode_fused's counters
    __syncthreads();
#ifdef CHAIN_PROBE
    pt[4] = probe_now();
    if (tid == 0 && FR_PHASES == 2) probe_post(pt, 0x1fu, PROBE_EARLIEST, gridDim.x * gridDim.y);
#endif
    if (FR_PHASES == 2) {
        if (tid == 0) *done = 0;
        return;
    }
#ifdef LIVE_TOKENS
    const int bucketed = min(num_tokens, LIVE_COUNT());  // the live tokens' pairs alone (LIVE_PARAM's note)
#else
    const int bucketed = num_tokens;
#endif
    bucket_block<FR_THREADS>([&](int p) { return bin_sh[p]; }, bucketed * (top_k + SHARED), FR_BINS, BT, E, expert_off, sorted_pair, pair_pos, tile_expert, tile_row, num_tiles,
        stats, count_sh, off_sh, fill_sh, warp_tot);
#ifdef CHAIN_PROBE
    __syncthreads();  // (probe builds only) every thread's share of the bucketing done
    pt[5] = probe_now();
    if (tid == 0) probe_post(pt, 0x3fu, PROBE_EARLIEST, gridDim.x * gridDim.y);
#endif
    if (tid == 0) *done = 0;  // every block has counted: ready for the next launch
}
#endif
