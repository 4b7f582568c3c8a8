// moe_gemm_tc.cu — grouped GEMM over expert-bucketed rows: shared-memory tiled bf16 tensor-core GEMM
// (mma.sync m16n8k16, fp32 accumulate) with a multi-stage cp.async pipeline, for the two MoE projections
// (spec §5.1): moe_grouped_gemm_tc (one projection a launch) and moe_decode_fused (both projections of a
// decode step in one launch, below).  Same math and rounding as moe_gemm.cu (the weight-stationary kernel):
//
//   FUSE_SILU = 1 (gate/up):  g = x[tok(r)] · W[e, f]ᵀ,  u = x[tok(r)] · W[e, HALF + f]ᵀ
//                             h[r, f] = bf16( bf16(SiLU(bf16(g))) · bf16(u) )      (as silu_mul.cu)
//                             W = w13 [E, 2·HALF, K] (gate rows first), x [T, K], tok(r) = sorted_pair[r] / TOPK
//   FUSE_SILU = 0 (down):     y[r, f] = bf16(h[r] · W[e, f]ᵀ)                       W = w2 [E, NOUT, K]
//
// Rows r are the expert-sorted pair rows of moe_align.cu built with BT = BM: tile i covers rows
// [tile_row[i], min(tile_row[i] + BM, expert_off[e + 1])) of expert e = tile_expert[i].
//
// Geometry.  C[rows, features] = A[rows, K] · Bᵀ with A = gathered x rows (or h rows) and
// B = the expert's weight rows, both K-contiguous, so both operands come from shared memory by
// plain (non-transposed) ldmatrix.  Grid (feature blocks, max_tiles): the feature blocks of one
// row tile are launched next to each other (its A rows are read from L2 after the first), and the
// tiles of one expert are a few CTAs apart (its weight block is read from DRAM about once).  A CTA
// whose tile index is ≥ num_tiles[0] (read on the device) exits at once, so the grid depends on
// (T, A, E) only and the launch can be captured in a CUDA graph.
//   CTA tile BM rows × BN features, K in steps of BK through STAGES shared-memory stages filled by
//   cp.async (16 B per thread and copy; STAGES - 1 steps in flight while one is multiplied).
//   WARPS_M × WARPS_N warps, each owning WM = BM / WARPS_M rows × WN = BN / WARPS_N features:
//   MI = WM / 16 m16 tiles × NI = WN / 8 n8 tiles of fp32 accumulators.  Fragments of the next
//   k16 step are loaded (ldmatrix) while the current one is multiplied.
//   FUSE_SILU: shared-memory B rows [0, BN/2) are gate features f0 .. f0 + BN/2 - 1 and rows
//   [BN/2, BN) the matching up features HALF + f0 ..; a warp's first NI/2 n-tiles are gate, the
//   last NI/2 the matching up tiles, so the SiLU·up epilogue pairs accumulators of one thread.
//   Rows past the tile end are zero-filled by cp.async (their source pointer is clamped to the
//   tile's first row, never out of bounds; nothing is read) and never stored; a warp whose WM rows
//   all lie past the end skips its MMAs (ragged last tiles of an expert).
// Shared memory: STAGES · (BM + BN) · LDS · 2 bytes, LDS = BK + 8: each row padded by 16 bytes, so
// the 8 row addresses of one ldmatrix phase fall in 8 distinct 16-byte bank groups.
//
// Shapes / dtypes: src bf16 ([T, K] x when FUSE_SILU, else [N, K] h); weight bf16 [E, NOUT, K];
//   dst bf16 [N, HALF] (FUSE_SILU) or bf16 [N, NOUT] (y, one bf16 rounding per expert row as HF's expert output); plan arrays int32 (moe_align.cu).
// Compile-time constants: K, NOUT, FUSE_SILU, TOPK, BM, BN, BK, STAGES, WARPS_M, WARPS_N, MIN_BLOCKS, EARLY_B (0/1),
// WFMT and E4M3_CVT (below); moe_decode_fused: FUSED_DECODE = 1, HIDDEN (D), INTER (I) instead of K, NOUT, FUSE_SILU,
// and DEC_WS (0/1: its producer-warp form, below).
//
// WFMT = 1: the weights in e4m3 (uint8 bits, [E, NOUT, K]) with one fp32 scale a weight row (scale [E, NOUT],
// loader/quant.py), as moe_gemv.cu's WFMT = 1.  The B stages hold the e4m3 bytes (half the bf16 bytes: BK bytes a row,
// rows LDW = BK + 16 bytes apart, so the 8 row addresses of one ldmatrix fall on distinct bank groups); the products
// stay bf16 x bf16 on the tensor cores.  One ldmatrix.x4 gives a thread 4 consecutive e4m3 bytes of one weight row
// (k = 4c .. 4c + 3 of a k16 slice, c = lane mod 4) for each of 4 n-tiles; they become the bf16 pairs b0 = (4c, 4c + 1)
// and b1 = (4c + 2, 4c + 3), which the mma reads as k slots (2c, 2c + 1) and (2c + 8, 2c + 9).  The A fragments are
// loaded in the same k order (8-byte shared loads of k = 4c .. 4c + 3 instead of ldmatrix), so every product pairs the
// same k: the sum is over the same terms, in the tensor core's order.  The codes become bf16 exactly (e4m3.cuh, the
// way E4M3_CVT picks).  The epilogue multiplies each fp32 sum by its row's scale before the roundings (gate and up
// each by their own row's).  H200 (tests/gpu/bench_moe_decode.py --e4m3, ops/moe_gemm_tc.py): batch 32, 67.9 experts,
// moe_decode_fused 246.9 us bf16 against 143.8 us e4m3.
// Measured on H200 (tests/gpu/bench_moe_gemm.py, E=256, top-8, D=2304, I=1024, random routing;
// tiles as chosen in kda_rt/cuda/ops/moe_gemm_tc.py: BM=128 BN=128 BK=64, 3 stages, 2x2 warps,
// 2 CTAs per SM), gate/up | down, against moe_gemm.cu:
//   T=2048:  0.84 | 0.42 ms = 184 | 184 TFLOP/s  (moe_gemm.cu 1.46 | 1.03 ms)
//   T=8192:  2.47 | 1.32 ms = 250 | 235 TFLOP/s  (4.63 | 2.81 ms)
//   T=16384: 4.77 | 2.49 ms = 259 | 248 TFLOP/s  (9.13 | 5.28 ms); cuBLAS dense, same size: 754 | 638
// and at T=128 (4 rows per expert, BM=64) 0.61 | 0.31 ms: the weights stream at 4.0 TB/s.
// So about a third of the bf16 peak where the step is compute-bound: mma.sync with one barrier per
// k step; wgmma with a warp-specialised TMA producer is the next step for large T.
#include "common.cuh"

