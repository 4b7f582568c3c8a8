// skinny_gemm.cu — y = x · Wᵀ for a handful of rows (decode: M ≤ 8 tokens), bf16 in, fp32
// accumulate, bf16 or fp32 out: the dense decode projections whose output is narrow (N ≤ 4096), where
// cuBLAS picks small-M kernels that leave the weight stream below bandwidth (o_proj 4096 -> 2304 at
// M = 1: split-K + a reduce kernel, 9.9 us for 18.9 MB; f_a|g_a|b 2304 -> 288: 5.9 us for 1.3 MB).
//
// Grid (N / 16), block WARPS·32 (256): one CTA per 16 output features (rows of W), each warp a
// contiguous K / WARPS slice of the reduction; the 8 per-warp partial tiles are summed in shared memory
// in warp order (deterministic), then rounded once.
// Per warp, mma.sync m16n8k16 with A = the 16 weight rows, B = xᵀ (8 tokens per n-tile), over chunks
// of 32 k: lane (g = lane / 4, c = lane mod 4) loads 16 bytes (k = 8c .. 8c + 7 of the chunk) of weight
// rows g and g + 8 and of token row g.  The mma's k order inside a chunk is thereby
// permuted (step s takes physical k 8c + 4s .. 8c + 4s + 3 as logical 2c, 2c + 1, 2c + 8, 2c + 9) the
// same way for both operands, so the sum is the plain dot product, and every load is one 16-byte piece
// straight into the fragment registers (moe_gemm.cu's weight-stationary loads, without shared memory).
// UNROLL chunks of loads are issued before their mma so that a warp keeps UNROLL·1 KB of weights in
// flight (__launch_bounds__(256, 1) lets ptxas keep them all in registers: with its default budget
// it interleaved each load with its mma, one chunk in flight).  Weight loads bypass L1 (each byte is read once); token rows stay cached (every CTA reads them).
//
// Measured (H200, 2026-11-30, tests/gpu/bench_skinny.py: graph replay over weight copies streamed
// from HBM, M = 1 / 8, against cuBLAS): o_proj 7.5 / 8.2 us (cuBLAS 9.9 / 9.8), f_a|g_a|b 3.4 / 3.7 us
// (5.9 / 6.0), dense down 9216 -> 2304 14.0 / 14.8 us (15.6 / 15.7).  On wide outputs cuBLAS is as fast
// or faster (q|k|v 12288: 17.3 vs 16.9 us; lm_head: 178 vs 175 us), and with 16 rows (two n-tiles,
// one CTA per SM for its registers) this kernel lost everywhere: ops/skinny_gemm.py sends only M ≤ 8,
// N ≤ 4096 here.
// Shapes: x [M, K] bf16 rows ldx apart; w [N, K] bf16 contiguous; out [M, N] rows ldo apart, bf16
// (OUT_F32 = 0) or fp32.  N % 16 == 0, K % (32·WARPS) == 0, x, w 16-byte aligned, ldx % 8 == 0,
// 1 ≤ M ≤ 8 (ops/skinny_gemm.py checks all of it).
// Compile-time constants: OUT_F32, UNROLL, WARPS (8: the launcher's block is WARPS·32 threads).
//
// skinny_gemm_cl (SPLITS defined, SKWS not) — the same weight stream for 9 ≤ M ≤ 8·NT rows (decode batches of up to
// 32), where x no longer fits the registers: x is staged in shared memory, and the reduction is split over
// a thread-block cluster (sm_90+) so that a CTA stages only its K / SPLITS slice of x.
//   Grid (N / FPC, SPLITS), cluster (1, SPLITS, 1), block WARPS·32.  CTA (b, s) computes features
//   [b·FPC, b·FPC + FPC) over k in [s·KS, s·KS + KS): it issues its first UNROLL weight chunks (weights:
//   before the programmatic-launch wait; later groups of UNROLL chunks are loaded while the group before is
//   multiplied, two register buffers), copies rows [0, 8·NT) of its x slice into shared memory (rows ≥ M
//   zero-filled; row pitch KS + 32 bf16, so the 8 rows of a 16-byte load phase fall on distinct banks), and
//   its warps stream the weight rows as above: warp w takes m-tile w / WPM (16 features) and the k quarter
//   (or half) w mod WPM of the slice, with NT n-tiles of 8 tokens per chunk (x fragments are 16-byte
//   shared loads in the same permuted k order as the weights).
//   Reduction, in a fixed order (deterministic): the WPM warps of an m-tile in warp order in shared memory,
//   then each element of the CTA's [8·NT, FPC] partial goes to the shared memory of the cluster CTA that
//   owns it (element i to rank i mod SPLITS, remote stores after a "started" cluster barrier), and after a
//   second cluster barrier every owner adds its elements' SPLITS partials in split order and stores them.
// Compile-time constants: OUT_F32, UNROLL, WARPS, SPLITS (cluster size, 1 ... 8), FPC (32 or 64 features per
// CTA), KS (k per CTA), NT (n-tiles); K = SPLITS·KS, N % FPC == 0, KS % (32·WPM) == 0, 9 ≤ M ≤ 8·NT.
//   Measured (H200, 2026-12-01, tests/gpu/bench_skinny.py --rows 16,32 --splits, weights from HBM, M = 16 / 32):
//   o_proj 4096 -> 2304 8.63 / 10.64 us at the launcher's split of 4 (cuBLAS 9.90 / 10.08; splits 2 and 8:
//   9.28 / 11.09 and 11.30 / 13.63), f_a|g_a|b 2304 -> 288 3.14 / 3.62 us at 6 (cuBLAS 6.01 / 6.01), the
//   dense down 9216 -> 2304 slower than cuBLAS (18.5 / 24.4 against 16.0 us with one buffer: K > 4096 stays
//   there).  In the model's decode graphs (tests/gpu/bench_ab.py --env KDA_RT_SKINNY_WIDE) batch 16 went
//   6.190 -> 6.075 ms and batch 32 8.041 -> 7.892 ms, although o_proj at 32 rows is 0.6 us slower alone
//   here (in the graph cuBLAS ran it as split-K + reduce: 246 + 54 us per batch-32 step in the traces).
#include "common.cuh"

