// mla_attn.cu — MLA attention over the paged 576-wide latent cache, absorbed form (spec §4.3).
//
// Every new token t (sequence b, absolute position pos = context_lens[b] + t - cu_seqlens[b])
// attends causally over cached positions 0..pos, with all H heads sharing each latent row:
//
//   qk[h]      = [q_lat[t, h, :R] | q_pe[t, h, :DR]]        (q_lat = W_UK_hᵀ q_nope_h, bf16, by cuBLAS)
//   score[h,τ] = scale · qk[h] · kv[τ]                       kv[τ] = pool row [c | k_pe] (R+DR)
//   ctx[h]     = Σ_τ softmax_τ(score[h])[τ] · c[τ]           (R wide; o_h = W_UV_h ctx_h by cuBLAS)
//
// Used for decode (1 token per sequence) and prefill (n tokens per sequence; each token is its
// own query group, so the causal mask is just the length pos+1).  Flash-decoding split: each
// token's context (pos+1 positions, not the table width) is cut into NUM_SPLITS = gridDim.y
// equal ranges of whole tiles of NT positions.
//   - SPLIT=1: each (token, split) block writes its unnormalised partial ctx (fp32) and its
//     running max m (log2 units) and sum l; mla_attn_combine merges the splits into bf16 ctx.
//   - SPLIT=0 (one split): the block writes bf16 ctx = acc / l directly.
// Softmax in fp32 with max subtraction, in base 2 (scores pre-multiplied by scale·log2 e).
//
// Block geometry (mla_attn_split): THREADS = 256 threads = 8 warps; heads padded to HP = 16·ceil(H/16)
// rows (HP <= 32).  Per tile of NT = 64 positions:
//   1. S[HP, NT] = Q·KVᵀ: warp w computes columns [8w, 8w+8) over all K = R+DR (tensor cores,
//      mma.sync m16n8k16 bf16 -> fp32, operands by ldmatrix from shared memory).
//   2. online softmax: HP·NT / 256 scores per thread, P (bf16) to shared memory.
//   3. O[HP, R] += P·C: warp w owns output columns [w·R/8, (w+1)·R/8) in registers.
// The KV tiles stream through two shared-memory stages with cp.async (positions past the
// context or on a missing page are zero-filled, so NaN garbage in unowned rows never reaches
// the math).  Rows are padded (strides LDK, LDS_S, LDP) so ldmatrix phases hit 32 distinct banks.
// Shared memory: (HP + 2·NT)·LDK·2 + HP·LDS_S·4 + HP·LDP·2 + HP·4 bytes (≈200 KB at HP=32).
//
// Shapes: q_lat [T, H, R] bf16 (ctx is written over it in SPLIT=0 mode: each block reads only
// its own token's rows, before writing them); q [T, ld_q] bf16 with q_pe of head h at
// columns h·(DN+DR)+DN ..; kv_pool [num_blocks, BLOCK_SIZE, R+DR] bf16; block_tables [B, M],
// cu_seqlens [B+1], context_lens [B] int32; partial [T, NUM_SPLITS, H, R] fp32,
// stats [T, NUM_SPLITS, H, 2] fp32 (m, l).
// Compile-time constants (chosen in kda_rt/cuda/ops/mla_attn.py): H, R, DR, DN, BLOCK_SIZE, SPLIT (0/1),
// THREADS, NT, HP, and the padded shared-memory row strides LDK (Q and KV tiles, bf16), LDS_S (scores,
// fp32), LDP (probabilities, bf16).  Needs sm_80+ (mma.sync, cp.async).
#include "common.cuh"

#if !defined(H) || !defined(R) || !defined(DR) || !defined(DN) || !defined(BLOCK_SIZE) || !defined(SPLIT)
#error "mla_attn.cu needs -DH -DR -DDR -DDN -DBLOCK_SIZE -DSPLIT"
#endif
#if !defined(THREADS) || !defined(NT) || !defined(HP) || !defined(LDK) || !defined(LDS_S) || !defined(LDP)
#error "mla_attn.cu needs -DTHREADS -DNT -DHP -DLDK -DLDS_S -DLDP"
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "mla_attn.cu needs sm_80 or newer (mma.sync bf16, cp.async)"
#endif

