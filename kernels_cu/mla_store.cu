// mla_store.cu — write this step's MLA latent rows into the paged KV pool (spec §4.1, §4.4).
//
//   for each new token t of sequence b (position pos = context_lens[b] + t - cu_seqlens[b]):
//     c     = kv_a[t, :R]                                   (raw latent, bf16)
//     c_out = bf16( bf16(c * rsqrt(mean(c^2) + eps)) * w )  (fp32 statistics, rounded like rmsnorm.cu)
//     kv_pool[table[b, pos / BLOCK_SIZE], pos % BLOCK_SIZE, :] = [c_out | kv_a[t, R:R+DR]]  (k_pe raw)
//
// The token -> sequence map is found on the device by binary search over cu_seqlens, so a launch
// needs no host data and can be captured in a CUDA graph.  A position whose page slot is past the
// table width or whose page id is negative is skipped (never written anywhere else).
//
// Grid: one block per token (T blocks).  Block: THREADS = R / 8 threads; thread i owns latent
// columns [8i, 8i+8) as one 16-byte vector; threads 0 .. DR/8-1 also copy k_pe.
// Shapes: kv_a [T, ld_kv_a] bf16 (row-strided view: first R+DR columns used, rows 16-byte
// aligned); norm_w [R] bf16; kv_pool [num_blocks, BLOCK_SIZE, R+DR] bf16; cu_seqlens [B+1],
// context_lens [B], block_tables [B, max_pages] int32.
// Compile-time constants: R (latent rank), DR (k_pe width), BLOCK_SIZE (rows per page).
#include "common.cuh"

#if !defined(R) || !defined(DR) || !defined(BLOCK_SIZE)
#error "mla_store.cu needs -DR=<latent rank> -DDR=<k_pe width> -DBLOCK_SIZE=<page rows>"
#endif
#define THREADS (R / 8)
#define ROW (R + DR)

// ---------------------------------------------------------------------------------------------
// helpers

// sequence_of() (token -> sequence by binary search over cu_seqlens) lives in common.cuh.

// ---------------------------------------------------------------------------------------------
// kernels

extern "C" __global__ void __launch_bounds__(THREADS)
mla_store_rows(const bf16* __restrict__ kv_a, int ld_kv_a, const bf16* __restrict__ norm_w,
               bf16* __restrict__ kv_pool, const int* __restrict__ cu_seqlens,
               const int* __restrict__ context_lens, const int* __restrict__ block_tables,
               int num_seqs, int max_pages, float eps) {
    KDA_PDL_ENTRY();
    __shared__ float scratch[THREADS / 32 > 0 ? THREADS / 32 : 1];
    const int t = blockIdx.x;
    if (t >= __ldg(cu_seqlens + num_seqs)) return;
    const int b = sequence_of(cu_seqlens, num_seqs, t);
    const int pos = __ldg(context_lens + b) + t - __ldg(cu_seqlens + b);
    const int slot = pos / BLOCK_SIZE;
    const int page = slot < max_pages ? __ldg(block_tables + (size_t)b * max_pages + slot) : -1;

    const bf16* src = kv_a + (size_t)t * ld_kv_a;
    const bf16x8 c = reinterpret_cast<const bf16x8*>(src)[threadIdx.x];
    float v[8];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) { v[i] = to_f32(c.v[i]); ss += v[i] * v[i]; }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)R + eps);  // every thread reaches the barrier
    if (page < 0) return;

    const bf16x8 w = reinterpret_cast<const bf16x8*>(norm_w)[threadIdx.x];
    bf16x8 y;
#pragma unroll
    for (int i = 0; i < 8; ++i) y.v[i] = to_bf16(round_bf16(v[i] * inv) * to_f32(w.v[i]));
    bf16* dst = kv_pool + ((size_t)page * BLOCK_SIZE + pos % BLOCK_SIZE) * ROW;
    reinterpret_cast<bf16x8*>(dst)[threadIdx.x] = y;
    if (threadIdx.x < DR / 8)
        reinterpret_cast<bf16x8*>(dst + R)[threadIdx.x] = reinterpret_cast<const bf16x8*>(src + R)[threadIdx.x];
}
