// moe_gemm_wg.cu — prefill grouped GEMM over expert-bucketed rows on Hopper's warpgroup MMA (wgmma,
// sm_90a only: KDA_RT_HOPPER), for the two MoE projections (spec §5.1).  Same contract, math and
// rounding as moe_gemm_tc.cu (mma.sync, any sm_80+), which serves every other arch and the small tiles:
//
//   FUSE_SILU = 1 (gate/up):  g = x[tok(r)] · W[e, f]ᵀ,  u = x[tok(r)] · W[e, HALF + f]ᵀ
//                             h[r, f] = bf16( bf16(SiLU(bf16(g))) · bf16(u) )      (as silu_mul.cu)
//                             W = w13 [E, 2·HALF, K] (gate rows first), x [T, K], tok(r) = sorted_pair[r] / TOPK
//   FUSE_SILU = 0 (down):     y[r, f] = bf16(h[r] · W[e, f]ᵀ)                       W = w2 [E, NOUT, K]
//
// Rows r are the expert-sorted pair rows of moe_align.cu built with BT = 128: tile i covers rows
// [tile_row[i], min(tile_row[i] + 128, expert_off[e + 1])) of expert e = tile_expert[i].  A CTA whose
// tile index is ≥ num_tiles[0] (read on the device) exits at once (graph-capturable grid).
//
// Geometry.  CTA tile 128 rows × BN features (BN = 128 or 256), K in steps of 64 bf16 (WFMT 2: 128 e4m3) (one 128-byte row
// per operand row and step).  Two warpgroups (256 threads); warpgroup w computes rows [64w, 64w + 64)
// × all BN features with wgmma.m64nBNk16 (4 per k step), A and B both K-major from shared memory, the
// fp32 accumulators in registers (BN / 2 per thread).  Grid (feature blocks, max_tiles), as moe_gemm_tc.cu.
//   FUSE_SILU: shared-memory B rows [0, BN/2) are gate features f0 .. f0 + BN/2 - 1 and rows
//   [BN/2, BN) the matching up features HALF + f0 ..; in the wgmma accumulator layout a thread holding
//   column n also holds column n + BN/2, so the SiLU·up epilogue pairs registers of one thread.
// Pipeline.  STAGES shared-memory stages filled by cp.async (16 B per thread and copy; the A rows are a
// gather, so no bulk tensor copy), STAGES - 2 k steps in flight while one is multiplied and the
// previous one's wgmma group may still run:
//   step kt: wait for stage kt's copies; fence.proxy.async (cp.async writes are generic-proxy writes the
//   tensor cores read); barrier (every warpgroup that multiplies is past step kt - 1's wait, so step kt - 2's
//   stage is free); copy step kt + STAGES - 2 into it; issue step kt's 4 wgmma, commit, wait until ≤ 1 group is
//   pending (step kt - 1's done).
// Shared memory layout: each stage is A [128][64] then B [BN][64] bf16, 128-byte rows with the 128-byte
// swizzle that the descriptors name (16-byte chunk c of row r stored at chunk c ^ (r mod 8)), every
// operand tile 1024-byte aligned; descriptor: start >> 4, stride between 8-row groups 1024 B, swizzle
// mode 1 (128 B); the k16 slice s of a step starts 32·s bytes into the rows.
//   Rows past the tile end are zero-filled by cp.async (source clamped to the tile's first row, nothing
//   read) and never stored.  A warpgroup whose 64 rows all lie past the end (an expert's last tile of 64 rows
//   or fewer) skips its wgmma (HALF_SKIP = 1): it runs a copy of the k loop without them, chosen once before
//   the loop (a branch around the wgmma inside the loop, even a warpgroup-uniform one, makes ptxas serialise
//   them: C7518), and still copies its share and meets every barrier; the other warpgroup then has the tensor
//   cores to itself.  Outputs bit-identical.  H200, 2026-12-01, tests/gpu/bench_moe_gemm.py --define
//   HALF_SKIP=0,1 (5 interleaved rounds, uniform routing; the tool's percentages, from unrounded medians):
//   gate/up | down at T = 8192 -2.9 | -2.8%, 16384 -4.9 | -2.5%, 32768 -1.0 | -1.2% (fewer experts' last tiles
//   against the full ones).
//
// Shapes / dtypes: src bf16 (WFMT 2: uint8 e4m3 codes with src_scale fp32 a row) ([T, K] x when FUSE_SILU, else [N, K]
//   h); weight bf16 [E, NOUT, K] (WFMT 1, 2: uint8 e4m3 with scale [E, NOUT]);
//   dst bf16 [N, HALF] (FUSE_SILU) or bf16 [N, NOUT] (y, one bf16 rounding per expert row as HF's expert output); plan arrays int32 (moe_align.cu).
// Compile-time constants: K, NOUT, FUSE_SILU, TOPK, BN, STAGES, STAGED_OUT (the epilogue, below), HALF_SKIP (0 / 1),
// UNALIGNED_BAR (0 / 1: k_barrier), WFMT and E4M3_CVT (below).
//
// WFMT = 1: the weights in e4m3 (uint8 bits [E, NOUT, K]) with one fp32 scale a weight row (scale [E, NOUT],
// loader/quant.py).  wgmma multiplies bf16 by bf16 only, so each k step's e4m3 B rows are widened to bf16 in shared
// memory first (exact: every e4m3 value is a bf16 value): a stage holds A [128][64] bf16 and Bq [BN][64] e4m3 (plain
// 64-byte rows), and three bf16 B tiles Bc [BN][64] in the swizzled layout above take step kt's weights in tile
// kt mod 3.  Each thread converts exactly the 16-byte pieces it copied (after its own cp.async wait, no barrier
// needed) into two swizzled 16-byte pieces of Bc; the step's one barrier then publishes A and Bc together.  Three
// tiles, not two: a thread converts step kt before the barrier of step kt, while the other warpgroup may still be
// multiplying step kt - 2 (its wait for kt - 2 comes after the barrier of step kt - 1); step kt - 3's products are
// done before the barrier of step kt - 1.  Shared memory: STAGES x (16 KB + BN x 64) + 3 x BN x 128 bytes (224 KB
// at BN = 256, 4 stages).  The conversion is e4m3.cuh's (E4M3_CVT picks it); the epilogue multiplies each
// fp32 sum by its row's scale before the roundings.
// Measured (H200, 2026-12-02, tests/gpu/bench_moe_gemm.py --e4m3, interleaved rounds, uniform routing), gate/up | down
// at T = 8192: bf16 1.165 | 0.606 ms, e4m3 through the conversion unit 1.784 | 0.847 (+53 | +40%), by bit moves 1.941
// | 1.013; T = 16384: 2.045 | 1.064, 3.319 | 1.690 (+62 | +59%), 3.347 | 1.796.  The widening (32 K codes a k step
// and SM) takes longer than the step's products (~1370 cycles at 605 TFLOP/s), so e4m3 weights cost prefill time
// here: still above moe_gemm_tc.cu's mma.sync rate, and correct, but the fast prefill form for e4m3 weights is FP8
// tensor-core products (activations quantized per row to e4m3 as well, wgmma e4m3 x e4m3), not written.
// WFMT = 2 (branch next/w8a8-prefill, KDA_RT_FP8_PREFILL): the sources are e4m3 codes too, with one fp32 scale a
// source row (ops/quant.quantize_activations_e4m3), and the products run on the e4m3 tensor cores: a k step is 128
// codes, one 128-byte row of A and of B as bf16's 64 elements, so the stages, swizzle and descriptors are bf16's and
// each of a step's four wgmma m64nNk32 takes 32 bytes of every row; the epilogue multiplies each sum by its weight
// row's scale and its source row's (the token's x row for gate/up, the h row for down).
// Measured (H200, 2026-12-02, tests/gpu/bench_moe_gemm.py --e4m3 --w8a8, 5 interleaved rounds, uniform routing),
// gate/up | down: T = 8192 bf16 1.270 | 0.633 ms, w8a8 0.756 | 0.447 (-40.5 | -29.3%; with the source's quantization
// 0.805 | 0.569), T = 16384 bf16 2.328 | 1.139, w8a8 1.300 | 0.785 = 951 | 787 TFLOP/s (-44.1 | -31.0%; with the
// quantization 1.561 | 1.014: h's pass, 268 MB read, is 0.23 ms and wants to ride in the gate/up epilogue).
// Open: the whole K accumulates in the tensor cores' accumulator, which on Hopper keeps fewer bits than fp32 for e4m3
// products (DeepSeek-V3 report, section 3.3.2, promotes to fp32 every 128 of K); the first unit test case measured
// RMS 4.07e-3 on h against the 4e-3 bound it was first given (now 8e-3, and per element the drift).  Kept so: vLLM's per-token x per-channel FP8 GEMMs on sm_90
// (csrc/quantization/cutlass_w8a8/c3x/scaled_mm_sm90_fp8_dispatch.cuh) run CUTLASS's FP8 "fast accumulation" schedule,
// no promotion, in every M bucket; promotion here would need a second accumulator set (BN / 2 more registers a
// thread: BN = 128 only).  The unit test's bounds follow from the drift (tests/kernels/test_moe_gemm_tc.py).
// Measured on H200 (tests/gpu/bench_moe_gemm.py, E=256, top-8, D=2304, I=1024, uniform random routing),
// gate/up | down, BN=256 with 4 stages (the launcher's tile) against moe_gemm_tc.cu's 128-row tile:
//   T=2048:  0.84 | 0.36 ms                    (moe_gemm_tc ~0.84 | 0.42)
//   T=8192:  1.28 | 0.79 ms = 483 | 390 TFLOP/s (2.36 | 1.21 ms = 262 | 256)
//   T=16384: 2.19 | 1.40 ms = 566 | 441 TFLOP/s (4.11 | 2.24 ms = 301 | 276); cuBLAS dense: 755 | 534
// 3 stages (1 k step in flight) lose a quarter: the copies are not hidden.  Tried and dropped (same bench,
// 2026-11-30): a persistent variant (one CTA per SM) with a producer warpgroup streaming cp.async stages
// 3 steps ahead on mbarriers: 435 | 377 TFLOP/s at T=8192 and 512 | 382 at T=16384, no better.  Tried and
// dropped (2026-12-01, bench_moe_gemm.py --tiles): 192-row tiles on three warpgroups (commit 221ed90), 110
// instead of 85 FLOP per byte copied: -1% at T=16384 (padding 1.125x against 1.114x), +17% at 8192 (1.5x);
// BN = 128 with 3 stages at 2 CTAs per SM: +20-29%; 32-wide k steps in 64-byte swizzled rows with 8 stages
// (commit 9ef6472): +17% gate/up, +8.5% down: the fixed cost of a k step (block barrier, wgmma wait, copy
// issue) is ~17% of a 64-wide one, the largest item between this kernel and the tensor cores' rate.
// ncu (2026-12-01, tests/gpu/ncu_moe_gemm.sh, T = 16384): tensor pipe 79% (gate/up) | 75% (down) active at
// 1.53 GHz, L2 throughput 74 | 78%, issue slots 27 | 25%; stall samples at the block barrier 21 | 26%, the
// cp.async wait 17 | 15%.  Tried and dropped (commit c94080d, bench_moe_gemm.py --define PF_AHEAD=0,3,4,6): each
// thread prefetching one 128-byte line of a later k step into L2 (prefetch.global.L2), 3 to 6 steps ahead:
// +35-62% at 8192 and 16384.  So L2 requests, not DRAM latency, bound the copies: any extra request costs.
#include "common.cuh"

