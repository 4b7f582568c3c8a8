// mla_attn.cu — MLA attention over the paged 576-wide latent cache, absorbed form (spec §4.3).
//
// Every new token t (sequence b, absolute position pos = context_lens[b] + t - cu_seqlens[b])
// attends causally over cached positions 0..pos, with all H heads sharing each latent row:
//
//   qk[h]      = [q_lat[t, h, :R] | q_pe[t, h, :DR]]        (q_lat = W_UK_hᵀ q_nope_h, bf16: mla_absorb_q / cuBLAS)
//   score[h,τ] = scale · qk[h] · kv[τ]                       kv[τ] = pool row [c | k_pe] (R+DR)
//   ctx[h]     = Σ_τ softmax_τ(score[h])[τ] · c[τ]           (R wide; o_h = W_UV_h ctx_h: mla_expand_out / cuBLAS)
//
// Used for decode (1 token per sequence) and prefill (n tokens per sequence; each token is its
// own query group, so the causal mask is just the length pos+1).
//
// Flash-decoding split (grid (T, S), S = gridDim.y fixed by the launcher from (T, table width), so one
// graph serves every context length).  At run time each token's own context of tiles = ⌈(pos+1)/NT⌉
// tiles is cut into `used` = ⌈tiles / tps⌉ ranges of tps = max(⌈tiles / S⌉, MIN_TILES) whole tiles;
// blocks with split >= used exit at once (split_plan, shared by both kernels).
//   - used == 1: the block writes bf16 ctx = acc / l directly (no partial, combine skips the token).
//   - used > 1: each block writes its normalised partial acc / l (bf16, [T, S, H, R]) and (m, l)
//     (fp32, m in log2 units); mla_attn_combine{4,8,16} merge the used splits.
// Softmax in fp32 with max subtraction, in base 2 (scores pre-multiplied by scale·log2 e).
//
// Block geometry (mla_attn_split): THREADS = 256 threads = 8 warps, ONE block per SM (≈190 KB smem);
// all HP = 16·⌈H/16⌉ head rows (HP <= 32) share one pass over each latent row.  Per tile of NT = 64
// positions (tensor cores: mma.sync m16n8k16 bf16 -> fp32, operands by ldmatrix):
//   1. S[HP, NT] = Q·KVᵀ split over K: warp w = (ng, kg) = (w / KG, w % KG) computes positions
//      [32·ng, 32·ng + 32) over depth [KW·kg, KW·kg + KW) (KW = KD / KG = 144).  Its Q fragments
//      (HP x KW) stay in registers for the whole block, so each KV element is read from shared memory
//      once (the Q-in-shared form re-read Q per warp: 2.4x the shared traffic, the old bottleneck).
//      The KG partial score tiles go to shared memory (fp32).
//   2. online softmax: sum of the KG partials, HP·NT / 256 scores per thread, P (bf16) to shared memory.
//   3. O[HP, R] += P·C: warp w owns output columns [w·R/8, (w+1)·R/8) in registers.
// KV tiles stream through two shared-memory stages with cp.async: tile i+1 is issued as soon as
// every warp is done with tile i-1 (top of iteration i), so one 72 KB tile is always in flight per SM.
// Issuing a tile is 18 unrolled 16-byte copies a thread with a few integer ops each; the tile's page (64-row
// pages: one page a tile) is read a tile ahead.  (Until 2026-12-04 every copy looked its row's page up and spent
// ~40 integer ops: B=32 L=32K 479 -> 368 us, L=2K 51.6 -> 45.3 us, B=1 L=128K 78.9 -> 66.0 us.)
// (Tried 2026-12-01, with those copies: 32-position tiles through 5 stages, four in flight: B=32 L=32K 484 ->
// 517 us, B=1 L=128K 78 -> 81 us; the loop was bound by its own instructions and barriers.)
// Positions past the context or on a missing page are zero-filled, so NaN garbage in unowned rows
// never reaches the math.  Rows are padded (LDK, LDS_S, LDP) so ldmatrix / float2 phases hit distinct banks.
// Shared memory: max(HP·LDK·2, KG·HP·LDS_S·4) (Q staging, then the partial scores) + 2·NT·LDK·2 (KV
// stages) + HP·LDP·2 + HP·4 bytes (191,616 at HP = 32).
//
// mla_attn_combine{4,8,16}: grid (T, H, R / CC), 256 threads = CT = CC / 8 column threads x CG split groups,
// CG = 4, 8 or 16 (the launcher's S rounded up to a power of two, at least 2048 / R); each thread
// merges splits g, g + CG, ... for 8 columns, then the groups are summed in shared memory.  (With CG fixed
// at 16, a batch-32 decode step at 2K context, S = 4, left three quarters of the threads without a split
// and ran 4096 blocks where 1024 do.)
//   ctx[t, h] = Σ_s w_s o_s / Σ_s w_s,  w_s = 2^(m_s - m) l_s,  m = max_s m_s
//
// Shapes: q_lat [T, H, R] bf16 (ctx is written over it: each block reads only its own token's rows,
// and only the blocks of a token with used == 1 (one block) or the combine write them, after every
// read); q [T, ld_q] bf16 with q_pe of head h at columns h·(DN+DR)+DN ..; kv_pool [num_blocks,
// BLOCK_SIZE, R+DR] bf16; block_tables [B, M], cu_seqlens [B+1], context_lens [B] int32;
// partial [T, S, H, R] bf16, stats [T, S, H, 2] fp32 (m, l).
// mla_absorb_q / mla_expand_out (T <= TMAX only): the two per-head up-projections as weight-streaming
// GEMVs (each kv_b row read once for all T tokens); larger T uses cuBLAS bmm.  EARLY_W = 1 (bench switch
// KDA_RT_MLA_EARLY_WEIGHTS): each loads its kv_b rows before the programmatic-launch wait (they are weights) and lets
// the next launch go at once (MLA_UP_PDL_ENTRY), so in a decode graph the rows stream while the kernel before still
// runs; the latent-row store that mla_absorb_q may carry waits first.  Same math and outputs.
//
// Compile-time constants (chosen in kda_rt/cuda/ops/mla_attn.py): H, R, DR, DN, DV, BLOCK_SIZE, THREADS,
// NT, HP, MIN_TILES, TMAX, and the padded shared-memory row strides LDK (Q and KV tiles, bf16), LDS_S (scores,
// fp32), LDP (probabilities, bf16).  Needs sm_80+ (mma.sync, cp.async).
// Measured (H200, graph replay incl. the two cuBLAS bmm, before this layout: Q re-read per warp, fp32
// partials, S from the table width, serial combine): B=1 L=32K 96.5 us (0.48 TB/s), B=32 L=8K 199 us
// (1.56), B=128 L=32K 2297 us (2.11).  This layout (tests/gpu/check_mla_decode.sh, 2026-11-30, same
// accounting, us (TB/s)): B=1 L=1K 20.3 (0.47), L=32K 35.5 (1.30), L=128K 81.0 (1.97); B=32 L=1K 47.0
// (0.98), L=4K 91.9 (1.73), L=32K 490 (2.48), L=128K 1839 (2.63); B=128 L=1K 79.5 (2.01), L=4K 252 (2.43).
// With the cheaper tile copies (bench_decode_sweep.py --parts=mla, 2026-12-04): B=1 L=2K 17.9 (0.60), L=32K 31.2
// (1.48), L=128K 66.0 (2.41); B=32 L=2K 45.3 (1.85), L=8K 110.2 (2.82), L=32K 368.0 (3.31), L=128K 1408 (3.44).
// About 14 us of every call is fixed (the L=1 time: up-projections, launches).
#include "common.cuh"

