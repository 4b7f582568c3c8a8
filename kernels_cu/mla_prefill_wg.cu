// mla_prefill_wg.cu — MLA prefill attention, expanded form, on Hopper's warpgroup MMA (sm_90a only:
// KDA_RT_HOPPER).  Same contract, rounds, masking, running state and rounding points as
// mla_prefill_attn in mla_prefill.cu (mma.sync, every sm_80+ arch, and the fallback here); only the
// products and the scratch layout of the decompressed keys and values differ:
//
//   kn [H, ld_rows, DN]  k_nope of scratch row r and head h at (h·ld_rows + r)·DN    (cuBLAS, batched)
//   vt [H, DV, ld_rows]  v of scratch row r and head h, transposed: column r of rows h·DV .. h·DV + DV - 1
//   lat [rows, R + DR]   k_pe at column R (mla_prefill_gather)
// Each sequence's segment starts at a scratch row that is a multiple of 32 (ops/mla_prefill.py pads the
// segments; the gather zero-fills the padding rows), so a key tile's V^T columns are 16-byte aligned.
//
// Geometry.  Grid (num_tiles, H), 256 threads = two warpgroups; a CTA owns BLOCK_M = 128 query rows of one
// (sequence, head), warpgroup w rows 64w .. 64w + 63 (warp q of it rows 16q .. of those: the same
// rows per warp as mla_prefill_attn, so the epilogue is shared).  Key tiles of BLOCK_N = 64 positions:
//   S[64, 64] = Q·Kᵀ: DQK/16 wgmma.m64n64k16, A = Q from registers (loaded once with ldmatrix), B = K
//   K-major in shared memory;  mask, online softmax (mla_prefill.cuh) on the accumulators;
//   O[64, 128] += P·V: BLOCK_N/16 wgmma.m64n128k16 with A = P from registers (the S accumulators packed
//   to bf16: wgmma.cuh's layouts) and B = Vᵀ K-major (keys contiguous) in shared memory.
// Staggered warpgroups: between two barriers (one key tile), warpgroup 0 runs S(it), softmax(it), PV(it)
// while warpgroup 1 runs softmax(it-1), PV(it-1) on the scores it kept in registers, then S(it); so each
// one's softmax overlaps the other's products on the tensor cores.  STAGES stages, STAGES - 2 tiles in
// flight: right after the barrier that starts iteration it (every warpgroup is past iteration it - 1, whose
// wgmma waits retired every product that read tile it - 2), tile it + STAGES - 2 is copied into the stage of
// tile it - 2 while warpgroup 1 still reads tile it - 1's values; one block barrier per tile.  Tried and
// dropped (H200, 2026-12-01, bench_mla_prefill.py --variants, commit db03181): both warpgroups in step, each
// issuing S(it) and P·V(it - 1) together and running the softmax of tile it under P·V(it - 1) (FA3's
// in-warpgroup overlap without its ping-pong): +11-12% at 32K and 128K, +6% at 8 x 2048.
// Shared memory, 128-byte rows with the 128-byte swizzle, every sub-tile 1024-byte aligned: Q as DQK/64
// sub-tiles [128][64]; per stage K as DQK/64 sub-tiles [64 keys][64] and Vᵀ as one [128 dv][64 keys]
// (168 KB at DQK = 192 with 3 stages, 208 KB with 4; one CTA per SM).  Every copy is a 16-byte cp.async
// into its swizzled place; key positions past the key end are zero-filled.
// Compile-time constants: H, R, DN, DR, DV (DN, DR multiples of 64, DV = 128), STAGES (3 or 4), FLAG_HAS_PREV,
// FLAG_FINAL.
// H200, 2026-12-01 (tests/gpu/bench_mla_prefill.py, H = 32): 467-483 TFLOP/s from 32K context (mma.sync
// 258-264), 387 at 8 x 2048 (226).  Before the per-thread copy geometry, the first-slice overwrite and the
// held-max rescale skip, 352 (ncu at 8 x 2048: tensor pipe 32% busy, issue 43%, 1.97 warps per scheduler
// with 0.62 eligible, 860 instructions per warp and tile: the copies' address arithmetic dominated).
// 4 stages (2026-12-01, thirteenth session, --variants 3,4 interleaved): 489 -> 500 TFLOP/s at 1 x 32768, 463 ->
// 478 at 131072 in chunks of 8192.  ncu at 1 x 32768 (3 stages, before): tensor pipe 51% of its cycles at 1.80 GHz,
// issue slots 38%, 0.52 eligible warps per scheduler; stall samples: fixed-latency waits 29%, the block
// barrier 15%, the cp.async wait 8%, the wgmma waits ~8%.
#include "mla_prefill.cuh"
#include "mla_prefill_wg.cuh"

#if !defined(H) || !defined(R) || !defined(DN) || !defined(DR) || !defined(DV) || !defined(STAGES) || \
    !defined(FLAG_HAS_PREV) || !defined(FLAG_FINAL)
