// quant.cu — weights to e4m3 with one fp32 scale a row on the GPU, bit for bit as loader/quant.quantize_rows does on
// the host (the FP8 format of the expert kernels, WFMT = 1):
//
//   amax = max_k |w[n, k]|;  scale[n] = amax / 448 (fp32 division), or 1 when amax < 448 * FLT_MIN (the row is then
//   stored as zeros: its scale would be subnormal);  q[n, k] = e4m3(w[n, k] / scale[n]) (fp32 division, rounded to
//   nearest even, saturated at +-448, as the host's clip then cast)
//
// A row with a non-finite entry is not quantized: the first such (row, column) in row-major order goes to bad[0]
// (atomicMin of row * K + column, initialised by the launcher to INT64_MAX), which the launcher reports by name.
// Activations (bad = null, the prefill GEMMs' e4m3 sources: nothing is refused mid-step) get a NaN scale for such
// a row instead, so that every product of the row is NaN, as the bf16 products of a non-finite entry would be, and
// their codes are e4m3(x · r) with r = 1 / scale[n] rounded once (loader/quant.quantize_rows reciprocal=True, as
// vLLM's per-token quantization multiplies by its inverted scale) instead of a quotient an element, whose issue cost
// showed where the quantization rode in a GEMM's epilogue (branch next/h-codes, dropped: the gate/up GEMM writing h's
// codes itself took 1.946 ms with quotients and 1.527 with products, against 1.357 writing bf16 h; H200, 2026-12-02,
// T = 16384, its tests/gpu/bench_moe_gemm.py --h-codes).
// Grid: one block per row; block THREADS threads over the row's K / 2 pairs (two passes: the row's max, then the
// codes).  Shapes: w [N, K] bf16 (K even, 4-byte aligned rows), q [N, K] uint8, scale [N] fp32, bad [1] int64.
// Compile-time constants: THREADS (a multiple of 32, at most 1024).
#include "e4m3.cuh"

#ifndef THREADS
#error "quant.cu needs -DTHREADS"
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#error "quant.cu needs sm_89 or newer (cvt.rn.satfinite.e4m3x2.f32)"
#endif

extern "C" __global__ void __launch_bounds__(THREADS) quantize_rows_e4m3(const bf16* __restrict__ w, int K,
                                                                         unsigned char* __restrict__ q,
                                                                         float* __restrict__ scale,
                                                                         unsigned long long* __restrict__ bad) {
    KDA_PDL_ENTRY();
    __shared__ float red[THREADS / 32];
    __shared__ int row_bad;
    const size_t row = blockIdx.x;
    const __nv_bfloat162* src = reinterpret_cast<const __nv_bfloat162*>(w + row * K);
    if (threadIdx.x == 0) row_bad = 0;
    __syncthreads();
    float amax = 0.f;
    for (int p = threadIdx.x; p < K / 2; p += THREADS) {
        const float2 v = __bfloat1622float2(src[p]);
        const bool f0 = isfinite(v.x), f1 = isfinite(v.y);
        if (!f0 || !f1) {
            if (bad) atomicMin(bad, (unsigned long long)(row * K + 2 * p + (f0 ? 1 : 0)));
            row_bad = 1;  // (benign race: every writer stores 1)
        }
        amax = fmaxf(amax, fmaxf(fabsf(v.x), fabsf(v.y)));
    }
    amax = warp_max(amax);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
    __syncthreads();
    if (threadIdx.x < 32) {
        float m = threadIdx.x < THREADS / 32 ? red[threadIdx.x] : 0.f;
        m = warp_max(m);
        if (threadIdx.x == 0) red[0] = m;
    }
    __syncthreads();
    if (row_bad) {  // the launcher refuses the tensor (weights), or the row's products are NaN (activations)
        if (!bad && threadIdx.x == 0) scale[row] = __int_as_float(0x7fc00000);
        return;
    }
    const E4m3Row qr = e4m3_row(red[0]);
    if (threadIdx.x == 0) scale[row] = qr.scale;
    unsigned short* dst = reinterpret_cast<unsigned short*>(q + row * K);
    for (int p = threadIdx.x; p < K / 2; p += THREADS) {
        unsigned short pair = 0;
        if (!qr.zero) {  // (weights: the quotient; activations: x · r)
            const float2 v = __bfloat1622float2(src[p]);
            pair = bad ? e4m3x2_codes(__fdiv_rn(v.x, qr.scale), __fdiv_rn(v.y, qr.scale))
                       : e4m3x2_codes(v.x * qr.r, v.y * qr.r);
        }
        dst[p] = pair;
    }
}

#ifdef ROW_K
// quantize_rows_e4m3_warp (ROW_K defined: the row width, a multiple of 8): activations, the prefill GEMMs' e4m3
// sources (moe_gemm_wg.cu WFMT = 2): one warp a row, THREADS / 32 rows a block, the row's 16-byte pieces held in
// registers between its max and its codes (one read of x), the same codes and scales as the kernel above; a row
// with a non-finite entry gets a NaN scale (nothing is refused), so that its products are NaN.  Shapes: x [rows,
// ROW_K] bf16 (16-byte aligned), q [rows, ROW_K] uint8 (8-byte aligned), scale [rows] fp32.
#define ROW_PIECES (ROW_K / 8)
#define PIECES_A_LANE ((ROW_PIECES + 31) / 32)
static_assert(ROW_K % 8 == 0 && PIECES_A_LANE <= 32, "quantize_rows_e4m3_warp: ROW_K % 8 == 0, at most 8192");

__device__ __forceinline__ float bf16_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned w) { return __uint_as_float(w & 0xFFFF0000u); }

extern "C" __global__ void __launch_bounds__(THREADS) quantize_rows_e4m3_warp(const bf16* __restrict__ x, int rows,
                                                                              unsigned char* __restrict__ q,
                                                                              float* __restrict__ scale) {
    KDA_PDL_ENTRY();
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5);
    if (row >= rows) return;  // (a whole warp: the shuffles below stay full)
    const uint4* src = reinterpret_cast<const uint4*>(x + row * ROW_K);
    uint4 v[PIECES_A_LANE];
    float amax = 0.f;
    bool finite = true;
#pragma unroll
    for (int j = 0; j < PIECES_A_LANE; ++j) {
        const int p = lane + 32 * j;
        v[j] = p < ROW_PIECES ? src[p] : make_uint4(0, 0, 0, 0);
        const unsigned w[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float a = bf16_lo(w[i]), b = bf16_hi(w[i]);
            finite = finite && isfinite(a) && isfinite(b);
            amax = fmaxf(amax, fmaxf(fabsf(a), fabsf(b)));
        }
    }
    amax = warp_max(amax);
    if (!__all_sync(0xFFFFFFFFu, finite)) {
        if (lane == 0) scale[row] = __int_as_float(0x7fc00000);
        return;
    }
    const E4m3Row qr = e4m3_row(amax);
    if (lane == 0) scale[row] = qr.scale;
    uint2* dst = reinterpret_cast<uint2*>(q + row * ROW_K);
#pragma unroll
    for (int j = 0; j < PIECES_A_LANE; ++j) {
        const int p = lane + 32 * j;
        if (p >= ROW_PIECES) break;
        const unsigned w[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
        unsigned c[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) c[i] = qr.zero ? 0u : e4m3x2_codes(bf16_lo(w[i]) * qr.r, bf16_hi(w[i]) * qr.r);
        dst[p] = make_uint2(c[0] | (c[1] << 16), c[2] | (c[3] << 16));
    }
}
#endif