#if !defined(H) || !defined(R) || !defined(DR) || !defined(DN) || !defined(DV) || !defined(BLOCK_SIZE) || \
    !defined(MIN_TILES) || !defined(TMAX)
#error "mla_attn.cu needs -DH -DR -DDR -DDN -DDV -DBLOCK_SIZE -DMIN_TILES -DTMAX"
#endif
#if !defined(THREADS) || !defined(NT) || !defined(HP) || !defined(LDK) || !defined(LDS_S) || !defined(LDP)
#error "mla_attn.cu needs -DTHREADS -DNT -DHP -DLDK -DLDS_S -DLDP"
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "mla_attn.cu needs sm_80 or newer (mma.sync bf16, cp.async)"
#endif

#ifndef EARLY_W
#define EARLY_W 0
#endif
#if EARLY_W
#define MLA_UP_PDL_ENTRY() KDA_PDL_ENTRY_DEFERRED()
#else
#define MLA_UP_PDL_ENTRY() KDA_PDL_ENTRY()
#endif

#define NUM_WARPS (THREADS / 32)
#define MT (HP / 16)
#define KD (R + DR)                  // score GEMM depth (576)
#define KG 4                         // score GEMM: warps along the depth
#define NG (NUM_WARPS / KG)          // score GEMM: warps along the positions
#define KW (KD / KG)                 // depth per warp (144)
#define KSTEPS (KW / 16)             // k16 steps per warp (9)
#define NPW (NT / NG)                // positions per warp in the score GEMM (32)
#define OCOLS (R / NUM_WARPS)        // output columns per warp
#define ONT (OCOLS / 8)              // n8 tiles per warp
#define TPR (THREADS / HP)           // softmax threads per head row
#define CPT (NT / TPR)               // softmax columns per thread
#define CHUNKS (KD / 8)              // 16-byte chunks per row

