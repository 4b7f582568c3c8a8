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
// columns [8i, 8i+8) as one 16-byte vector; threads 0 .. DR/8-1 also copy k_pe (mla_store.cuh: the same row
// code runs in mla_attn.cu's mla_absorb_q when a small decode step folds the store into it).
// Shapes: kv_a [T, ld_kv_a] bf16 (row-strided view: first R+DR columns used, rows 16-byte
// aligned); norm_w [R] bf16; kv_pool [num_blocks, BLOCK_SIZE, R+DR] bf16; cu_seqlens [B+1],
// context_lens [B], block_tables [B, max_pages] int32.
// Compile-time constants: R (latent rank), DR (k_pe width), BLOCK_SIZE (rows per page).
#include "common.cuh"

#if !defined(R) || !defined(DR) || !defined(BLOCK_SIZE)
#error "mla_store.cu needs -DR=<latent rank> -DDR=<k_pe width> -DBLOCK_SIZE=<page rows>"
#endif
#define THREADS (R / 8)

#include "mla_store.cuh"

extern "C" __global__ void __launch_bounds__(THREADS)
mla_store_rows(const bf16* __restrict__ kv_a, int ld_kv_a, const bf16* __restrict__ norm_w,
               bf16* __restrict__ kv_pool, const int* __restrict__ cu_seqlens,
               const int* __restrict__ context_lens, const int* __restrict__ block_tables,
               int num_seqs, int max_pages, float eps) {
    KDA_PDL_ENTRY();
    __shared__ float scratch[THREADS / 32];
    store_latent_row<THREADS>(kv_a, ld_kv_a, norm_w, kv_pool, cu_seqlens, context_lens, block_tables, num_seqs,
                              max_pages, eps, blockIdx.x, scratch);
}
