// mla_prefill_fp8.cu — MLA prefill attention, expanded form, with FP8 (e4m3) products on Hopper's warpgroup MMA
// (sm_90a only: KDA_RT_HOPPER): an opt-in, lossy variant of mla_prefill_wg.cu (ops/mla_prefill.py, fp8=True) for
// long prompts, where the attention's FLOPs grow with the square of the length.  Same rounds, masking, running
// state and epilogue (mla_prefill.cuh); the operands are e4m3 codes with fp32 scales, made per round by the
// quantization kernels below from the bf16 scratch of mla_prefill_wg.cu:
//
//   K   kn8 [H, ld_rows, DN] = e4m3(kn / sk_h)       sk_h = amax(kn[h]) / 448 over the round's rows (one a head)
//       kpe8 [ld_rows, DR]   = e4m3(k_pe / s_pe)     s_pe = amax(k_pe) / 448 (k_pe is shared by the heads)
//   Q   q8 [T, H·DQK]        = e4m3(q' / qs_t,h)     q' = q ∘ (sk_h on the DN dims, s_pe on the DR dims),
//                                                     qs_t,h = amax(q'[t, h]) / 448 (one a query row)
//       so q · k = qs_t,h · (q8 · k8) exactly in the codes' values: the score scale is a row factor.
//   V   vt8 [H, DV, ld_rows] = e4m3(vt / sv_h,d)     sv_h,d = amax over the round's keys of channel d (a Vᵀ row);
//       it factors out of the sum over keys and multiplies the output column at the end.  Within every 32-key
//       group the codes are stored permuted (position L holds key vperm(L)), so that the probabilities of the
//       score accumulators, packed in place, are the A fragment of the P·V product (below).
//   P   e4m3 of 2^(s·sl − m + 8): the probabilities times 256 (softmax_tile's P_SHIFT; the row sums carry the same
//       factor, so o / l is unchanged): probabilities down to 2^-14 keep normal codes (3 mantissa bits), down to
//       2^-17 subnormal ones, instead of 2^-6 and 2^-9 unscaled.
// The K and V scales are the round's, shared by the sequences in it (as a prefill step's activation scales are the
// step's rows'): a sequence's outputs can move with what it is batched with, within the scheme's error.
// Codes as e4m3.cuh's row rule (scale = amax / 448, codes of x · (1 / scale), clamped, round to nearest even).
//
// Geometry.  Grid (num_tiles, H), 256 threads = two warpgroups staggered as in mla_prefill_wg.cu (one's softmax under
// the other's products); a CTA owns BLOCK_M = 128 query rows; key tiles of BLOCK_N = 128 positions (twice the bf16
// kernel's: an e4m3 product takes half the time, so the fixed cost of a tile is spread over twice the keys):
//   S[64, 128] = Q·Kᵀ: DQK/32 = 6 wgmma.m64n128k32 e4m3, A = Q codes from registers (ldmatrix), B = K K-major;
//   O[64, 128] += P·V: 4 wgmma.m64n128k32, A = P codes from registers, B = Vᵀ K-major (keys contiguous).
// The A fragment of a k32 slice wants bytes 4c .. 4c + 3 of rows g and g + 8 (and 16 + 4c ..), while a thread's score
// accumulators hold keys 8j + 2c, 8j + 2c + 1 of n8-blocks j = 4kk .. 4kk + 3: packing blocks (4kk, 4kk + 1) and
// (4kk + 2, 4kk + 3) pairwise puts key vperm(L) at A position L, vperm(L) = 16·(L / 16) + 8·((L / 2) mod 2) +
// 2·((L / 4) mod 4) + L mod 2, and the Vᵀ codes are stored in that order (mla_fp8_quant_v), so no shuffle is needed.
// Shared memory, 128-byte rows, 128-byte swizzle, 1024-byte aligned sub-tiles: Q as two [128][128 B] sub-tiles (codes
// 0..127, 128..191); per stage K as two [128 keys][128 B] sub-tiles (k_nope; k_pe in the first 64 bytes) and Vᵀ as one
// [128 dv][128 keys]: 48 KB a stage, 4 stages + Q = 224 KB (one CTA an SM).
// Compile-time constants: H, R, DN (128), DR (64), DV (128), STAGES (3 or 4), FLAG_HAS_PREV, FLAG_FINAL.
#include "e4m3.cuh"
#include "mla_prefill.cuh"
#include "mla_prefill_wg.cuh"