#ifndef EXP_SKIP
#define EXP_SKIP 0
#endif
#ifndef HALF_SKIP
#define HALF_SKIP 1  // a warpgroup with no rows in the tile skips its wgmma (k_loop below); 0: it multiplies zeros
#endif
#ifndef UNALIGNED_BAR
#define UNALIGNED_BAR 1  // the k loop's block barrier as barrier.sync (defined across the two loop copies); 0: bar.sync
#endif
#ifndef EXP_IEEE_SILU
#define EXP_IEEE_SILU 0
#endif
#ifndef WFMT
#define WFMT 0
#endif
#ifndef E4M3_CVT
#define E4M3_CVT 1  // (the launcher passes ops/moe_gemm_tc.py E4M3_CONVERT)
#endif
// B_TMA = 1 (WFMT 0 or 2): each stage's weight rows by two 2D tensor copies (cp.async.bulk.tensor, TMA) of BN / 2 rows x
// one 128-byte k step, issued by thread 0 and completing on the stage's mbarrier, in the same 128-byte swizzle
// (the tensor map's CU_TENSOR_MAP_SWIZZLE_128B writes 16-byte chunk c of row r at c ^ (r mod 8) in a 1024-byte aligned
// tile, as the copies below do), instead of BN x 8 16-byte cp.async pieces over the block.  b_map (an 11th argument,
// B_TMA builds only): the tensor map (ops/tma.py, over the weights as [E NOUT] rows of K elements, box BN / 2 rows x
// 128 bytes) in global memory.  ncu
// (2026-12-01): L2 74-78% busy and the cp.async waits 15-17% of the stall samples; with no copies and no epilogue
// gate/up at T = 16384 ran 1.561 ms against 1.872 with them (bench_moe_gemm.py --limits): the weights are two thirds of
// a stage's bytes.  The same values in the same places: bit-identical.  Measured (H200, 2026-12-03): no faster, so 0.
// bench_moe_gemm.py --define B_TMA=0,1 --tokens 8192,16384 (bf16, interleaved rounds): gate/up 1.328 -> 1.326 ms and
// 2.391 -> 2.387, down 0.674 -> 0.683 and 1.225 -> 1.228; the full 27-layer fp8 seed prefill (bench_ab.py, 3 rounds,
// TTFT max medians) 0.6286 s without, 0.6255 with B_TMA, 0.6233 with B_TMA + A_TMA (within the rounds' spread).  The
// copies' issue is not what bounds this kernel (the per-step barrier and wgmma wait are the suspects: ncu above);
// kept, opt-in and tested, as the copy path a warp-specialized producer would use.
#ifndef B_TMA
#define B_TMA 0
#endif
#if B_TMA && WFMT == 1
#error "moe_gemm_wg.cu: B_TMA copies the weights into the swizzled tile wgmma reads; WFMT 1 widens them first"
#endif
// A_TMA = 1 (with B_TMA, the down GEMM only: its source rows, h, lie contiguous in expert order): each stage's 128
// source rows by one more tensor-map copy (box 128 rows x 128 bytes at the tile's first row) on the same mbarrier,
// so a stage is three copies of one thread and no cp.async at all.  a_map (a 12th argument, A_TMA builds only): the
// map over the source's allocation (ops/tma.py: rows past the step's N hold whatever the buffer held, rows past the
// allocation read as 0; neither is ever stored: only rows < nrows are).  gate/up's rows are a gather (x[tok(r)]), a
// box a row, which Hopper's TMA has no gather for.  The same values in the same places: bit-identical.  Measured with
// B_TMA above (2026-12-03): no faster, so 0.
#ifndef A_TMA
#define A_TMA 0
#endif
#if A_TMA && !(B_TMA && !FUSE_SILU)
#error "moe_gemm_wg.cu: A_TMA is built on B_TMA, for the down GEMM (contiguous source rows)"
#endif
// WS = 1 (with B_TMA; bf16, or e4m3 weights with e4m3 sources): the persistent, warp-specialized form,
// moe_grouped_gemm_ws, instead of moe_grouped_gemm_wg.  One CTA an SM (the launcher's grid) with WS_THREADS = 384
// threads claims (tile, feature block) items from a counter in global memory (`claim`, two ints that the last CTA
// done claiming sets back to 0: one pair a stream, ops/moe_gemm_wg.py), item w = tile · NFB + feature block, so
// CTAs that drew cheap items (an expert's last tile) draw more, as the plain kernel's grid does.  Warps 0-7 are the two
// consumer warpgroups (the plain kernel's wgmma and epilogue, rows [64w, 64w + 64) each), warps 8-11 the producer
// warpgroup (40 registers a thread, the consumers 232: setmaxnreg), which fills the STAGES stages as a ring for
// every item in turn, running ahead across items:
//   full[s]: stage s landed.  Its weight rows (and with A_TMA its source rows) by tensor-map copies that thread 0
//     issues after one arrival with their bytes; without A_TMA the gathered source rows by the warpgroup's cp.async
//     pieces, each thread's arriving when its pieces land (cp.async.mbarrier.arrive.noinc), and the consumers fence
//     the generic proxy's writes for the tensor cores after their wait.  The first k step of an item also names the
//     item (stage_item, -1: no more).
//   empty[s]: each consumer warp arrives once its wgmma on stage s are done (after the next stage's wgmma wait,
//     or at the item's end); the producer waits for it before the stage's next fill.
// So a stage is refilled as soon as the products that read it are done (no block barrier a k step), and the next
// item's stages fill while the consumers run the epilogue.  Staged epilogues (STAGED_OUT) get a tile of their own
// after the stages (the ring is busy with the next item), so the down GEMM fits 3 stages (the launcher's choice:
// ops/moe_gemm_wg.py ws_stages).  The same values in the same places and the same accumulation order as the plain
// kernel: bit-identical.
// Measured (H200, 2026-12-03, tests/gpu/bench_moe_gemm.py --ws [--e4m3 --w8a8], 5 interleaved rounds, uniform routing),
// plain -> WS, gate/up | down: bf16 T = 2048 0.648 -> 0.615 | 0.339 -> 0.330 ms, 8192 1.322 -> 1.355 | 0.691 -> 0.711,
// 16384 2.365 -> 2.412 | 1.207 -> 1.249 (+2.0 | +3.5%); e4m3 sources and weights (WFMT 2) 8192 0.852 -> 0.817 | 0.461
// -> 0.433, 16384 1.506 -> 1.453 | 0.819 -> 0.787 (-3.5 | -3.9%).  The full 27-layer seed prefill (bench_ab.py, TTFT
// max medians of 3 rounds): fp8 0.6152 -> 0.6078 s (-1.2%), bf16 0.8302 -> 0.8363 s (within the rounds' spread).  So
// the launcher takes it for e4m3 sources only (KDA_RT_MOE_WS unset).  A first form, each producer thread arriving
// STAGES - 2 steps after its copies (cp.async.wait_group, then a fence) and items dealt statically (blockIdx.x +
// i·gridDim.x), was 5-12% slower than the plain kernel at 8192-16384 tokens: the arrival tied to the issue of later
// steps left the consumers waiting, and the expert's short last tiles left CTAs unevenly loaded.  ncu (T = 16384,
// bf16, tests/gpu/ncu_moe_gemm.sh with KERNEL=moe_grouped_gemm_ws): gate/up 2.034 ms against the plain 2.023, tensor
// pipe ~75% either way; the consumers' stall samples sit in the wgmma wait (11%) and the full-barrier wait (4%).
// Three review fixes then changed its machine code (the maps' fence moved into the producer thread that issues the
// copies, a skipping warp's sync before freeing a stage, the fenced counter reset); measured again (forty-second
// session, tests/gpu/moe_ws_check.sh): bit-identical on every test tile, w8a8 8192 0.769 -> 0.727 | 0.438 -> 0.408 ms,
// 16384 1.357 -> 1.432 | 0.765 -> 0.737; bf16 +3 to +12%; fp8 seed prefill 0.6254 -> 0.6185 s (-1.1%), bf16 0.8364
// -> 0.8309 s (noise).
#ifndef WS
#define WS 0
#endif
// MC = 1 (with WS; opt-in: measured slower, below): clusters of two CTAs (__cluster_dims__(2, 1, 1)) claim
// pair items, tiles 2q and 2q + 1 of one feature block, rank r taking tile 2q + r.  When both tiles are one expert's,
// each CTA's producer copies one of the stage's two weight boxes (rank 0 the gate / first half, rank 1 the other) into
// both CTAs' stages by a multicast tensor copy, so a stage takes 32 KB from L2 instead of 48 (the A rows stay the
// CTA's own): L2 was 77-83% busy under ncu (fortieth and forty-first sessions), the suspected bound.  Each CTA's full
// barrier still expects the whole stage's bytes (its own box and the peer's); its empty barrier counts both CTAs'
// consumer warps (16), each of which frees a stage in both CTAs, since the peer's copies land there too.  A pair
// across two experts copies its own two boxes in each CTA; a last tile alone in its pair leaves the other CTA a ghost
// (no bytes expected, no products, no output) that still waits and frees stages.  Rank 0 claims for the cluster and
// hands each claim to rank 1 through a slot of rank 1's shared memory (two slots, an mbarrier each way); both CTAs
// meet at a cluster barrier before leaving (the peer may still copy or arrive into them).  Bit for bit WS's products.
// The MC = 0 builds are byte-identical to the WS kernel before MC was added (NVRTC 13.5, sm_90a).  Checked without a
// GPU: a helper's review against the PTX ISA (a divergent .aligned cluster barrier in the producer warp of the A_TMA
// build found and fixed: cluster_sync_any) and a randomized simulation of the protocol (two CTAs' producers and 16
// consumer warps as independent actors, mbarriers with signed tx-counts, random plans with odd tile counts and pairs
// across experts: no deadlock, no stage overwritten while read, every tile once, in 6,000 schedules; ten injected
// protocol bugs, eight caught in most runs).
// Measured on the H200 (2026-12-03, tests/gpu/moe_ws_check.sh): bit for bit WS's output on every test tile.  As first
// written, 36-75% slower a GEMM: its stage release to the peer was the .release.cluster arrive, which put a
// MEMBAR.ALL.GPU before every consumer warp's arrival each k step (mbar_arrive_remote says why the .cta form is
// enough).  Since then +1 to +15% against the plain kernel (bf16 16384 gate/up 2.317 -> 2.486 ms, WS 2.420; w8a8
// 1.507 -> 1.517, WS 1.455), the seed prefill within noise of the plain kernel: slower than WS, so opt-in.  Under
// ncu (T = 16384, bf16) L2 throughput fell only 79 -> 75% and the tensor pipe did not gain.
#ifndef MC
#define MC 0
#endif
#if MC && !WS
#error "moe_gemm_wg.cu: MC is built on WS"
#endif
#if WS && (!B_TMA || WFMT == 1)
#error "moe_gemm_wg.cu: WS is built on B_TMA (bf16 weights, or e4m3 weights with e4m3 sources)"
#endif