static_assert(HP % 16 == 0 && H <= HP && HP < H + 16, "HP: the heads padded to whole m16 tiles");
static_assert(HP <= 32, "mla_attn.cu supports at most 32 heads per launch (shared memory, registers)");
static_assert(THREADS == 256 && NT == 64, "the warp maps assume 8 warps and tiles of 64 positions");
static_assert(KD % (KG * 16) == 0 && NPW % 16 == 0, "score GEMM split: whole k16 steps, pairs of n8 tiles");
static_assert(LDK >= KD && LDK % 8 == 0 && LDP >= NT && LDP % 8 == 0 && LDS_S >= NT && LDS_S % 4 == 0,
              "padded rows must keep 16-byte alignment");
static_assert(R % (NUM_WARPS * 16) == 0 && R % 128 == 0 && DR % 8 == 0, "bad MLA dims");
static_assert(TPR <= 32 && CPT % 4 == 0, "softmax row split must stay inside a warp, float4 columns");
static_assert(MIN_TILES >= 1, "MIN_TILES: at least one tile per split");

// ---------------------------------------------------------------------------------------------
// helpers (cp.async / ldmatrix / mma wrappers are in common.cuh)

// How token t's context is split: kv_end positions (pos + 1, clipped to the table), `used` splits
// of `tps` tiles each (the last one shorter); every split < used has at least one position.
struct SplitPlan { int b, kv_end, tps, used; };

// one_token (decode: every sequence has exactly one token, so token t is sequence t): no search through
// cu_seqlens, whose dependent loads were most of a block's start-up latency.
__device__ __forceinline__ SplitPlan split_plan(const int* __restrict__ cu_seqlens, const int* __restrict__ context_lens,
                                                int num_seqs, int one_token, int max_pages, int num_splits, int t) {
    SplitPlan p;
    p.b = one_token ? t : sequence_of(cu_seqlens, num_seqs, t);
    const int pos = __ldg(context_lens + p.b) + (one_token ? 0 : t - __ldg(cu_seqlens + p.b));
    p.kv_end = max(1, min(pos + 1, max_pages * BLOCK_SIZE));  // positions past the table are never read
    const int tiles = (p.kv_end + NT - 1) / NT;
    p.tps = max((tiles + num_splits - 1) / num_splits, MIN_TILES);
    p.used = (tiles + p.tps - 1) / p.tps;
    return p;
}

// The page of a tile that lies in one page (BLOCK_SIZE % NT == 0: tiles start at multiples of NT), -1 if missing;
// other page sizes look each row's page up in load_kv_tile, and this returns 0 (unused).
__device__ __forceinline__ int tile_page(const int* __restrict__ table, int start) {
    if constexpr (BLOCK_SIZE % NT == 0) return __ldg(table + start / BLOCK_SIZE);
    return 0;
}