#error "mla_prefill_wg.cu needs -DH -DR -DDN -DDR -DDV -DSTAGES -DFLAG_HAS_PREV -DFLAG_FINAL"
#endif

#define THREADS 256
#define BLOCK_M 128
#define BLOCK_N 64
#define AHEAD (STAGES - 2)            // key tiles in flight
#define DQK (DN + DR)
#define LATW (R + DR)
#define SUB_BYTES 16384                 // one [128][64] bf16 sub-tile (Q, Vᵀ)
#define KSUB_BYTES (BLOCK_N * 128)      // one [BLOCK_N][64] bf16 sub-tile (K)
#define QSUB (DQK / 64)                 // sub-tiles of a Q or K tile
#define QK_STEPS (DQK / 16)             // k16 slices of Q·Kᵀ
#define Q_BYTES (QSUB * SUB_BYTES)
#define STAGE_BYTES (QSUB * KSUB_BYTES + SUB_BYTES)
#define SN (BLOCK_N / 8)                // n8 score blocks per thread
#define ON (DV / 8)                     // n8 output blocks per thread

static_assert(DN % 64 == 0 && DR % 64 == 0 && DV == 128, "mla_prefill_wg: DN, DR multiples of 64 and DV = 128");
static_assert(BLOCK_N == 64, "mla_prefill_wg: one Vᵀ sub-tile per stage, m64n64 score products");
static_assert(STAGES == 3 || STAGES == 4, "mla_prefill_wg: 3 or 4 stages");

// cp.async of tile rows: Q rows, K rows (k_nope from kn, k_pe from lat), Vᵀ rows (dv index, keys contiguous)
__device__ __forceinline__ void load_q(unsigned q_base, const bf16* __restrict__ q, int ld_q, size_t tok, int h, int rows) {
    constexpr int CH = DQK / 8;
    for (int i = threadIdx.x; i < BLOCK_M * CH; i += THREADS) {
        const int row = i / CH, ch = i % CH;
        const bool ok = row < rows;
        const bf16* src = q + (ok ? tok + row : 0) * (size_t)ld_q + h * DQK + ch * 8;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(q_base + (ch / 8) * SUB_BYTES + swz(row, ch % 8)),
                     "l"(src), "r"(ok ? 16 : 0));
    }
}

// Per-thread copy geometry of the K and Vᵀ tiles (fixed for the CTA): thread t copies 16-byte chunk
// lch = t mod 8 of rows lrow = t / 8 + 32·i of every sub-tile; its sources advance with the tile's first key.
struct KvCopy {
    const bf16* k_src[QSUB];  // row 0 of the round's scratch, this thread's chunk of K sub-tile s
    int k_ld[QSUB];           // row stride of that source (DN for kn, LATW for lat)
    const bf16* v_src;        // Vᵀ row h·DV + lrow, key column row0 - ks + 8·lch
    unsigned dst;             // swz(lrow, lch): the same in every 32-row pass (32 mod 8 == 0)
    int lrow, lch;
};

__device__ __forceinline__ KvCopy kv_copy(const bf16* __restrict__ kn, const bf16* __restrict__ vt,
                                          const bf16* __restrict__ lat, int ld_rows, int h, int row0, int ks) {
    KvCopy c;
    c.lrow = threadIdx.x >> 3, c.lch = threadIdx.x & 7;
#pragma unroll
    for (int sb = 0; sb < QSUB; ++sb) {
        const bool nope = sb < DN / 64;
        c.k_src[sb] = nope ? kn + (size_t)h * ld_rows * DN + sb * 64 + c.lch * 8 : lat + R + (sb - DN / 64) * 64 + c.lch * 8;
        c.k_ld[sb] = nope ? DN : LATW;
    }
    c.v_src = vt + ((size_t)h * DV + c.lrow) * ld_rows + (row0 - ks) + 8 * c.lch;
    c.dst = swz(c.lrow, c.lch);
    return c;
}

// cp.async of the tile of keys kb .. kb + BLOCK_N - 1 into a stage (key positions >= kend zero-filled; a Vᵀ
// chunk reaching past kend holds the segment's zero padding or keys the mask drops)
__device__ __forceinline__ void load_kv(const KvCopy& c, unsigned stage, int ld_rows, int row0, int ks, int kb, int kend) {
    static_assert(THREADS == 256 && BLOCK_N % 32 == 0 && DV % 32 == 0, "copy passes of 32 rows");
#pragma unroll
    for (int i = 0; i < BLOCK_N / 32; ++i) {
        const int pos = kb + c.lrow + 32 * i;
        const bool ok = pos < kend;
        const size_t r = ok ? (size_t)(row0 + pos - ks) : 0;
#pragma unroll
        for (int sb = 0; sb < QSUB; ++sb)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(stage + sb * KSUB_BYTES + c.dst + i * 32 * 128),
                         "l"(c.k_src[sb] + r * c.k_ld[sb]), "r"(ok ? 16 : 0));
    }
    const unsigned v_base = stage + QSUB * KSUB_BYTES;
    const bool ok = kb + 8 * c.lch < kend;
    const bf16* src = c.v_src + (ok ? kb : ks - row0 - 8 * c.lch);  // not ok: column 0 of the row, nothing read