#ifndef EARLY_B
#define EARLY_B 0
#endif
#ifndef FUSED_DECODE
#define FUSED_DECODE 0
#endif
#if FUSED_DECODE
#if !defined(HIDDEN) || !defined(INTER) || EARLY_B
#error "moe_gemm_tc.cu with FUSED_DECODE needs -DHIDDEN -DINTER (and no EARLY_B: its down items always copy weights first)"
#endif
#else
#if !defined(K) || !defined(NOUT) || !defined(FUSE_SILU)
#error "moe_gemm_tc.cu needs -DK -DNOUT -DFUSE_SILU (or -DFUSED_DECODE=1 -DHIDDEN -DINTER)"
#endif
#if EARLY_B && FUSE_SILU
#error "EARLY_B: only the down GEMM reads nothing but weights before its wait (gate/up needs the plan first)"
#endif
#endif
// gate/up keeps the plain entry (wait, then let the next launch go), so that when the down kernel starts
// every gate/up block is past its wait, i.e. the plan the down kernel reads first is complete
#if EARLY_B
#define TC_PDL_ENTRY() KDA_PDL_ENTRY_DEFERRED()
#else
#define TC_PDL_ENTRY() KDA_PDL_ENTRY()
#endif
#if !defined(BM) || !defined(BN) || !defined(BK) || !defined(STAGES) || !defined(WARPS_M) || !defined(WARPS_N) || \
    !defined(TOPK) || !defined(MIN_BLOCKS)
#error "moe_gemm_tc.cu needs -DBM -DBN -DBK -DSTAGES -DWARPS_M -DWARPS_N -DTOPK -DMIN_BLOCKS"
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "moe_gemm_tc.cu needs sm_80 or newer (mma.sync bf16, cp.async, ldmatrix)"
#endif

#ifndef WFMT
#define WFMT 0
#endif
#ifndef E4M3_CVT
#define E4M3_CVT 0  // (the launcher passes ops/moe_gemm_tc.py E4M3_CONVERT, 1)
#endif
#if WFMT == 1
typedef unsigned char wtype;  // e4m3 bits
#elif WFMT == 0
typedef bf16 wtype;
#else
#error "moe_gemm_tc.cu: WFMT must be 0 (bf16) or 1 (e4m3 with row scales)"
#endif
#if WFMT == 1 && E4M3_CVT && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#error "moe_gemm_tc.cu: E4M3_CVT = 1 needs sm_89 or newer (cvt.rn.f16x2.e4m3x2)"
#endif

// B_SWZ (set by DEC_WS): the B stages hold 128-byte rows in the tensor maps' 128-byte swizzle (16-byte chunk c of
// stage row r at chunk c ^ (r mod 8), the stage 1024-byte aligned) instead of padded rows LDW apart
#if defined(DEC_WS) && DEC_WS
#define B_SWZ 1
#else
#define B_SWZ 0
#endif

#define THREADS (WARPS_M * WARPS_N * 32)
#define WM (BM / WARPS_M)              // rows per warp
#define WN (BN / WARPS_N)              // features per warp
#define MI (WM / 16)                   // m16 tiles per warp
#define NI (WN / 8)                    // n8 tiles per warp
#define LDS (BK + 8)                   // shared row stride in bf16 (16 B of padding)
#define CH (BK / 8)                    // 16-byte chunks per row and stage
#define RPP (THREADS / CH)             // rows copied per pass of all threads
#define A_PASSES (BM / RPP)
#define B_PASSES (BN / RPP)

static_assert(BK % 16 == 0 && STAGES >= 2, "BK must be a multiple of 16");
static_assert(WM % 16 == 0 && WN % 16 == 0, "warp tile must be a multiple of 16 x 16");
static_assert(THREADS % CH == 0 && BM % RPP == 0 && BN % RPP == 0, "copy passes must tile the stage");
#if WFMT == 1
#define LDW (BK + 16)                  // shared row stride of the e4m3 B stages, in bytes
#define CHW (BK / 16)                  // 16-byte chunks per e4m3 row and stage
#define RPPW (THREADS / CHW)           // e4m3 rows copied per pass
#define B_PASSES_W (BN / RPPW)
static_assert(BK % 16 == 0 && THREADS % CHW == 0 && BN % RPPW == 0 && (BN / 2) % RPPW == 0 && NI % 4 == 0,
              "e4m3 B stages: copy passes must tile the stage (and each half of a gate/up stage); 4 n-tiles a load");
#else
#define LDW LDS
#endif

#include "moe_tile.cuh"  // after the constants above: tile_row_sources, b_pass_offset
#include "e4m3.cuh"

// ---------------------------------------------------------------------------------------------
// helpers

// c += a · b (m16n8k16, bf16 in, fp32 accumulate).  Not volatile (unlike common.cuh's mma_bf16):
// a pure register op, so the compiler may interleave it with the next step's ldmatrix.
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Shared-memory B row of this warp's n-tile t (first of the pair t, t + 1 for ldmatrix x4)
template <bool SILU>
__device__ __forceinline__ int b_tile_row(int wn, int t) {
    if (SILU) return t < NI / 2 ? wn * (WN / 2) + 8 * t : BN / 2 + wn * (WN / 2) + 8 * (t - NI / 2);
    return wn * WN + 8 * t;
}