// Issue the cp.async copies of positions [start, start + NT) into one KV stage: a fixed NT·CHUNKS / THREADS 16-byte
// chunks a thread, unrolled.  A tile inside one page (`page` = tile_page(table, start), read by the caller ahead of its
// barrier) is one contiguous run of rows in the pool (KD = 8·CHUNKS), so chunk i of the tile is element 8i from the
// tile's first row: a division by CHUNKS (the row, for the padded shared-memory row and the kv_end mask) and two adds
// a chunk.  Smaller pages look each row's page up (independent loads, in flight together).  Positions at or past
// kv_end and rows of a missing page (-1) are zero-filled.
__device__ __forceinline__ void load_kv_tile(bf16* stage, const bf16* __restrict__ kv_pool,
                                             const int* __restrict__ table, int start, int kv_end, int page) {
    static_assert(NT * CHUNKS % THREADS == 0 && KD == 8 * CHUNKS, "whole rounds of 16-byte chunks over the block");
    if constexpr (BLOCK_SIZE % NT == 0) {
        const bf16* tile_src = kv_pool + ((size_t)max(page, 0) * BLOCK_SIZE + (unsigned)start % BLOCK_SIZE) * KD;
        const int rows = page >= 0 ? kv_end - start : 0;  // rows that hold data (may pass NT)
#pragma unroll
        for (int k = 0; k < NT * CHUNKS / THREADS; ++k) {
            const unsigned i = threadIdx.x + k * THREADS, row = i / CHUNKS;
            const bool ok = (int)row < rows;
            cp_async16(stage + i * 8 + row * (LDK - KD), tile_src + (ok ? i * 8 : 0), ok ? 16 : 0);  // (a valid address)
        }
    } else {
#pragma unroll
        for (int k = 0; k < NT * CHUNKS / THREADS; ++k) {
            const unsigned i = threadIdx.x + k * THREADS, row = i / CHUNKS, chunk = i - row * CHUNKS;
            const int pos = start + (int)row;
            const int pg = pos < kv_end ? __ldg(table + pos / BLOCK_SIZE) : -1;
            const bool ok = pg >= 0;
            const bf16* src = ok ? kv_pool + ((size_t)pg * BLOCK_SIZE + (unsigned)pos % BLOCK_SIZE) * KD + chunk * 8
                                 : kv_pool;
            cp_async16(stage + row * LDK + chunk * 8, src, ok ? 16 : 0);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// kernels

extern "C" __global__ void __launch_bounds__(THREADS, 1)
mla_attn_split(const bf16* q_lat, const bf16* __restrict__ q, int ld_q,
               const bf16* __restrict__ kv_pool, const int* __restrict__ cu_seqlens,
               const int* __restrict__ context_lens, const int* __restrict__ block_tables,
               int num_seqs, int one_token, int max_pages, float scale_log2,
               bf16* ctx_out, bf16* __restrict__ partial, float* __restrict__ stats) {
    KDA_PDL_ENTRY();
    // q_lat and ctx_out alias: no __restrict__ on them
    extern __shared__ __align__(128) unsigned char smem_raw[];
    constexpr int QS_BYTES = HP * LDK * 2, SP_BYTES = KG * HP * LDS_S * 4;
    constexpr int U_BYTES = QS_BYTES > SP_BYTES ? QS_BYTES : SP_BYTES;
    bf16* q_s = reinterpret_cast<bf16*>(smem_raw);                        // [HP][LDK], until the Q fragments are loaded
    float* sp_s = reinterpret_cast<float*>(smem_raw);                     // [KG][HP][LDS_S], afterwards
    bf16* kv_s = reinterpret_cast<bf16*>(smem_raw + U_BYTES);             // [2][NT][LDK]
    bf16* p_s = kv_s + 2 * NT * LDK;                                      // [HP][LDP]
    float* alpha_s = reinterpret_cast<float*>(p_s + HP * LDP);            // [HP]

    const int t = blockIdx.x, split = blockIdx.y, num_splits = gridDim.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (t >= (one_token ? num_seqs : __ldg(cu_seqlens + num_seqs))) return;
    const SplitPlan plan = split_plan(cu_seqlens, context_lens, num_seqs, one_token, max_pages, num_splits, t);
    if (split >= plan.used) return;  // uniform over the block; never reads q_lat
    const int kv_end = plan.kv_end;
    const int first = split * plan.tps * NT;
    const int last = min(first + plan.tps * NT, kv_end);
    const int num_tiles = (last - first + NT - 1) / NT;  // >= 1
    const int* table = block_tables + (size_t)plan.b * max_pages;

    // queries: [q_lat | q_pe] for heads < H, zeros for padding rows (commit group 0), then tile 0 (group 1)
    for (int i = threadIdx.x; i < HP * CHUNKS; i += THREADS) {
        const int h = i / CHUNKS, chunk = i % CHUNKS;
        bf16* dst = q_s + h * LDK + chunk * 8;
        if (h >= H) { *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0); continue; }
        const bf16* src = chunk * 8 < R ? q_lat + ((size_t)t * H + h) * R + chunk * 8
                                        : q + (size_t)t * ld_q + h * (DN + DR) + DN + (chunk * 8 - R);
        cp_async16(dst, src, 16);
    }
    cp_async_commit();
    load_kv_tile(kv_s, kv_pool, table, first, kv_end, tile_page(table, first));
    cp_async_commit();
    int next_page = num_tiles > 1 ? tile_page(table, first + NT) : 0;  // tile_page of the next tile to load

    // score-GEMM role of this warp and its Q fragments (HP rows x KW depth), kept in registers
    const int kg = warp % KG, ng = warp / KG;
    unsigned qf[MT][KSTEPS][4];
    cp_async_wait<1>();
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int s = 0; s < KSTEPS; ++s)
            ldmatrix_x4(qf[mt][s], q_s + (mt * 16 + (lane & 15)) * LDK + kg * KW + s * 16 + (lane >> 4) * 8);
    // (the loop's first barrier orders these reads before the partial scores overwrite q_s)

    // softmax row ownership: head row `srow`, columns [scol, scol + CPT); m, l kept redundantly by the TPR threads
    const int srow = threadIdx.x / TPR, scol = (threadIdx.x % TPR) * CPT;
    float m_run = neg_inf(), l_run = 0.f;
    float o[MT][ONT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < ONT; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;

    for (int it = 0; it < num_tiles; ++it) {
        const int start = first + it * NT;
        cp_async_wait<0>();  // tile it (the only group in flight)
        __syncthreads();     // ... visible to all; every warp is done with tile it-1's stage, p_s and alpha_s
        if (it + 1 < num_tiles) {
            load_kv_tile(kv_s + ((it + 1) & 1) * NT * LDK, kv_pool, table, start + NT, kv_end, next_page);
            cp_async_commit();
            next_page = it + 2 < num_tiles ? tile_page(table, start + 2 * NT) : 0;  // (a whole tile's time to arrive)
        }
        const bf16* kv = kv_s + (it & 1) * NT * LDK;

        // 1. partial scores: positions [NPW·ng, NPW·ng + NPW), depth [KW·kg, KW·kg + KW), all head rows
        {
            float sacc[MT][NPW / 8][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < NPW / 8; ++j) sacc[mt][j][0] = sacc[mt][j][1] = sacc[mt][j][2] = sacc[mt][j][3] = 0.f;
            // ldmatrix x4: (n-tile 2jp, k lo), (2jp, k hi), (2jp+1, k lo), (2jp+1, k hi)
            const bf16* kv_row = kv + (ng * NPW + (lane & 7) + ((lane >> 4) << 3)) * LDK + kg * KW + ((lane >> 3) & 1) * 8;
#pragma unroll
            for (int s = 0; s < KSTEPS; ++s)
#pragma unroll
                for (int jp = 0; jp < NPW / 16; ++jp) {
                    unsigned bk[4];
                    ldmatrix_x4(bk, kv_row + jp * 16 * LDK + s * 16);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_bf16(sacc[mt][2 * jp], qf[mt][s], bk[0], bk[1]);
                        mma_bf16(sacc[mt][2 * jp + 1], qf[mt][s], bk[2], bk[3]);
                    }
                }
            const int g = lane >> 2;
            float* sp = sp_s + kg * HP * LDS_S + ng * NPW + (lane & 3) * 2;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < NPW / 8; ++j) {
                    *reinterpret_cast<float2*>(sp + (mt * 16 + g) * LDS_S + j * 8) = make_float2(sacc[mt][j][0], sacc[mt][j][1]);
                    *reinterpret_cast<float2*>(sp + (mt * 16 + g + 8) * LDS_S + j * 8) = make_float2(sacc[mt][j][2], sacc[mt][j][3]);
                }
        }
        __syncthreads();

        // 2. online softmax (base 2) over the summed partials, probabilities to p_s as bf16, rescale factors to alpha_s
        {
            float s[CPT];
#pragma unroll
            for (int j = 0; j < CPT; ++j) s[j] = 0.f;
#pragma unroll
            for (int k = 0; k < KG; ++k)
#pragma unroll
                for (int j = 0; j < CPT; j += 4) {
                    const float4 v = *reinterpret_cast<const float4*>(sp_s + (k * HP + srow) * LDS_S + scol + j);
                    s[j] += v.x; s[j + 1] += v.y; s[j + 2] += v.z; s[j + 3] += v.w;
                }
            float mx = m_run;
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                s[j] = start + scol + j < kv_end ? s[j] * scale_log2 : neg_inf();
                mx = fmaxf(mx, s[j]);
            }
            mx = warp_max<TPR>(mx);
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < CPT; j += 2) {
                const float p0 = exp2f(s[j] - mx), p1 = exp2f(s[j + 1] - mx);  // exp2(-inf) = 0 for masked positions
                sum += p0 + p1;
                *reinterpret_cast<__nv_bfloat162*>(p_s + srow * LDP + scol + j) = __floats2bfloat162_rn(p0, p1);
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
    }
    __syncthreads();  // every warp has read alpha_s of the last tile

    // epilogue: the C fragment of o[mt][j] holds rows mt·16 + g (+8), columns warp·OCOLS + 8j + 2·(lane & 3)
    if (threadIdx.x % TPR == 0) alpha_s[srow] = l_run > 0.f ? 1.f / l_run : 0.f;
    const bool direct = plan.used == 1;
    if (!direct && threadIdx.x % TPR == 0 && srow < H) {
        float* st = stats + (((size_t)t * num_splits + split) * H + srow) * 2;
        st[0] = m_run;
        st[1] = l_run;
    }
    __syncthreads();
    const int g = lane >> 2, c = warp * OCOLS + (lane & 3) * 2;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int h = mt * 16 + g + half * 8;
            if (h >= H) continue;
            const float inv = alpha_s[h];
            bf16* dst = direct ? ctx_out + ((size_t)t * H + h) * R + c
                               : partial + (((size_t)t * num_splits + split) * H + h) * R + c;
#pragma unroll
            for (int j = 0; j < ONT; ++j)
                *reinterpret_cast<__nv_bfloat162*>(dst + j * 8) =
                    __floats2bfloat162_rn(o[mt][j][2 * half] * inv, o[mt][j][2 * half + 1] * inv);
        }
}

