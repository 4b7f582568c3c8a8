// embed.cu — token embedding gather: out[t, :] = table[ids[t], :].
//
// A pure copy (exact).  Each thread moves 16 bytes (8 bf16) per step; a block copies one row.
// An id outside [0, V) writes a zero row instead of reading out of bounds (the runner never
// produces one; zeros make the mistake visible downstream without a memory fault).
//
// Grid: (T).  Block: THREADS threads striding over the D / 8 vectors of the row.
// Shapes: ids [T] int32, table [V, D] bf16, out [T, D] bf16 (rows 16-byte aligned: D % 8 == 0).
// Compile-time constants: D (row width), THREADS.
#include "common.cuh"

#ifndef D
#error "embed.cu needs -DD=<row width>"
#endif
#if D % 8 != 0
#error "embed.cu: D must be a multiple of 8 (16-byte vectors)"
#endif
#define VECS (D / 8)

// ---------------------------------------------------------------------------------------------
// kernels

extern "C" __global__ void embed_gather(const int* __restrict__ ids, const bf16x8* __restrict__ table,
                                        bf16x8* __restrict__ out, int num_tokens, int vocab) {
    KDA_PDL_ENTRY();
    const int t = blockIdx.x;
    if (t >= num_tokens) return;
    const int id = ids[t];
    const bool valid = id >= 0 && id < vocab;
    const bf16x8* src = table + (size_t)(valid ? id : 0) * VECS;
    bf16x8* dst = out + (size_t)t * VECS;
    bf16x8 zero;
#pragma unroll
    for (int i = 0; i < 8; ++i) zero.v[i] = to_bf16(0.f);
    for (int v = threadIdx.x; v < VECS; v += THREADS) dst[v] = valid ? src[v] : zero;
}