#if !defined(K) || !defined(NOUT) || !defined(BN) || !defined(STAGES) || !defined(FUSE_SILU) || !defined(TOPK) || \
    !defined(STAGED_OUT)
#error "moe_gemm_wg.cu needs -DK -DNOUT -DBN -DSTAGES -DFUSE_SILU -DTOPK -DSTAGED_OUT"
#endif
#if defined(__CUDA_ARCH__) && !defined(KDA_RT_HOPPER)
#error "moe_gemm_wg.cu needs sm_90a (wgmma); other archs use moe_gemm_tc.cu"
#endif

#define BM 128
#if WFMT == 2
#define BK 128                               // e4m3 operands: 128 codes, one 128-byte row a step as bf16's 64
#else
#define BK 64
#endif
#define THREADS 256
#define ACC (BN / 2)                         // fp32 accumulators per thread (64 rows x BN per warpgroup)
#define A_BYTES (BM * 128)                   // 16 KB: 128-byte rows
#define SLICES 4                             // wgmma k slices a step (k16 bf16 / k32 e4m3: 32 bytes each)
#if WFMT == 1
typedef bf16 atype;
typedef unsigned char wtype;                 // e4m3 bits
#define B_BYTES (BN * BK)                    // the stage's e4m3 rows (64 bytes each)
#define BC_BYTES (BN * BK * 2)               // one widened bf16 B tile (swizzled 128-byte rows)
#define BC_TILES 3
#define CHW (BK / 16)                        // 16-byte pieces of an e4m3 row
#define RPPW (THREADS / CHW)                 // e4m3 rows copied per pass
#define B_PASSES_W (BN / RPPW)
static_assert((BN / 2) % RPPW == 0, "e4m3 gate/up stages: a copy pass lies in one half");
#elif WFMT == 2
typedef unsigned char atype;                 // e4m3 bits, both operands
typedef unsigned char wtype;
#define B_BYTES (BN * 128)
#define BC_BYTES 0
#define BC_TILES 0
#elif WFMT == 0
typedef bf16 atype;
typedef bf16 wtype;
#define B_BYTES (BN * BK * 2)
#define BC_BYTES 0
#define BC_TILES 0
#else
#error "moe_gemm_wg.cu: WFMT must be 0 (bf16), 1 (e4m3 weights with row scales) or 2 (e4m3 weights and sources)"
#endif
#define STAGE_BYTES (A_BYTES + B_BYTES)
#define KT (K / BK)
#define HALF (NOUT / 2)
#define RPP (THREADS / 8)                    // rows copied per pass: 8 chunks of 16 B per 128-byte row
#define A_PASSES (BM / RPP)
#define B_PASSES (BN / RPP)

