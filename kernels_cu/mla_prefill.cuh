// mla_prefill.cuh — the parts the MLA prefill attention kernels share (mla_prefill.cu on mma.sync,
// mla_prefill_wg.cu on wgmma, mla_prefill_fp8.cu on e4m3 wgmma): the online softmax over one tile of scores and the
// epilogue that merges a query row's result with the previous rounds' state and stores it.  The kernels hold scores
// and outputs in the same register layout: per warp 16 query rows, thread (g = lane / 4, c = lane mod 4)
// holds rows g and g + 8; element 4j + e of a [4·N] array is row g + 8·(e / 2), column 8j + 2c + (e mod 2)
// (mma.sync's m16n8 C fragments side by side, and wgmma's m64nN accumulator per warp).
// Needs H, DV, FLAG_HAS_PREV, FLAG_FINAL defined by the including kernel file.
#pragma once
#include "common.cuh"

#define NEG_INF (-__int_as_float(0x7f800000))

// 2^x on the SFU; ex2.approx(-inf) = +0
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

// One CTA's query tile of a round: entry blockIdx.x of tiles [N, 2] (b, i0), the sequence's record of
// seq_rec [B, 8] (tok0, n, ctx, row0, ks, ke, flags, 0), and what both kernels derive from them.
struct QueryTile {
    int tok0, i0, row0, ks, flags;
    int rows;       // valid query rows of this CTA
    int p0;         // position of the CTA's first query
    int kend;       // keys past the last query's position are skipped
    int num_tiles;  // key tiles of BlockN positions
    int mask_from;  // tiles reaching past here need the mask
};

template <int BlockM, int BlockN>
__device__ __forceinline__ QueryTile query_tile(const int* __restrict__ seq_rec, const int* __restrict__ tiles) {
    QueryTile t;
    const int b = __ldg(tiles + 2 * blockIdx.x);
    const int* rec = seq_rec + b * 8;
    t.i0 = __ldg(tiles + 2 * blockIdx.x + 1);
    t.tok0 = __ldg(rec), t.row0 = __ldg(rec + 3), t.ks = __ldg(rec + 4), t.flags = __ldg(rec + 6);
    t.rows = min(BlockM, __ldg(rec + 1) - t.i0);
    t.p0 = __ldg(rec + 2) + t.i0;
    t.kend = min(__ldg(rec + 5), t.p0 + t.rows);
    t.num_tiles = t.kend > t.ks ? (t.kend - t.ks + BlockN - 1) / BlockN : 0;
    t.mask_from = min(t.p0 + 1, t.kend);
    return t;
}

// Causal mask of one tile of SN n8 score blocks s[4·SN] whose first key is kb: keys past the row's position
// (rows g and g + 8 of the warp at positions prow0, prow0 + 8; c4 = lane mod 4) or at / past kend become -inf.  Only tiles
// reaching past mask_from (the first query's position + 1, or kend) have any.
template <int SN>
__device__ __forceinline__ void mask_tile(float* s, int kb, int prow0, int kend, int mask_from, int c4) {
    if (kb + 8 * SN > mask_from) {
#pragma unroll
        for (int j = 0; j < SN; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = kb + j * 8 + 2 * c4 + (e & 1);
                if (key > prow0 + (e >> 1) * 8 || key >= kend) s[4 * j + e] = NEG_INF;
            }
    }
}

// Online softmax, base 2, over one tile of SN n8 score blocks s[4·SN] (raw scores, masked ones -inf):
// s becomes the unnormalised probabilities 2^(scale_log2·(s - m)), m_run / l_run (raw-score max and this
// thread's partial row sums) are updated, and the SN_O n8 output blocks o[4·SN_O] are rescaled.  With
// SKIP_HELD, a warp whose rows all kept their max skips the rescale (by 1: the same bits); H200, 2026-12-01:
// it helps the wgmma kernel and cost the mma.sync one ~7% (tests/gpu/bench_mla_prefill.py), which keeps it off.
// Row r's scores use scale sl[r] (mla_prefill_fp8.cu: the softmax scale times the row's query scale; the bf16
// kernels pass one scale twice); P_SHIFT adds that many to the probabilities' base-2 exponents (their
// row sums too, so o / l is unchanged).
template <int SN, int SN_O, bool SKIP_HELD, int P_SHIFT = 0>
__device__ __forceinline__ void softmax_tile(float* s, float* o, float (&m_run)[2], float (&l_run)[2], const float (&sl)[2]) {
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = m_run[r];
#pragma unroll
        for (int j = 0; j < SN; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float ms = mx == NEG_INF ? 0.f : mx * sl[r];  // no (-inf) - (-inf) for rows without keys yet
        alpha[r] = fast_exp2(m_run[r] * sl[r] - ms);       // 0 while m_run = -inf
        m_run[r] = mx;
        const float shifted = P_SHIFT == 0 ? -ms : (float)P_SHIFT - ms;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < SN; ++j) {
            s[4 * j + 2 * r] = fast_exp2(fmaf(s[4 * j + 2 * r], sl[r], shifted));
            s[4 * j + 2 * r + 1] = fast_exp2(fmaf(s[4 * j + 2 * r + 1], sl[r], shifted));
            sum += s[4 * j + 2 * r] + s[4 * j + 2 * r + 1];
        }
        l_run[r] = l_run[r] * alpha[r] + sum;  // this thread's columns; the quad sums at the end
    }
    if (!SKIP_HELD || __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int j = 0; j < SN_O; ++j) {
            o[4 * j] *= alpha[0];
            o[4 * j + 1] *= alpha[0];
            o[4 * j + 2] *= alpha[1];
            o[4 * j + 3] *= alpha[1];
        }
    }
}

