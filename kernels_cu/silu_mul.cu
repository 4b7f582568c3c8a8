// silu_mul.cu — activation of the SiLU-gated MLP (spec §5.1) on a fused gate|up projection.
//
//   out[t, i] = bf16( bf16(SiLU(gate[t, i])) * up[t, i] ),  gate = gu[t, :I], up = gu[t, I:]
//
// Rounding follows transformers (act_fn on the bf16 gate projection gives a bf16 tensor, then a
// bf16 × bf16 product): SiLU is computed in fp32 from the bf16 gate and rounded to bf16, the
// product is computed in fp32 and rounded once more.  expf is the accurate libdevice version
// (we build without --use_fast_math).
//
// Grid: (T, ceil(I / 8 / THREADS)) (rows on x: no 65535 limit on T).  Block: THREADS; each thread handles 8 columns with 16-byte
// loads and stores.  Shapes: gu [T, 2I] bf16, out [T, I] bf16.
// Compile-time constants: I (intermediate width, multiple of 8), THREADS.
#include "common.cuh"

#ifndef I
#error "silu_mul.cu needs -DI=<intermediate width>"
#endif
#if I % 8 != 0
#error "silu_mul.cu: I must be a multiple of 8 (16-byte vectors)"
#endif

// ---------------------------------------------------------------------------------------------
// kernels

extern "C" __global__ void silu_mul_fwd(const bf16* __restrict__ gu, bf16* __restrict__ out, int num_rows) {
    KDA_PDL_ENTRY();
    const int t = blockIdx.x;
    const int c = (blockIdx.y * THREADS + threadIdx.x) * 8;
    if (t >= num_rows || c >= I) return;
    const bf16x8 g = *reinterpret_cast<const bf16x8*>(gu + (size_t)t * (2 * I) + c);
    const bf16x8 u = *reinterpret_cast<const bf16x8*>(gu + (size_t)t * (2 * I) + I + c);
    bf16x8 y;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float gf = to_f32(g.v[j]);
        const float act = round_bf16(silu(gf));
        y.v[j] = to_bf16(act * to_f32(u.v[j]));
    }
    *reinterpret_cast<bf16x8*>(out + (size_t)t * I + c) = y;
}