// Merge the used splits of token t, head h, columns [CC·z, CC·z + CC): ctx = Σ w_s o_s / Σ w_s,
// w_s = 2^(m_s - m) l_s.  Tokens with one used split were written by mla_attn_split.  CG split groups of
// CT = 256 / CG column threads (a compile-time CG keeps the split loop's loads together: one kernel per CG).
template <int CG>
__device__ __forceinline__ void combine_splits(const bf16* __restrict__ partial, const float* __restrict__ stats,
                                               const int* __restrict__ cu_seqlens, const int* __restrict__ context_lens,
                                               int num_seqs, int one_token, int max_pages, int num_splits,
                                               bf16* __restrict__ ctx_out) {
    constexpr int CT = 256 / CG, CC = 8 * CT;
    static_assert(CG >= 1 && CG <= 256 && 256 % CG == 0, "combine: CG groups of 256 / CG threads");
    if (R % CC != 0) return;  // (compiled for every R % 128 == 0, launched only where CC divides R: combine_groups)
    __shared__ float red_m[CG], red_l[CG];
    __shared__ __align__(16) float red_acc[CG][CC + 4];
    const int ct = threadIdx.x % CT, grp = threadIdx.x / CT;
    const int t = blockIdx.x, h = blockIdx.y, col = blockIdx.z * CC + ct * 8;
    if (t >= (one_token ? num_seqs : __ldg(cu_seqlens + num_seqs))) return;
    const SplitPlan plan = split_plan(cu_seqlens, context_lens, num_seqs, one_token, max_pages, num_splits, t);
    if (plan.used <= 1) return;
    const float* st = stats + ((size_t)t * num_splits * H + h) * 2;
    const bf16* pp = partial + ((size_t)t * num_splits * H + h) * R + col;

    // pass 1: m = max over the used splits (each group over its own, then across groups)
    float m = neg_inf();
    for (int s = grp; s < plan.used; s += CG) m = fmaxf(m, __ldg(st + (size_t)s * H * 2));
    if (ct == 0) red_m[grp] = m;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < CG; ++i) m = fmaxf(m, red_m[i]);

    // pass 2: weighted sum of the partials (loads of different splits are independent)
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float l = 0.f;
#pragma unroll 4
    for (int s = grp; s < plan.used; s += CG) {
        const float2 ml = __ldg(reinterpret_cast<const float2*>(st + (size_t)s * H * 2));
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(pp + (size_t)s * H * R));
        const float w = exp2f(ml.x - m) * ml.y;
        const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(v[i]);
            acc[2 * i] += w * f.x;
            acc[2 * i + 1] += w * f.y;
        }
        l += w;
    }
    float* ra = &red_acc[grp][ct * 8];
    *reinterpret_cast<float4*>(ra) = make_float4(acc[0], acc[1], acc[2], acc[3]);
    *reinterpret_cast<float4*>(ra + 4) = make_float4(acc[4], acc[5], acc[6], acc[7]);
    if (ct == 0) red_l[grp] = l;
    __syncthreads();
    if (grp != 0) return;
    l = 0.f;