#if !defined(H) || !defined(R) || !defined(DN) || !defined(DR) || !defined(DV) || !defined(STAGES) || \
    !defined(FLAG_HAS_PREV) || !defined(FLAG_FINAL)
#error "mla_prefill_fp8.cu needs -DH -DR -DDN -DDR -DDV -DSTAGES -DFLAG_HAS_PREV -DFLAG_FINAL"
#endif

#define THREADS 256
#define BLOCK_M 128
#define BLOCK_N 128
#define AHEAD (STAGES - 2)  // key tiles in flight
#define DQK (DN + DR)
#define LATW (R + DR)
#define SUB 16384                       // one [128][128 B] sub-tile
#define Q_BYTES (2 * SUB)
#define STAGE_BYTES (3 * SUB)           // K nope, K pe, Vᵀ
#define QK_STEPS (DQK / 32)             // k32 slices of Q·Kᵀ
#define PV_STEPS (BLOCK_N / 32)         // k32 slices of P·V
#define SN (BLOCK_N / 8)                // n8 score blocks per thread
#define ON (DV / 8)                     // n8 output blocks per thread
#define P_EXP 8                         // the probabilities' codes are of p · 2^P_EXP

static_assert(DN == 128 && DR == 64 && DV == 128, "mla_prefill_fp8: DN = 128, DR = 64, DV = 128");
static_assert(STAGES == 3 || STAGES == 4, "mla_prefill_fp8: 3 or 4 stages");

// key position (within its 32-key group) of the Vᵀ code stored at position L: see the header
__device__ __forceinline__ int vperm(int L) { return 16 * (L >> 4) + 8 * ((L >> 1) & 1) + 2 * ((L >> 2) & 3) + (L & 1); }

// ------------------------------------------------------------------------------------------------------------------
// Quantization of a round's scratch (ops/mla_prefill.py: amax, then k and v, then q).

__device__ __forceinline__ float block_max(float m) {
    __shared__ float part[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = m;
    __syncthreads();
    m = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.f;
    if (threadIdx.x < 32) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (threadIdx.x == 0) part[0] = m;
    }
    __syncthreads();
    m = part[0];
    __syncthreads();  // part is reused by a later call
    return m;
}

__device__ __forceinline__ float amax8(uint4 v) {
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(p[i]);
        m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
    return m;
}

// Grid-stride walk over the 8-element chunks of the keys blockIdx.y names (y < H: the rows of kn[y]; y = H: lat's k_pe
// columns), rows r < rows: f(the chunk's first element, r, its column within the row).
template <class F>
__device__ __forceinline__ void for_key_chunks(const bf16* __restrict__ kn, const bf16* __restrict__ lat, int ld_rows,
                                               int rows, F&& f) {
    const int y = blockIdx.y, per_row = (y < H ? DN : DR) / 8;
    const long long n = (long long)rows * per_row;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / per_row;
        const int c = (int)(i % per_row) * 8;
        f(y < H ? kn + ((size_t)y * ld_rows + r) * DN + c : lat + (size_t)r * LATW + R + c, r, c);
    }
}

// amax[h] (h < H) = max |kn[h, r, :]| and amax[H] = max |lat[r, R:R + DR]| over rows r < rows, as float bits
// (non-negative floats order as their bits); amax zeroed by the caller.  Grid (blocks, H + 1), 256 threads.
extern "C" __global__ void __launch_bounds__(256) mla_fp8_amax(const bf16* __restrict__ kn, const bf16* __restrict__ lat,
                                                                int ld_rows, int rows, unsigned* __restrict__ amax) {
    KDA_PDL_ENTRY();
    float m = 0.f;
    for_key_chunks(kn, lat, ld_rows, rows, [&](const bf16* src, long long, int) {
        m = fmaxf(m, amax8(__ldg(reinterpret_cast<const uint4*>(src))));
    });
    m = block_max(m);
    if (threadIdx.x == 0) atomicMax(amax + blockIdx.y, __float_as_uint(m));
}

__device__ __forceinline__ uint2 codes8(uint4 v, float r) {
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(p[i]);
        w[i] = e4m3x2_codes(f.x * r, f.y * r);
    }
    return make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
}