#if WFMT == 1
// The fragments of k16 step kk as loaded below, in the k order of the e4m3 B fragments (see the header): A row g
// holds k = 4c .. 4c + 3 in registers a0 (4c, 4c + 1) and a2 (4c + 2, 4c + 3), row g + 8 in a1 and a3
template <bool SILU>
__device__ __forceinline__ void load_fragments(unsigned (&af)[MI][4], unsigned (&bfr)[NI][2], const bf16* ta,
                                               const wtype* tb, int wm, int wn, int lane, int kk, int mi_live = MI) {
    const int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
        if (MI > 1 && mi >= mi_live) break;  // (warp-uniform: m16 tiles with no row of the tile)
        const bf16* p = ta + (wm * WM + mi * 16 + g) * LDS + kk * 16 + 4 * c;
        const uint2 lo = *reinterpret_cast<const uint2*>(p), hi = *reinterpret_cast<const uint2*>(p + 8 * LDS);
        af[mi][0] = lo.x, af[mi][1] = hi.x, af[mi][2] = lo.y, af[mi][3] = hi.y;
    }
#pragma unroll
    for (int t = 0; t < NI; t += 4) {
        unsigned r[4];  // r[q]: bytes 4c .. 4c + 3 of weight row g of n-tile t + q (lanes 8q .. 8q + 7 name its rows)
        const int row = b_tile_row<SILU>(wn, t + (lane >> 3)) + (lane & 7);
        ldmatrix_x4(r, B_SWZ ? tb + row * 128 + ((kk ^ (row & 7)) << 4) : tb + row * LDW + kk * 16);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            bfr[t + q][0] = e4m3x2_to_bf16x2<E4M3_CVT>(r[q] & 0xFFFFu);
            bfr[t + q][1] = e4m3x2_to_bf16x2<E4M3_CVT>(r[q] >> 16);
        }
    }
}
#else
// A fragments (MI m16 tiles) and B fragments (NI n8 tiles) of k16 step kk of one stage
template <bool SILU>
__device__ __forceinline__ void load_fragments(unsigned (&af)[MI][4], unsigned (&bfr)[NI][2], const bf16* ta,
                                               const wtype* tb, int wm, int wn, int lane, int kk, int mi_live = MI) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
        if (MI > 1 && mi >= mi_live) break;  // (warp-uniform: m16 tiles with no row of the tile)
        ldmatrix_x4(af[mi], ta + (wm * WM + mi * 16 + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8);
    }
#pragma unroll
    for (int t = 0; t < NI; t += 2) {
        unsigned r[4];
        const int row = b_tile_row<SILU>(wn, t) + (lane & 7) + ((lane >> 4) << 3), chunk = 2 * kk + ((lane >> 3) & 1);
        ldmatrix_x4(r, B_SWZ ? tb + row * 64 + ((chunk ^ (row & 7)) << 3) : tb + row * LDS + 8 * chunk);
        bfr[t][0] = r[0];
        bfr[t][1] = r[1];
        bfr[t + 1][0] = r[2];
        bfr[t + 1][1] = r[3];
    }
}
#endif

// The products of one stage into acc (this warp's rows wm, its features wn): ta, tb the stage's A and B tiles.
// mi_live: the warp's m16 tiles that hold a row of the tile (a warp of MI > 1 tiles, e.g. the 32-row decode tile,
// skips the loads and products of the others: their accumulator rows are never stored)
template <bool SILU>
__device__ __forceinline__ void multiply_stage(float (&acc)[MI][NI][4], const bf16* ta, const wtype* tb, int wm, int wn,
                                               int lane, int mi_live = MI) {
    unsigned af[2][MI][4], bfr[2][NI][2];
    load_fragments<SILU>(af[0], bfr[0], ta, tb, wm, wn, lane, 0, mi_live);
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
        if (kk + 1 < BK / 16)
            load_fragments<SILU>(af[(kk + 1) & 1], bfr[(kk + 1) & 1], ta, tb, wm, wn, lane, kk + 1, mi_live);
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
            if (MI > 1 && mi >= mi_live) break;
#pragma unroll
            for (int t = 0; t < NI; ++t) mma_16816(acc[mi][t], af[kk & 1][mi], bfr[kk & 1][t][0], bfr[kk & 1][t][1]);
        }
    }
}

// The epilogue of one tile (this warp's part): acc[mi][t] = {(row g, col 2c), (g, 2c + 1), (g + 8, 2c),
// (g + 8, 2c + 1)}; rows at or past nrows are not stored.  gate/up (SILU): h = SiLU(gate)·up into dst [., HALF_] from
// feature f0 of the block; down: the sums into dst [., NOUT_] (WFMT = 1: each times its weight row's scale).
template <int NOUT_, bool SILU>
__device__ __forceinline__ void store_tile(const float (&acc)[MI][NI][4], const float* __restrict__ scale, int e,
                                           int row0, int nrows, int f0, bf16* __restrict__ dst, int wm, int wn,
                                           int lane) {
    constexpr int HALF_ = NOUT_ / 2;
    const int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int hrow = 0; hrow < 2; ++hrow) {
            const int rl = wm * WM + mi * 16 + g + 8 * hrow;
            if (rl >= nrows) continue;
            const size_t r = (size_t)(row0 + rl);
            if (SILU) {
#pragma unroll
                for (int t = 0; t < NI / 2; ++t) {
                    const int f = f0 + wn * (WN / 2) + 8 * t + 2 * c;
#if WFMT == 1
                    const float2 sg = __ldg(reinterpret_cast<const float2*>(scale + (size_t)e * NOUT_ + f));
                    const float2 su = __ldg(reinterpret_cast<const float2*>(scale + (size_t)e * NOUT_ + HALF_ + f));
                    const float sgv[2] = {sg.x, sg.y}, suv[2] = {su.x, su.y};
#endif
                    float hv[2];
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
#if WFMT == 1
                        const float gate = round_bf16(acc[mi][t][2 * hrow + j] * sgv[j]);
                        const float up = round_bf16(acc[mi][t + NI / 2][2 * hrow + j] * suv[j]);
#else
                        const float gate = round_bf16(acc[mi][t][2 * hrow + j]);
                        const float up = round_bf16(acc[mi][t + NI / 2][2 * hrow + j]);
#endif
                        hv[j] = round_bf16(silu(gate)) * up;
                    }
                    *reinterpret_cast<__nv_bfloat162*>(dst + r * HALF_ + f) = __floats2bfloat162_rn(hv[0], hv[1]);
                }
            } else {
#pragma unroll
                for (int t = 0; t < NI; ++t) {
                    const int f = f0 + wn * WN + 8 * t + 2 * c;
#if WFMT == 1
                    const float2 s2 = __ldg(reinterpret_cast<const float2*>(scale + (size_t)e * NOUT_ + f));
                    *reinterpret_cast<__nv_bfloat162*>(dst + r * NOUT_ + f) =
                        __floats2bfloat162_rn(acc[mi][t][2 * hrow] * s2.x, acc[mi][t][2 * hrow + 1] * s2.y);
#else
                    *reinterpret_cast<__nv_bfloat162*>(dst + r * NOUT_ + f) =
                        __floats2bfloat162_rn(acc[mi][t][2 * hrow], acc[mi][t][2 * hrow + 1]);
#endif
                }
            }
        }
}