static_assert(BN == 128 || BN == 256, "BN must be 128 or 256 (one wgmma per k16 slice)");
static_assert(K % BK == 0 && KT >= STAGES - 2 && STAGES >= 3, "K must be a multiple of BK, STAGES >= 3");
static_assert(BM % RPP == 0 && BN % RPP == 0, "copy passes must tile the stage");
#if FUSE_SILU
static_assert(HALF % (BN / 2) == 0, "gate/up tiles: BN/2 must divide HALF");
#else
static_assert(NOUT % BN == 0, "NOUT must be a multiple of BN");
#endif

#include "moe_tile.cuh"  // after the constants above: tile_row_sources, b_pass_offset
#include "wgmma.cuh"
#include "e4m3.cuh"

// one k slice of the warpgroup tile (k16 bf16, k32 e4m3: 32 bytes of each row)
__device__ __forceinline__ void wgmma_tile(float (&d)[ACC], unsigned long long desc_a, unsigned long long desc_b) {
#if WFMT == 2 && BN == 256
    wgmma_m64n256k32_e4m3(d, desc_a, desc_b);
#elif WFMT == 2
    wgmma_m64n128k32_e4m3(d, desc_a, desc_b);
#elif BN == 256
    wgmma_m64n256k16(d, desc_a, desc_b);
#else
    wgmma_m64n128k16(d, desc_a, desc_b);
#endif
}

// one k step of the warpgroup tile: its wgmma over the A and B tiles at shared addresses a_tile, b_tile, committed,
// then the wait until at most this group is pending (the step before's products are done)
__device__ __forceinline__ void k_step(float (&acc)[ACC], unsigned a_tile, unsigned b_tile) {
    fence_regs(acc);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < SLICES; ++s)
        wgmma_tile(acc, smem_desc(a_tile + 32 * s), smem_desc(b_tile + 32 * s));
    wgmma_commit();
    wgmma_wait<1>();
    fence_regs(acc);
}

// Epilogue (STAGED_OUT picks one; ops/moe_gemm_wg.py: staged for down, direct for gate/up).  The tensor
// cores idle while it runs (one CTA per SM), so its cost is the kernel's: with no epilogue at all the down
// GEMM at T = 16384 ran 0.975 ms against 1.377 (bench_moe_gemm.py --limits, EXP_SKIP=4).
//   direct (0): each thread stores its accumulator pairs as they lie (4-byte pieces, 8 rows per warp store);
//   staged (1): each warpgroup writes its bf16 results into a [BM][OUT_COLS] tile over the idle stage buffers
//     with stmatrix, rows OUT_PITCH bytes apart (16 bytes of padding put the 8 row addresses of one stmatrix
//     on distinct banks), and after a barrier the block copies whole rows out in 16-byte pieces.
// H200, bench_moe_gemm.py --epilogue (T = 8192 | 16384, interleaved rounds): down staged -18 | -21% against
// direct; gate/up direct -8 | -7% and staged -6 | -4% against the IEEE-division SiLU the kernel had (the
// quotient's slow-path call serialised the epilogue; silu_nr has none).  Tried: the staged tile stored by one
// bulk copy per row (cp.async.bulk, the CTA waiting only for the copies' reads): down -16% against direct where
// the 16-byte stores gave -21% in the same rounds, gate/up +1%.  What is left (--limits, T = 16384): without
// any epilogue gate/up ran 1.872 against 2.067 ms and down 0.973 against 1.090.  Same roundings either way;
// rows >= nrows are not stored.
#define OUT_COLS (FUSE_SILU ? BN / 2 : BN)  // output columns of the CTA
#define OUT_PITCH (OUT_COLS * 2 + 16)       // bytes between staged rows
#define OUT_LD (FUSE_SILU ? HALF : NOUT)    // output row stride (elements)
static_assert(BM * OUT_PITCH <= STAGES * STAGE_BYTES, "the staged output tile must fit the stage buffers");

// WFMT >= 1: where the row scales of the thread's output columns start (weight row f0 + 2·(l mod 4) of expert e; column
// 8j + q is row + 8j + q, and gate/up's matching up row HALF further on), read from L1 as the epilogue needs them.
// WFMT = 2: also the scales of the thread's two source rows (tile rows rbase + 16·(warp) + l / 4 + 8·hrow: the
// token's x row for gate/up, the h row for down; 0 past the tile's end, where nothing is stored).
struct Scales {
#if WFMT >= 1
    const float* row;
#endif
#if WFMT == 2
    float src[2];
#endif
};
__device__ __forceinline__ void load_scales(Scales& sc, const float* __restrict__ scale, int e, int f0, int t,
                                            const float* __restrict__ src_scale, const int* __restrict__ sorted_pair,
                                            int row0, int nrows, int rbase) {
#if WFMT >= 1
    sc.row = scale + (size_t)e * NOUT + f0 + 2 * ((t & 31) & 3);
#endif
#if WFMT == 2
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
        const int rl = rbase + (t >> 5) * 16 + ((t & 31) >> 2) + 8 * hrow;
        const int r = row0 + rl;
        sc.src[hrow] = rl < nrows ? __ldg(src_scale + (FUSE_SILU ? sorted_pair[r] / TOPK : r)) : 0.f;
    }
#else
    (void)src_scale, (void)sorted_pair, (void)row0, (void)nrows, (void)rbase;
#endif
}
// accumulator value q of pair (j, hrow), times its weight row's scale (WFMT >= 1) and its source row's (WFMT = 2);
// up = 1: the up half of gate/up
__device__ __forceinline__ float acc_val(const float (&acc)[ACC], const Scales& sc, int j, int hrow, int q, int up) {
    const float a = acc[4 * (j + up * (BN / 16)) + 2 * hrow + q];
#if WFMT == 2
    return a * __ldg(sc.row + up * HALF + 8 * j + q) * sc.src[hrow];
#elif WFMT == 1
    return a * __ldg(sc.row + up * HALF + 8 * j + q);
#else
    return a;
#endif
}

// accumulator pair (j, hrow) of thread t as the packed bf16 outputs: row 16w + l/4 + 8·hrow, columns
// 8j + 2·(l mod 4) + {0, 1} of the warpgroup's output tile (see wgmma.cuh)
__device__ __forceinline__ unsigned out_pair(const float (&acc)[ACC], const Scales& sc, int j, int hrow) {
#if FUSE_SILU
    float hv[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const float gate = round_bf16(acc_val(acc, sc, j, hrow, q, 0));
        const float up = round_bf16(acc_val(acc, sc, j, hrow, q, 1));
#if EXP_IEEE_SILU  // bench only: the IEEE quotient, as before silu_nr
        hv[q] = round_bf16(silu(gate)) * up;
#else
        hv[q] = round_bf16(silu_nr(gate)) * up;
#endif
    }
    __nv_bfloat162 p = __floats2bfloat162_rn(hv[0], hv[1]);
#else
    __nv_bfloat162 p = __floats2bfloat162_rn(acc_val(acc, sc, j, hrow, 0, 0), acc_val(acc, sc, j, hrow, 1, 0));
#endif
    return *reinterpret_cast<unsigned*>(&p);
}