#pragma unroll
    for (int i = 0; i < CG; ++i) l += red_l[i];
    const float inv = 1.f / l;  // l >= the weight of the max split, its l_s > 0
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < CG; ++i) sum += red_acc[i][ct * 8 + j];
        acc[j] = sum * inv;
    }
    bf16x8 out;
#pragma unroll
    for (int j = 0; j < 8; ++j) out.v[j] = to_bf16(acc[j]);
    *reinterpret_cast<bf16x8*>(ctx_out + ((size_t)t * H + h) * R + col) = out;
}

extern "C" __global__ void __launch_bounds__(256)
mla_attn_combine4(const bf16* __restrict__ partial, const float* __restrict__ stats, const int* __restrict__ cu_seqlens,
                  const int* __restrict__ context_lens, int num_seqs, int one_token, int max_pages, int num_splits,
                  bf16* __restrict__ ctx_out) {
    KDA_PDL_ENTRY();
    combine_splits<4>(partial, stats, cu_seqlens, context_lens, num_seqs, one_token, max_pages, num_splits, ctx_out);
}

extern "C" __global__ void __launch_bounds__(256)
mla_attn_combine8(const bf16* __restrict__ partial, const float* __restrict__ stats, const int* __restrict__ cu_seqlens,
                  const int* __restrict__ context_lens, int num_seqs, int one_token, int max_pages, int num_splits,
                  bf16* __restrict__ ctx_out) {
    KDA_PDL_ENTRY();
    combine_splits<8>(partial, stats, cu_seqlens, context_lens, num_seqs, one_token, max_pages, num_splits, ctx_out);
}

