// mla_prefill.cu — MLA prefill attention, expanded form (spec §4.3): causal varlen flash attention
// over keys decompressed from the paged latent cache.
//
// Per "round" (kda_rt/cuda/ops/mla_prefill.py plans them), sequence b contributes the key positions
// [ks_b, ke_b) of its context, stored at scratch rows row0_b .. row0_b + ke_b - ks_b:
//   lat[r]             = pool row [c | k_pe] of (b, pos)             (mla_prefill_gather, 576 wide)
//   kv[r, h]           = [k_nope_h | v_h] = W_kvb_h · c               (cuBLAS, [rows, H·(DN+DV)])
// Query i of sequence b (absolute position p = ctx_b + i, token t = tok0_b + i) and head h:
//   s[τ]  = q[t, h] · [k_nope_h[τ] | k_pe[τ]]        for ks_b <= τ <= min(p, ke_b - 1)
//   o     = Σ softmax(scale · s)[τ] · v_h[τ]
// with the online softmax in fp32, base 2 (scores times scale·log2 e).  When a sequence's keys
// span several rounds, each round merges into an fp32 running state (o unnormalised, m in log2
// units, l) per (token, head): flag HAS_PREV reads it, flag FINAL writes bf16 o / l to `out`
// instead of the state.
//
// mla_prefill_attn: FA2-style.  Grid (num_tiles, H): a CTA owns BLOCK_M = 16·NUM_WARPS query rows
// of one (sequence, head); warp w owns rows 16w .. 16w + 15.  Key tiles of BLOCK_N = 64 positions
// stream through two shared-memory stages (cp.async, next tile in flight while this one is used).
// Per tile and warp: S[16, 64] = Q·Kᵀ (12 k-steps of mma.sync m16n8k16 bf16 -> fp32, Q fragments
// kept in registers, K by ldmatrix), mask (only tiles that reach past the first row's position or
// the key end), online softmax in registers, P (bf16) reused as the A operand of O += P·V (V by
// ldmatrix.trans).  Tiles past the last query's position are never visited (causal skip).
// Key rows past the key end are zero-filled by cp.async, so scratch garbage never reaches the math;
// masked scores are -inf and a row whose max is -inf uses 0 as its offset (no inf - inf).
// Shared memory: (BLOCK_M·LDQ + 2·BLOCK_N·(LDK + LDV))·2 bytes; rows padded by 16 bytes so each
// ldmatrix phase hits 32 distinct banks (≈137 KB at 8 warps: one CTA per SM).
//
// Shapes: q [T, ld_q] bf16, head h at columns h·(DN+DR) .. (nope then pe); kv [rows, H·(DN+DV)]
// bf16; lat [rows, R+DR] bf16 (k_pe at column R); out [T, ld_out] bf16, head h at h·DV;
// o_state [T, H, DV] fp32, ml_state [T, H, 2] fp32 (m log2 units, l).
// seq_rec [B, 8] int32: tok0, n, ctx, row0, ks, ke, flags, 0.  tiles [num_tiles, 2]: (b, i0).
// row_start [B+1]: row0 of each sequence then the round's row count (gather's binary search).
// Compile-time constants (all from ops/mla_prefill.py): H, R, DN, DR, DV, BLOCK_SIZE (pool page),
// NUM_WARPS, BLOCK_N (keys per tile), LDQ / LDK / LDV (smem row strides in bf16, padded by 16 B
// against bank conflicts), FLAG_HAS_PREV / FLAG_FINAL (seq_rec flags).  sm_80+.
#include "mla_prefill.cuh"

#if !defined(H) || !defined(R) || !defined(DN) || !defined(DR) || !defined(DV) || !defined(BLOCK_SIZE) || \
    !defined(NUM_WARPS) || !defined(BLOCK_N) || !defined(LDQ) || !defined(LDK) || !defined(LDV) || \
    !defined(FLAG_HAS_PREV) || !defined(FLAG_FINAL)
#error "mla_prefill.cu needs -DH -DR -DDN -DDR -DDV -DBLOCK_SIZE -DNUM_WARPS -DBLOCK_N -DLDQ -DLDK -DLDV -DFLAG_*"
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "mla_prefill.cu needs sm_80 or newer (mma.sync bf16, cp.async)"
#endif