// kn8 = codes of kn[h] / sk_h (y = h < H), kpe8 = codes of lat's k_pe / s_pe (y = H); 8 elements a thread.
extern "C" __global__ void __launch_bounds__(256) mla_fp8_quant_k(const bf16* __restrict__ kn, const bf16* __restrict__ lat,
                                                                   int ld_rows, int rows, const unsigned* __restrict__ amax,
                                                                   unsigned char* __restrict__ kn8,
                                                                   unsigned char* __restrict__ kpe8) {
    KDA_PDL_ENTRY();
    const int y = blockIdx.y;
    const E4m3Row q = e4m3_row(__uint_as_float(__ldg(amax + y)));
    for_key_chunks(kn, lat, ld_rows, rows, [&](const bf16* src, long long r, int c) {
        unsigned char* dst = y < H ? kn8 + ((size_t)y * ld_rows + r) * DN + c : kpe8 + (size_t)r * DR + c;
        *reinterpret_cast<uint2*>(dst) = q.zero ? make_uint2(0u, 0u) : codes8(__ldg(reinterpret_cast<const uint4*>(src)), q.r);
    });
}

// One CTA a Vᵀ row (h, d) = blockIdx.x: sv[h·DV + d] = amax over keys r < rows / 448, then the codes, each 32-key
// group permuted (vt8[.., 32i + L] = code of vt[.., 32i + vperm(L)]).  rows is a multiple of 32.
extern "C" __global__ void __launch_bounds__(256) mla_fp8_quant_v(const bf16* __restrict__ vt, int ld_rows, int rows,
                                                                   unsigned char* __restrict__ vt8, float* __restrict__ sv) {
    KDA_PDL_ENTRY();
    const bf16* src = vt + (size_t)blockIdx.x * ld_rows;
    unsigned char* dst = vt8 + (size_t)blockIdx.x * ld_rows;
    float m = 0.f;
    for (int i = threadIdx.x; i < rows / 8; i += blockDim.x) m = fmaxf(m, amax8(__ldg(reinterpret_cast<const uint4*>(src) + i)));
    const E4m3Row q = e4m3_row(block_max(m));
    if (threadIdx.x == 0) sv[blockIdx.x] = q.scale;
    for (int gi = threadIdx.x; gi < rows / 32; gi += blockDim.x) {
        float x[32];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(src + 32 * gi) + c);
            const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 f = __bfloat1622float2(p[e]);
                x[8 * c + 2 * e] = f.x * q.r, x[8 * c + 2 * e + 1] = f.y * q.r;
            }
        }
        unsigned w[8];
#pragma unroll
        for (int k = 0; k < 8; ++k)
            w[k] = q.zero ? 0u : (e4m3x2_codes(x[vperm(4 * k)], x[vperm(4 * k + 1)]) |
                                  ((unsigned)e4m3x2_codes(x[vperm(4 * k + 2)], x[vperm(4 * k + 3)]) << 16));
        uint4* d4 = reinterpret_cast<uint4*>(dst + 32 * gi);
        d4[0] = make_uint4(w[0], w[1], w[2], w[3]);
        d4[1] = make_uint4(w[4], w[5], w[6], w[7]);
    }
}

// One warp a query row (t, h): q8[t, h·DQK ..] = codes of q' / qs, qs[t·H + h] = amax(q') / 448 with q' = q ∘ the K
// scales (sk_h on the first DN dims, s_pe on the rest, from amax).  Lanes 0 .. DQK/8 - 1 take 8 dims each.
extern "C" __global__ void __launch_bounds__(256) mla_fp8_quant_q(const bf16* __restrict__ q, int ld_q, int T,
                                                                   const unsigned* __restrict__ amax,
                                                                   unsigned char* __restrict__ q8, float* __restrict__ qs) {
    KDA_PDL_ENTRY();
    static_assert(DQK / 8 <= 32, "one lane an 8-dim chunk");
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= (long long)T * H) return;
    const int lane = threadIdx.x & 31, h = (int)(row % H);
    const long long t = row / H;
    const bool on = lane < DQK / 8;
    const float sk = e4m3_row(__uint_as_float(__ldg(amax + (lane < DN / 8 ? h : H)))).scale;
    float x[8] = {};
    float m = 0.f;
    if (on) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(q + (size_t)t * ld_q + h * DQK + lane * 8));
        const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float2 f = __bfloat1622float2(p[e]);
            x[2 * e] = f.x * sk, x[2 * e + 1] = f.y * sk;
            m = fmaxf(m, fmaxf(fabsf(x[2 * e]), fabsf(x[2 * e + 1])));
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const E4m3Row qr = e4m3_row(m);
    if (lane == 0) qs[row] = qr.scale;
    if (on) {
        unsigned w[2] = {0u, 0u};
        if (!qr.zero) {
#pragma unroll
            for (int k = 0; k < 2; ++k)
                w[k] = e4m3x2_codes(x[4 * k] * qr.r, x[4 * k + 1] * qr.r) |
                       ((unsigned)e4m3x2_codes(x[4 * k + 2] * qr.r, x[4 * k + 3] * qr.r) << 16);
        }
        *reinterpret_cast<uint2*>(q8 + (size_t)t * (H * DQK) + h * DQK + lane * 8) = make_uint2(w[0], w[1]);
    }
}