template <int SN, int SN_O, bool SKIP_HELD>
__device__ __forceinline__ void softmax_tile(float* s, float* o, float (&m_run)[2], float (&l_run)[2], float scale_log2) {
    const float sl[2] = {scale_log2, scale_log2};
    softmax_tile<SN, SN_O, SKIP_HELD>(s, o, m_run, l_run, sl);
}

// Epilogue of warp `warp` (rows 16·warp + g, + 8 of the CTA's query tile starting at i0): merge with the
// previous rounds' state (FLAG_HAS_PREV), then write bf16 o / l (FLAG_FINAL) or the new fp32 state.
// o[4·(DV / 8)] in the layout above; m_run in raw score units (row r's scale sl[r], as softmax_tile's);
// rows = valid query rows of the tile.
__device__ __forceinline__ void store_rows(const float* o, float (&l_run)[2], const float (&m_run)[2], int warp, int rows,
                                           size_t tok_i0, int h, int flags, const float (&sl)[2], bf16* __restrict__ out,
                                           int ld_out, float* __restrict__ o_state, float* __restrict__ ml_state) {
    constexpr int ON = DV / 8;
    const int lane = threadIdx.x & 31, g = lane >> 2, c4 = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
        l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
    }
    float mp[2] = {NEG_INF, NEG_INF}, lp[2] = {0.f, 0.f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = warp * 16 + g + 8 * r;
        if ((flags & FLAG_HAS_PREV) && i < rows) {
            const size_t row = (tok_i0 + i) * H + h;
            mp[r] = ml_state[row * 2];
            lp[r] = ml_state[row * 2 + 1];
        }
    }
    __syncwarp();  // every lane of a quad has read its row's (m, l) before lane c4 = 0 overwrites them
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = warp * 16 + g + 8 * r;
        if (i >= rows) continue;
        const size_t row = (tok_i0 + i) * H + h;
        float m = m_run[r] == NEG_INF ? NEG_INF : m_run[r] * sl[r];  // log2 units
        float l = l_run[r], f_new = 1.f, f_prev = 0.f;
        if (flags & FLAG_HAS_PREV) {
            const float mm = fmaxf(m, mp[r]), ms = mm == NEG_INF ? 0.f : mm;
            f_new = fast_exp2(m - ms);  // 0 when this round gave the row no key
            f_prev = fast_exp2(mp[r] - ms);
            l = l * f_new + lp[r] * f_prev;
            m = mm;
        }
        const float* prev = o_state + row * DV + 2 * c4;
        float x[ON][2];
#pragma unroll
        for (int j = 0; j < ON; ++j) {
            x[j][0] = o[4 * j + 2 * r] * f_new;
            x[j][1] = o[4 * j + 2 * r + 1] * f_new;
            if (flags & FLAG_HAS_PREV) {
                const float2 pv = *reinterpret_cast<const float2*>(prev + j * 8);
                x[j][0] += pv.x * f_prev;
                x[j][1] += pv.y * f_prev;
            }
        }
        if (flags & FLAG_FINAL) {
            const float inv = l > 0.f ? 1.f / l : 0.f;
            bf16* dst = out + (tok_i0 + i) * ld_out + h * DV + 2 * c4;
#pragma unroll
            for (int j = 0; j < ON; ++j)
                *reinterpret_cast<__nv_bfloat162*>(dst + j * 8) = __floats2bfloat162_rn(x[j][0] * inv, x[j][1] * inv);
        } else {
            float* dst = o_state + row * DV + 2 * c4;
#pragma unroll
            for (int j = 0; j < ON; ++j) *reinterpret_cast<float2*>(dst + j * 8) = make_float2(x[j][0], x[j][1]);
            if (c4 == 0) {
                ml_state[row * 2] = m;
                ml_state[row * 2 + 1] = l;
            }
        }
    }
}

__device__ __forceinline__ void store_rows(const float* o, float (&l_run)[2], const float (&m_run)[2], int warp, int rows,
                                           size_t tok_i0, int h, int flags, float scale_log2, bf16* __restrict__ out,
                                           int ld_out, float* __restrict__ o_state, float* __restrict__ ml_state) {
    const float sl[2] = {scale_log2, scale_log2};
    store_rows(o, l_run, m_run, warp, rows, tok_i0, h, flags, sl, out, ld_out, o_state, ml_state);
}

// lat[r] = pool row of (b, pos) for every scratch row r of the round, zeros for the padding rows after
// each sequence's segment (pos >= ke: segments start at multiples of 32 rows); one thread per 16-byte chunk.
// seq_rec [B, 8] (tok0, n, ctx, row0, ks, ke, flags, 0), row_start [B + 1]; LATW = R + DR.
template <int LATW, int BS>
__device__ __forceinline__ void gather_latent(const bf16* __restrict__ kv_pool, const int* __restrict__ block_tables,
                                              int max_pages, const int* __restrict__ seq_rec,
                                              const int* __restrict__ row_start, int num_seqs, int num_rows,
                                              bf16* __restrict__ lat) {
    constexpr int CH = LATW / 8;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)num_rows * CH) return;
    const int r = (int)(i / CH), chunk = (int)(i % CH);
    const int b = sequence_of(row_start, num_seqs, r);
    const int pos = __ldg(seq_rec + b * 8 + 4) + r - __ldg(row_start + b);
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (pos < __ldg(seq_rec + b * 8 + 5)) {
        const int page = __ldg(block_tables + (size_t)b * max_pages + pos / BS);
        v = __ldg(reinterpret_cast<const uint4*>(kv_pool + ((size_t)page * BS + pos % BS) * LATW + chunk * 8));
    }
    *reinterpret_cast<uint4*>(lat + (size_t)r * LATW + chunk * 8) = v;
}