#if !defined(OUT_F32) || !defined(WARPS) || (!defined(UNROLL) && !defined(SROWS) && !defined(SKWS))
#error "skinny_gemm.cu needs -DOUT_F32 -DWARPS and -DUNROLL (skinny_gemm, skinny_gemm_cl), -DSROWS -DSK or -DSKWS"
#endif
#define FT 16  // output features per CTA (one mma m-tile)

template <int N>
struct Count {
    static constexpr int value = N;
};

// 16 bytes of weights that are read once: no L1 allocation
__device__ __forceinline__ uint4 ld_stream16(const bf16* p) {
    uint4 v;  // (not volatile: ptxas may issue it ahead of earlier mma)
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

#if !defined(SPLITS) && !defined(SROWS)
extern "C" __global__ void __launch_bounds__(WARPS * 32, 1) skinny_gemm(const bf16* __restrict__ x, int ldx,
                                                                     const bf16* __restrict__ w, void* __restrict__ out,
                                                                     int ldo, int M, int K) {
    KDA_PDL_ENTRY();
    __shared__ float part[WARPS][8][FT + 1];  // [warp][token][feature] partial sums
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int f0 = blockIdx.x * FT;
    const int kw = K / WARPS, kbeg = warp * kw, nch = kw / 32;

    const bf16* w0 = w + (size_t)(f0 + g) * K + kbeg + 8 * c;
    const bf16* w1 = w0 + (size_t)8 * K;
    const bool xv = g < M;  // token row g exists (rows past M multiply zeros and are not stored)
    const bf16* xr = x + (size_t)(xv ? g : 0) * ldx + kbeg + 8 * c;

    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    // UNROLL chunks of loads, then their mma; the last nch mod UNROLL chunks one at a time
    auto chunks = [&](int ch, auto n_tag) {  // n_tag: Count<n> (NVRTC has no <type_traits>)
        constexpr int n = decltype(n_tag)::value;
        uint4 a0[n], a1[n], b[n];
#pragma unroll
        for (int u = 0; u < n; ++u) {
            const int k = (ch + u) * 32;
            a0[u] = ld_stream16(w0 + k);
            a1[u] = ld_stream16(w1 + k);
            b[u] = xv ? __ldg(reinterpret_cast<const uint4*>(xr + k)) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < n; ++u) {
            const unsigned s0[4] = {a0[u].x, a1[u].x, a0[u].y, a1[u].y}, s1[4] = {a0[u].z, a1[u].z, a0[u].w, a1[u].w};
            mma_bf16(acc, s0, b[u].x, b[u].y);
            mma_bf16(acc, s1, b[u].z, b[u].w);
        }
    };
    int ch = 0;
    for (; ch + UNROLL <= nch; ch += UNROLL) chunks(ch, Count<UNROLL>{});
    for (; ch < nch; ++ch) chunks(ch, Count<1>{});

    // acc = {(feature g, token 2c), (g, 2c + 1), (g + 8, 2c), (g + 8, 2c + 1)}
#pragma unroll
    for (int j = 0; j < 4; ++j) part[warp][2 * c + (j & 1)][g + 8 * (j >> 1)] = acc[j];
    __syncthreads();
    for (int i = threadIdx.x; i < M * FT; i += WARPS * 32) {
        const int tok = i / FT, f = i % FT;
        float s = 0.f;
#pragma unroll
        for (int v = 0; v < WARPS; ++v) s += part[v][tok][f];  // warp order: deterministic
#if OUT_F32
        static_cast<float*>(out)[(size_t)tok * ldo + f0 + f] = s;
#else
        static_cast<bf16*>(out)[(size_t)tok * ldo + f0 + f] = to_bf16(s);
#endif
    }
}
#endif

#ifdef SPLITS
// The cluster reduction of skinny_gemm_cl and skinny_gemm_ws, in a fixed order (deterministic): each of the CTA's
// ELEMS_ partial sums (element i = token · FPC + feature; partial(i) sums the CTA's warps in warp order) goes to the
// shared memory of the cluster CTA that owns it (rank i mod SPLITS, slot i / SPLITS of red [SPLITS][PER_RANK_]), remote
// stores after the "started" cluster barrier (every CTA arrived on it at its start); after a second cluster barrier
// every owner adds its elements' SPLITS partials in split order and stores the rows < M (feature f of the CTA at
// column n0 + f of out).  (skinny_gemm_ws's SASS is the same as with this code written out in it; skinny_gemm_cl's
// differs in instruction order only, nvdisasm of NVRTC 13 sm_90a builds, 2026-12-04.)
template <int ELEMS_, int PER_RANK_, int NTHREADS, typename Partial>
__device__ __forceinline__ void cluster_reduce_store(Partial partial, float* red, int split, int M, void* __restrict__ out,
                                                     int ldo, int n0) {
    const int tid = threadIdx.x;
    cluster_wait();  // every CTA of the cluster has started: its shared memory takes remote stores
    for (int i = tid; i < ELEMS_; i += NTHREADS) {
        const float v = partial(i);
        st_cluster(red + split * PER_RANK_ + i / SPLITS, (unsigned)(i % SPLITS), v);
    }
    cluster_arrive();  // every partial is at its owner after the wait
    cluster_wait();
    for (int jj = tid; jj < PER_RANK_; jj += NTHREADS) {
        const int i = jj * SPLITS + split;
        const int tok = i / FPC, f = i - tok * FPC;
        if (i >= ELEMS_ || tok >= M) continue;
        float v = 0.f;
#pragma unroll
        for (int sp = 0; sp < SPLITS; ++sp) v += red[sp * PER_RANK_ + jj];  // split order
        const size_t o = (size_t)tok * ldo + n0 + f;
#if OUT_F32
        static_cast<float*>(out)[o] = v;
#else
        static_cast<bf16*>(out)[o] = to_bf16(v);
#endif
    }
}
#endif

#if defined(SPLITS) && !defined(SKWS)
#define MT (FPC / 16)           // m-tiles of 16 features per CTA
#define WPM (WARPS / MT)        // warps per m-tile: each a k part of the CTA's slice
#define KW (KS / WPM)           // k per warp
#define NCH (KW / 32)           // 32-wide chunks per warp
#define MP (8 * NT)             // staged x rows
#define XPITCH (KS + 32)        // bf16 per staged x row (row pitch = 64 mod 128 bytes)
#define ELEMS (MP * FPC)        // partial sums of a CTA
#define PER_RANK ((ELEMS + SPLITS - 1) / SPLITS)
static_assert((FPC == 32 || FPC == 64) && WARPS % MT == 0, "skinny_gemm_cl: FPC 32 or 64, whole warps per m-tile");
static_assert(KS % (32 * WPM) == 0 && NT >= 1 && NT <= 4 && SPLITS >= 1 && SPLITS <= 8,
              "skinny_gemm_cl: KS a multiple of 32 per warp, 1 to 4 n-tiles, clusters of 1 to 8");

extern "C" __global__ void __cluster_dims__(1, SPLITS, 1) __launch_bounds__(WARPS * 32, 2)
skinny_gemm_cl(const bf16* __restrict__ x, int ldx, const bf16* __restrict__ w, void* __restrict__ out, int ldo,
               int M, int K) {
    KDA_PDL_ENTRY_DEFERRED();  // the weights are no kernel's output: their first loads go out before the wait
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* xs = reinterpret_cast<bf16*>(smem_raw);                       // [MP][XPITCH]
    float* part = reinterpret_cast<float*>(smem_raw + MP * XPITCH * 2);  // [WARPS][MP][16]
    float* red = part + WARPS * MP * 16;                                 // [SPLITS][PER_RANK]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const int mt = warp / WPM, q = warp % WPM;
    const int split = blockIdx.y;  // the cluster rank: cluster (1, SPLITS, 1), grid y = SPLITS
    const int kcta = split * KS;
    const bf16* w0 = w + (size_t)(blockIdx.x * FPC + mt * 16 + g) * K + kcta + q * KW + 8 * c;
    const bf16* w1 = w0 + (size_t)8 * K;
    cluster_arrive_relaxed();  // "started": waited for before the first remote store

    // weight chunks in groups of U, double-buffered in registers: group i + 1's loads are issued before
    // group i's mma (a single buffer exposed one round trip per group: o_proj at M = 32 ran at 1.7 TB/s)
    constexpr int U = NCH < UNROLL ? NCH : UNROLL, NG = (NCH + U - 1) / U;
    uint4 a0[2][U], a1[2][U];
    auto load_group = [&](int gi) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (gi * U + u < NCH) {
                a0[gi & 1][u] = ld_stream16(w0 + (gi * U + u) * 32);
                a1[gi & 1][u] = ld_stream16(w1 + (gi * U + u) * 32);
            }
        }
    };
    load_group(0);
    {
        unsigned dep = 0u;  // (every early load feeds the wait: common.cuh KDA_PDL_WAIT_AFTER)
#pragma unroll
        for (int u = 0; u < U; ++u) dep |= a0[0][u].x | a1[0][u].x;
        KDA_PDL_WAIT_AFTER(dep);  // x (and out) only after the kernel before has finished
    }
    for (int i = tid; i < MP * (KS / 8); i += WARPS * 32) {
        const int r = i / (KS / 8), cc = i - r * (KS / 8);
        cp_async16(xs + r * XPITCH + 8 * cc, x + (size_t)(r < M ? r : 0) * ldx + kcta + 8 * cc, r < M ? 16 : 0);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    const bf16* xq = xs + g * XPITCH + q * KW + 8 * c;  // token g of n-tile 0 at the warp's first k
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) {
        if (gi + 1 < NG) load_group(gi + 1);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int ch = gi * U + u;
            if (ch >= NCH) break;
            const uint4 A0 = a0[gi & 1][u], A1 = a1[gi & 1][u];
            const unsigned s0[4] = {A0.x, A1.x, A0.y, A1.y}, s1[4] = {A0.z, A1.z, A0.w, A1.w};
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const uint4 b = *reinterpret_cast<const uint4*>(xq + j * 8 * XPITCH + ch * 32);
                mma_bf16(acc[j], s0, b.x, b.y);
                mma_bf16(acc[j], s1, b.z, b.w);
            }
        }
    }

    // acc[j] = {(feature g, token 8j + 2c), (g, 8j + 2c + 1), (g + 8, 8j + 2c), (g + 8, 8j + 2c + 1)}
    float* pw = part + warp * MP * 16;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) pw[(8 * j + 2 * c + (e & 1)) * 16 + g + 8 * (e >> 1)] = acc[j][e];
    }
    __syncthreads();
    cluster_reduce_store<ELEMS, PER_RANK, WARPS * 32>([&](int i) {
        const int tok = i / FPC, f = i - tok * FPC, m = f >> 4;
        float v = 0.f;
#pragma unroll
        for (int k = 0; k < WPM; ++k) v += part[((m * WPM + k) * MP + tok) * 16 + (f & 15)];  // warp order
        return v;
    }, red, split, M, out, ldo, blockIdx.x * FPC);
}
#endif