// ------------------------------------------------------------------------------------------------------------------
// The attention kernel

// four codes of p·2^P_EXP (already shifted by softmax_tile), a at the lowest byte
__device__ __forceinline__ unsigned p_codes(float a, float b, float c, float d) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    return (unsigned)lo | ((unsigned)hi << 16);
}

// Per-thread copy geometry (fixed for the CTA): thread t copies 16-byte chunk lch = t mod 8 of rows t / 8 + 32·i
// of the K nope and Vᵀ sub-tiles, and chunk t mod 4 of rows t / 4 + 64·i of the k_pe sub-tile.
struct KvCopy8 {
    const unsigned char* kn_src;  // scratch row 0 of head h, this thread's chunk
    const unsigned char* pe_src;  // scratch row 0, this thread's k_pe chunk
    const unsigned char* v_src;   // Vᵀ row h·DV + lrow, column row0 - ks + 16·lch
    int lrow, lch, prow, pch;
};

__device__ __forceinline__ void load_kv8(const KvCopy8& c, unsigned stage, int ld_rows, int row0, int ks, int kb, int kend) {
#pragma unroll
    for (int i = 0; i < BLOCK_N / 32; ++i) {
        const int pos = kb + c.lrow + 32 * i;
        const bool ok = pos < kend;
        const size_t r = ok ? (size_t)(row0 + pos - ks) : 0;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(stage + swz(c.lrow + 32 * i, c.lch)),
                     "l"(c.kn_src + r * DN), "r"(ok ? 16 : 0));
    }
#pragma unroll
    for (int i = 0; i < BLOCK_N / 64; ++i) {
        const int pos = kb + c.prow + 64 * i;
        const bool ok = pos < kend;
        const size_t r = ok ? (size_t)(row0 + pos - ks) : 0;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(stage + SUB + swz(c.prow + 64 * i, c.pch)),
                     "l"(c.pe_src + r * DR), "r"(ok ? 16 : 0));
    }
    const bool ok = kb + 16 * c.lch < kend;
    const unsigned char* src = c.v_src + (ok ? kb : ks - row0 - 16 * c.lch);  // not ok: column 0 of the row, nothing read
#pragma unroll
    for (int i = 0; i < DV / 32; ++i)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(stage + 2 * SUB + swz(c.lrow + 32 * i, c.lch)),
                     "l"(src + (size_t)32 * i * ld_rows), "r"(ok ? 16 : 0));
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
mla_prefill_attn_fp8(const unsigned char* __restrict__ q8, const float* __restrict__ qs,
                     const unsigned char* __restrict__ kn8, const unsigned char* __restrict__ kpe8,
                     const unsigned char* __restrict__ vt8, const float* __restrict__ sv, int ld_rows,
                     const int* __restrict__ seq_rec, const int* __restrict__ tiles, float scale_log2,
                     bf16* __restrict__ out, int ld_out, float* __restrict__ o_state, float* __restrict__ ml_state) {
    KDA_PDL_ENTRY();
    extern __shared__ unsigned char smem_raw[];
    const unsigned base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // the launcher adds 1 KB for this alignment
    const unsigned q_base = base, stage0 = base + Q_BYTES;

    const int h = blockIdx.y;
    const QueryTile qt = query_tile<BLOCK_M, BLOCK_N>(seq_rec, tiles);
    const int row0 = qt.row0, ks = qt.ks, rows = qt.rows, p0 = qt.p0, kend = qt.kend;
    const int num_tiles = qt.num_tiles, mask_from = qt.mask_from;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int g = lane >> 2, c4 = lane & 3;
    const size_t tok = (size_t)(qt.tok0 + qt.i0);

    float o[4 * ON];
#pragma unroll
    for (int j = 0; j < 4 * ON; ++j) o[j] = 0.f;
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};
    float s[4 * SN] = {};
    unsigned qa[QK_STEPS][4];
    float sl[2];  // rows g, g + 8: the softmax scale times the row's query scale
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = warp * 16 + g + 8 * r;
        sl[r] = scale_log2 * (i < rows ? __ldg(qs + (tok + i) * H + h) : 1.f);
    }

    KvCopy8 cp;
    cp.lrow = threadIdx.x >> 3, cp.lch = threadIdx.x & 7, cp.prow = threadIdx.x >> 2, cp.pch = threadIdx.x & 3;
    cp.kn_src = kn8 + (size_t)h * ld_rows * DN + cp.lch * 16;
    cp.pe_src = kpe8 + cp.pch * 16;
    cp.v_src = vt8 + ((size_t)h * DV + cp.lrow) * ld_rows + (row0 - ks) + 16 * cp.lch;
    if (num_tiles > 0) {  // Q and tiles 0 .. AHEAD - 1, one commit group each
        for (int i = threadIdx.x; i < BLOCK_M * (DQK / 16); i += THREADS) {
            const int row = i / (DQK / 16), ch = i % (DQK / 16);
            const bool ok = row < rows;
            const unsigned char* src = q8 + (ok ? tok + row : 0) * (size_t)(H * DQK) + h * DQK + ch * 16;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(q_base + (ch / 8) * SUB + swz(row, ch % 8)),
                         "l"(src), "r"(ok ? 16 : 0));
        }