#pragma unroll
    for (int i = 0; i < DV / 32; ++i)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(v_base + c.dst + i * 32 * 128),
                     "l"(src + (size_t)32 * i * ld_rows), "r"(ok ? 16 : 0));
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
mla_prefill_attn_wg(const bf16* __restrict__ q, int ld_q, const bf16* __restrict__ kn, const bf16* __restrict__ vt,
                    const bf16* __restrict__ lat, int ld_rows, const int* __restrict__ seq_rec,
                    const int* __restrict__ tiles, float scale_log2, bf16* __restrict__ out, int ld_out,
                    float* __restrict__ o_state, float* __restrict__ ml_state) {
    KDA_PDL_ENTRY();
    extern __shared__ unsigned char smem_raw[];
    const unsigned base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // the launcher adds 1 KB for this alignment
    const unsigned q_base = base, stage0 = base + Q_BYTES;

    const int h = blockIdx.y;
    const QueryTile qt = query_tile<BLOCK_M, BLOCK_N>(seq_rec, tiles);
    const int row0 = qt.row0, ks = qt.ks, rows = qt.rows, p0 = qt.p0, kend = qt.kend;
    const int num_tiles = qt.num_tiles, mask_from = qt.mask_from;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int g = lane >> 2, c4 = lane & 3;

    float o[4 * ON];
#pragma unroll
    for (int j = 0; j < 4 * ON; ++j) o[j] = 0.f;
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};  // rows g and g + 8 of this warp (raw score units)
    float s[4 * SN] = {};  // scores of the tile in hand (warpgroup 1 keeps them across the barrier)
    unsigned qa[QK_STEPS][4];  // this warpgroup's Q rows as A fragments

    const KvCopy cp = kv_copy(kn, vt, lat, ld_rows, h, row0, ks);
    if (num_tiles > 0) {  // Q and tiles 0 .. AHEAD - 1, one commit group each (group t holds tile t)
        load_q(q_base, q, ld_q, (size_t)(qt.tok0 + qt.i0), h, rows);
#pragma unroll
        for (int t = 0; t < AHEAD; ++t) {
            if (t < num_tiles) load_kv(cp, stage0 + t * STAGE_BYTES, ld_rows, row0, ks, ks + t * BLOCK_N, kend);
            cp_async_commit();
        }
    }
    const int prow0 = p0 + warp * 16 + g;  // positions of rows g and g + 8

    auto scores = [&](unsigned k_tile) {  // s = Q·Kᵀ of one tile (waits for it)
        fence_regs(s);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < QK_STEPS; ++kk)  // the first slice overwrites s
            wgmma_m64n64k16_rs(s, qa[kk], smem_desc(k_tile + (kk / 4) * KSUB_BYTES + 32 * (kk % 4)), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(s);
    };
    auto attend = [&](int kb, unsigned v_tile) {  // mask, softmax, O += P·V of the tile in s (issued, not waited)
        mask_tile<SN>(s, kb, prow0, kend, mask_from, c4);
        softmax_tile<SN, ON, true>(s, o, m_run, l_run, scale_log2);
        // score blocks 2kk, 2kk + 1 packed to bf16 are the A fragment of k16 slice kk (all packed before the
        // fence: a register written between two wgmma costs an injected arrive)
        unsigned pa[BLOCK_N / 16][4];
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
#pragma unroll
            for (int e = 0; e < 4; ++e) pa[kk][e] = pack_bf16(s[8 * kk + 2 * e], s[8 * kk + 2 * e + 1]);
        }
        fence_regs(o);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) wgmma_m64n128k16_rs(o, pa[kk], smem_desc(v_tile + 32 * kk));
        wgmma_commit();
    };

    staggered_key_tiles<STAGES, BLOCK_N>(
        num_tiles, ks, wg, stage0, STAGE_BYTES, QSUB * KSUB_BYTES,
        [&](unsigned stage, int kb) { load_kv(cp, stage, ld_rows, row0, ks, kb, kend); },
        [&] {
#pragma unroll
            for (int kk = 0; kk < QK_STEPS; ++kk)  // rows 16·warp + (lane mod 16), columns 16kk + 8·(lane / 16)
                ldmatrix_x4(qa[kk], smem_raw + (q_base - smem_addr(smem_raw)) + (kk / 4) * SUB_BYTES +
                                        swz(warp * 16 + (lane & 15), 2 * (kk % 4) + (lane >> 4)));
        },
        scores, attend, [&] { fence_regs(o); });
    store_rows(o, l_run, m_run, warp, rows, (size_t)(qt.tok0 + qt.i0), h, qt.flags, scale_log2, out, ld_out, o_state, ml_state);
}
