// rmsnorm.cu — RMSNorm with optional fused residual add.
//
//   if HAS_RESIDUAL:  h = x + residual  (written back to residual, bf16: the new residual stream)
//   else              h = x
//   y = bf16( bf16(h * rsqrt(mean(h^2) + eps)) * w )        (fp32 statistics, spec §6)
//
// Grid: one block per row (T rows).  Block: THREADS threads, each handling D / THREADS columns
// with D a multiple of THREADS.  Shapes: x, residual, y [T, D] bf16; w [D] bf16.
// Compile-time constants: D (row width), THREADS, HAS_RESIDUAL (0/1).
#include "common.cuh"

#ifndef D
#error "rmsnorm.cu needs -DD=<row width>"
#endif
#define PER_THREAD (D / THREADS)

extern "C" __global__ void rmsnorm_fwd(const bf16* __restrict__ x, bf16* __restrict__ residual,
                                       const bf16* __restrict__ w, bf16* __restrict__ y, int num_rows, float eps) {
    KDA_PDL_ENTRY();
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
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int c = threadIdx.x + i * THREADS;
        y[base + c] = to_bf16(round_bf16(h[i] * inv) * to_f32(w[c]));
    }
}