#define THREADS (NUM_WARPS * 32)
#define BLOCK_M (NUM_WARPS * 16)     // query rows per CTA
#define DQK (DN + DR)                // score depth (192)
#define KVW (H * (DN + DV))          // row width of the decompressed kv scratch
#define LATW (R + DR)                // row width of the latent rows (576)
#define QK_STEPS (DQK / 16)          // k-steps of the score GEMM
#define SN (BLOCK_N / 8)             // n8 score tiles per warp
#define ON (DV / 8)                  // n8 output tiles per warp
#define QCH (DQK / 8)                // 16-byte chunks per q / k row
#define NCH (DN / 8)                 // ... of which from k_nope
#define VCH (DV / 8)                 // ... per v row

static_assert(LDQ >= DQK && LDK >= DQK && LDV >= DV && BLOCK_N % 16 == 0, "bad tile constants");
static_assert(DQK % 16 == 0 && DV % 16 == 0 && DN % 8 == 0 && DR % 8 == 0, "bad MLA head dims");
static_assert(NUM_WARPS == 4 || NUM_WARPS == 8, "4 or 8 warps");

// helpers: cp.async / ldmatrix / mma wrappers are in common.cuh; softmax, epilogue, gather in mla_prefill.cuh

// Issue the cp.async copies of key positions [kb, kb + BLOCK_N) (scratch rows row0 + pos - ks):
// K rows = [k_nope_h | k_pe], V rows = v_h; positions >= kend are zero-filled.
__device__ __forceinline__ void load_kv_tile(bf16* k_s, bf16* v_s, const bf16* __restrict__ kv,
                                             const bf16* __restrict__ lat, int h, int row0, int ks, int kb,
                                             int kend) {
    for (int i = threadIdx.x; i < BLOCK_N * QCH; i += THREADS) {
        const int row = i / QCH, chunk = i % QCH, pos = kb + row;
        const bool ok = pos < kend;
        const size_t r = ok ? (size_t)(row0 + pos - ks) : 0;
        const bf16* src = chunk < NCH ? kv + r * KVW + h * (DN + DV) + chunk * 8 : lat + r * LATW + R + (chunk - NCH) * 8;
        cp_async16(k_s + row * LDK + chunk * 8, src, ok ? 16 : 0);
    }
    for (int i = threadIdx.x; i < BLOCK_N * VCH; i += THREADS) {
        const int row = i / VCH, chunk = i % VCH, pos = kb + row;
        const bool ok = pos < kend;
        const size_t r = ok ? (size_t)(row0 + pos - ks) : 0;
        cp_async16(v_s + row * LDV + chunk * 8, kv + r * KVW + h * (DN + DV) + DN + chunk * 8, ok ? 16 : 0);
    }
}

// ---------------------------------------------------------------------------------------------
// kernels