#ifdef SROWS
// skinny_gemm_staged (SROWS defined) — the M <= 8 product with the CTA's weight rows copied into shared memory
// BEFORE the programmatic-launch wait, so that the whole weight stream can run under the kernel before it
// (a decode layer's o_proj under kda_decode_step or the MLA attention, which leave HBM mostly idle at small
// batches): after the wait only x (L2) and the products from shared memory remain.
//   Grid G (about one CTA per SM, the launcher's choice), block WARPS·32.  CTA i owns the output features
//   [i·N/G, (i + 1)·N/G) (at most SROWS rows of W, 16-row m-tiles, the rows past its range read its last row
//   and are not stored): every thread issues cp.async copies of 16-byte pieces of those rows into shared
//   memory (row pitch 2K + 64 bytes: the 8 lanes of a 16-byte load phase, rows g and g + 1 at pieces c, fall
//   on distinct banks), then waits for the kernel before, loads its token rows, waits for its copies.
//   Warp w takes the k slice [w·K/WARPS, (w + 1)·K/WARPS) of every m-tile, the same fragments (permuted k
//   order) and the same chunk order as skinny_gemm, and the partials are summed in warp order: the results
//   are bit-identical to skinny_gemm's.
// SBULK = 1: one bulk copy (cp.async.bulk, the copy engine) per weight row instead of 16-byte cp.async pieces.
// Measured (H200, 2026-12-01): after a 6-10 us latency-bound predecessor (tests/gpu/bench_skinny.py --spin-us,
// 128 CTAs of 128 threads, also in clusters of 4 with 21 KB of shared memory) o_proj adds 2.8-3.0 us at 1 row and
// 3.3-3.4 us at 8 (cp.async or bulk alike) where the streaming kernel adds 7.1 / 7.8 us.  In the model's decode
// graphs (tests/gpu/bench_ab.py --env KDA_RT_SKINNY_STAGED) batch 8 gains 1.1% and batch 1 nothing: the timeline
// (trace_decode.py --timeline) shows most CTAs starting only after kda_decode_step ends, because the driver sizes
// that kernel's SMs' shared memory for its own occupancy and an SM changes it only when idle; forcing the whole
// carveout on kda_decode_step lets them start under it (o_proj then ends 2.6 us after it, not 7.2) but slows
// kda_decode_step itself and the kernels around it (KDA_RT_SMEM_CARVEOUT, env.py): no net gain.
// Compile-time constants: OUT_F32, WARPS, SROWS (weight rows per CTA, at most), SK (K), SBULK.  Needs the launcher's
// dynamic shared memory: SROWS·(2·SK + 64) + WARPS·16·SMT·8·4 bytes.
#define SMT ((SROWS + 15) / 16)       // m-tiles per CTA
#define SPITCH (2 * SK + 64)          // bytes per staged weight row
#define SKW (SK / WARPS)              // k per warp
#define SNCH (SKW / 32)               // 32-wide chunks per warp
#ifndef SBULK
#define SBULK 0
#endif
static_assert(SK % (32 * WARPS) == 0 && SROWS >= 1, "skinny_gemm_staged: K a multiple of 32 per warp");