// warpgroup rows [rbase, rbase + 64) of the output tile into the staging tile at shared address `stage`
__device__ __forceinline__ void stage_rows(const float (&acc)[ACC], const Scales& sc, unsigned stage, int nrows, int rbase,
                                           int t) {
    if (rbase >= nrows) return;  // no rows of this warpgroup (uniform over it: stmatrix is warp-collective)
    const int lane = t & 31, wq = t >> 5, m = lane >> 3;
    // this lane names row (m mod 2)·8 + lane mod 8 of the warp's 16 rows, 16 bytes (8 columns) into the pair
    const unsigned addr = stage + (rbase + wq * 16 + 8 * (m & 1) + (lane & 7)) * OUT_PITCH + 16 * (m >> 1);
#pragma unroll
    for (int j = 0; j < OUT_COLS / 8; j += 2)  // matrices (j, rows 0-7), (j, 8-15), (j + 1, 0-7), (j + 1, 8-15)
        stmatrix_x4(addr + 16 * j, out_pair(acc, sc, j, 0), out_pair(acc, sc, j, 1), out_pair(acc, sc, j + 1, 0),
                    out_pair(acc, sc, j + 1, 1));
}

// direct epilogue: warpgroup rows [rbase, rbase + 64) from the accumulators to dst
__device__ __forceinline__ void store_rows(const float (&acc)[ACC], const Scales& sc, void* __restrict__ dst, int row0,
                                           int nrows, int f0, int rbase, int t) {
    if (rbase >= nrows) return;
    const int lane = t & 31, wq = t >> 5;
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
        const int rl = rbase + wq * 16 + (lane >> 2) + 8 * hrow;
        if (rl >= nrows) continue;
        bf16* out = static_cast<bf16*>(dst) + (size_t)(row0 + rl) * OUT_LD + f0 + 2 * (lane & 3);
#pragma unroll
        for (int j = 0; j < OUT_COLS / 8; ++j) *reinterpret_cast<unsigned*>(out + 8 * j) = out_pair(acc, sc, j, hrow);
    }
}

// the staged tile's rows < nrows to dst rows row0 + r, columns f0 .. f0 + OUT_COLS, in 16-byte pieces
// (t: the thread's index among the THREADS that copy: threadIdx.x, or the WS kernel's consumer index)
__device__ __forceinline__ void copy_out(const unsigned char* staged, void* __restrict__ dst, int row0, int nrows, int f0,
                                         int t) {
    constexpr int PPR = OUT_COLS / 8;  // 16-byte pieces per row
    bf16* out = static_cast<bf16*>(dst) + (size_t)row0 * OUT_LD + f0;
    static_assert(BM * PPR % THREADS == 0, "copy_out: whole passes of the block");
#pragma unroll
    for (int i = 0; i < BM * PPR / THREADS; ++i) {
        const int p = t + i * THREADS, r = p / PPR, ch = p % PPR;
        if (r < nrows)
            *reinterpret_cast<uint4*>(out + (size_t)r * OUT_LD + ch * 8) =
                *reinterpret_cast<const uint4*>(staged + r * OUT_PITCH + ch * 16);
    }
}

#if WFMT == 1
// 16 e4m3 codes (a 16-byte piece of weight row r, k = 16c .. 16c + 15 of the step) into the bf16 tile at shared
// address bc: bf16 pieces 2c and 2c + 1 of row r, at the swizzled places c' ^ (r mod 8)
__device__ __forceinline__ void widen_piece(unsigned bc, uint4 q, int r, int c) {
    const unsigned w[4] = {q.x, q.y, q.z, q.w};
    unsigned o[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        o[2 * i] = e4m3x2_to_bf16x2<E4M3_CVT>(w[i] & 0xFFFFu);
        o[2 * i + 1] = e4m3x2_to_bf16x2<E4M3_CVT>(w[i] >> 16);
    }
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(bc + swz(r, 2 * c)), "r"(o[0]), "r"(o[1]), "r"(o[2]),
                 "r"(o[3]) : "memory");
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(bc + swz(r, 2 * c + 1)), "r"(o[4]), "r"(o[5]),
                 "r"(o[6]), "r"(o[7]) : "memory");
}
#endif

// ---------------------------------------------------------------------------------------------
// kernels

template <bool B>
struct BoolC {  // the k loop's variant (k_loop)
    static constexpr bool value = B;
};

// the k loop's block barrier.  With HALF_SKIP the two warpgroups can run different copies of the loop, so they
// meet at two barrier instructions: bar.sync is the .aligned form, which the PTX ISA defines only when every
// thread of the CTA executes the same instruction, so the kernel uses barrier.sync, the form defined for this
// (UNALIGNED_BAR = 1, the default; 0 builds bar.sync, bench only).  It costs at most 1% (H200,
// 2026-12-01, tests/gpu/bench_moe_gemm.py --define UNALIGNED_BAR=0,1 --tokens 8192,16384, bit-identical):
// gate/up 1.364 / 1.365 ms at 8192, 2.406 / 2.406 at 16384; down 0.709 / 0.709, 1.246 / 1.258 (+1.0%).
__device__ __forceinline__ void k_barrier() {
#if UNALIGNED_BAR
    asm volatile("barrier.sync 0;" ::: "memory");
#else
    __syncthreads();
#endif
}

#if !WS
extern "C" __global__ void __launch_bounds__(THREADS, 1)
moe_grouped_gemm_wg(const atype* __restrict__ src, const int* __restrict__ sorted_pair, const wtype* __restrict__ weight,
                    const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                    const int* __restrict__ expert_off, const int* __restrict__ num_tiles, void* __restrict__ dst,
                    const float* __restrict__ scale, const float* __restrict__ src_scale
#if B_TMA
                    , const void* __restrict__ b_map  // (B_TMA builds only: the default's arguments unchanged)
#endif
#if A_TMA
                    , const void* __restrict__ a_map
#endif
                    ) {
    KDA_PDL_ENTRY();
    extern __shared__ unsigned char smem_raw[];
    const unsigned raw = smem_addr(smem_raw);
    const unsigned base = (raw + 1023u) & ~1023u;  // the launcher adds 1 KB for this alignment
#if B_TMA
    __shared__ alignas(8) unsigned long long b_full[STAGES];  // stage s's weight rows landed (phase: its use count)
    const unsigned bar0 = smem_addr(b_full);
#endif

    const int tile = blockIdx.y;
    if (tile >= num_tiles[0]) return;
    const int e = tile_expert[tile], row0 = tile_row[tile];
    const int nrows = min(BM, expert_off[e + 1] - row0);
    const int tid = threadIdx.x, wg = tid >> 7;
#if FUSE_SILU
    const int f0 = blockIdx.x * (BN / 2);  // first gate feature (= first h column) of the block
#else
    const int f0 = blockIdx.x * BN;
#endif

    // copy geometry: thread copies chunk lch of rows lrow + i·RPP
    const int lrow = tid >> 3, lch = tid & 7;
    const atype* a_src[A_PASSES];
    int a_bytes[A_PASSES];  // 16, or 0 for rows past the tile end: zero-filled, nothing read
    tile_row_sources<K, FUSE_SILU>(a_src, a_bytes, src, sorted_pair, row0, nrows, lrow, lch);
#if WFMT == 1
    // e4m3 rows: thread copies (and later widens) piece wch (16 codes) of rows wrow + i·RPPW of each stage
    const int wrow = tid / CHW, wch = tid % CHW;
    const wtype* b_src = weight + ((size_t)e * NOUT + f0 + wrow) * K + wch * 16;
    const unsigned bc_base = base + STAGES * STAGE_BYTES;  // the BC_TILES widened bf16 B tiles
#else
    const wtype* b_src = weight + ((size_t)e * NOUT + f0 + lrow) * K + lch * (16 / (int)sizeof(wtype));
#endif
    // (lrow + i·RPP) mod 8 == lrow mod 8: one swizzled offset per thread, plus i·RPP rows
    const unsigned dst_off = swz(lrow, lch);
#if B_TMA
    // the tile's weight rows in the map: gate/up's two halves are gate features f0 .. and up features HALF + f0 ..
    const int b_row0 = e * NOUT + f0, b_row1 = b_row0 + (FUSE_SILU ? HALF : BN / 2);
    if (tid == 0) {  // (the map was written by the host: the fence's scope is the system's)
        asm volatile("fence.proxy.tensormap::generic.acquire.sys [%0], 128;\n" ::"l"(b_map) : "memory");
#if A_TMA
        asm volatile("fence.proxy.tensormap::generic.acquire.sys [%0], 128;\n" ::"l"(a_map) : "memory");
#endif
#pragma unroll
        for (int s = 0; s < STAGES; ++s) mbar_init(bar0 + 8 * s, 1);
    }
    __syncthreads();  // the barriers initialised before any thread waits on one
#endif

    auto load_stage = [&](int stage, int kt) {
        const int k0 = kt * BK;
        const unsigned a_dst = base + stage * STAGE_BYTES + dst_off, b_dst = a_dst + A_BYTES;
#if EXP_SKIP & 3  // bench only (tests/gpu/bench_moe_gemm.py --limits): 1 skips B, 2 A, 3 both after the prologue, 4 the epilogue
        const bool skip_a = (EXP_SKIP & 2) && kt >= STAGES - 2, skip_b = (EXP_SKIP & 1) && kt >= STAGES - 2;
#else
        const bool skip_a = false, skip_b = false;
#endif
#if !A_TMA
        if (!skip_a)
#pragma unroll
        for (int i = 0; i < A_PASSES; ++i)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a_dst + i * RPP * 128), "l"(a_src[i] + k0),
                         "r"(a_bytes[i]));