// One CTA tile of one grouped GEMM (the body of both kernels below): bucketed rows [row0, row0 + nrows) of
// expert e (nrows <= BM) times feature block fb of the expert's weight [NOUT_, K_] (gate/up: SILU, NOUT_ =
// 2·HALF), into dst (WFMT = 1: each sum times its weight row's scale, scale [E, NOUT_]).  EARLY: the first STAGES - 1 weight steps are copied before before_a() returns (the
// A rows, src, may be written by someone else until then); otherwise before_a is not called.  after_loop()
// runs once every product is issued, before the epilogue.
template <int K_, int NOUT_, bool SILU, bool EARLY, typename BeforeA, typename AfterLoop>
__device__ __forceinline__ void gemm_tile(const bf16* __restrict__ src, const int* __restrict__ sorted_pair,
                                          const wtype* __restrict__ weight, const float* __restrict__ scale, int e,
                                          int row0, int nrows, int fb, bf16* __restrict__ dst, bf16* sa, wtype* sb,
                                          BeforeA before_a, AfterLoop after_loop) {
    constexpr int KT = K_ / BK, HALF_ = NOUT_ / 2;
    static_assert(K_ % BK == 0 && KT >= STAGES - 1, "K must be a multiple of BK, with at least STAGES - 1 steps");
    static_assert(!SILU || (NI % 4 == 0 && (BN / 2) % RPP == 0 && HALF_ % (BN / 2) == 0),
                  "gate/up tiles: BN/2 must divide HALF");
    static_assert(SILU || NOUT_ % BN == 0, "NOUT must be a multiple of BN");
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int f0 = SILU ? fb * (BN / 2) : fb * BN;  // gate/up: first gate feature (= first h column) of the block

    // copy geometry: thread copies chunk lch of rows lrow + i·RPP
    const int lrow = tid / CH, lch = tid % CH;
    bf16* a_dst = sa + lrow * LDS + lch * 8;
#if WFMT == 1
    // e4m3 rows: thread copies chunk (16 weights) tid mod CHW of rows tid / CHW + i·RPPW
    const int wrow = tid / CHW, wch = tid % CHW;
    const wtype* b_src = weight + ((size_t)e * NOUT_ + f0 + wrow) * K_ + wch * 16;
    wtype* b_dst = sb + wrow * LDW + wch * 16;
    auto load_b = [&](int stage, int kt) {
#pragma unroll
        for (int i = 0; i < B_PASSES_W; ++i) {
            const int r = i * RPPW;  // a pass lies in one half of a gate/up stage ((BN / 2) % RPPW == 0)
            const int off = SILU && r >= BN / 2 ? HALF_ - BN / 2 + r : r;
            cp_async16(b_dst + stage * BN * LDW + r * LDW, b_src + (size_t)off * K_ + kt * BK, 16);
        }
    };
#else
    const bf16* b_src = weight + ((size_t)e * NOUT_ + f0 + lrow) * K_ + lch * 8;
    bf16* b_dst = sb + lrow * LDS + lch * 8;
    auto load_b = [&](int stage, int kt) {
#pragma unroll
        for (int i = 0; i < B_PASSES; ++i)
            cp_async16(b_dst + stage * BN * LDS + i * RPP * LDS,
                       b_src + (size_t)b_pass_offset<SILU, HALF_>(i) * K_ + kt * BK, 16);
    };
#endif
    if (EARLY) {
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) load_b(s, s);  // (committed with stage 0's A rows below)
        before_a();
    }
    const bf16* a_src[A_PASSES];
    int a_bytes[A_PASSES];  // 16, or 0 for rows past the tile end: zero-filled, nothing read
    tile_row_sources<K_, SILU>(a_src, a_bytes, src, sorted_pair, row0, nrows, lrow, lch);
    auto load_a = [&](int stage, int kt) {
#pragma unroll
        for (int i = 0; i < A_PASSES; ++i)
            cp_async16(a_dst + stage * BM * LDS + i * RPP * LDS, a_src[i] + kt * BK, a_bytes[i]);
    };
    auto load_stage = [&](int stage, int kt) {
        load_a(stage, kt);
        load_b(stage, kt);
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (EARLY)
            load_a(s, s);
        else
            load_stage(s, s);
        cp_async_commit();
    }

    float acc[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int t = 0; t < NI; ++t) acc[mi][t][0] = acc[mi][t][1] = acc[mi][t][2] = acc[mi][t][3] = 0.f;
    const bool active = wm * WM < nrows;  // warp-uniform: rows of this warp exist

    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<STAGES - 2>();  // step kt has landed (this thread's copies) ...
        __syncthreads();              // ... everyone's; and step kt - 1's stage is free to refill
        if (kt + STAGES - 1 < KT) load_stage((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
        cp_async_commit();            // (an empty group near the end keeps the wait count uniform)
        if (active) {  // (multiply_stage's body, written out: called here, ptxas orders two tiled builds otherwise)
            const bf16* ta = sa + (kt % STAGES) * BM * LDS;
            const wtype* tb = sb + (kt % STAGES) * BN * LDW;
            unsigned af[2][MI][4], bfr[2][NI][2];
            load_fragments<SILU>(af[0], bfr[0], ta, tb, wm, wn, lane, 0);
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) {
                if (kk + 1 < BK / 16) load_fragments<SILU>(af[(kk + 1) & 1], bfr[(kk + 1) & 1], ta, tb, wm, wn, lane, kk + 1);
#pragma unroll
                for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                    for (int t = 0; t < NI; ++t) mma_16816(acc[mi][t], af[kk & 1][mi], bfr[kk & 1][t][0], bfr[kk & 1][t][1]);
            }
        }
    }
    cp_async_wait<0>();
    after_loop();

    if (!active) return;
    store_tile<NOUT_, SILU>(acc, scale, e, row0, nrows, f0, dst, wm, wn, lane);
}

