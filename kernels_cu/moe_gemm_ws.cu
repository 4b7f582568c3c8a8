// moe_gemm_ws.cu — the prefill grouped GEMM of moe_gemm_wg.cu (same contract, math, rounding, tiles and
// accumulation order: outputs bit-identical) with its copies taken off the multiplying warps (sm_90a only:
// KDA_RT_HOPPER): one producer warpgroup fills the shared-memory stages, two consumer warpgroups multiply.
//
//   weights (B): bulk tensor copies (TMA) of 128-row boxes from the 2-D view [E · NOUT, K] of the weight,
//                128-byte swizzle, issued by one thread; the map (128 bytes, built by the launcher through
//                cuTensorMapEncodeTiled) is read from global memory;
//   rows (A):    cp.async by the 128 producer threads (a gather of x rows for gate/up, h rows for down; rows
//                past the tile end zero-filled, nothing read), each thread's 16-byte pieces at the swizzled
//                offsets the descriptors name.
//
// Stage s is handed over with two mbarriers: full[s] (count 129: every producer thread arrives after its
// copies of the stage have landed and it has fenced them for the tensor cores' async proxy, and thread 0
// arrives once more with the stage's expected TMA bytes) and empty[s] (count 8: lane 0 of every consumer
// warp, after the wgmma group that read the stage has completed).  The producer runs up to STAGES k steps
// ahead; it signals step kt - 1 after issuing step kt (so its cp.async wait never holds back an issue).
// Consumer warpgroup c computes rows [64c, 64c + 64) x BN features as moe_gemm_wg.cu's warpgroup c does
// (wgmma m64nBNk16, 4 per k step, one group in flight), then stores (store_rows).
// Block 384 threads (warpgroup 0 produces, 1 and 2 consume); grid, plan and shapes as moe_gemm_wg.cu.
//
// MC = 1: clusters of two CTAs along the tiles (grid.y even): when tiles 2i and 2i + 1 are both in use and
// belong to one expert, they read the same weight boxes, so each CTA loads one of the two 128-row boxes of
// a stage and multicasts it into both CTAs' shared memory: half the weight traffic from L2.  Then each
// CTA's full[s] expects both boxes' bytes, its empty[s] counts the consumer warps of both CTAs (16: a CTA's
// copy writes the peer's stage too, so it may refill only when both have read it; consumers arrive on the
// peer's barrier through its cluster address), the barriers are initialised before a cluster barrier, and
// both CTAs meet at a cluster barrier before leaving (the peer may still arrive on this CTA's barriers).
// Otherwise (a pair of two experts, or a partner past the tiles in use) each CTA loads alone, as MC = 0.
// Compile-time constants: K, NOUT, FUSE_SILU, TOPK, BN, STAGES, MC (0 or 1).
#include "common.cuh"

#if !defined(K) || !defined(NOUT) || !defined(BN) || !defined(STAGES) || !defined(FUSE_SILU) || !defined(TOPK)
#error "moe_gemm_ws.cu needs -DK -DNOUT -DBN -DSTAGES -DFUSE_SILU -DTOPK"
#endif
#if defined(__CUDA_ARCH__) && !defined(KDA_RT_HOPPER)
#error "moe_gemm_ws.cu needs sm_90a (wgmma, bulk tensor copies)"
#endif

#ifndef MC
#define MC 0
#endif
#define BM 128
#define BK 64
#define THREADS 384
#define PTHREADS 128                         // producer warpgroup
#define ACC (BN / 2)
#define A_BYTES (BM * BK * 2)                // 16 KB
#define B_BYTES (BN * BK * 2)
#define STAGE_BYTES (A_BYTES + B_BYTES)
#define KT (K / BK)
#define HALF (NOUT / 2)
#define RPP (PTHREADS / 8)                   // A rows copied per pass of the producer warpgroup
#define A_PASSES (BM / RPP)
#define BOX 128                              // rows of one tensor-map box

static_assert(BN == 256, "moe_gemm_ws.cu: BN must be 256 (gate/up: one 128-row box of gate rows, one of up rows)");
static_assert(K % BK == 0 && STAGES >= 2, "K must be a multiple of 64, STAGES >= 2");
#if FUSE_SILU
static_assert(HALF % (BN / 2) == 0, "gate/up tiles: BN/2 must divide HALF");
#else
static_assert(NOUT % BN == 0, "NOUT must be a multiple of BN");
#endif

#include "moe_tile.cuh"
#include "wgmma.cuh"

__device__ __forceinline__ void wgmma_tile(float (&d)[ACC], unsigned long long desc_a, unsigned long long desc_b) {
#if BN == 256
    wgmma_m64n256k16(d, desc_a, desc_b);
#else
    wgmma_m64n128k16(d, desc_a, desc_b);
#endif
}

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile("{\n.reg .pred p;\nWAIT:\n"
                 "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// box of BOX rows x 64 columns at (row, col) of the 2-D tensor named by the map into shared memory
__device__ __forceinline__ void tma_load_2d(unsigned dst, const void* map, int row, int col, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 ::"r"(dst), "l"(map), "r"(col), "r"(row), "r"(bar) : "memory");
}
// the same box into the same shared-memory offset of both CTAs of the cluster (each one's barrier at `bar`)
__device__ __forceinline__ void tma_load_2d_mc2(unsigned dst, const void* map, int row, int col, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3}], [%4], %5;"
                 ::"r"(dst), "l"(map), "r"(col), "r"(row), "r"(bar), "h"((unsigned short)3) : "memory");
}
// arrive on the barrier at the cluster address `bar` (the peer CTA's)
__device__ __forceinline__ void mbar_arrive_cluster(unsigned bar) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(bar) : "memory");
}

#include "moe_wg_epilogue.cuh"  // store_rows

