// mla_store.cuh — one new token's MLA latent row into its page (spec §4.1, §4.4), by one block: mla_store.cu's
// mla_store_rows (R / 8 threads a block) and mla_attn.cu's mla_absorb_q (an extra column of blocks, 256
// threads, when the launcher folds the store into it).  Contract in mla_store.cu's header:
//   c_out = bf16( bf16(c * rsqrt(mean(c^2) + eps)) * w ),  kv_pool[page, slot, :] = [c_out | k_pe]
// Threads 0 .. R/8 - 1 own 8 latent columns each (one 16-byte vector), threads 0 .. DR/8 - 1 also copy k_pe;
// the others add zeros to the sum of squares, so its fp32 order (warp sums, then warps in order) and the row
// are bit-identical for every block size.  Every thread of the block must call it (block_sum's barriers).
// Needs R, DR, BLOCK_SIZE defined; sequence_of and block_sum from common.cuh.
#pragma once

template <int NTHREADS>
__device__ __forceinline__ void store_latent_row(const bf16* __restrict__ kv_a, int ld_kv_a,
                                                 const bf16* __restrict__ norm_w, bf16* __restrict__ kv_pool,
                                                 const int* __restrict__ cu_seqlens,
                                                 const int* __restrict__ context_lens,
                                                 const int* __restrict__ block_tables, int num_seqs, int max_pages,
                                                 float eps, int t, float (&scratch)[NTHREADS / 32]) {
    static_assert(NTHREADS % 32 == 0 && NTHREADS * 8 >= R && R % 256 == 0 && DR % 8 == 0 && DR <= R,
                  "store_latent_row: whole warps, one 16-byte vector of the row a thread");
    if (t >= __ldg(cu_seqlens + num_seqs)) return;  // uniform over the block
    const int b = sequence_of(cu_seqlens, num_seqs, t);
    const int pos = __ldg(context_lens + b) + t - __ldg(cu_seqlens + b);
    const int slot = pos / BLOCK_SIZE;
    const int page = slot < max_pages ? __ldg(block_tables + (size_t)b * max_pages + slot) : -1;
    const bool mine = threadIdx.x < R / 8;

    const bf16* src = kv_a + (size_t)t * ld_kv_a;
    float v[8];
    float ss = 0.f;
    if (mine) {
        const bf16x8 c = reinterpret_cast<const bf16x8*>(src)[threadIdx.x];
#pragma unroll
        for (int i = 0; i < 8; ++i) { v[i] = to_f32(c.v[i]); ss += v[i] * v[i]; }
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)R + eps);  // every thread reaches the barrier
    if (page < 0 || !mine) return;

    const bf16x8 w = reinterpret_cast<const bf16x8*>(norm_w)[threadIdx.x];
    bf16x8 y;
#pragma unroll
    for (int i = 0; i < 8; ++i) y.v[i] = to_bf16(round_bf16(v[i] * inv) * to_f32(w.v[i]));
    bf16* dst = kv_pool + ((size_t)page * BLOCK_SIZE + pos % BLOCK_SIZE) * (R + DR);
    reinterpret_cast<bf16x8*>(dst)[threadIdx.x] = y;
    if (threadIdx.x < DR / 8)
        reinterpret_cast<bf16x8*>(dst + R)[threadIdx.x] = reinterpret_cast<const bf16x8*>(src + R)[threadIdx.x];
}