#endif
#if WFMT == 1
        if (!skip_b)
#pragma unroll
        for (int i = 0; i < B_PASSES_W; ++i) {
            const int r = i * RPPW;  // (a pass lies in one half of a gate/up stage)
            const int off = FUSE_SILU && r >= BN / 2 ? HALF - BN / 2 + r : r;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, 16;\n" ::"r"(base + stage * STAGE_BYTES + A_BYTES +
                         (wrow + r) * BK + wch * 16), "l"(b_src + (size_t)off * K + k0));
        }
        (void)b_dst;
#elif B_TMA
        if (tid == 0) {  // one arrival with the stage's bytes; skipped copies (bench only) complete the phase at once
            const unsigned bar = bar0 + 8 * stage, b_tile = base + stage * STAGE_BYTES + A_BYTES;
            mbar_arrive_expect_tx(bar, (skip_b ? 0u : (unsigned)B_BYTES) + (A_TMA && !skip_a ? (unsigned)A_BYTES : 0u));
            if (!skip_b) {
                tma_load_2d(b_tile, b_map, k0, b_row0, bar);
                tma_load_2d(b_tile + (BN / 2) * 128, b_map, k0, b_row1, bar);
            }
#if A_TMA
            if (!skip_a) tma_load_2d(base + stage * STAGE_BYTES, a_map, k0, row0, bar);
#endif
        }
        (void)b_dst, (void)b_src;
#else
        if (!skip_b)
#pragma unroll
        for (int i = 0; i < B_PASSES; ++i)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, 16;\n" ::"r"(b_dst + i * RPP * 128),
                         "l"(b_src + (size_t)b_pass_offset<FUSE_SILU, HALF>(i) * K + k0));
#endif
    };

#pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) {
        load_stage(s, s);
        cp_async_commit();
    }

    float acc[ACC];
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc[i] = 0.f;

    // the k loop; MMA = false: a warpgroup whose 64 rows all lie past the tile's end (HALF_SKIP) only copies and
    // meets the barriers, so the other warpgroup has the tensor cores to itself (a branch inside the loop around
    // the wgmma, even a warpgroup-uniform one, makes ptxas serialise them: the choice is made once, outside)
    auto k_loop = [&](auto mma) {
        constexpr bool MMA = decltype(mma)::value;
        for (int kt = 0; kt < KT; ++kt) {
            cp_async_wait<STAGES - 3>();  // step kt has landed (this thread's copies) ...
#if WFMT == 1
            // ... and this thread widens its own e4m3 pieces of it into bf16 tile kt mod 3 (see the header)
#pragma unroll
            for (int i = 0; i < B_PASSES_W; ++i) {
                const int r = wrow + i * RPPW;
                uint4 q;
                asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(q.x), "=r"(q.y), "=r"(q.z), "=r"(q.w)
                             : "r"(base + (kt % STAGES) * STAGE_BYTES + A_BYTES + r * BK + wch * 16) : "memory");
                widen_piece(bc_base + (kt % BC_TILES) * BC_BYTES, q, r, wch);
            }
#endif
            fence_proxy_async();          // ... and is visible to the tensor cores' (async) proxy ...
            k_barrier();                  // ... for everyone's copies; step kt - 2's stage is free
            if (kt + STAGES - 2 < KT) load_stage((kt + STAGES - 2) % STAGES, kt + STAGES - 2);
            cp_async_commit();            // (an empty group near the end keeps the wait count uniform)
            if constexpr (MMA) {
                const unsigned a_tile = base + (kt % STAGES) * STAGE_BYTES + wg * 64 * 128;
#if WFMT == 1
                const unsigned b_tile = bc_base + (kt % BC_TILES) * BC_BYTES;
#else
                const unsigned b_tile = base + (kt % STAGES) * STAGE_BYTES + A_BYTES;
#endif
#if B_TMA
                // the stage's weight rows (its (kt / STAGES)-th fill; it is refilled only after every warpgroup is
                // past the barrier of step kt + 2, so no phase passes unseen)
                mbar_wait(bar0 + 8 * (kt % STAGES), (kt / STAGES) & 1);
#endif
                k_step(acc, a_tile, b_tile);
            }
        }
        if constexpr (MMA) {
            wgmma_wait<0>();
            fence_regs(acc);
        }
    };
#if HALF_SKIP
    if (wg * 64 < nrows)
        k_loop(BoolC<true>{});
    else
        k_loop(BoolC<false>{});
#else
    k_loop(BoolC<true>{});
#endif
    cp_async_wait<0>();

#if EXP_SKIP & 4  // bench only: no epilogue (one store kept so that the products stay live)
    if (acc[0] == 1.2345e-30f) static_cast<bf16*>(dst)[0] = to_bf16(acc[ACC - 1]);
#else
    Scales sc;
    load_scales(sc, scale, e, f0, tid & 127, src_scale, sorted_pair, row0, nrows, wg * 64);
#if STAGED_OUT
    __syncthreads();  // both warpgroups' products are done: the stage buffers are free
    stage_rows(acc, sc, base, nrows, wg * 64, tid & 127);
    __syncthreads();
    copy_out(smem_raw + (base - raw), dst, row0, nrows, f0, tid);
#else
    store_rows(acc, sc, dst, row0, nrows, f0, wg * 64, tid & 127);
#endif
#endif
}
#endif  // !WS

#if WS
#define WS_THREADS (THREADS + 128)  // two consumer warpgroups (warps 0-7) and the producer warpgroup (warps 8-11)
#define WS_PASSES (BM / 16)         // a producer pass copies 16 rows (8 pieces of 16 bytes each)
#define NFB (FUSE_SILU ? HALF / (BN / 2) : NOUT / BN)  // feature blocks of an expert tile
#define FULL_COUNT (A_TMA ? 1 : 129)  // thread 0's arrival with the copies' bytes (+ the 128 threads' cp.async)
static_assert(WS_PASSES <= 32, "WS: one valid-row bit a producer pass");
#if MC
#define CL 2  // CTAs a cluster
#else
#define CL 1
#endif