#define NUM_WARPS (THREADS / 32)
#define MT (HP / 16)
#define KD (R + DR)                  // score GEMM depth (576)
#define OCOLS (R / NUM_WARPS)        // output columns per warp
#define ONT (OCOLS / 8)              // n8 tiles per warp
#define TPR (THREADS / HP)           // softmax threads per head row
#define CPT (NT / TPR)               // softmax columns per thread
#define CHUNKS (KD / 8)              // 16-byte chunks per row

static_assert(HP % 16 == 0 && H <= HP && HP < H + 16, "HP: the heads padded to whole m16 tiles");
static_assert(HP <= 32, "mla_attn.cu supports at most 32 heads per launch (shared memory)");
static_assert(NT == 8 * NUM_WARPS, "the score GEMM gives each warp one n8 tile of positions");
static_assert(LDK >= KD && LDK % 8 == 0 && LDP >= NT && LDP % 8 == 0 && LDS_S >= NT && LDS_S % 2 == 0,
              "padded rows must keep 16-byte (bf16) and 8-byte (fp32 pairs) alignment");
static_assert(KD % 32 == 0 && R % (NUM_WARPS * 16) == 0 && DR % 8 == 0, "bad MLA dims");
static_assert(TPR <= 32 && CPT >= 1, "softmax row split must stay inside a warp");

// helpers: cp.async / ldmatrix / mma wrappers are in common.cuh


// Issue the cp.async copies of positions [start, start + NT) into one KV stage.
__device__ __forceinline__ void load_kv_tile(bf16* stage, const bf16* __restrict__ kv_pool,
                                             const int* __restrict__ table, int start, int kv_end) {
    for (int i = threadIdx.x; i < NT * CHUNKS; i += THREADS) {
        const int row = i / CHUNKS, chunk = i % CHUNKS, pos = start + row;
        const int page = pos < kv_end ? __ldg(table + pos / BLOCK_SIZE) : -1;
        const bf16* src = page >= 0 ? kv_pool + ((size_t)page * BLOCK_SIZE + pos % BLOCK_SIZE) * KD + chunk * 8
                                    : kv_pool;
        cp_async16(stage + row * LDK + chunk * 8, src, page >= 0 ? 16 : 0);
    }
}

// ---------------------------------------------------------------------------------------------
// kernels