extern "C" __global__ void __launch_bounds__(256)
mla_attn_combine16(const bf16* __restrict__ partial, const float* __restrict__ stats, const int* __restrict__ cu_seqlens,
                  const int* __restrict__ context_lens, int num_seqs, int one_token, int max_pages, int num_splits,
                  bf16* __restrict__ ctx_out) {
    KDA_PDL_ENTRY();
    combine_splits<16>(partial, stats, cu_seqlens, context_lens, num_seqs, one_token, max_pages, num_splits, ctx_out);
}

// ---------------------------------------------------------------------------------------------
// small-batch up-projections (T <= TMAX tokens; larger T uses cuBLAS bmm): weight-streaming GEMVs that
// read each kv_b row once for all tokens (cuBLAS' batched GEMM with M = T <= 8: ~5 us each for 4 MB on H200).
#if R % 256 == 0 && DN % 32 == 0 && DV % 16 == 0   // the launcher uses them only then
#include "mla_store.cuh"

// q_lat[t, h, r] = Σ_{n < DN} q[t, h·(DN+DR) + n] · w_kvb[h·(DN+DV) + n, r]       (W_UK_hᵀ q_nope)
// Grid (H, R / 64), 256 threads: thread (ng, cg) = (tid / 8, tid % 8) sums rows n = ng·NPT .. +NPT for
// columns 8·cg .. +8 of the block's 64 (one 16-byte weight load per row); lanes sharing cg are reduced
// with shuffles, then the 8 warps in shared memory.
// With `store` (grid (H + 1, R / 64), num_tokens <= R / 64), block (H, t) writes token t's latent row into its page
// instead (mla_store.cuh, bit-identical to mla_store.cu's mla_store_rows): a small decode step's MLA layer is one
// launch shorter; both only read the q|kv_a projection.  The attention kernel after it (mla_attn_split) reads the
// row, so it must not touch the pool before its programmatic-launch wait (it does not: KDA_PDL_ENTRY first).
extern "C" __global__ void __launch_bounds__(256)
mla_absorb_q(const bf16* __restrict__ q, int ld_q, const bf16* __restrict__ w_kvb, int num_tokens,
             bf16* __restrict__ q_lat, int store, const bf16* __restrict__ kv_a, int ld_kv_a,
             const bf16* __restrict__ kv_norm_w, bf16* __restrict__ kv_pool, const int* __restrict__ cu_seqlens,
             const int* __restrict__ context_lens, const int* __restrict__ block_tables, int num_seqs,
             int max_pages, float eps) {
    MLA_UP_PDL_ENTRY();
#if R <= 2048  // (the launcher folds the store only then: a row's 16-byte pieces must fit 256 threads)
    if (store && blockIdx.x == H) {
#if EARLY_W
        KDA_PDL_WAIT();  // kv_a: the projection before's output
#endif
        __shared__ float scratch[8];
        if (blockIdx.y < num_tokens)
            store_latent_row<256>(kv_a, ld_kv_a, kv_norm_w, kv_pool, cu_seqlens, context_lens, block_tables, num_seqs,
                                  max_pages, eps, blockIdx.y, scratch);
        return;
    }
#endif
    constexpr int NPT = DN / 32;  // weight rows per thread
    __shared__ float q_s[TMAX][DN];
    __shared__ __align__(16) float red[8][TMAX][64];
    const int h = blockIdx.x, c0 = blockIdx.y * 64, cg = threadIdx.x % 8, ng = threadIdx.x / 8;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint4 wv[NPT];
#pragma unroll
    for (int i = 0; i < NPT; ++i)
        wv[i] = __ldg(reinterpret_cast<const uint4*>(w_kvb + (size_t)(h * (DN + DV) + ng * NPT + i) * R + c0 + cg * 8));
#if EARLY_W
    {
        unsigned dep = 0u;  // (every early load feeds the wait, else ptxas may issue it first: KDA_PDL_WAIT_AFTER)
#pragma unroll
        for (int i = 0; i < NPT; ++i) dep |= wv[i].x;
        KDA_PDL_WAIT_AFTER(dep);  // q: the projection before's output
    }
#endif
    for (int i = threadIdx.x; i < TMAX * DN; i += 256) {
        const int t = i / DN, n = i % DN;
        q_s[t][n] = t < num_tokens ? to_f32(q[(size_t)t * ld_q + h * (DN + DR) + n]) : 0.f;
    }
    __syncthreads();
    float acc[TMAX][8];
#pragma unroll
    for (int t = 0; t < TMAX; ++t)
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[t][k] = 0.f;
#pragma unroll
    for (int i = 0; i < NPT; ++i) {
        const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv[i]);
        float w[8];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float2 f = __bfloat1622float2(w2[k]);
            w[2 * k] = f.x;
            w[2 * k + 1] = f.y;
        }