// ---------------------------------------------------------------------------------------------
// kernels

#if !FUSED_DECODE
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
moe_grouped_gemm_tc(const bf16* __restrict__ src, const int* __restrict__ sorted_pair, const wtype* __restrict__ weight,
                    const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                    const int* __restrict__ expert_off, const int* __restrict__ num_tiles, void* __restrict__ dst,
                    const float* __restrict__ scale) {
    // EARLY_B (down only): the tile's first STAGES - 1 weight steps are copied before waiting for the gate/up
    // kernel, whose h rows this reads (under programmatic dependent launch a decode step's down kernel starts
    // while gate/up runs; the plan it reads first was written two kernels back, before any gate/up block
    // passed its own wait, and is read from L2: ld.cg)
    TC_PDL_ENTRY();
    extern __shared__ __align__(128) unsigned char smem_raw[];
    bf16* sa = reinterpret_cast<bf16*>(smem_raw);                 // [STAGES][BM][LDS]
    wtype* sb = reinterpret_cast<wtype*>(sa + STAGES * BM * LDS);  // [STAGES][BN][LDW]

    const int tile = blockIdx.y;
    if (tile >= __ldcg(num_tiles)) {
        KDA_PDL_WAIT();  // (again a no-op without EARLY_B; every block waits before it exits)
        return;
    }
    const int e = __ldcg(tile_expert + tile), row0 = __ldcg(tile_row + tile);
    const int nrows = min(BM, __ldcg(expert_off + e + 1) - row0);
    gemm_tile<K, NOUT, FUSE_SILU, EARLY_B>(src, sorted_pair, weight, scale, e, row0, nrows, blockIdx.x,
                                           static_cast<bf16*>(dst), sa, sb, [] { KDA_PDL_WAIT(); }, [] {});
}
#endif

#if FUSED_DECODE
// moe_decode_fused — both grouped GEMMs of a decode step's MoE layer in one launch, over the (tile, feature
// block) work actually routed: the gate/up items (num_tiles · GU_BLOCKS, tile-major) then the down items
// (num_tiles · DN_BLOCKS).  A grid of as many CTAs as the GPU holds at once (the launcher asks the occupancy
// calculator) claims items in order from one atomic counter (sync[0]), so a down item is claimed only after
// every gate/up item; a CTA finishing a gate/up item of tile i adds 1 to sync[1 + i] after its h stores
// (release), and a down item of tile i copies its first weight steps, then waits until sync[1 + i] =
// GU_BLOCKS (acquire) before copying the h rows.  Every item waited on was claimed earlier by a running CTA
// that waits on nothing, so every wait ends whatever the grid and however many of its CTAs are resident (other
// streams' or processes' kernels may hold SMs).  This replaces the two launches' tail and ramp (the gate/up
// grid's last partial wave, the down grid's start) with one stream of items.
// A CTA claims its next item when its current one has issued its last products (its epilogue hides the
// atomic's latency), not earlier: a claim made at an item's start fixes who does what at time zero (at
// batch 1, CTAs holding a waiting down item took a second one while gate/up CTAs found nothing left).
// Tried and not kept: CTA b starting with gate/up item b (consecutive blocks land on different SMs, so the
// first wave spreads over the SMs like a plain grid's; claimed from the counter, some SMs draw three gate/up
// streams and others one): batch 1 39.1 -> 36.7 us, but a down item could then wait on a gate/up item whose
// CTA is not resident, a deadlock as soon as another stream's kernel holds SMs.
// Measured (H200, 2026-12-01, tests/gpu/bench_moe_decode.py --fused: bucket + GEMMs in graph replays with
// programmatic dependent launch, 8 routings cycled, E = 256, top-8, D = 2304, I = 1024), two launches ->
// fused: T = 1 34.5 -> 39.1 us (so T = 1 keeps two launches: moe_gemm_tc.py FUSED_MIN_TOKENS), T = 4
// 113.3 -> 107.4, T = 8 208.0 -> 203.4 (17 experts: 70.8 -> 65.8), T = 32 559.8 -> 554.0 (68 experts:
// 244.1 -> 239.1); in the full model's decode graphs (tests/gpu/bench_ab.py --replays) batch 8 5.559 ->
// 5.425 ms, 32 8.416 -> 8.160.
// sync: [1 + max_tiles] int32, zero at the start (moe_bucket zeroes it); h [N, INTER] bf16 scratch; WFMT = 1: w13, w2
// in e4m3 with scale13 [E, 2·INTER], scale2 [E, HIDDEN] (null for bf16).
#ifndef DEC_WS
#define DEC_WS 0
#endif
#if DEC_WS && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "moe_gemm_tc.cu: DEC_WS = 1 needs sm_90 or newer (tensor-map and bulk copies, mbarriers)"
#endif
#if DEC_WS != 0 && DEC_WS != 1
#error "moe_gemm_tc.cu: DEC_WS must be 0 (every warp copies) or 1 (a producer warp, tensor-map copies)"
#endif
#define GU_BLOCKS (INTER / (BN / 2))
#define DN_BLOCKS (HIDDEN / BN)
// DEC_REVERSE = 1 (KDA_RT_MOE_DEC_REVERSE, the default since 2026-12-04: ops/moe_gemm_tc.py FUSED64_BF16): the items of
// each GEMM in reverse tile order, so the shared expert's bin (the plan's last tiles, each full) comes first instead of
// last: its full tiles are the slowest items (their stages hold the most A rows), and as the launch's last items they
// drain alone.  Every gate/up item is still claimed before every down item, so no wait can block on an unclaimed item;
// the same items compute the same values: bit for bit.
#ifndef DEC_REVERSE
#define DEC_REVERSE 0
#endif
#define ITEM_TILE(tq, ntiles) (DEC_REVERSE ? (ntiles) - 1 - (tq) : (tq))