extern "C" __global__ void __launch_bounds__(WARPS * 32, 1)
skinny_gemm_staged(const bf16* __restrict__ x, int ldx, const bf16* __restrict__ w, void* __restrict__ out, int ldo,
                   int M, int N) {
    KDA_PDL_ENTRY_DEFERRED();  // the weights are no kernel's output: all of them are copied before the wait
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* part = reinterpret_cast<float*>(smem_raw + SROWS * SPITCH);  // [WARPS][SMT·16][8]
    const int n0 = (int)((long long)blockIdx.x * N / gridDim.x);
    const int rows = (int)((long long)(blockIdx.x + 1) * N / gridDim.x) - n0;  // 1 .. SROWS (launcher)
    const bf16* wc = w + (size_t)n0 * SK;
#if SBULK
    // one bulk copy (the copy engine) per weight row, all completing on one mbarrier
    __shared__ __align__(8) unsigned long long bar;
    const unsigned bar_a = smem_addr(&bar);
    if (threadIdx.x == 0) mbar_init(bar_a, 1), fence_proxy_async_smem(), mbar_arrive_expect_tx(bar_a, rows * SK * 2);
    __syncwarp();
    for (int r = threadIdx.x; r < rows && threadIdx.x < 32; r += 32)
        bulk_copy_g2s(smem_addr(smem_raw + r * SPITCH), wc + (size_t)r * SK, SK * 2, bar_a);
    __syncthreads();  // the barrier's initialisation before any thread waits on it
#else
    constexpr int PIECES = SK / 8;  // 16-byte pieces of a weight row
    for (int i = threadIdx.x; i < rows * PIECES; i += WARPS * 32) {
        const int r = i / PIECES, p = i - r * PIECES;
        cp_async16(smem_raw + r * SPITCH + 16 * p, wc + (size_t)r * SK + 8 * p, 16);
    }
    cp_async_commit();
#endif

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int kbeg = warp * SKW;
    KDA_PDL_WAIT();  // x (and out) only after the kernel before has finished
    const bool xv = g < M;  // token row g exists (rows past M multiply zeros and are not stored)
    const bf16* xr = x + (size_t)(xv ? g : 0) * ldx + kbeg + 8 * c;
    uint4 b[SNCH];
#pragma unroll
    for (int u = 0; u < SNCH; ++u) b[u] = xv ? __ldg(reinterpret_cast<const uint4*>(xr + u * 32)) : make_uint4(0u, 0u, 0u, 0u);
#if SBULK
    mbar_wait(bar_a, 0);
#else
    cp_async_wait<0>();
    __syncthreads();
#endif

    float acc[SMT][4];
#pragma unroll
    for (int mt = 0; mt < SMT; ++mt) {
        acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
        const int r0 = min(mt * 16 + g, rows - 1), r1 = min(mt * 16 + g + 8, rows - 1);
        const unsigned char* a0p = smem_raw + r0 * SPITCH + 2 * (kbeg + 8 * c);
        const unsigned char* a1p = smem_raw + r1 * SPITCH + 2 * (kbeg + 8 * c);
#pragma unroll
        for (int u = 0; u < SNCH; ++u) {
            const uint4 A0 = *reinterpret_cast<const uint4*>(a0p + 64 * u);
            const uint4 A1 = *reinterpret_cast<const uint4*>(a1p + 64 * u);
            const unsigned s0[4] = {A0.x, A1.x, A0.y, A1.y}, s1[4] = {A0.z, A1.z, A0.w, A1.w};
            mma_bf16(acc[mt], s0, b[u].x, b[u].y);
            mma_bf16(acc[mt], s1, b[u].z, b[u].w);
        }
    }
    // acc[mt] = {(feature 16mt + g, token 2c), (.., 2c + 1), (16mt + g + 8, 2c), (.., 2c + 1)}
    float* pw = part + warp * (SMT * 16 * 8);
#pragma unroll
    for (int mt = 0; mt < SMT; ++mt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) pw[(mt * 16 + g + 8 * (e >> 1)) * 8 + 2 * c + (e & 1)] = acc[mt][e];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < M * rows; i += WARPS * 32) {
        const int tok = i / rows, f = i - tok * rows;
        float s = 0.f;
#pragma unroll
        for (int v = 0; v < WARPS; ++v) s += part[(v * SMT * 16 + f) * 8 + tok];  // warp order: deterministic
#if OUT_F32
        static_cast<float*>(out)[(size_t)tok * ldo + n0 + f] = s;
#else
        static_cast<bf16*>(out)[(size_t)tok * ldo + n0 + f] = to_bf16(s);
#endif
    }
}
#endif