extern "C" __global__ void __launch_bounds__(THREADS, 1)
#if MC
__cluster_dims__(1, 2, 1)
#endif
moe_grouped_gemm_ws(const bf16* __restrict__ src, const int* __restrict__ sorted_pair, const void* __restrict__ wmap,
                    const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                    const int* __restrict__ expert_off, const int* __restrict__ num_tiles, void* __restrict__ dst) {
    KDA_PDL_ENTRY();
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long bars[2 * STAGES];  // full[0..S), empty[0..S)
    const unsigned raw = smem_addr(smem_raw);
    const unsigned base = (raw + 1023u) & ~1023u;  // the launcher adds 1 KB for this alignment
    const unsigned full0 = smem_addr(bars), empty0 = full0 + 8 * STAGES;

    const int tile = blockIdx.y;
#if MC
    // both CTAs of the pair read the same plan entries, so they agree on `mc` (a CTA may leave at once
    // only when the pair does not share: then neither touches the other)
    const int used = num_tiles[0], peer_tile = tile ^ 1;
    const bool mc = tile < used && peer_tile < used && tile_expert[tile] == tile_expert[peer_tile];
    const unsigned rank = cluster_rank();
#else
    constexpr bool mc = false;
#endif
    if (tile >= num_tiles[0]) return;
    const int e = tile_expert[tile], row0 = tile_row[tile];
    const int nrows = min(BM, expert_off[e + 1] - row0);
    const int tid = threadIdx.x, wg = tid >> 7;
#if FUSE_SILU
    const int f0 = blockIdx.x * (BN / 2);
#else
    const int f0 = blockIdx.x * BN;
#endif

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, PTHREADS + 1);
            mbar_init(empty0 + 8 * s, mc ? 16 : 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
#if MC
    if (mc) {  // the peer's barriers are initialised before any copy or arrive reaches them
        cluster_arrive();
        cluster_wait();
    }
    const unsigned peer_empty0 = mc ? peer_addr(bars + STAGES, rank ^ 1) : 0u;
#endif

    if (wg == 0) {  // ---- producer
        const int lrow = tid >> 3, lch = tid & 7;
        const bf16* a_src[A_PASSES];
        int a_bytes[A_PASSES];
        tile_row_sources<K, FUSE_SILU>(a_src, a_bytes, src, sorted_pair, row0, nrows, lrow, lch);
        const unsigned dst_off = swz(lrow, lch);
        // weight rows of the block: gate/up: gate f0.. (smem rows 0..BN/2) and up HALF + f0.. (BN/2..BN)
        const int wrow = e * NOUT + f0;
        for (int kt = 0; kt <= KT; ++kt) {
            if (kt < KT) {
                const int s = kt % STAGES;
                if (kt >= STAGES) mbar_wait(empty0 + 8 * s, ((kt / STAGES) - 1) & 1);
                const unsigned a_dst = base + s * STAGE_BYTES, b_dst = a_dst + A_BYTES;
                if (tid == 0) {
                    mbar_arrive_tx(full0 + 8 * s, B_BYTES);
#pragma unroll
                    for (int j = 0; j < BN / BOX; ++j) {
                        const int r = FUSE_SILU ? (j * BOX < BN / 2 ? wrow + j * BOX : wrow + HALF - BN / 2 + j * BOX)
                                                : wrow + j * BOX;
                        if (!mc) tma_load_2d(b_dst + j * BOX * 128, wmap, r, kt * BK, full0 + 8 * s);
#if MC
                        else if (j == (int)rank) tma_load_2d_mc2(b_dst + j * BOX * 128, wmap, r, kt * BK, full0 + 8 * s);
#endif
                    }
                }
#pragma unroll
                for (int i = 0; i < A_PASSES; ++i)
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a_dst + dst_off + i * RPP * 128),
                                 "l"(a_src[i] + kt * BK), "r"(a_bytes[i]));
                cp_async_commit();
            }
            if (kt >= 1) {  // step kt - 1's rows have landed: fence them for the tensor cores, hand over
                if (kt < KT) cp_async_wait<1>();
                else cp_async_wait<0>();
                fence_proxy_async();
                mbar_arrive(full0 + 8 * ((kt - 1) % STAGES));
            }
        }
    } else {  // ---- consumers: warpgroup c = wg - 1 multiplies rows [64c, 64c + 64)
        const int c = wg - 1, lane = tid & 31;
        float acc[ACC];
#pragma unroll
        for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
        for (int kt = 0; kt < KT; ++kt) {
            const int s = kt % STAGES;
            mbar_wait(full0 + 8 * s, (kt / STAGES) & 1);
            const unsigned a_tile = base + s * STAGE_BYTES + c * 64 * 128;
            const unsigned b_tile = base + s * STAGE_BYTES + A_BYTES;
            fence_regs(acc);
            wgmma_fence();
#pragma unroll
            for (int k16 = 0; k16 < BK / 16; ++k16) wgmma_tile(acc, smem_desc(a_tile + 32 * k16), smem_desc(b_tile + 32 * k16));
            wgmma_commit();
            wgmma_wait<1>();
            fence_regs(acc);
            if (kt >= 1 && lane == 0) {  // step kt - 1's products are done: its stage may be refilled
                const unsigned off = 8 * ((kt - 1) % STAGES);
                mbar_arrive(empty0 + off);
#if MC
                if (mc) mbar_arrive_cluster(peer_empty0 + off);
#endif
            }
        }
        wgmma_wait<0>();
        fence_regs(acc);
        store_rows(acc, dst, row0, nrows, f0, c * 64, tid & 127);
    }
#if MC
    if (mc) {  // the peer may still arrive on this CTA's barriers until it is past its last step
        cluster_arrive();
        cluster_wait();
    }
#endif
}