__device__ __forceinline__ int ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

#if !DEC_WS
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
moe_decode_fused(const bf16* __restrict__ x, const int* __restrict__ sorted_pair, const wtype* __restrict__ w13,
                 const wtype* __restrict__ w2, const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                 const int* __restrict__ expert_off, const int* __restrict__ num_tiles, bf16* __restrict__ h,
                 bf16* __restrict__ y, int* __restrict__ sync, const float* __restrict__ scale13,
                 const float* __restrict__ scale2, const void* map13, const void* map2) {
    KDA_PDL_ENTRY();
    extern __shared__ __align__(128) unsigned char smem_raw[];
    bf16* sa = reinterpret_cast<bf16*>(smem_raw);                 // [STAGES][BM][LDS]
    wtype* sb = reinterpret_cast<wtype*>(sa + STAGES * BM * LDS);  // [STAGES][BN][LDW]
    __shared__ int next_item;

    const int ntiles = __ldcg(num_tiles);
    const int n_gu = ntiles * GU_BLOCKS, n_all = n_gu + ntiles * DN_BLOCKS;
    if (threadIdx.x == 0) next_item = atomicAdd(sync, 1);
    __syncthreads();
    for (int item = next_item; item < n_all; item = next_item) {
        __syncthreads();  // everyone has read next_item
        int* next = &next_item;  // (a __shared__ variable is not captured by reference)
        const auto claim = [sync, next] {
            if (threadIdx.x == 0) *next = atomicAdd(sync, 1);
        };
        const bool gate_up = item < n_gu;
        const int j = gate_up ? item : item - n_gu;
        const int blocks = gate_up ? GU_BLOCKS : DN_BLOCKS;
        const int tq = j / blocks, fb = j - tq * blocks, tile = ITEM_TILE(tq, ntiles);
        const int e = __ldcg(tile_expert + tile), row0 = __ldcg(tile_row + tile);
        const int nrows = min(BM, __ldcg(expert_off + e + 1) - row0);
        if (gate_up) {
            gemm_tile<HIDDEN, 2 * INTER, true, false>(x, sorted_pair, w13, scale13, e, row0, nrows, fb, h, sa, sb, [] {},
                                                      claim);
            __syncthreads();  // every h store of the tile is issued ...
            if (threadIdx.x == 0) {
                __threadfence();  // ... and visible GPU-wide before the count says so
                atomicAdd(sync + 1 + tile, 1);
            }
        } else {
            int* done = sync + 1 + tile;
            gemm_tile<INTER, HIDDEN, false, true>(h, sorted_pair, w2, scale2, e, row0, nrows, fb, y, sa, sb, [done] {
                if (threadIdx.x == 0)
                    while (ld_acquire(done) < GU_BLOCKS) __nanosleep(100);
                __syncthreads();  // the h rows are read with cp.async.cg (L2), after this
            }, claim);
        }
        __syncthreads();  // next_item is written; the stages are free for the next item
    }
}
#else
// DEC_WS = 1 (sm_90+, the default where the tile takes it: moe_gemm_tc.py decode_ws, KDA_RT_MOE_DECODE_WS): the
// same items, products and stores, with the copies taken off the computing warps.  One more warp (the producer)
// claims the items, and for each k step of an item waits until its stage is free (empty[stage]: each of the WARPS
// consumer warps arrives once it has read the stage), then copies the step's weight rows by two tensor-map copies
// (map13 / map2: tensor maps over w13 / w2 as [E·NOUT, K] rows, boxes of BN/2 rows x 128 bytes, ops/tma.py; the B
// stages in their 128-byte swizzle, B_SWZ) and the item's valid A rows by one bulk copy a row, all completing on
// full[stage] (the stage's item id written before the arrival that sets its bytes).  The consumer warps wait on
// full[stage] alone, with no CTA-wide barrier a step, so a warp that is done with a stage goes on to the next while
// the others finish.  A rows past the tile end are not copied: whatever the stage held there only reaches
// accumulator rows that are never stored (an mma row of C reads only its row of A).  Down items: the producer
// copies the first STAGES steps' weights (their stages' bytes expected, no arrival yet), waits for the tile's
// gate/up items (sync[1 + tile], acquire), orders the generic stores it then sees before its bulk reads of h
// (fence.proxy.async), then arrives with h's bytes; a gate/up item's consumers count it done after their stores
// (barrier of the consumer warps, fence, atomicAdd).  The waits end as in the plain form: the producer issues
// every step of an item before it claims the next, so a claimed gate/up item finishes without help.
// After the last item the producer passes the CTA an item id past the end through the next stage.
// H200, 2026-12-03 (tests/gpu/decode_ws_check.sh): e4m3 T = 32 292.4 -> 284.8 us (68 experts: 131.5 -> 126.9),
// bf16 556.3 -> 533.4; the full model's decode replays fp8 batch 32 5.920 -> 5.785 ms, bf16 8.220 -> 8.037.  A
// bulk copy a weight row instead (~144 a step, each a loop over the lanes in SASS) ran 3-4x slower.
#define CONSUMERS (WARPS_M * WARPS_N)
// DEC_A_ASYNC = 1 (KDA_RT_MOE_DEC_A_ASYNC, the default since 2026-12-04: ops/moe_gemm_tc.py FUSED64_BF16): the item's A
// rows (x's gathered token rows, or h's rows) by cp.async from all 32 producer lanes, CPR lanes a row of BK bf16 (16
// bytes each), each lane's row pointer shuffled from the lane that looked it up, instead of one bulk copy a row, which
// compiles to a loop that issues the rows one lane at a time (ELECT) into the one TMA unit the weight boxes also use:
// its cost grows with the tile's live rows (at 64 live rows over the ~1.9 K cycles of DRAM time a stage, a code
// reading's estimate), while the cp.async form's stays a few instructions a row.  The copies complete on full[stage]
// through cp.async.mbarrier.arrive.noinc, one arrival a lane (full's count 1 + 32: the producer's own arrival and its
// lanes'), so a stage's A bytes are no longer counted as transaction bytes.  Same stage layout, same products: bit for
// bit the bulk-copy form.
#ifndef DEC_A_ASYNC
#define DEC_A_ASYNC 0
#endif
#if DEC_A_ASYNC
#define A_ARRIVALS 32
#define CPR (BK * 2 / 16)  // 16-byte chunks of an A row (bf16: BK of them)
static_assert(CPR <= 32 && 32 % CPR == 0 && BM % (32 / CPR) == 0, "DEC_A_ASYNC: whole A rows a pass of the warp");
// the executing thread's earlier cp.async copies complete on bar as one arrival of its pending count (.noinc: counted
// in the barrier's init count)
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
#else
#define A_ARRIVALS 0
#endif
#define SB_STAGE (BN * 128 / (int)sizeof(wtype))  // elements of a B stage
static_assert(BK * sizeof(wtype) == 128 && BN / 2 <= 256, "DEC_WS: one 128-byte k step a row, boxes of <= 256 rows");