#pragma unroll
        for (int t = 0; t < TMAX; ++t) {
            const float qv = q_s[t][ng * NPT + i];
#pragma unroll
            for (int k = 0; k < 8; ++k) acc[t][k] = fmaf(qv, w[k], acc[t][k]);
        }
    }
#pragma unroll
    for (int t = 0; t < TMAX; ++t)
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            acc[t][k] += __shfl_xor_sync(0xffffffffu, acc[t][k], 8);
            acc[t][k] += __shfl_xor_sync(0xffffffffu, acc[t][k], 16);
        }
    if (lane < 8) {
#pragma unroll
        for (int t = 0; t < TMAX; ++t) {
            *reinterpret_cast<float4*>(&red[warp][t][cg * 8]) = make_float4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]);
            *reinterpret_cast<float4*>(&red[warp][t][cg * 8 + 4]) = make_float4(acc[t][4], acc[t][5], acc[t][6], acc[t][7]);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < num_tokens * 64; i += 256) {
        const int t = i / 64, c = i % 64;
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < 8; ++w) sum += red[w][t][c];
        q_lat[((size_t)t * H + h) * R + c0 + c] = to_bf16(sum);
    }
}

// out[t, h·DV + v] = Σ_{r < R} ctx[t, h, r] · w_kvb[h·(DN+DV) + DN + v, r]           (W_UV_h ctx_h)
// Grid (H, DV / 16), 256 threads: warp w owns rows v = 16·blockIdx.y + 2w, +1; lane covers columns
// 8·lane + 256·i (16-byte loads), then a warp sum per (row, token).
extern "C" __global__ void __launch_bounds__(256)
mla_expand_out(const bf16* __restrict__ ctx, const bf16* __restrict__ w_kvb, int num_tokens,
               bf16* __restrict__ out, int ld_out) {
    MLA_UP_PDL_ENTRY();
    constexpr int RPL = R / 256;  // 16-byte chunks per lane and row
    __shared__ __align__(16) bf16 c_s[TMAX][R];
    const int h = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int v0 = blockIdx.y * 16 + warp * 2;
    uint4 wv[2][RPL];
#pragma unroll
    for (int row = 0; row < 2; ++row)
#pragma unroll
        for (int i = 0; i < RPL; ++i)
            wv[row][i] = __ldg(reinterpret_cast<const uint4*>(w_kvb + (size_t)(h * (DN + DV) + DN + v0 + row) * R
                                                              + lane * 8 + i * 256));
#if EARLY_W
    {
        unsigned dep = 0u;  // (every early load feeds the wait, else ptxas issues it first: KDA_PDL_WAIT_AFTER)
#pragma unroll
        for (int row = 0; row < 2; ++row)
#pragma unroll
            for (int i = 0; i < RPL; ++i) dep |= wv[row][i].x;
        KDA_PDL_WAIT_AFTER(dep);  // ctx: the attention's output
    }
#endif
    for (int i = threadIdx.x; i < num_tokens * (R / 8); i += 256) {
        const int t = i / (R / 8), c = (i % (R / 8)) * 8;
        *reinterpret_cast<uint4*>(&c_s[t][c]) = *reinterpret_cast<const uint4*>(ctx + ((size_t)t * H + h) * R + c);
    }
    __syncthreads();
#pragma unroll
    for (int row = 0; row < 2; ++row) {
#pragma unroll
        for (int t = 0; t < TMAX; ++t) {
            if (t >= num_tokens) break;
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < RPL; ++i) {
                const uint4 cv = *reinterpret_cast<const uint4*>(&c_s[t][lane * 8 + i * 256]);
                const __nv_bfloat162* c2 = reinterpret_cast<const __nv_bfloat162*>(&cv);
                const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv[row][i]);
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const float2 a = __bfloat1622float2(c2[k]), b = __bfloat1622float2(w2[k]);
                    sum = fmaf(a.x, b.x, fmaf(a.y, b.y, sum));
                }
            }
            sum = warp_sum(sum);
            if (lane == 0) out[(size_t)t * ld_out + h * DV + v0 + row] = to_bf16(sum);
        }
    }
}
#endif  // small-batch up-projections
