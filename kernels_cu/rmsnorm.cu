// rmsnorm.cu — RMSNorm with optional fused residual add.
//
//   if HAS_RESIDUAL:  h = x + residual  (written back to residual, bf16: the new residual stream)
//   else              h = x
//   y = bf16( bf16(h * rsqrt(mean(h^2) + eps)) * w )        (fp32 statistics, spec §6)
//
// Grid: one block per row (T rows).  Block: THREADS threads, each handling D / THREADS columns
// with D a multiple of THREADS.  Shapes: x, residual, y [T, D] bf16; w [D] bf16.
// Compile-time constants: D (row width), THREADS, HAS_RESIDUAL (0/1), E4M3_OUT (0/1, below).
//
// E4M3_OUT = 1 (rmsnorm_fwd_e4m3, sm_89+): y's row also as e4m3 codes with one fp32 scale, the source rows of the
// MoE's FP8 prefill GEMMs (moe_gemm_wg.cu WFMT = 2), the same codes and scale as quant.cu gives the stored bf16 row
// (amax / 448, __fdiv_rn; codes of y · __frcp_rn(scale), rounded to nearest even, saturated; 1 with zero codes
// below 448 * FLT_MIN; a NaN scale for a row with a non-finite value), so the MoE need not read y again to quantize
// it.  Shapes: q [T, D] uint8, qs [T] fp32.
#include "e4m3.cuh"

#ifndef D
#error "rmsnorm.cu needs -DD=<row width>"
#endif
#ifndef E4M3_OUT
#define E4M3_OUT 0
#endif
#if E4M3_OUT && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#error "rmsnorm.cu E4M3_OUT needs sm_89 or newer (cvt.rn.satfinite.e4m3x2.f32)"
#endif
#define PER_THREAD (D / THREADS)

// one row: y (and with Codes its e4m3 codes q and scale qs, E4M3_OUT above)
template <bool Codes>
__device__ __forceinline__ void rmsnorm_row(const bf16* __restrict__ x, bf16* __restrict__ residual,
                                            const bf16* __restrict__ w, bf16* __restrict__ y, int num_rows, float eps,
                                            unsigned char* __restrict__ q, float* __restrict__ qs) {
    __shared__ float scratch[THREADS / 32];
    const int row = blockIdx.x;
    if (row >= num_rows) return;
    const size_t base = (size_t)row * D;
    float h[PER_THREAD];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int c = threadIdx.x + i * THREADS;
        float v = to_f32(x[base + c]);
#if HAS_RESIDUAL
        // the residual stream is bf16 in every reference: round the sum before normalising it
        v = round_bf16(v + to_f32(residual[base + c]));
        residual[base + c] = to_bf16(v);
#endif
        h[i] = v;
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)D + eps);
    float amax = 0.f;
    bool finite = true;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int c = threadIdx.x + i * THREADS;
        const bf16 out = to_bf16(round_bf16(h[i] * inv) * to_f32(w[c]));
        y[base + c] = out;
        if constexpr (Codes) {
            h[i] = to_f32(out);  // the stored value: its codes
            finite = finite && isfinite(h[i]);
            amax = fmaxf(amax, fabsf(h[i]));
        }
    }
    if constexpr (Codes) {
        // the row's max over the block (block_sum's barrier at its end leaves scratch free), and whether any value
        // is not finite (then the scale is NaN, as quant.cu's, and the codes are left as they are)
        amax = warp_max(amax);
        if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = amax;
        const bool bad = __syncthreads_or(!finite);
#pragma unroll
        for (int k = 0; k < THREADS / 32; ++k) amax = fmaxf(amax, scratch[k]);
        if (bad) {
            if (threadIdx.x == 0) qs[row] = __int_as_float(0x7fc00000);
            return;
        }
        const E4m3Row qr = e4m3_row(amax);  // (quant.cu's activations: y · (1 / scale))
        if (threadIdx.x == 0) qs[row] = qr.scale;
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i)
            q[base + threadIdx.x + i * THREADS] = qr.zero ? 0 : (unsigned char)(e4m3x2_codes(h[i] * qr.r, 0.f) & 0xFF);
    }
}

extern "C" __global__ void rmsnorm_fwd(const bf16* __restrict__ x, bf16* __restrict__ residual,
                                       const bf16* __restrict__ w, bf16* __restrict__ y, int num_rows, float eps) {
    KDA_PDL_ENTRY();
    rmsnorm_row<false>(x, residual, w, y, num_rows, eps, nullptr, nullptr);
}

#if E4M3_OUT
extern "C" __global__ void rmsnorm_fwd_e4m3(const bf16* __restrict__ x, bf16* __restrict__ residual,
                                            const bf16* __restrict__ w, bf16* __restrict__ y, int num_rows, float eps,
                                            unsigned char* __restrict__ q, float* __restrict__ qs) {
    KDA_PDL_ENTRY();
    rmsnorm_row<true>(x, residual, w, y, num_rows, eps, q, qs);
}
#endif