// one arrival of `count` on bar
__device__ __forceinline__ void mbar_arrive(unsigned bar, unsigned count = 1) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// an arrival on bar once this thread's earlier cp.async copies have landed (counted in the barrier's expected count)
__device__ __forceinline__ void mbar_arrive_cp_async(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// barriers of the 256 consumer threads (id 1) and the 128 producer threads (id 2) only (barrier.sync: the two
// consumer warpgroups may come from different copies of the k loop, see k_barrier)
__device__ __forceinline__ void consumer_barrier() { asm volatile("barrier.sync 1, 256;" ::: "memory"); }
__device__ __forceinline__ void producer_barrier() { asm volatile("barrier.sync 2, 128;" ::: "memory"); }
#if MC
// an arrival on the mbarrier at shared::cluster address `bar` (another CTA's), releasing this thread's earlier writes
// to the cluster
__device__ __forceinline__ void mbar_arrive_cluster(unsigned bar) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// an arrival on the mbarrier at shared::cluster address `bar` (another CTA's) in the default .release.cta form: a stage's
// release (its reads were wgmma reads, done by the wgmma wait before it).  The .release.cluster form costs a
// MEMBAR.ALL.GPU before the arrival (nvdisasm of the MC build), which waits for the warp's global stores of the last
// epilogue too; with it on every k step of every consumer warp MC measured 36-75% slower than the plain kernel.  (The
// producer's wait on the empty barriers is the CTA-scope mbar_wait for the same reason: the cluster-scope acquire adds
// CCTL.IVALL.)
__device__ __forceinline__ void mbar_arrive_remote(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// mbar_wait, acquiring what the cluster's other CTAs released on bar
__device__ __forceinline__ void mbar_wait_cluster(unsigned bar, unsigned parity) {
    for (unsigned done = 0; !done;)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
// the cluster barrier in its non-.aligned form, for threads of one warp that reach it at different instructions (the
// producer warpgroup: thread 0 after its last copy, the others at once when it copies alone)
__device__ __forceinline__ void cluster_sync_any() {
    asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
}
// the shared::cluster address of shared address `a` (of this CTA) in the CTA of cluster rank `rank`
__device__ __forceinline__ unsigned peer_shared(unsigned a, unsigned rank) {
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    return r;
}
// tma_load_2d into the same place of both CTAs of the cluster, completing by its bytes on each one's barrier at the
// same place
__device__ __forceinline__ void tma_load_2d_mc(unsigned dst, const void* map, int c0, int c1, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar),
                 "h"((unsigned short)3) : "memory");
}
// a pair item w names tiles 2·(w / NFB) + {0, 1} (feature block w mod NFB); the CTA of cluster rank r takes tile
// 2·(w / NFB) + r.  ghost: no such tile (the last pair of an odd count): the CTA only waits and frees stages.  mc:
// both tiles are one expert's, so each CTA copies half of the weight rows into both CTAs' stages.
struct PairItem {
    int tile, fb, e, row0, nrows;
    bool ghost, mc;
};
__device__ __forceinline__ PairItem pair_item(int w, unsigned rank, const int* __restrict__ tile_expert,
                                              const int* __restrict__ tile_row, const int* __restrict__ expert_off,
                                              int ntiles) {
    PairItem im;
    const int q = w / NFB;
    im.fb = w - q * NFB;
    im.tile = 2 * q + (int)rank;
    im.ghost = im.tile >= ntiles;
    im.mc = 2 * q + 1 < ntiles && tile_expert[2 * q] == tile_expert[2 * q + 1];
    im.e = im.ghost ? 0 : tile_expert[im.tile];
    im.row0 = im.ghost ? 0 : tile_row[im.tile];
    im.nrows = im.ghost ? 0 : min(BM, expert_off[im.e + 1] - im.row0);
    return im;
}
#endif

extern "C" __global__ void
#if MC
__cluster_dims__(2, 1, 1)
#endif
__launch_bounds__(WS_THREADS, 1)
moe_grouped_gemm_ws(const atype* __restrict__ src, const int* __restrict__ sorted_pair, const wtype* __restrict__ weight,
                    const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
                    const int* __restrict__ expert_off, const int* __restrict__ num_tiles, void* __restrict__ dst,
                    const float* __restrict__ scale, const float* __restrict__ src_scale, const void* __restrict__ b_map,
                    int* __restrict__ claim
#if A_TMA
                    , const void* __restrict__ a_map
#endif
                    ) {
    KDA_PDL_ENTRY();
    extern __shared__ unsigned char smem_raw[];
    const unsigned raw = smem_addr(smem_raw);
    const unsigned base = (raw + 1023u) & ~1023u;  // the launcher adds 1 KB for this alignment
    __shared__ alignas(8) unsigned long long full[STAGES], empty[STAGES];
    __shared__ int stage_item[STAGES];  // the item whose first k step fill s of stage s holds (-1: no more items)
    const unsigned full0 = smem_addr(full), empty0 = smem_addr(empty);
    const int tid = threadIdx.x;
#if MC
    const int ntiles = num_tiles[0];
    const int items = (ntiles + 1) / 2 * NFB;  // pair items
    const unsigned rank = cluster_rank(), peer = rank ^ 1u;
    // rank 0's producer hands each claim to rank 1's: pair_slot[n mod 2] of rank 1, `ready` there, `taken` on rank 0
    __shared__ int pair_slot[2];
    __shared__ alignas(8) unsigned long long ready[2], taken[2];
    const unsigned ready0 = smem_addr(ready), taken0 = smem_addr(taken);
#else
    const int items = num_tiles[0] * NFB;
    constexpr unsigned rank = 0;  // (a cluster of one)
#endif
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, FULL_COUNT);
            mbar_init(empty0 + 8 * s, 8 * CL);  // the cluster's consumer warps (MC: the peer copies into it too)
        }
#if MC
        for (int s = 0; s < 2; ++s) {
            mbar_init(ready0 + 8 * s, 1);
            mbar_init(taken0 + 8 * s, 1);
        }
#endif
    }
    __syncthreads();  // the barriers initialised before any thread waits on one
#if MC
    cluster_arrive();  // ... and the peer's before any copy or arrival reaches them
    cluster_wait();