extern "C" __global__ void __launch_bounds__(THREADS, 1)
mla_attn_split(const bf16* q_lat, const bf16* __restrict__ q, int ld_q,
               const bf16* __restrict__ kv_pool, const int* __restrict__ cu_seqlens,
               const int* __restrict__ context_lens, const int* __restrict__ block_tables,
               int num_seqs, int max_pages, float scale_log2,
               bf16* ctx_out, float* __restrict__ partial, float* __restrict__ stats) {
    // q_lat and ctx_out may alias (SPLIT=0): no __restrict__ on them
    extern __shared__ __align__(128) unsigned char smem_raw[];
    bf16* q_s = reinterpret_cast<bf16*>(smem_raw);                       // [HP][LDK]
    bf16* kv_s = q_s + HP * LDK;                                          // [2][NT][LDK]
    float* s_s = reinterpret_cast<float*>(kv_s + 2 * NT * LDK);           // [HP][LDS_S]
    bf16* p_s = reinterpret_cast<bf16*>(s_s + HP * LDS_S);                // [HP][LDP]
    float* alpha_s = reinterpret_cast<float*>(p_s + HP * LDP);            // [HP]

    const int t = blockIdx.x, split = blockIdx.y, num_splits = gridDim.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (t >= __ldg(cu_seqlens + num_seqs)) return;
    const int b = sequence_of(cu_seqlens, num_seqs, t);
    const int pos = __ldg(context_lens + b) + t - __ldg(cu_seqlens + b);
    const int kv_end = min(pos + 1, max_pages * BLOCK_SIZE);  // positions past the table are never read
    // this token's context tiles are shared out evenly over the splits (at run time, so one graph
    // serves every context length; splits past the context get none)
    const int tiles_per_split = ((kv_end + NT - 1) / NT + num_splits - 1) / num_splits;
    const int first = split * tiles_per_split * NT;
    const int last = min(first + tiles_per_split * NT, kv_end);
    const int num_tiles = last > first ? (last - first + NT - 1) / NT : 0;
    const int* table = block_tables + (size_t)b * max_pages;

    // softmax row ownership: head row `srow`, columns [scol, scol + CPT); m, l kept redundantly by the TPR threads
    const int srow = threadIdx.x / TPR, scol = (threadIdx.x % TPR) * CPT;
    float m_run = neg_inf(), l_run = 0.f;
    float o[MT][ONT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < ONT; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;

    if (num_tiles > 0) {
        // queries: [q_lat | q_pe] for heads < H, zeros for padding rows (group 0, with tile 0)
        for (int i = threadIdx.x; i < HP * CHUNKS; i += THREADS) {
            const int h = i / CHUNKS, chunk = i % CHUNKS;
            bf16* dst = q_s + h * LDK + chunk * 8;
            if (h >= H) { *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0); continue; }
            const bf16* src = chunk * 8 < R ? q_lat + ((size_t)t * H + h) * R + chunk * 8
                                            : q + (size_t)t * ld_q + h * (DN + DR) + DN + (chunk * 8 - R);
            cp_async16(dst, src, 16);
        }
        load_kv_tile(kv_s, kv_pool, table, first, kv_end);
        cp_async_commit();
    }

    for (int it = 0; it < num_tiles; ++it) {
        const int start = first + it * NT;
        if (it + 1 < num_tiles) load_kv_tile(kv_s + ((it + 1) & 1) * NT * LDK, kv_pool, table, start + NT, kv_end);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const bf16* kv = kv_s + (it & 1) * NT * LDK;

        // 1. scores for positions [8·warp, 8·warp + 8) of this tile, all head rows
        {
            float sacc[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) sacc[mt][0] = sacc[mt][1] = sacc[mt][2] = sacc[mt][3] = 0.f;
            const bf16* kv_row = kv + (warp * 8 + (lane & 7)) * LDK + (lane >> 3) * 8;
#pragma unroll 6
            for (int k = 0; k < KD; k += 32) {
                unsigned bk[4];  // b0, b1 of k-step k, then of k-step k + 16
                ldmatrix_x4(bk, kv_row + k);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    unsigned a[4];
                    const bf16* q_row = q_s + (mt * 16 + (lane & 15)) * LDK + (lane >> 4) * 8 + k;
                    ldmatrix_x4(a, q_row);
                    mma_bf16(sacc[mt], a, bk[0], bk[1]);
                    ldmatrix_x4(a, q_row + 16);
                    mma_bf16(sacc[mt], a, bk[2], bk[3]);
                }
            }
            const int g = lane >> 2, c = warp * 8 + (lane & 3) * 2;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                *reinterpret_cast<float2*>(s_s + (mt * 16 + g) * LDS_S + c) = make_float2(sacc[mt][0], sacc[mt][1]);
                *reinterpret_cast<float2*>(s_s + (mt * 16 + g + 8) * LDS_S + c) = make_float2(sacc[mt][2], sacc[mt][3]);
            }
        }
        __syncthreads();

        // 2. online softmax (base 2), probabilities to p_s as bf16, rescale factors to alpha_s
        {
            float s[CPT];
            float mx = m_run;
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                const bool valid = start + scol + j < kv_end;
                s[j] = valid ? s_s[srow * LDS_S + scol + j] * scale_log2 : neg_inf();
                mx = fmaxf(mx, s[j]);
            }
            mx = warp_max<TPR>(mx);
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                const float p = exp2f(s[j] - mx);  // exp2(-inf) = 0 for masked positions
                sum += p;
                p_s[srow * LDP + scol + j] = to_bf16(p);
            }
            sum = warp_sum<TPR>(sum);
            const float alpha = exp2f(m_run - mx);  // 0 on the first tile (m_run = -inf, mx finite)
            l_run = l_run * alpha + sum;
            m_run = mx;
            if (threadIdx.x % TPR == 0) alpha_s[srow] = alpha;
        }
        __syncthreads();

        // 3. O[:, warp's columns] = alpha · O + P · C
        {
            const int g = lane >> 2;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const float a_lo = alpha_s[mt * 16 + g], a_hi = alpha_s[mt * 16 + g + 8];
#pragma unroll
                for (int j = 0; j < ONT; ++j) {
                    o[mt][j][0] *= a_lo; o[mt][j][1] *= a_lo; o[mt][j][2] *= a_hi; o[mt][j][3] *= a_hi;
                }
            }