#ifdef SKWS
// skinny_gemm_ws (SKWS defined) — skinny_gemm_cl's product (9 ≤ M ≤ 8·NT rows, K split over a cluster of SPLITS CTAs,
// the same grid and cluster reduction) with its inputs streamed through shared memory by a producer warp (sm_90+).
// Why: skinny_gemm_cl at 32 rows streams o_proj (4096 -> 2304, 18.9 MB) at ~1.9 TB/s, and at ~2.2 TB/s when the weight
// sits in L2 (tests/gpu/bench_skinny.py --l2): its time is its chain of round trips, not the bytes.  Under ncu
// (tests/gpu/ncu_skinny.sh, H200, 2026-12-04) 45% of its warps' stall samples are long-scoreboard waits and 18% sit on
// the OR that feeds the programmatic-launch wait (KDA_PDL_WAIT_AFTER): every thread waits for its first weight group
// to land before it stages x, then streams the rest two register groups deep; 15% of the SM's warps are active.
//   Here one more warp (the producer) runs the pipeline: before the programmatic-launch wait it issues the tensor-map
// copies (TMA, 128-byte swizzle) of the weights of the first RING ring entries, then waits, then issues every entry's
// x copies and, once an entry is free again, the next entry's weights and x.  An entry is one k step of 128: FPC
// weight rows and 8·NT x rows, each as two 64-column boxes (x's map has M rows: the copy zero-fills the rest; one
// bulk copy per x row instead, 32 an entry, ran o_proj at 32 rows in 15.3 us against skinny_gemm_cl's 9.9: a warp
// issues bulk copies one lane at a time).  Consumer
// warp w (of WARPS = 8) takes the k16 slice w of every entry for all FPC / 16 m-tiles and NT n-tiles (ldmatrix
// fragments, mma.sync), so each weight and x byte is read from shared memory once; the warps' partial tiles are
// summed in warp order (over the ring's bytes, once every entry is consumed), then the cluster reduction of
// skinny_gemm_cl (fixed order: deterministic; the k grouping differs from skinny_gemm_cl's, so the bits may too).
// Compile-time constants: OUT_F32, WARPS (8), SPLITS, FPC (32 or 64), KS (k per CTA, a multiple of 128), NT (2 or 4),
// RING (entries).  The launcher passes tensor maps over w [N, K] (boxes of FPC rows x 64 columns) and x [M, K] (rows
// ldx apart, boxes of 8·NT rows x 64 columns) and _ws_smem bytes of dynamic shared memory (1024-byte alignment slack
// + the ring + the reduction slots).
#define WS_STEP 128                           // k per ring entry: one k16 slice per consumer warp
#define WS_NSTEP (KS / WS_STEP)               // entries per CTA
#define WS_MT (FPC / 16)                      // m-tiles
#define WS_MP (8 * NT)                        // staged x rows
#define WS_WBYTES (FPC * WS_STEP * 2)         // an entry's weights: two boxes of FPC rows x 128 bytes
#define WS_XBYTES (WS_MP * WS_STEP * 2)       // an entry's x rows: two boxes of 8·NT rows x 128 bytes
#define WS_ELEMS (WS_MP * FPC)                // partial sums of a CTA
#define WS_PP (FPC + 4)                       // floats per token row of a warp's partial tile (4 mod 16: the 32 lanes'
                                              // stores, tokens 2c apart, fall on distinct banks)