// lat[r] = pool row of (b, pos) for every scratch row r of the round (zeros in the padding rows)
extern "C" __global__ void mla_prefill_gather(const bf16* __restrict__ kv_pool, const int* __restrict__ block_tables,
                                              int max_pages, const int* __restrict__ seq_rec,
                                              const int* __restrict__ row_start, int num_seqs, int num_rows,
                                              bf16* __restrict__ lat) {
    KDA_PDL_ENTRY();
    gather_latent<LATW, BLOCK_SIZE>(kv_pool, block_tables, max_pages, seq_rec, row_start, num_seqs, num_rows, lat);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
mla_prefill_attn(const bf16* __restrict__ q, int ld_q, const bf16* __restrict__ kv, const bf16* __restrict__ lat,
                 const int* __restrict__ seq_rec, const int* __restrict__ tiles, float scale_log2,
                 bf16* __restrict__ out, int ld_out, float* __restrict__ o_state, float* __restrict__ ml_state) {
    KDA_PDL_ENTRY();
    extern __shared__ __align__(128) unsigned char smem_raw[];
    bf16* q_s = reinterpret_cast<bf16*>(smem_raw);          // [BLOCK_M][LDQ]
    bf16* k_s = q_s + BLOCK_M * LDQ;                         // [2][BLOCK_N][LDK]
    bf16* v_s = k_s + 2 * BLOCK_N * LDK;                     // [2][BLOCK_N][LDV]

    const int h = blockIdx.y;
    const QueryTile qt = query_tile<BLOCK_M, BLOCK_N>(seq_rec, tiles);
    const int row0 = qt.row0, ks = qt.ks, rows = qt.rows, p0 = qt.p0, kend = qt.kend;
    const int num_tiles = qt.num_tiles, mask_from = qt.mask_from;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c4 = lane & 3;

    float o[ON][4];
#pragma unroll
    for (int j = 0; j < ON; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};  // rows g and g + 8 of this warp (raw score units)

    if (num_tiles > 0) {
        for (int i = threadIdx.x; i < BLOCK_M * QCH; i += THREADS) {
            const int row = i / QCH, chunk = i % QCH;
            const bool ok = row < rows;
            const bf16* src = q + (size_t)(ok ? qt.tok0 + qt.i0 + row : 0) * ld_q + h * DQK + chunk * 8;
            cp_async16(q_s + row * LDQ + chunk * 8, src, ok ? 16 : 0);
        }
        load_kv_tile(k_s, v_s, kv, lat, h, row0, ks, ks, kend);
        cp_async_commit();
    }

    unsigned qf[QK_STEPS][4];  // this warp's Q rows as A fragments, loaded once
    const int prow0 = p0 + warp * 16 + g;  // positions of rows g and g + 8
    for (int it = 0; it < num_tiles; ++it) {
        const int kb = ks + it * BLOCK_N;
        if (it + 1 < num_tiles) {
            const int st = (it + 1) & 1;
            load_kv_tile(k_s + st * BLOCK_N * LDK, v_s + st * BLOCK_N * LDV, kv, lat, h, row0, ks, kb + BLOCK_N, kend);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const bf16* kt = k_s + (it & 1) * BLOCK_N * LDK;
        const bf16* vt = v_s + (it & 1) * BLOCK_N * LDV;
        if (it == 0) {
#pragma unroll
            for (int kk = 0; kk < QK_STEPS; ++kk)
                ldmatrix_x4(qf[kk], q_s + (warp * 16 + (lane & 15)) * LDQ + kk * 16 + (lane >> 4) * 8);
        }

        // 1. S[16, BLOCK_N] = Q·Kᵀ (ldmatrix x4: b0, b1 of n-tile 2jp, then of n-tile 2jp + 1)
        float s[SN][4];
#pragma unroll
        for (int j = 0; j < SN; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < QK_STEPS; ++kk) {
#pragma unroll
            for (int jp = 0; jp < SN / 2; ++jp) {
                unsigned bk[4];
                ldmatrix_x4(bk, kt + (jp * 16 + (lane & 7) + ((lane >> 4) << 3)) * LDK + kk * 16 + ((lane >> 3) & 1) * 8);
                mma_bf16(s[2 * jp], qf[kk], bk[0], bk[1]);
                mma_bf16(s[2 * jp + 1], qf[kk], bk[2], bk[3]);
            }
        }

        // 2. mask (key > query position, or past the key end), online softmax in base 2
        mask_tile<SN>(&s[0][0], kb, prow0, kend, mask_from, c4);
        softmax_tile<SN, ON, false>(&s[0][0], &o[0][0], m_run, l_run, scale_log2);

        // 3. O += P·V: the S accumulators of n-tiles 2kk, 2kk + 1 are the A fragment of k-step kk
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            const unsigned pa[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                                    pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int jp = 0; jp < ON / 2; ++jp) {
                unsigned bv[4];
                ldmatrix_x4_trans(bv, vt + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDV + jp * 16 + (lane >> 4) * 8);
                mma_bf16(o[2 * jp], pa, bv[0], bv[1]);
                mma_bf16(o[2 * jp + 1], pa, bv[2], bv[3]);
            }
        }
        __syncthreads();  // the next iteration's cp.async overwrites this stage
    }
    cp_async_wait<0>();
    store_rows(&o[0][0], l_run, m_run, warp, rows, (size_t)(qt.tok0 + qt.i0), h, qt.flags, scale_log2, out, ld_out, o_state,
               ml_state);
}