#pragma unroll
            for (int ks = 0; ks < NT; ks += 16) {
                unsigned a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    ldmatrix_x4(a[mt], p_s + (mt * 16 + (lane & 15)) * LDP + ks + (lane >> 4) * 8);
                const bf16* v_row = kv + (ks + (lane & 7) + ((lane >> 3) & 1) * 8) * LDK + warp * OCOLS + (lane >> 4) * 8;
#pragma unroll
                for (int j = 0; j < ONT; j += 2) {
                    unsigned bv[4];  // b0, b1 of n-tile j, then of n-tile j + 1
                    ldmatrix_x4_trans(bv, v_row + j * 8);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_bf16(o[mt][j], a[mt], bv[0], bv[1]);
                        mma_bf16(o[mt][j + 1], a[mt], bv[2], bv[3]);
                    }
                }
            }
        }
        __syncthreads();  // the next iteration overwrites this stage (cp.async) and s_s / p_s
    }
    cp_async_wait<0>();

    // epilogue: the C fragment of o[mt][j] holds rows mt·16 + g (+8), columns warp·OCOLS + 8j + 2·(lane & 3)
    if (threadIdx.x % TPR == 0) alpha_s[srow] = l_run > 0.f ? 1.f / l_run : 0.f;
#if SPLIT
    if (threadIdx.x % TPR == 0 && srow < H) {
        float* st = stats + (((size_t)t * num_splits + split) * H + srow) * 2;
        st[0] = m_run;
        st[1] = l_run;
    }
    if (num_tiles == 0) return;  // combine skips splits with l = 0, their partial rows stay unwritten
#endif
    __syncthreads();
    const int g = lane >> 2, c = warp * OCOLS + (lane & 3) * 2;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int h = mt * 16 + g + half * 8;
            if (h >= H) continue;
#if SPLIT
            float* dst = partial + (((size_t)t * num_splits + split) * H + h) * R + c;
#pragma unroll
            for (int j = 0; j < ONT; ++j)
                *reinterpret_cast<float2*>(dst + j * 8) = make_float2(o[mt][j][2 * half], o[mt][j][2 * half + 1]);
#else
            const float inv = alpha_s[h];
            bf16* dst = ctx_out + ((size_t)t * H + h) * R + c;
#pragma unroll
            for (int j = 0; j < ONT; ++j)
                *reinterpret_cast<__nv_bfloat162*>(dst + j * 8) =
                    __floats2bfloat162_rn(o[mt][j][2 * half] * inv, o[mt][j][2 * half + 1] * inv);
#endif
        }
}

// Merge the splits: ctx[t, h] = Σ_s 2^(m_s - m) acc_s / Σ_s 2^(m_s - m) l_s  (splits with l = 0 skipped).
// Grid (T, H), block R / 4 threads, 4 columns each.
extern "C" __global__ void __launch_bounds__(R / 4)
mla_attn_combine(const float* __restrict__ partial, const float* __restrict__ stats, int num_splits,
                 const int* __restrict__ cu_seqlens, int num_seqs, bf16* __restrict__ ctx_out) {
    const int t = blockIdx.x, h = blockIdx.y;
    if (t >= __ldg(cu_seqlens + num_seqs)) return;
    const float* st = stats + ((size_t)t * num_splits * H + h) * 2;
    float m = neg_inf();
    for (int s = 0; s < num_splits; ++s)
        if (st[s * H * 2 + 1] > 0.f) m = fmaxf(m, st[s * H * 2]);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float l = 0.f;
    for (int s = 0; s < num_splits; ++s) {
        const float ls = st[s * H * 2 + 1];
        if (!(ls > 0.f)) continue;
        const float w = exp2f(st[s * H * 2] - m);
        const float4 p = reinterpret_cast<const float4*>(partial + (((size_t)t * num_splits + s) * H + h) * R)[threadIdx.x];
        acc.x += w * p.x; acc.y += w * p.y; acc.z += w * p.z; acc.w += w * p.w;
        l += w * ls;
    }
    const float inv = 1.f / l;
    __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(ctx_out + ((size_t)t * H + h) * R) + threadIdx.x * 2;
    dst[0] = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
    dst[1] = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
}