#define WS_PER_RANK ((WS_ELEMS + SPLITS - 1) / SPLITS)
#define WS_RING_BYTES (RING * (WS_WBYTES + WS_XBYTES))
static_assert(WARPS == 8 && KS % WS_STEP == 0 && (FPC == 32 || FPC == 64) && (NT == 2 || NT == 4) && RING >= 1,
              "skinny_gemm_ws: 8 consumer warps, KS a multiple of 128, FPC 32 or 64, NT 2 or 4");
static_assert(WARPS * WS_MP * WS_PP * 4 <= WS_RING_BYTES, "skinny_gemm_ws: the warps' partials fit over the ring");

__device__ __forceinline__ void ws_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// bytes that copies completing on bar will bring, without an arrival (the phase stays open until one)
__device__ __forceinline__ void ws_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

extern "C" __global__ void __cluster_dims__(1, SPLITS, 1) __launch_bounds__((WARPS + 1) * 32, 2)
skinny_gemm_ws(const void* xmap, const void* wmap, void* __restrict__ out, int ldo, int M) {
    KDA_PDL_ENTRY_DEFERRED();  // the weights are no kernel's output: their first copies go out before the wait
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* ring = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);  // (the swizzle's alignment)
    unsigned char* wst = ring;                                // [RING][2 boxes][FPC][128 bytes]
    unsigned char* xst = ring + RING * WS_WBYTES;             // [RING][2 boxes][WS_MP][128 bytes]
    float* part = reinterpret_cast<float*>(ring);             // [WARPS][WS_MP][WS_PP], over the ring after the loop
    float* red = reinterpret_cast<float*>(ring + WS_RING_BYTES);  // [SPLITS][WS_PER_RANK]
    __shared__ __align__(8) unsigned long long full[RING], empty[RING];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int split = blockIdx.y, kcta = split * KS, n0 = blockIdx.x * FPC;
    if (tid == 0) {
        for (int s = 0; s < RING; ++s) mbar_init(smem_addr(full + s), 1), mbar_init(smem_addr(empty + s), WARPS);
    }
    __syncthreads();
    cluster_arrive_relaxed();  // "started": waited for before the first remote store

    if (warp == WARPS) {  // the producer warp
        const int pre = WS_NSTEP < RING ? WS_NSTEP : RING;
        const auto copy_weights = [&](int s, unsigned bar) {
            const unsigned dst = smem_addr(wst + (s % RING) * WS_WBYTES);
            tma_load_2d(dst, wmap, kcta + s * WS_STEP, n0, bar);
            tma_load_2d(dst + FPC * 128, wmap, kcta + s * WS_STEP + 64, n0, bar);
        };
        const auto copy_x = [&](int s, unsigned bar) {
            const unsigned dst = smem_addr(xst + (s % RING) * WS_XBYTES);
            tma_load_2d(dst, xmap, kcta + s * WS_STEP, 0, bar);
            tma_load_2d(dst + WS_MP * 128, xmap, kcta + s * WS_STEP + 64, 0, bar);
        };
        if (lane == 0) {
            for (int s = 0; s < pre; ++s) ws_expect_tx(smem_addr(full + s), WS_WBYTES), copy_weights(s, smem_addr(full + s));
            KDA_PDL_WAIT();  // x only after the kernel before has finished
            for (int s = 0; s < WS_NSTEP; ++s) {
                const int slot = s % RING;
                const unsigned bar = smem_addr(full + slot);
                if (s >= pre) {
                    mbar_wait(smem_addr(empty + slot), ((s / RING) & 1) ^ 1);
                    mbar_arrive_expect_tx(bar, WS_WBYTES + WS_XBYTES), copy_weights(s, bar);
                } else {
                    mbar_arrive_expect_tx(bar, WS_XBYTES);
                }
                copy_x(s, bar);
            }
        }
        __syncwarp();
        cluster_wait();  // (the producer takes part in the cluster barriers below; it stores nothing)
        cluster_arrive();
        cluster_wait();
        return;
    }

    KDA_PDL_WAIT();  // (nothing here reads an earlier kernel's output but through the producer; the stores come last)
    const int g = lane >> 2, c = lane & 3;
    float acc[WS_MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < WS_MT; ++mt)
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.f;
    // ldmatrix lanes: A (weights) row (lane mod 16) of the m-tile at k half lane / 16; B (x) token (lane mod 8) +
    // 8·(lane / 16) of the n-tile pair at k half (lane / 8) mod 2
    const int arow = lane & 15, ahalf = lane >> 4;
    const int aunit = ((2 * warp + ahalf) & 7) ^ (arow & 7), abox = (2 * warp + ahalf) >> 3;
    const int brow = (lane & 7) + 8 * (lane >> 4), bhalf = (lane >> 3) & 1;
    const int bunit = ((2 * warp + bhalf) & 7) ^ (brow & 7), bbox = (2 * warp + bhalf) >> 3;
    for (int s = 0; s < WS_NSTEP; ++s) {
        const int slot = s % RING;
        mbar_wait(smem_addr(full + slot), (s / RING) & 1);
        const unsigned char* we = wst + slot * WS_WBYTES + abox * (FPC * 128) + arow * 128 + aunit * 16;
        const unsigned char* xe = xst + slot * WS_XBYTES + bbox * (WS_MP * 128) + brow * 128 + bunit * 16;
        unsigned b[NT / 2][4];
#pragma unroll
        for (int p = 0; p < NT / 2; ++p) ldmatrix_x4(b[p], xe + p * 16 * 128);
#pragma unroll
        for (int mt = 0; mt < WS_MT; ++mt) {
            unsigned a[4];
            ldmatrix_x4(a, we + mt * 16 * 128);
#pragma unroll
            for (int j = 0; j < NT; ++j) mma_bf16(acc[mt][j], a, b[j >> 1][2 * (j & 1)], b[j >> 1][2 * (j & 1) + 1]);
        }
        __syncwarp();
        if (lane == 0) ws_arrive(smem_addr(empty + slot));
    }
    asm volatile("barrier.sync 1, %0;" ::"n"(WARPS * 32) : "memory");  // every entry consumed: the ring is free
    // acc[mt][j] = {(feature 16mt + g, token 8j + 2c), (.., 8j + 2c + 1), (16mt + g + 8, 8j + 2c), (.., 8j + 2c + 1)}
    float* pw = part + warp * (WS_MP * WS_PP);  // [WS_MP][WS_PP]
#pragma unroll
    for (int mt = 0; mt < WS_MT; ++mt)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) pw[(8 * j + 2 * c + (e & 1)) * WS_PP + 16 * mt + g + 8 * (e >> 1)] = acc[mt][j][e];
    asm volatile("barrier.sync 1, %0;" ::"n"(WARPS * 32) : "memory");
    cluster_reduce_store<WS_ELEMS, WS_PER_RANK, WARPS * 32>([&](int i) {
        const int pi = i / FPC * WS_PP + i % FPC;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) v += part[w * (WS_MP * WS_PP) + pi];  // warp order
        return v;
    }, red, split, M, out, ldo, n0);
}
#endif