#endif

    if (tid >= THREADS) {  // the producer warpgroup
        const int p = tid - THREADS;
        if (p == 0) {  // the thread that issues the tensor copies acquires their maps (written by the host: the
                       // fence's scope is the system's; a proxy fence orders this thread's accesses only)
            asm volatile("fence.proxy.tensormap::generic.acquire.sys [%0], 128;\n" ::"l"(b_map) : "memory");
#if A_TMA
            asm volatile("fence.proxy.tensormap::generic.acquire.sys [%0], 128;\n" ::"l"(a_map) : "memory");
#endif
        }
        __syncwarp();
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
#if A_TMA
#if MC
        if (p != 0) {  // (alive until the cluster's last barrier)
            cluster_sync_any();
            return;
        }
#else
        if (p != 0) return;
#endif
#else
        __shared__ int claimed[2];  // thread 0's claims for the other producer threads (by parity)
        const int prow = p >> 3, pch = p & 7;  // the warpgroup copies piece pch of rows prow + 16i, i < WS_PASSES
#endif
        int it = 0;  // k steps over the CTA's items: stage it mod STAGES, its fill it / STAGES
        for (int n = 0;; ++n) {
#if MC
            int w_claim = 0;
            if (p == 0) {
                const int slot = n & 1;
                if (rank == 0) {
                    if (n >= 2) mbar_wait_cluster(taken0 + 8 * slot, ((n >> 1) - 1) & 1);  // rank 1 read its last claim
                    w_claim = atomicAdd(claim, 1);
                    asm volatile("st.shared::cluster.s32 [%0], %1;" ::"r"(peer_shared(smem_addr(&pair_slot[slot]), 1)),
                                 "r"(w_claim) : "memory");
                    mbar_arrive_cluster(peer_shared(ready0 + 8 * slot, 1));
                } else {
                    mbar_wait_cluster(ready0 + 8 * slot, (n >> 1) & 1);
                    w_claim = pair_slot[slot];
                    mbar_arrive_cluster(peer_shared(taken0 + 8 * slot, 0));
                }
            }
#if A_TMA
            const int w = w_claim;
#else
            if (p == 0) claimed[n & 1] = w_claim;
            producer_barrier();  // (the slot of parity n is rewritten after the next barrier: read by then)
            const int w = claimed[n & 1];
#endif
            if (w >= items) break;
            const PairItem im = pair_item(w, rank, tile_expert, tile_row, expert_off, ntiles);
            const int e = im.e, row0 = im.row0;
            const int f0 = im.fb * (FUSE_SILU ? BN / 2 : BN);
#else
#if A_TMA
            const int w = atomicAdd(claim, 1);
#else
            if (p == 0) claimed[n & 1] = atomicAdd(claim, 1);
            producer_barrier();  // (the slot of parity n is rewritten after the next barrier: read by then)
            const int w = claimed[n & 1];
#endif
            if (w >= items) break;
            const int tile = w / NFB, fb = w - tile * NFB;
            const int e = tile_expert[tile], row0 = tile_row[tile];
            const int f0 = fb * (FUSE_SILU ? BN / 2 : BN);
#endif
            const int b_row0 = e * NOUT + f0, b_row1 = b_row0 + (FUSE_SILU ? HALF : BN / 2);
#if !A_TMA
#if MC
            const int nrows = im.nrows;
#else
            const int nrows = min(BM, expert_off[e + 1] - row0);
#endif
            int srow[WS_PASSES];  // source row of each pass's row (gate/up: the token's x row); the tile's first past the end
            unsigned valid = 0;
#pragma unroll
            for (int i = 0; i < WS_PASSES; ++i) {
                const int r = prow + 16 * i;
                valid |= (r < nrows ? 1u : 0u) << i;
                const int rr = row0 + (r < nrows ? r : 0);
                srow[i] = FUSE_SILU ? sorted_pair[rr] / TOPK : rr;
            }
#endif
            for (int kt = 0; kt < KT; ++kt, ++it) {
                const int stage = it % STAGES;
                if (it >= STAGES) mbar_wait(empty0 + 8 * stage, ((it / STAGES) - 1) & 1);  // its last fill consumed
                const unsigned st = base + stage * STAGE_BYTES, bar = full0 + 8 * stage;
                if (p == 0) {
                    if (kt == 0) stage_item[stage] = w;  // (published by the arrival below)
#if MC
                    mbar_arrive_expect_tx(bar, im.ghost ? 0u : (unsigned)B_BYTES + (A_TMA ? (unsigned)A_BYTES : 0u));
                    if (im.mc)  // this rank's half of the weight rows into both CTAs (the peer sends the other half)
                        tma_load_2d_mc(st + A_BYTES + rank * (BN / 2) * 128, b_map, kt * BK, rank ? b_row1 : b_row0, bar);
                    else if (!im.ghost) {
                        tma_load_2d(st + A_BYTES, b_map, kt * BK, b_row0, bar);
                        tma_load_2d(st + A_BYTES + (BN / 2) * 128, b_map, kt * BK, b_row1, bar);
                    }
#if A_TMA
                    if (!im.ghost) tma_load_2d(st, a_map, kt * BK, row0, bar);
#endif
#else
                    mbar_arrive_expect_tx(bar, (unsigned)B_BYTES + (A_TMA ? (unsigned)A_BYTES : 0u));
                    tma_load_2d(st + A_BYTES, b_map, kt * BK, b_row0, bar);
                    tma_load_2d(st + A_BYTES + (BN / 2) * 128, b_map, kt * BK, b_row1, bar);
#if A_TMA
                    tma_load_2d(st, a_map, kt * BK, row0, bar);
#endif
#endif
                }
#if !A_TMA
#pragma unroll
                for (int i = 0; i < WS_PASSES; ++i)  // rows past the tile's end: zero-filled, nothing read
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(st + swz(prow + 16 * i, pch)),
                                 "l"(src + (size_t)srow[i] * K + kt * BK + pch * (16 / (int)sizeof(atype))),
                                 "r"((valid >> i & 1u) * 16u));
                mbar_arrive_cp_async(bar);
#endif
            }
        }
        if (p == 0) {  // no more items: the consumers' stop, then the claim counter back to 0 for the next launch
            const int stage = it % STAGES;
            if (it >= STAGES) mbar_wait(empty0 + 8 * stage, ((it / STAGES) - 1) & 1);
            stage_item[stage] = -1;
            mbar_arrive(full0 + 8 * stage, FULL_COUNT);
            if (rank == 0) {  // (MC: rank 0 claims for its cluster)
                __threadfence();  // this cluster's claims before its count of clusters done claiming
                if (atomicAdd(claim + 1, 1) == (int)gridDim.x / CL - 1) {  // every cluster is done claiming
                    __threadfence();  // (the others' claims, ordered before their counts, before the reset)
                    claim[0] = 0;
                    claim[1] = 0;
                }
            }
        }
#if MC
        cluster_sync_any();  // no CTA of the cluster leaves while the other may still copy or arrive into it
#endif
        return;
    }

    // the consumers: warpgroup wg computes rows [64 wg, 64 wg + 64) of each item's tile
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int wg = tid >> 7, t = tid & 127, lane = tid & 31;
#if STAGED_OUT
    const unsigned staged = base + STAGES * STAGE_BYTES;  // the output tile of the staged epilogue (its own room)
#endif
    for (int it = 0;;) {
        // k step it: stage it mod STAGES, its fill it / STAGES; the first step of each item names the item
        auto wait_full = [&]() {
            mbar_wait(full0 + 8 * (it % STAGES), (it / STAGES) & 1);
#if !A_TMA
            fence_proxy_async();  // the producers' cp.async pieces (generic proxy) before the tensor cores' reads
#endif
        };
        wait_full();
        const int w = stage_item[it % STAGES];
        if (w < 0) break;
#if MC
        const PairItem im = pair_item(w, rank, tile_expert, tile_row, expert_off, ntiles);
        const int e = im.e, row0 = im.row0, nrows = im.nrows;
        const int f0 = im.fb * (FUSE_SILU ? BN / 2 : BN);
#else
        const int tile = w / NFB, fb = w - tile * NFB;
        const int e = tile_expert[tile], row0 = tile_row[tile];
        const int nrows = min(BM, expert_off[e + 1] - row0);
        const int f0 = fb * (FUSE_SILU ? BN / 2 : BN);
#endif
        float acc[ACC];
#pragma unroll
        for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
        // MMA = false: this warpgroup's rows all lie past the tile's end (HALF_SKIP): it only waits and releases
        auto k_loop = [&](auto mma) {
            constexpr bool MMA = decltype(mma)::value;
            for (int kt = 0; kt < KT; ++kt, ++it) {
                if (kt > 0) wait_full();
                if constexpr (MMA) {
                    const unsigned a_tile = base + (it % STAGES) * STAGE_BYTES + wg * 64 * 128;
                    const unsigned b_tile = base + (it % STAGES) * STAGE_BYTES + A_BYTES;
                    k_step(acc, a_tile, b_tile);  // (step it - 1's products are then done: its stage is free)
                }
                if constexpr (!MMA) __syncwarp();  // the warp's reads (stage_item) before lane 0 frees the stage
                                                    // (with MMA the warp-wide wgmma wait orders them)
                if (kt > 0 && lane == 0) {
                    mbar_arrive(empty0 + 8 * ((it - 1) % STAGES));
#if MC
                    mbar_arrive_remote(peer_shared(empty0 + 8 * ((it - 1) % STAGES), peer));  // (its copies land here too)
#endif
                }
            }
            if constexpr (MMA) {
                wgmma_wait<0>();
                fence_regs(acc);
            }
            if constexpr (!MMA) __syncwarp();
            if (lane == 0) {
                mbar_arrive(empty0 + 8 * ((it - 1) % STAGES));
#if MC
                mbar_arrive_remote(peer_shared(empty0 + 8 * ((it - 1) % STAGES), peer));
#endif
            }
        };
#if HALF_SKIP
        if (wg * 64 < nrows)
            k_loop(BoolC<true>{});
        else
            k_loop(BoolC<false>{});
#elif MC
        if (nrows > 0)
            k_loop(BoolC<true>{});
        else
            k_loop(BoolC<false>{});
#else
        k_loop(BoolC<true>{});
#endif
#if MC
        if (im.ghost) continue;  // (uniform over the CTA)
#endif
        Scales sc;
        load_scales(sc, scale, e, f0, t, src_scale, sorted_pair, row0, nrows, wg * 64);
#if STAGED_OUT
        consumer_barrier();  // every consumer is past the last item's copy_out: the output tile is free
        stage_rows(acc, sc, staged, nrows, wg * 64, t);
        consumer_barrier();
        copy_out(smem_raw + (staged - raw), dst, row0, nrows, f0, tid);
#else
        store_rows(acc, sc, dst, row0, nrows, f0, wg * 64, t);
#endif
    }
#if MC
    cluster_arrive();
    cluster_wait();
#endif
}
#endif  // WS