static_assert((BM <= 32 || BM == 64) && HIDDEN % BK == 0 && INTER % BK == 0 && INTER % (BN / 2) == 0 &&
              HIDDEN % BN == 0, "DEC_WS: one producer lane an A row (two at BM = 64), whole k steps and feature blocks");

// one arrival on bar (moe_gemm_wg.cu has the same helper; kept here so that common.cuh, which every kernel includes,
// and with it every other kernel's cache key stay as they were)
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// bytes that copies completing on bar will bring, without an arrival (the phase stays open until one)
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void consumer_sync() { asm volatile("barrier.sync 1, %0;" ::"n"(THREADS) : "memory"); }

extern "C" __global__ void __launch_bounds__(THREADS + 32, MIN_BLOCKS)
moe_decode_fused(const bf16* __restrict__ x, const int* __restrict__ sorted_pair, const wtype* __restrict__ w13,
                 const wtype* __restrict__ w2, const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                 const int* __restrict__ expert_off, const int* __restrict__ num_tiles, bf16* __restrict__ h,
                 bf16* __restrict__ y, int* __restrict__ sync, const float* __restrict__ scale13,
                 const float* __restrict__ scale2, const void* map13, const void* map2) {
    KDA_PDL_ENTRY();
    extern __shared__ __align__(128) unsigned char smem_raw[];
    bf16* sa = reinterpret_cast<bf16*>(smem_raw);  // [STAGES][BM][LDS]
    // [STAGES][BN][128 bytes], 1024-byte aligned (the launcher's allocation leaves the room)
    unsigned char* sb_raw = smem_raw + STAGES * BM * LDS * 2;
    wtype* sb = reinterpret_cast<wtype*>(sb_raw + ((1024u - (smem_addr(sb_raw) & 1023u)) & 1023u));
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
    __shared__ int stage_item[STAGES];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s)
            mbar_init(smem_addr(full + s), 1 + A_ARRIVALS), mbar_init(smem_addr(empty + s), CONSUMERS);
    }
    __syncthreads();
    const int ntiles = __ldcg(num_tiles);
    const int n_gu = ntiles * GU_BLOCKS, n_all = n_gu + ntiles * DN_BLOCKS;

    if (warp == CONSUMERS) {  // the producer warp
        int it = 0;  // k steps issued (stage it mod STAGES, its use it / STAGES)
        int item = 0;
        if (lane == 0) item = atomicAdd(sync, 1);
        item = __shfl_sync(0xffffffffu, item, 0);
        for (;; item = __shfl_sync(0xffffffffu, lane == 0 ? atomicAdd(sync, 1) : 0, 0)) {
            if (item >= n_all) {  // the end, through the next stage (no bytes)
                const int stage = it % STAGES;
                mbar_wait(smem_addr(empty + stage), ((it / STAGES) & 1) ^ 1);
                if (lane == 0) stage_item[stage] = n_all, mbar_arrive_expect_tx(smem_addr(full + stage), 0);
#if DEC_A_ASYNC
                cp_async_mbar_arrive_noinc(smem_addr(full + stage));  // (the phase's lane arrivals, no copies)
#endif
                break;
            }
            const bool gate_up = item < n_gu;
            const int j = gate_up ? item : item - n_gu, blocks = gate_up ? GU_BLOCKS : DN_BLOCKS;
            const int tq = j / blocks, fb = j - tq * blocks, tile = ITEM_TILE(tq, ntiles);
            const int e = __ldcg(tile_expert + tile), row0 = __ldcg(tile_row + tile);
            const int nrows = min(BM, __ldcg(expert_off + e + 1) - row0);
            const int K_ = gate_up ? HIDDEN : INTER, KT = K_ / BK;
            // this lane's A rows (lane and, at BM = 64, lane + 32, where < nrows): x's token row for gate/up, h's row
            // for down
            const bf16* arow = nullptr;
            const bf16* arow2 = nullptr;
            if (lane < nrows)
                arow = gate_up ? x + (size_t)(__ldcg(sorted_pair + row0 + lane) / TOPK) * HIDDEN
                               : h + (size_t)(row0 + lane) * INTER;
            if (BM > 32 && lane + 32 < nrows)
                arow2 = gate_up ? x + (size_t)(__ldcg(sorted_pair + row0 + lane + 32) / TOPK) * HIDDEN
                                : h + (size_t)(row0 + lane + 32) * INTER;
            const int nout = gate_up ? 2 * INTER : HIDDEN, half = nout / 2;
            const int f0 = gate_up ? fb * (BN / 2) : fb * BN;
            const unsigned wbytes = BN * BK * sizeof(wtype), abytes = DEC_A_ASYNC ? 0 : nrows * BK * 2;
            // two boxes of BN/2 rows x one k step (gate/up: the gate rows, then their up rows HALF rows on)
            const void* map = gate_up ? map13 : map2;
            const int row_a = e * nout + f0, row_b = row_a + (gate_up ? half : BN / 2);
            const auto copy_weights = [&](int stage, int kt, unsigned bar) {
                if (lane == 0) {
                    const unsigned dst = smem_addr(sb + stage * SB_STAGE);
                    tma_load_2d(dst, map, kt * BK, row_a, bar);
                    tma_load_2d(dst + BN / 2 * 128, map, kt * BK, row_b, bar);
                }
            };
            // down items: the first steps' weights before the wait for h (no kernel's output), each stage held open
            // by its missing arrival until its h rows are copied too (the plain form's EARLY)
            const int early = gate_up ? 0 : min(STAGES, KT);
            for (int kt = 0; kt < early; ++kt) {
                const int i = it + kt, stage = i % STAGES;
                mbar_wait(smem_addr(empty + stage), ((i / STAGES) & 1) ^ 1);
                if (lane == 0) stage_item[stage] = item, mbar_expect_tx(smem_addr(full + stage), wbytes);
                __syncwarp();
                copy_weights(stage, kt, smem_addr(full + stage));
            }
            if (!gate_up) {  // h of the tile stored by its gate/up items
                if (lane == 0)
                    while (ld_acquire(sync + 1 + tile) < GU_BLOCKS) __nanosleep(100);
                __syncwarp();
                asm volatile("fence.proxy.async.global;" ::: "memory");
            }
            for (int kt = 0; kt < KT; ++kt, ++it) {
                const int stage = it % STAGES;
                const unsigned bar = smem_addr(full + stage);
#if DEC_A_ASYNC
                if (kt >= early) mbar_wait(smem_addr(empty + stage), ((it / STAGES) & 1) ^ 1);
                {  // the A rows: CPR lanes a row, 32 / CPR rows a pass (a pass's rows all below 32 or all from 32)
                    const int sub = lane / CPR, chunk = lane % CPR;
#pragma unroll
                    for (int p = 0; p < BM / (32 / CPR); ++p) {
                        const int r0 = p * (32 / CPR), r = r0 + sub;
                        if (r0 >= nrows) break;  // (warp-uniform)
                        const bf16* base = BM > 32 && r0 >= 32 ? arow2 : arow;
                        const bf16* src = reinterpret_cast<const bf16*>(
                            __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(base), r & 31));
                        if (r < nrows) cp_async16(sa + (stage * BM + r) * LDS + chunk * 8, src + kt * BK + chunk * 8, 16);
                    }
                    cp_async_mbar_arrive_noinc(bar);
                }
#endif
                if (kt >= early) {
#if !DEC_A_ASYNC
                    mbar_wait(smem_addr(empty + stage), ((it / STAGES) & 1) ^ 1);
#endif
                    if (lane == 0) stage_item[stage] = item, mbar_arrive_expect_tx(bar, wbytes + abytes);
                    __syncwarp();
                    copy_weights(stage, kt, bar);
                } else {  // (its weights on the way since before the wait)
                    if (lane == 0) mbar_arrive_expect_tx(bar, abytes);
                    __syncwarp();
                }
#if !DEC_A_ASYNC
                if (arow) bulk_copy_g2s(smem_addr(sa + (stage * BM + lane) * LDS), arow + kt * BK, BK * 2, bar);
                if (BM > 32 && arow2)
                    bulk_copy_g2s(smem_addr(sa + (stage * BM + lane + 32) * LDS), arow2 + kt * BK, BK * 2, bar);
#endif
            }
        }
        return;
    }

    // the consumer warps
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    int it = 0;
    for (;;) {
        int stage = it % STAGES;
        mbar_wait(smem_addr(full + stage), (it / STAGES) & 1);
        const int item = stage_item[stage];
        if (item >= n_all) break;
        const bool gate_up = item < n_gu;
        const int j = gate_up ? item : item - n_gu, blocks = gate_up ? GU_BLOCKS : DN_BLOCKS;
        const int tq = j / blocks, fb = j - tq * blocks, tile = ITEM_TILE(tq, ntiles);
        const int e = __ldcg(tile_expert + tile), row0 = __ldcg(tile_row + tile);
        const int nrows = min(BM, __ldcg(expert_off + e + 1) - row0);
        const int KT = (gate_up ? HIDDEN : INTER) / BK;
        const bool active = wm * WM < nrows;  // warp-uniform: rows of this warp exist
        const int mi_live = (nrows - wm * WM + 15) / 16;  // (of MI: this warp's m16 tiles that hold rows)
        float acc[MI][NI][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int t = 0; t < NI; ++t) acc[mi][t][0] = acc[mi][t][1] = acc[mi][t][2] = acc[mi][t][3] = 0.f;
        for (int kt = 0; kt < KT; ++kt, ++it) {
            stage = it % STAGES;
            if (kt) mbar_wait(smem_addr(full + stage), (it / STAGES) & 1);
            if (active) {
                if (gate_up)
                    multiply_stage<true>(acc, sa + stage * BM * LDS, sb + stage * SB_STAGE, wm, wn, lane, mi_live);
                else
                    multiply_stage<false>(acc, sa + stage * BM * LDS, sb + stage * SB_STAGE, wm, wn, lane, mi_live);
            }
            fence_proxy_async_smem();  // this warp's reads of the stage before the producer's next copies into it
            __syncwarp();
            if (lane == 0) mbar_arrive(smem_addr(empty + stage));
        }
        if (gate_up) {
            if (active) store_tile<2 * INTER, true>(acc, scale13, e, row0, nrows, fb * (BN / 2), h, wm, wn, lane);
            consumer_sync();  // every h store of the tile is issued ...
            if (tid == 0) {
                __threadfence();  // ... and visible GPU-wide before the count says so
                atomicAdd(sync + 1 + tile, 1);
            }
        } else if (active) {
            store_tile<HIDDEN, false>(acc, scale2, e, row0, nrows, fb * BN, y, wm, wn, lane);
        }
    }
}
#endif  // DEC_WS
#endif  // FUSED_DECODE