#pragma unroll
        for (int t = 0; t < AHEAD; ++t) {
            if (t < num_tiles) load_kv8(cp, stage0 + t * STAGE_BYTES, ld_rows, row0, ks, ks + t * BLOCK_N, kend);
            cp_async_commit();
        }
    }
    const int prow0 = p0 + warp * 16 + g;

    auto scores = [&](unsigned k_tile) {  // s = Q·Kᵀ of one tile (waits for it)
        fence_regs(s);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < QK_STEPS; ++kk)  // the first slice overwrites s
            wgmma_m64n128k32_e4m3_rs(s, qa[kk], smem_desc(k_tile + (kk / 4) * SUB + 32 * (kk % 4)), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(s);
    };
    auto attend = [&](int kb, unsigned v_tile) {  // mask, softmax, O += P·V of the tile in s (issued, not waited)
        mask_tile<SN>(s, kb, prow0, kend, mask_from, c4);
        softmax_tile<SN, ON, true, P_EXP>(s, o, m_run, l_run, sl);
        unsigned pa[PV_STEPS][4];  // blocks (4kk, 4kk + 1) and (4kk + 2, 4kk + 3): see the header
#pragma unroll
        for (int kk = 0; kk < PV_STEPS; ++kk) {
            const float* b = s + 16 * kk;
            pa[kk][0] = p_codes(b[0], b[1], b[4], b[5]);
            pa[kk][1] = p_codes(b[2], b[3], b[6], b[7]);
            pa[kk][2] = p_codes(b[8], b[9], b[12], b[13]);
            pa[kk][3] = p_codes(b[10], b[11], b[14], b[15]);
        }
        fence_regs(o);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < PV_STEPS; ++kk) wgmma_m64n128k32_e4m3_rs(o, pa[kk], smem_desc(v_tile + 32 * kk));
        wgmma_commit();
    };

    staggered_key_tiles<STAGES, BLOCK_N>(
        num_tiles, ks, wg, stage0, STAGE_BYTES, 2 * SUB,
        [&](unsigned stage, int kb) { load_kv8(cp, stage, ld_rows, row0, ks, kb, kend); },
        [&] {
#pragma unroll
            for (int kk = 0; kk < QK_STEPS; ++kk)
                ldmatrix_x4(qa[kk], smem_raw + (q_base - smem_addr(smem_raw)) + (kk / 4) * SUB +
                                        swz(warp * 16 + (lane & 15), 2 * (kk % 4) + (lane >> 4)));
        },
        scores, attend, [&] { fence_regs(o); });
#pragma unroll
    for (int j = 0; j < ON; ++j) {  // the values' channel scales
        const float2 f = __ldg(reinterpret_cast<const float2*>(sv + h * DV + 8 * j + 2 * c4));
        o[4 * j] *= f.x, o[4 * j + 1] *= f.y, o[4 * j + 2] *= f.x, o[4 * j + 3] *= f.y;
    }
    store_rows(o, l_run, m_run, warp, rows, tok, h, qt.flags, sl, out, ld_out, o_state, ml_state);
}
