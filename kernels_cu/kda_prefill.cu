// kda_prefill.cu — KDA prefill over a varlen flat batch (spec §3.2–3.8): the chunked WY / UT
// delta rule in three launches, parallel over chunks where the math allows, products on bf16
// tensor cores (mma.sync m16n8k16, fp32 accumulate), the recurrent state fp32.
//
// Chunks (L = CHUNK = 64 tokens, tail padded with q = k = v = g = beta = 0): chunk j of sequence b
// has id c = b + cu_seqlens[b] / L + j.  Ids are distinct and < B + T / L, so every per-chunk
// workspace has B + T / L tiles, found without a host-side chunk table (32-way search on the id).
//
// kda_prefill_intra, grid (B + T/L, H), block INTRA_THREADS = 512 (16 warps), 195,504 bytes of dynamic smem, 221,616
// with QUAD_SPLIT (W = 4; 1 CTA per SM), 126 registers (ptxas, 2026-12-03): one chunk of one head, everything
// chunk-local:
//   every global input (raw q, k, v rows with W-1 history rows, f rows, the head's conv taps and
//   dt_bias) arrives in ONE cp.async round trip of coalesced 16-byte pieces; meanwhile the CTA
//   prefetches the rows of the tile that starts on its SM next into L2 (block id + number of SMs)
//   q, k, v = bf16(SiLU(conv)) from qkv (and the slot's conv state before the sequence start),
//   computed in place in the staged tiles; the SiLU quotient as u times the hardware reciprocal
//   (SILU_FAST; within ~2 ulp of IEEE division before the bf16 rounding; 0: one Newton step on it; IEEE
//   division's slow-path call kept the compiler from overlapping rows);
//   q^ = l2norm(q) K^-1/2, k^ = l2norm(k); g2 = log2(e) g (every decay is one exp2f); beta = sigmoid(b)
//   A_qk[r,s] = sum_d q^_r k^_s E[r,s] (s <= r),  A_kk[r,s] = beta_r sum_d k^_r k^_s E[r,s] (s < r),
//   E[r,s] = exp(G_r - G_s), G the inclusive in-chunk prefix sum of g
//   T = (I + A_kk)^-1: 16 x 16 diagonal blocks by forward substitution, off-diagonal blocks by
//   block forward substitution, all fp32 FMA
//   W = T diag(beta) (e^G k^),  U = T diag(beta) v                          (tensor cores)
//   -> workspace (bf16): qg = q^ e^G, kd = e^(G_last - G) k^, W, U [L, K]; A_qk [L, L]; G_last fp32 [K]
// kda_prefill_state, grid (K / VB, H, B), block 32 * NUM_WARPS(VB): columns vb of one head's state
// for one sequence (S[:, vb] evolves on its own), sequential over the sequence's chunks:
//   V_new = U - W S;  O = qg S + A_qk V_new -> bf16(O) into out;  S <- diag(e^G_last) S + kd^T V_new
// with the state in fp32 mma accumulators (a bf16 copy in smem is the B operand of W S and qg S);
// the next chunk's tiles stream in with cp.async while the current one runs (STATE_PF 0: W, qg, U after the V_new
// barrier, A_qk and kd after phase (3); 1: A_qk and kd a whole chunk ahead in second buffers; 2: every tile a whole
// chunk ahead; two barriers a chunk, three at STATE_PF 0).  Also writes the
// conv-state slot (vb == 0) and the final state to the slot.
// kda_prefill_norm, 16 threads per (token, head): y = bf16(O) / sqrt(mean(bf16(O)^2) + eps)
//   * o_norm_w * sigmoid(gate), in place in out.
//
// Safe gates (g can be -300 and below per token): exp(-G) is never formed.  Inside each 16-row
// sub-block I (first row n_I) the kernel keeps Lam_r = sum_{n_I < i <= r} g_i (<= 15 gates), and per
// channel the sums of whole sub-blocks.  Off-diagonal sub-blocks (I > J) factor
//   E[r,s] = e^(G_r - G_n) * e^(G_n - G_s)   (n = n_I; both exponents <= 0, underflow to 0 is right)
// so A is a plain product of the scaled tiles q^ e^Lam and k^ e^(G_n - G_s).  A diagonal sub-block
// uses the same split around its first row, e^(Lam_r) * e^(-Lam_s), when every channel decays by
// less than 2^-DIAG_SPAN over the sub-block (both factors within 2^+-DIAG_SPAN: no overflow, bf16
// keeps its relative precision at any exponent); otherwise (strong gates) its lower-left 8 x 8 quadrant is
// split around its row 8 instead (QUAD_SPLIT: e^(Lam_r - Lam_8) * e^(Lam_8 - Lam_s), both <= 1, on tensor cores)
// and its two 8 x 8 halves in fp32: by row scans (E_SCAN, the default: each earlier row's decay carried down the
// rows by one factor 2^(Lam_r - Lam_(r-1)) a row), or per element with exp2(Lam_r - Lam_s) (E_SCAN = 0).
// QUAD_SPLIT (H200, 2026-12-02, `PYTHONPATH=. python tests/gpu/bench_kda_phases.py --shapes 32x2048,1x32768 --ab
// QUAD_SPLIT`, 5 interleaved rounds, random gates as the random-weight model's): 32 x 2048 6.573 -> 6.470 ms, 1 x 32768
// 3.238 -> 3.188; phases (d, e) 7708 -> 6460 cycles a CTA, (c) 5816 -> 6697 (it builds the quadrant's factors).
//
// Rounding points: conv outputs bf16 (exact in the smem tiles); l2norm, gates, A_kk, T fp32; the
// tensor-core operands bf16 (q^ e^.., k^ e^.., T diag(beta), v, W, qg, kd, A_qk, V_new, a bf16 copy
// of S); all accumulation and the carried state fp32; O bf16 before the norm; y bf16.  This is
// fla's rounding (spec §3.7), measured in tests/kernels/test_kda_prefill.py.
// Shapes: qkv [T, 3P], f, gate [T, P], b [T, ldb] bf16; conv_w [3P, W], A_log [H], dt_bias [P],
// o_norm_w [K] fp32; conv_pool [S, 3, W-1, P] bf16; rec_pool [S, H, K, V] fp32; cu_seqlens [B+1],
// context_lens, state_slots [B] int32; out [T, P] bf16; qkv, f, conv_w, dt_bias, conv_pool 16-byte
// aligned.  kda_prefill_state's snap (null or [B, 2] int32: tokens, slot): sequence b's state after its first
// snap[b, 0] tokens of the step (0: none; else a multiple of CHUNK below its length) also goes to slot snap[b, 1]
// (the prefix cache's snapshot: the recurrent state and the conv history, which those tokens alone make).
// Compile-time constants (kda_rt/cuda/ops/kda_prefill.py): HEAD_DIM (K = V, must be 128), CONV_W
// (W), CHUNK (L, must be 64), VB (state columns per CTA of kda_prefill_state: 16, 32, 64 or 128),
// INTRA_THREADS (must be 512).
// Phases of the intra kernel (H200, 2026-12-01, `PYTHONPATH=. python tests/gpu/bench_kda_phases.py`: clock64
// stamps, 32 x 2048, random gates as the random-weight model's, so most diagonal sub-blocks are unsafe): 49.2 K
// cycles a CTA, kernel 7.42 ms -> 45.5 K, 6.83 ms after (c) took three exp2f per element instead of ~5.5
// (tables hold 2^sums) and (e) one round of the 512 threads (strictly-lower pairs; the diagonal from (b)'s q.k).
// The off-diagonal T blocks then read A and D rows as float4 with two accumulators: 6.6 K -> 6.0 K cycles,
// 6.78 ms.  The conv SiLU's e^-u and the softplus's e^z from ex2.approx alone (2026-12-01, twelfth session):
// conv + SiLU + gates 11.1 K -> 9.65 K cycles, 6.79 -> 6.54 ms (--ab EXP_ACCURATE_EXP).  Now: loads 14%, conv +
// SiLU + gates 22%, (b) 9%, (c) 13%, (d, e) 18%, T off-diagonal 14%, (g) 4%.  ncu (2026-12-01, thirteenth
// session, tests/gpu/ncu_kda_intra.sh, 32 x 2048): 16 warps per SM (one CTA: 71 registers x 512 threads and
// 195.5 KB of smem each allow one), 0.61 instructions issued per scheduler and cycle, 1.35 eligible warps; stall
// samples: fixed-latency waits 19%, not selected 18%, barrier 12%, short scoreboard 10%, drain at exit 5%;
// memory 0.72 TB/s (not the limit).  The workspace stores (4-byte pieces in mma fragment layout) take twice
// the sectors they fill.
// Thirty-fourth session (2026-12-02, --ab of the five variants below, all on): 32 x 2048 6.452 -> 5.555 ms, 1 x 32768
// 42.2 K -> 35.1 K cycles a CTA: copies 17%, conv + SiLU + gates 21%, (b) 7%, (c) 11%, (d, e) 17%, T off-diagonal
// 16%, (g) 3%.  Bulk copies (cp.async.bulk, one a 256-byte row, issued by four warps
// on four mbarriers, each tensor's conv once its rows had landed; bit-identical) were slower: 32 x 2048 5.614 ->
// 5.883 ms (+4.8%), 8 x 2048 +4.9%, 1 x 32768 +5.0%, q's rows landing 8.4 K cycles after the start against 6.0 K
// for every cp.async piece (bench_kda_phases.py --ab BULK_IN, 9e033ff; removed).
// Thirty-fifth / thirty-sixth sessions (2026-12-03, --ab, the model's beta with --ldb 288): CONV_PAIRS and T_HALVES
// together 32 x 2048 5.594 -> 5.175 ms, then BETA_EARLY 5.205 -> 5.090 and COPY_ROWS 5.112 -> 4.958 (thread 0's issue
// of its copies 4.1 K -> 2.9 K cycles), all on by default; the copies' phase 14% of a CTA after them.
// Thirty-seventh session (2026-12-03): ncu by phase (tests/gpu/ncu_kda_intra.sh --regions: phase (a) issues 2048 warp
// MUFU a CTA, 4096 cycles of the 16-a-clock pipe; the exit's drain 5.8% of the stall samples; the barriers after (b)
// and (d, e) 2.6% and 4.7%), then G_BALANCE, SILU_FAST, G_STAGED and ROW_SCATTER on: 32 x 2048 4.844 -> 4.516 ms.
// Thirty-eighth session (2026-12-03): E_SCAN, T_ROWS = 2, GATE_POLY, PAD_FIXUP and LOOKUP_BOUNDS on: 32 x 2048 4.536 ->
// 3.992 ms (8 x 2048 1.154 -> 1.016, 1 x 32768 2.219 -> 1.969); phases (d, e) 6.4 K -> 4.2 K cycles, (a) 6.1 K ->
// 5.4 K.
// Whole launcher against fla's chunk_kda in the same run (bench_kda_prefill.py, fla 0.6.0): 1 x 2048 0.543 /
// 0.954 ms, 8 x 2048 2.552 / 2.490, 32 x 2048 8.486 / 8.621, 1 x 32768 5.356 / 4.790 (before the state-width
// rule of ops/kda_prefill.py moved to 32 / 64 columns).
// Timing (H200, 2026-11-30, `PYTHONPATH=. python tests/gpu/bench_kda_prefill.py`, H = 32, K = V = 128,
// median ms of the whole launcher): 1x2048 0.476, 8x2048 2.58, 32x2048 9.14, 1x32768 5.65; the intra
// kernel alone 29.5 us per CTA and SM (was ~94 us when it loaded its inputs row by row).  Before this
// file (one CTA per (head, sequence), fp32 FMA): 3.30 / 7.32 / 29.2 / 49.3 ms.  fla's chunk_kda
// (earlier measurement, same GPU kind): 1.38 ms at 1x2048, 2.08 ms at 8x2048.
#include "kda_common.cuh"
#include "e4m3.cuh"

// PHASE_CLOCK (bench-only, tests/gpu/bench_kda_phases.py): thread 0 of each kda_prefill_intra CTA stores clock64()
// at its phase boundaries into kda_phase_clk[block][i]; undefined (every build of the runtime) it compiles to nothing.
#ifdef PHASE_CLOCK
#define PHASES 14
__device__ long long kda_phase_clk[PHASE_CLOCK][PHASES];
#define STAMP(i)                                                                                      \
    do {                                                                                              \
        const int blk_ = blockIdx.y * gridDim.x + blockIdx.x;                                         \
        if (threadIdx.x == 0 && blk_ < PHASE_CLOCK) kda_phase_clk[blk_][i] = clock64();              \
    } while (0)
#else
#define STAMP(i) \
    do {         \
    } while (0)
#endif

#ifndef EXP_ACCURATE_EXP
#define EXP_ACCURATE_EXP 0
#endif
// QUAD_SPLIT = 1: an unsafe diagonal sub-block (below) takes its lower-left 8 x 8 quadrant (rows 8-15, columns 0-7)
// on tensor cores, split around its row 8: E[r,s] = e^(Lam_r - Lam_8) * e^(Lam_8 - Lam_s), both exponents <= 0
// (Lam never increases), so neither factor overflows, whatever the gates; only its two 8 x 8 diagonal halves (56 of
// the 120 pairs) stay in fp32 (E_SCAN = 0: per element, two threads a pair; 1: row scans).  0: all 120 per element,
// one thread a pair (as before).
#ifndef QUAD_SPLIT
#define QUAD_SPLIT 1
#endif
// CONV_ONE_ROUND = 1: the conv + SiLU outputs are rounded to bf16 once, by their store, instead of by conv_silu_nr
// and again (an identity) by the store: the same bits, one conversion (F2F.BF16.F32, on the 16-a-clock conversion
// pipe beside ex2 and rcp in sm_90a SASS) and one shift fewer an element.  GATE_FAST = 1: the gate's softplus by
// kda_softplus_fast (branch-free, no log1pf: see kda_common.cuh for its error bound) instead of kda_softplus_approx.
// Both 1 by default (ops/kda_prefill.py: KDA_RT_KDA_CONV_ONE_ROUND, KDA_RT_KDA_GATE_FAST turn them off).  H200,
// 2026-12-02, tests/gpu/bench_kda_phases.py --ab (intra kernel alone, 5 interleaved rounds, ms off -> on): 32x2048
// CONV_ONE_ROUND 6.464 -> 6.309, GATE_FAST 6.458 -> 6.252; all five variants here together 6.452 -> 5.555 (-13.9%),
// 8x2048 1.631 -> 1.411, 1x32768 3.182 -> 2.732 (docs/PERFORMANCE.md, thirty-fourth session).
#ifndef CONV_ONE_ROUND
#define CONV_ONE_ROUND 1
#endif
#ifndef GATE_FAST
#define GATE_FAST 1
#endif
// SCALE_UNROLL = 1: phase (c)'s loop unrolled with each thread's column pair fixed (rows r8, r8 + 8, ...), so its
// sub-block, table rows and stores are compile-time per pass instead of recomputed from a flat index (the same
// values in the same order: bit-identical).  1 by default (KDA_RT_KDA_SCALE_UNROLL=0 turns it off); 32x2048 6.444 ->
// 6.097 ms alone.
#ifndef SCALE_UNROLL
#define SCALE_UNROLL 1
#endif
// ROW_NORM_SPREAD = 1: phase (b)'s row norms on warps 0-7, eight rows each, finished by lanes 0-7 side by side, and
// the channels' gate bookkeeping on warps 12-15 (it ran on warps 0-3 after their rows, the rows' square roots and
// quotients one after another on lane 0); bit-identical.  1 by default (KDA_RT_KDA_ROW_NORM_SPREAD=0 turns it off);
// 32x2048 6.448 -> 6.288 ms alone.
#ifndef ROW_NORM_SPREAD
#define ROW_NORM_SPREAD 1
#endif
// EXP2_FTZ = 1: the per-element exponentials of phases (c), (e) and (f) by ex2.approx.ftz alone (exp2_approx) instead
// of exp2f, whose handling of results below 2^-126 takes 3 of its 5 instructions (sm_90a SASS: a compare, a halving
// and a squaring around the same MUFU.EX2).  The same bits wherever the result is 2^-126 or more; below it 0 instead of
// a subnormal: a term under 2^-126 |q| |k| against the bf16 rounding of whatever it joins.  1 by default
// (KDA_RT_KDA_EXP2_FTZ=0 turns it off); 32x2048 6.452 -> 6.269 ms alone.
#ifndef EXP2_FTZ
#define EXP2_FTZ 1
#endif
// CONV_PAIRS = 1: phase (a) with two adjacent channels a thread (8 rows) instead of one (16 rows), so each row's
// loads and stores are 4-byte (8-byte for the gates) and its two bf16 conversions one packed F2FP instead of two F2F
// on the 16-a-clock conversion pipe that the SiLU's ex2 and rcp and the gates' ex2 and lg2 also use (phase (a) is
// bound by that pipe: 128 of its operations a thread against 48 conversions).  The same values, stored in the same
// places: bit-identical.  1 since 2026-12-03: -1.2% on the kernel at 32 x 2048 (KDA_RT_KDA_CONV_PAIRS=0: without).
#ifndef CONV_PAIRS
#define CONV_PAIRS 1
#endif
// T_HALVES = 1: T's off-diagonal blocks by halves instead of one block row at a time: T_10 and T_32 together (X =
// A_IJ D_J, then -D_I X), then the lower-left 32 x 32 half, -T_BB (A_BA T_AA), with A_BA T_AA staged in T's upper
// blocks (free: T is lower-triangular); the bf16 T diag(beta) written by each stage as it finishes its blocks
// (its upper blocks, which (g) never reads, left unwritten) instead of by a pass of its own.  5 barriers from (f) to
// (g) instead of 8, 128 FMAs every thread against 112 / 144 on the two halves of the threads.  Sums in another order
// than the block-row form (fp32): not bit-identical.  1 since 2026-12-03: -6.2% on the kernel at 32 x 2048
// (KDA_RT_KDA_T_HALVES=0: without).
#ifndef T_HALVES
#define T_HALVES 1
#endif
// BETA_EARLY = 1: each thread < L loads its row's beta (one bf16 a row, rows ldb elements apart: 64 lines, not in
// the L2 prefetch of the tile's q, k, v, f rows) into a register before the copies are issued, not after them and the
// next tile's prefetch: its round trip under the copies instead of after their issue.  Bit-identical.  1 since
// 2026-12-03 (KDA_RT_KDA_BETA_EARLY=0: without).  H200, tests/gpu/bench_kda_phases.py --ldb 288 --ab BETA_EARLY (the
// model's beta, a column block of the [T, 288] f_a | g_a | b projection; 5 interleaved rounds, ms): 32 x 2048 5.205
// -> 5.090, 8 x 2048 1.319 -> 1.294, 1 x 32768 2.542 -> 2.494; the copies' phase 6248 -> 5321 cycles a CTA (with the
// next tile's beta lines also prefetched into L2, which added nothing measurable on top: not kept).
#ifndef BETA_EARLY
#define BETA_EARLY 1
#endif
// COPY_ROWS = 1: the raw q, k, v and f copies issued with each thread on one 16-byte column piece of rows r1, r1 + 32,
// ..: a row's three pieces from one base pointer and a stride, no division or remainder a piece (the flat loop
// divides its index by the 1072 pieces of a tensor and by 16 a row).  The same copies: bit-identical.  1 since
// 2026-12-03 (KDA_RT_KDA_COPY_ROWS=0: without).  H200, bench_kda_phases.py --ldb 288 --ab COPY_ROWS (5 interleaved
// rounds, ms): 32 x 2048 5.112 -> 4.958, 8 x 2048 1.304 -> 1.273, 1 x 32768 2.517 -> 2.447; thread 0's issue of its
// copies 4096 -> 2880 cycles, the copies' phase 5487 -> 4388.
#ifndef COPY_ROWS
#define COPY_ROWS 1
#endif
// EARLY_LOOKUP = 1: the next tile's sequence lookup (for its L2 prefetch) searched beside the tile's own at the entry,
// one probe load of each in flight together, and its start, length and the head's A_log loaded there too, so the
// thread that issued its copies goes on to the prefetch and the copies' wait without a round trip of its own (the
// lookup + prefetch took ~0.8 K cycles after the copies' issue, then ~0.6 K for beta, -exp(A_log) and the wait).
// The same lookups, prefetches and values: bit-identical.  1 since 2026-12-03 (KDA_RT_KDA_EARLY_LOOKUP=0: without).
// H200, bench_kda_phases.py --ldb 288 --ab EARLY_LOOKUP (5 interleaved rounds, ms): 32 x 2048 4.953 -> 4.852, 8 x 2048
// 1.271 -> 1.246, 1 x 32768 2.442 -> 2.402.  (f's rows in a second copy group landing under the conv, SPLIT_F, were
// slower: 4.976 -> 5.013, 1.269 -> 1.279, 2.442 -> 2.458; removed.)
#ifndef EARLY_LOOKUP
#define EARLY_LOOKUP 1
#endif
// G_BALANCE = 1: phase (g)'s products (T diag(beta) is lower-triangular: row block mt takes mt + 1 k steps) with each
// warp on two row blocks, p and 3 - p, and 16 columns, so every warp runs 5 k steps of 4 mma instead of 1-4 k steps of
// 8 (the CTA ends with its slowest warp: 32 mma there now, 20 then).  The same products summed in the same order:
// bit-identical.  Measured (H200, 2026-12-03, bench_kda_phases.py --shapes 32x2048,8x2048,1x32768 --ldb 288 --ab
// G_BALANCE): 4.844 -> 4.826, 1.246 -> 1.242, 2.400 -> 2.379 ms.
#ifndef G_BALANCE
#define G_BALANCE 1
#endif
// ROW_SCATTER = 1 (applies with ROW_NORM_SPREAD; without it, no effect): phase (b)'s row sums of squares and q.k by a
// reduce-scatter over the lanes (27 shuffles a warp instead of 120) with the butterfly's pairing: the same bits.  ncu
// (2026-12-03): the row-norm warps are (b)'s longest, and the barrier after (b) held 2.6% of all the warps' stall
// samples.  Measured (H200, 2026-12-03, bench_kda_phases.py --shapes 32x2048,8x2048,1x32768 --ldb 288 --ab
// ROW_SCATTER): 4.653 -> 4.516, 1.190 -> 1.154, 2.292 -> 2.221 ms.  (Also tried that call, bit-identical and slower,
// removed: phase (d)'s tasks in an order that leaves an unsafe sub-block's empty diagonal A_kk task to the second
// round, +0.2%; no diagonal factor tile for unsafe sub-blocks in (c), +0.8%.  In call 2: (d) and (e) as a pool of warp
// parts from a shared counter, +3.2%.)
#ifndef ROW_SCATTER
#define ROW_SCATTER 1
#endif
// T_ROWS (1, 2 or 4, with T_HALVES): each thread of T's off-diagonal products computes T_ROWS rows of its column (rows
// rr, rr + 16 / T_ROWS, ..), the column's 16 shared-memory loads shared by them (dot16_rows): 12 (2 rows) or 8 (4)
// loads an output instead of 20, on 256 or 128 threads.  ncu (2026-12-03): those products (13.5% of a CTA) wait on the
// shared-memory instruction queue (MIO throttle 21-49% of their samples).  Each row's FMAs in dot16's order:
// bit-identical.  Applies with T_HALVES (the block-row form has no such map).  2 since 2026-12-03 (KDA_RT_KDA_T_ROWS=1
// or 4: the others).  Measured (H200, 2026-12-03, bench_kda_phases.py --shapes 32x2048,8x2048,1x32768 --ldb 288 --ab
// T_ROWS=1:2:4, ms at 1 / 2 / 4): 32 x 2048 4.525 / 4.387 / 4.442, 8 x 2048 1.160 / 1.128 / 1.141, 1 x 32768 2.224 /
// 2.157 / 2.184.
#ifndef T_ROWS
#define T_ROWS 2
#endif
// LOOKUP_BOUNDS = 1 (with EARLY_LOOKUP and COPY_ROWS): the sequence search returns the sequence's start and end with it
// (each probe loads its successor too; sequence_bounds_of_chunk_pair) instead of loading them after it, and the rows
// that cannot read the conv-state slot (all but each thread's first) are issued before the one that can, so most copies
// wait on no load after the search (the tile's fresh / slot loads only gate its first row).  ~0.9 K cycles from the
// entry to the first copy now (3% of a CTA: bench_kda_phases.py's "sequence lookup").  The same copies: bit-identical.
// Applies with EARLY_LOOKUP and COPY_ROWS (without either it builds as 0).  1 since 2026-12-03
// (KDA_RT_KDA_LOOKUP_BOUNDS=0: without).  Measured (H200, 2026-12-03, bench_kda_phases.py --shapes
// 32x2048,8x2048,1x32768 --ldb 288 --ab LOOKUP_BOUNDS): 4.535 -> 4.511, 1.153 -> 1.151, 2.220 -> 2.215 ms.
#ifndef LOOKUP_BOUNDS
#define LOOKUP_BOUNDS 1
#endif
#if LOOKUP_BOUNDS && !(EARLY_LOOKUP && COPY_ROWS)
#undef LOOKUP_BOUNDS
#define LOOKUP_BOUNDS 0
#endif
// GATE_POLY = 1: the gate's softplus by kda_softplus_poly (one exponential and a degree-7 polynomial, no logarithm:
// kda_common.cuh) and log2(e) -exp(A_log) as one factor, instead of kda_softplus_fast and two multiplies: 16 MUFU and
// ~100 instructions a thread fewer in phase (a), whose 128 MUFU (ex2 and rcp of the SiLU, ex2 and lg2 of the gate) take
// 4096 cycles of the 16-a-clock pipe, about its issue time (ncu, 2026-12-03).  Within the same bound as
// kda_softplus_fast (test_kda_softplus_fast checks both); not the same bits.  1 since 2026-12-03
// (KDA_RT_KDA_GATE_POLY=0: kda_softplus_fast).  Measured (H200, 2026-12-03, bench_kda_phases.py --shapes
// 32x2048,8x2048,1x32768 --ldb 288 --ab GATE_POLY): 4.540 -> 4.455, 1.154 -> 1.134, 2.222 -> 2.183 ms.
#ifndef GATE_POLY
#define GATE_POLY 1
#endif
// PAD_FIXUP = 1: phase (a) stores every row's conv + SiLU output and gate, and a tile with rows past its sequence's end
// (a sequence's last chunk) then overwrites those rows with 0 (the same thread, the same addresses), instead of a
// select a value (64 a thread) in every tile.  The same bits.  1 since 2026-12-03 (KDA_RT_KDA_PAD_FIXUP=0: without).
// Measured (H200, 2026-12-03, bench_kda_phases.py --shapes 32x2048,8x2048,1x32768 --ldb 288 --ab PAD_FIXUP): 4.534 ->
// 4.489, 1.155 -> 1.142, 2.223 -> 2.201 ms; with GATE_POLY (--ab GATE_POLY,PAD_FIXUP): 4.539 -> 4.423, 1.153 -> 1.125,
// 2.219 -> 2.163.
#ifndef PAD_FIXUP
#define PAD_FIXUP 1
#endif
// E_SCAN = 1 (applies with QUAD_SPLIT): phase (e)'s 8 x 8 halves of unsafe diagonal sub-blocks by a warp a half and
// product (A_qk or A_kk), the decay from each earlier row carried down the rows by one exponential a row and channel (7
// a channel and warp, 14 a channel and half with its two products' warps, instead of 28: 14,336 exponentials a tile of
// four unsafe sub-blocks instead of 28,672), q, k and Lam read once a row (a few KB a warp instead of ~400 KB of
// shared-memory loads a tile), the channel sums by a reduce-scatter.  ncu (2026-12-03): the per-element path runs in
// nearly every tile of random gates, (d, e) 20.7% of a CTA.  Products of up to 7 rounded factors instead of one
// exponential of the difference, sums in another order: not the same bits (within the prefill bounds: the variants
// test).  1 since 2026-12-03 (KDA_RT_KDA_E_SCAN=0: per element).  Measured (H200, 2026-12-03, bench_kda_phases.py
// --shapes 32x2048,8x2048,1x32768 --ldb 288 --ab E_SCAN): 4.536 -> 4.235, 1.154 -> 1.070, 2.219 -> 2.081 ms (-6.6%,
// -7.3%, -6.2%).
#ifndef E_SCAN
#define E_SCAN 1
#endif
// Tried and dropped (2026-12-03): SCALE_SCAN, phase (c) a half sub-block a thread with its decay factors as running
// products of the rows' one-step decays (8-9 exponentials a channel and half instead of 3-4 an element): slower, +1.0%
// at 32 x 2048 (4.017 -> 4.057 ms) and +1.4% at 1 x 32768 (1.977 -> 2.004 ms) in bench_kda_phases.py --ab SCALE_SCAN
// --ldb 288 (5 interleaved rounds), though its CTAs' mean cycles fell 1% (why the kernel lost is not measured).
// SILU_FAST = 1: conv + SiLU's quotient u / (1 + e^-u) as u times the hardware reciprocal (rcp.approx.ftz: within an
// ulp), without common.cuh's Newton step and the infinity test it needs (e^-u = inf: the reciprocal 0, u * 0 = -0 as
// the division gives), 4 instructions an element fewer in phase (a), which is issue-bound (ncu, 2026-12-03: 20% of the
// stall samples, "selected" and "not selected" 43% of them).  The product is within ~2 ulp of the quotient before the
// bf16 rounding: other bits only where the quotient lies that close to a bf16 rounding boundary.  Measured (H200,
// 2026-12-03, bench_kda_phases.py --shapes 32x2048,8x2048,1x32768 --ldb 288 --ab SILU_FAST): 4.847 -> 4.801, 1.233 ->
// 1.222, 2.376 -> 2.357 ms (phase (a) 6428 -> 6105 cycles); its outputs within the prefill bounds (the variants test).
#ifndef SILU_FAST
#define SILU_FAST 1
#endif
// G_STAGED = 1: W and U (phase (g)) staged in shared memory and stored in whole 16-byte pieces (4 a thread, each warp
// store 512 contiguous bytes) instead of 16 4-byte pieces a thread in the mma fragment layout (8 rows of 16 bytes a
// warp store, half of each 32-byte sector): one more barrier.  ncu (2026-12-03): after the last barrier 12.6% of the
// stall samples, 46% of them the warps' exit waiting for their stores to drain, 14% the store queue.  Same bits.
// Measured (H200, 2026-12-03, --ab G_STAGED as above): 4.815 -> 4.726, 1.234 -> 1.206, 2.376 -> 2.328 ms.
#ifndef G_STAGED
#define G_STAGED 1
#endif
#if EXP2_FTZ
#define EXP2_ELEM(x) exp2_approx(x)
#else
#define EXP2_ELEM(x) exp2f(x)
#endif
#if !defined(HEAD_DIM) || !defined(CONV_W) || !defined(CHUNK) || !defined(VB) || !defined(INTRA_THREADS)
#error "kda_prefill.cu needs -DHEAD_DIM -DCONV_W -DCHUNK -DVB -DINTRA_THREADS"
#endif
#if HEAD_DIM != 128 || CHUNK != 64
#error "kda_prefill.cu: the thread maps assume HEAD_DIM == 128 and CHUNK == 64"
#endif
#define K HEAD_DIM
#define L CHUNK
#define SUB 16                                     // rows per gate sub-block (one mma m-tile)
#define NUM_SUB (L / SUB)
#define NUM_PAIRS (NUM_SUB * (NUM_SUB + 1) / 2)    // (row block, column block <= row block)
#define LOG2E 1.4426950408889634f
#define DIAG_SPAN 60.f                             // log2 range of a diagonal sub-block on tensor cores
#define INTRA_WARPS (INTRA_THREADS / 32)
#define CONV_ROWS (L * K / INTRA_THREADS)          // rows a thread of the conv / gate stage (one channel)
#define LDB (K + 8)   // bf16 row stride of [.][K] smem tiles: 272 B, ldmatrix rows on distinct banks
#define LDA (L + 8)   // bf16 row stride of [.][L] tiles
#define LDF (K + 4)   // fp32 row stride of [.][K] tiles
#define LDT (L + 4)   // fp32 row stride of [.][L] tiles
#define WN (VB < 32 ? VB : 32)                     // state columns per warp of kda_prefill_state
#define STATE_WARPS (4 * (VB / WN))
#define LDV (VB + 8)  // bf16 row stride of [.][VB] tiles

static_assert(VB % 16 == 0 && K % VB == 0, "kda_prefill.cu: VB must be a multiple of 16 dividing K");
static_assert(INTRA_THREADS == 512, "kda_prefill_intra: the thread maps are written for 16 warps");

// ---------------------------------------------------------------------------------------------
// helpers

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&p);
}
__device__ __forceinline__ float2 unpack_bf16(unsigned u) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&u));
}
__device__ __forceinline__ void st_bf16x2(bf16* p, float lo, float hi) { *reinterpret_cast<unsigned*>(p) = pack_bf16(lo, hi); }
__device__ __forceinline__ float2 ld_bf16x2(const bf16* p) { return unpack_bf16(*reinterpret_cast<const unsigned*>(p)); }

// bf16(SiLU(conv)) as kda_conv_silu, but with the hardware reciprocal (SILU_FAST) or common.cuh's Newton quotient
// (no slow-path call of IEEE division, which kept the compiler from overlapping rows) and e^-u from the hardware
// exponential alone
// (relative error ~2^-22 + |u|·2^-24 before the bf16 rounding; expf's range reduction took ~6 more
// instructions an element in this issue-bound stage; EXP_ACCURATE_EXP=1, bench only, restores expf).
// CONV_ONE_ROUND: returned unrounded (the caller's bf16 store rounds it).
template <int W>
__device__ __forceinline__ float conv_silu_nr(const float (&taps)[W], const float (&hist)[W - 1], float x) {
    float u = 0.f;
#pragma unroll
    for (int j = 0; j < W - 1; ++j) u = fmaf(taps[j], hist[j], u);
    u = fmaf(taps[W - 1], x, u);
#if EXP_ACCURATE_EXP
    const float s = silu_nr(u);
#elif SILU_FAST
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.f + exp2_approx(-LOG2E * u)));
    const float s = u * r;
#else
    const float s = silu_quotient(u, 1.f + exp2_approx(-LOG2E * u));
#endif
    return CONV_ONE_ROUND ? s : round_bf16(s);
}

// CW (1 or 2) adjacent channels of one row: a bf16 load / store (2: one 4-byte access, one packed conversion) and an
// fp32 store (2: one 8-byte access)
template <int CW>
__device__ __forceinline__ void ld_row_bf16(const bf16* p, float (&x)[CW]) {
    if constexpr (CW == 2) {
        const float2 v = ld_bf16x2(p);
        x[0] = v.x, x[CW - 1] = v.y;
    } else {
        x[0] = to_f32(*p);
    }
}
template <int CW>
__device__ __forceinline__ void st_row_bf16(bf16* p, const float (&y)[CW]) {
    if constexpr (CW == 2) st_bf16x2(p, y[0], y[CW - 1]);
    else *p = to_bf16(y[0]);
}
template <int CW>
__device__ __forceinline__ void st_row_f32(float* p, const float (&y)[CW]) {
    if constexpr (CW == 2) *reinterpret_cast<float2*>(p) = make_float2(y[0], y[CW - 1]);
    else *p = y[0];
}

// acc0 / acc1 += a[k] col[k ld] over the 16 k of one fp32 row a (float4s; even k into acc0, odd into acc1: two
// chains of 8)
__device__ __forceinline__ void dot16(const float4* a4, const float* col, int ld, float& acc0, float& acc1) {
#pragma unroll
    for (int k4 = 0; k4 < SUB / 4; ++k4) {
        const float4 a = a4[k4];
        acc0 = fmaf(a.x, col[(4 * k4) * ld], acc0);
        acc1 = fmaf(a.y, col[(4 * k4 + 1) * ld], acc1);
        acc0 = fmaf(a.z, col[(4 * k4 + 2) * ld], acc0);
        acc1 = fmaf(a.w, col[(4 * k4 + 3) * ld], acc1);
    }
}

// dot16 for R rows of one fp32 tile, astride floats apart, against one column: the column's 16 loads shared by the R
// rows (acc[i][0 / 1]: row i's even / odd k, each row's FMAs in dot16's order: the same bits)
template <int R>
__device__ __forceinline__ void dot16_rows(const float* a, int astride, const float* col, int ld, float (&acc)[R][2]) {
#pragma unroll
    for (int k4 = 0; k4 < SUB / 4; ++k4) {
        const float c0 = col[(4 * k4) * ld], c1 = col[(4 * k4 + 1) * ld], c2 = col[(4 * k4 + 2) * ld],
                    c3 = col[(4 * k4 + 3) * ld];
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const float4 v = reinterpret_cast<const float4*>(a + i * astride)[k4];
            acc[i][0] = fmaf(v.x, c0, acc[i][0]), acc[i][1] = fmaf(v.y, c1, acc[i][1]);
            acc[i][0] = fmaf(v.z, c2, acc[i][0]), acc[i][1] = fmaf(v.w, c3, acc[i][1]);
        }
    }
}

// one step of a reduce-scatter over a warp's lanes (ROW_SCATTER's row sums, E_SCAN's pair sums): lanes paired over
// `off` add their halves of v[0, 2 HALF), the lane with `off` set keeping the upper half, each in v[0, HALF) after
// (a + b in the butterfly's order: both lanes of a pair get the same bits)
template <int HALF, int N>
__device__ __forceinline__ void halve_sums(float (&v)[N], const int off, const int lane) {
    static_assert(2 * HALF <= N, "halve_sums: 2 HALF values");
    const bool hi = lane & off;
#pragma unroll
    for (int j = 0; j < HALF; ++j) {
        const float a = v[j], b = v[HALF + j];
        v[j] = (hi ? b : a) + __shfl_xor_sync(0xffffffffu, hi ? a : b, off);
    }
}

// index of sub-block pair (I, J <= I) in the scaled-key tile
__device__ __forceinline__ constexpr int pair_index(int I, int J) { return I * (I + 1) / 2 + J; }
// index of the (row block I, column block J < I) pair in the gate table C
__device__ __forceinline__ constexpr int cross_index(int I, int J) { return I * (I - 1) / 2 + J; }

// First chunk id of sequence b (see the header): strictly increasing in b.
__device__ __forceinline__ int chunk_base(const int* __restrict__ cu_seqlens, int b) { return b + __ldg(cu_seqlens + b) / L; }

// Sequence holding chunk id cid: the largest seq with chunk_base(seq) <= cid, by a 32-way search
// (each warp on its own, all lanes active; one step for up to 32 sequences, where a binary search
// makes log2(B) dependent loads).
__device__ __forceinline__ int sequence_of_chunk(const int* __restrict__ cu_seqlens, int num_seqs, int cid) {
    const int lane = threadIdx.x & 31;
    int seq = 0;
    for (int hi = num_seqs; hi - seq > 1;) {
        const int step = (hi - seq + 31) / 32, probe = seq + lane * step;
        const unsigned ok = __ballot_sync(0xffffffffu, probe < hi && chunk_base(cu_seqlens, probe) <= cid);
        const int top = 31 - __clz(ok);  // lane 0 (probe seq) always qualifies
        hi = min(hi, seq + (top + 1) * step), seq += top * step;
    }
    return seq;
}

// sequence_of_chunk of two chunk ids at once (EARLY_LOOKUP): the two 32-way searches in lockstep, each step's probe
// loads of both issued before either ballot; a search already down to one sequence repeats a step that changes
// nothing (lane 0's probe, its lower end, qualifies; no other lane loads).  The same results as two calls.
__device__ __forceinline__ void sequence_of_chunk_pair(const int* __restrict__ cu_seqlens, int num_seqs, int cid,
                                                       int cid2, int& seq, int& seq2) {
    const int lane = threadIdx.x & 31;
    int s1 = 0, s2 = 0, hi1 = num_seqs, hi2 = num_seqs;
    while (hi1 - s1 > 1 || hi2 - s2 > 1) {
        const int step1 = (hi1 - s1 + 31) / 32, probe1 = s1 + lane * step1;
        const int step2 = (hi2 - s2 + 31) / 32, probe2 = s2 + lane * step2;
        const bool in1 = probe1 < hi1, in2 = probe2 < hi2;
        const int v1 = in1 ? __ldg(cu_seqlens + probe1) : 0, v2 = in2 ? __ldg(cu_seqlens + probe2) : 0;
        const unsigned ok1 = __ballot_sync(0xffffffffu, in1 && probe1 + v1 / L <= cid);
        const unsigned ok2 = __ballot_sync(0xffffffffu, in2 && probe2 + v2 / L <= cid2);
        const int top1 = 31 - __clz(ok1), top2 = 31 - __clz(ok2);
        hi1 = min(hi1, s1 + (top1 + 1) * step1), s1 += top1 * step1;
        hi2 = min(hi2, s2 + (top2 + 1) * step2), s2 += top2 * step2;
    }
    seq = s1, seq2 = s2;
}

// sequence_of_chunk_pair that also returns each sequence's bounds, cu_seqlens[seq] and cu_seqlens[seq + 1]
// (LOOKUP_BOUNDS): every probe loads its successor beside it (same round trip), and the last step's qualifying lane
// holds both; with one sequence (no step) they are loaded after.  The same sequences as sequence_of_chunk_pair.
__device__ __forceinline__ void sequence_bounds_of_chunk_pair(const int* __restrict__ cu_seqlens, int num_seqs, int cid,
                                                              int cid2, int& seq, int& seq2, int (&b1)[2], int (&b2)[2]) {
    const int lane = threadIdx.x & 31;
    int s1 = 0, s2 = 0, hi1 = num_seqs, hi2 = num_seqs;
    bool stepped = false;
    while (hi1 - s1 > 1 || hi2 - s2 > 1) {
        const int step1 = (hi1 - s1 + 31) / 32, probe1 = s1 + lane * step1;
        const int step2 = (hi2 - s2 + 31) / 32, probe2 = s2 + lane * step2;
        const bool in1 = probe1 < hi1, in2 = probe2 < hi2;
        const int v1 = in1 ? __ldg(cu_seqlens + probe1) : 0, v2 = in2 ? __ldg(cu_seqlens + probe2) : 0;
        const int w1 = in1 ? __ldg(cu_seqlens + probe1 + 1) : 0, w2 = in2 ? __ldg(cu_seqlens + probe2 + 1) : 0;
        const unsigned ok1 = __ballot_sync(0xffffffffu, in1 && probe1 + v1 / L <= cid);
        const unsigned ok2 = __ballot_sync(0xffffffffu, in2 && probe2 + v2 / L <= cid2);
        const int top1 = 31 - __clz(ok1), top2 = 31 - __clz(ok2);
        b1[0] = __shfl_sync(0xffffffffu, v1, top1), b1[1] = __shfl_sync(0xffffffffu, w1, top1);
        b2[0] = __shfl_sync(0xffffffffu, v2, top2), b2[1] = __shfl_sync(0xffffffffu, w2, top2);
        hi1 = min(hi1, s1 + (top1 + 1) * step1), s1 += top1 * step1;
        hi2 = min(hi2, s2 + (top2 + 1) * step2), s2 += top2 * step2;
        stepped = true;
    }
    if (!stepped) {  // one sequence: both ids are in sequence 0
        b1[0] = b2[0] = __ldg(cu_seqlens), b1[1] = b2[1] = __ldg(cu_seqlens + 1);
    }
    seq = s1, seq2 = s2;
}

// bf16 [ROWS][COLS] tile, global row stride ld_src -> smem row stride ld_dst, 16-byte cp.async pieces
template <int Rows, int Cols, int Threads>
__device__ __forceinline__ void tile_async(bf16* dst, int ld_dst, const bf16* src, int ld_src) {
    constexpr int per_row = Cols / 8;
    for (int i = threadIdx.x; i < Rows * per_row; i += Threads) {
        const int r = i / per_row, c = (i % per_row) * 8;
        cp_async16(dst + r * ld_dst + c, src + (size_t)r * ld_src + c, 16);
    }
}

// A fragment (16 x 16, row-major smem at p, row stride ld): rows 0-15, columns 0-15
__device__ __forceinline__ void frag_a(unsigned (&a)[4], const bf16* p, int ld) {
    const int lane = threadIdx.x & 31;
    ldmatrix_x4(a, p + (lane & 15) * ld + (lane >> 4) * 8);
}
// A fragment of X^T where X is stored [k][m] row-major at p (16 k rows, 16 m columns)
__device__ __forceinline__ void frag_a_trans(unsigned (&a)[4], const bf16* p, int ld) {
    const int lane = threadIdx.x & 31;
    ldmatrix_x4_trans(a, p + ((lane & 7) + ((lane >> 4) & 1) * 8) * ld + ((lane >> 3) & 1) * 8);
}
// B fragments of two n-tiles (b[0], b[1]: columns 0-7; b[2], b[3]: 8-15) from B stored [k][n] at p
__device__ __forceinline__ void frag_b_kn(unsigned (&b)[4], const bf16* p, int ld) {
    const int lane = threadIdx.x & 31;
    ldmatrix_x4_trans(b, p + ((lane & 7) + ((lane >> 3) & 1) * 8) * ld + (lane >> 4) * 8);
}
// the same from B stored [n][k] (k contiguous)
__device__ __forceinline__ void frag_b_nk(unsigned (&b)[4], const bf16* p, int ld) {
    const int lane = threadIdx.x & 31;
    ldmatrix_x4(b, p + ((lane & 7) + (lane >> 4) * 8) * ld + ((lane >> 3) & 1) * 8);
}

// dynamic shared memory plan of kda_prefill_intra, in bytes (kda_prefill.py reads INTRA_SMEM from
// the same numbers: keep _intra_smem_bytes in step)
#define SZ_TB (L * LDB * 2)                        // one bf16 [L][LDB] tile
#define HIST_B ((CONV_W - 1) * LDB * 2)            // W-1 conv history rows before a raw tile's row 0
#define SZ_TR (HIST_B + SZ_TB)                     // one raw tile with its history rows
#define IN_QR 0                                    // raw q -> q (bf16 conv output) in place, later e^G k^ (W's RHS)
#define IN_KR (IN_QR + SZ_TR)                      // raw k -> k
#define IN_VR (IN_KR + SZ_TR)                      // raw v -> v
#define IN_QA (IN_VR + SZ_TR)                      // raw f, then q^ e^Lam
#define IN_KA (IN_QA + SZ_TB)                      // k^ e^Lam, later T fp32 [L][LDT]
#define IN_KX (IN_KA + SZ_TB)                      // [NUM_PAIRS * SUB][LDB] k^ e^(G_n - G_s), later T diag(beta) bf16 [L][LDA]
#define IN_G (IN_KX + NUM_PAIRS * SUB * LDB * 2)   // Lam fp32 [L][LDF]
#define IN_AKK (IN_G + L * LDF * 4)                // beta A_kk fp32 [L][LDT]
#define NUM_CROSS (NUM_SUB * (NUM_SUB - 1) / 2)   // (row block, earlier column block) pairs
#define IN_TAB (IN_AKK + L * LDT * 4)              // fp32 tables P, R [NUM_SUB][K], C [NUM_CROSS][K]; X [NUM_SUB-1][SUB][SUB]
#define IN_VEC (IN_TAB + ((2 * NUM_SUB + NUM_CROSS) * K + (NUM_SUB - 1) * SUB * SUB) * 4)  // beta, rq, rk, q.k [L], flags
#if QUAD_SPLIT
// per sub-block, bf16 [QUAD_ROWS][LDB]: rows 0-7 k^_R e^(Lam_R - Lam_8) and rows 8-15 q^_R e^(Lam_R - Lam_8) for R = 8..15
// (the quadrant product's A: rows 0-7 give A_kk, rows 8-15 A_qk), rows 16-23 k^_S e^(Lam_8 - Lam_S) for S = 0..7 (its B)
#define QUAD_ROWS 24
#define IN_QUAD ((IN_VEC + 4 * L * 4 + 32 + 15) / 16 * 16)
#define INTRA_SMEM (IN_QUAD + NUM_SUB * QUAD_ROWS * LDB * 2)
#else
#define INTRA_SMEM (IN_VEC + 4 * L * 4 + 32)
#endif
static_assert((3 * CONV_W + 1) * K * 4 <= L * LDT * 4, "kda_prefill_intra: the conv taps must fit the A_kk tile");
static_assert(NUM_SUB <= 4, "kda_prefill_intra: the flags and -exp(A_log) share 32 bytes");
static_assert(IN_KA % 16 == 0 && IN_AKK % 16 == 0 && LDT % 4 == 0, "kda_prefill_intra: T and A_kk rows are read as float4");

// ---------------------------------------------------------------------------------------------
// kernels

extern "C" __global__ void __launch_bounds__(INTRA_THREADS, 1) kda_prefill_intra(
    const bf16* __restrict__ qkv, const bf16* __restrict__ f, const bf16* __restrict__ b, int ldb,
    const float* __restrict__ conv_w, const float* __restrict__ A_log, const float* __restrict__ dt_bias,
    const bf16* __restrict__ conv_pool, const int* __restrict__ cu_seqlens, const int* __restrict__ context_lens,
    const int* __restrict__ state_slots, bf16* __restrict__ ws_q, bf16* __restrict__ ws_k, bf16* __restrict__ ws_w,
    bf16* __restrict__ ws_u, bf16* __restrict__ ws_a, float* __restrict__ ws_g, int num_seqs, int num_heads,
    int prefetch_ahead) {
    KDA_PDL_ENTRY();
    extern __shared__ float4 smem4[];
    char* sm = reinterpret_cast<char*>(smem4);
    bf16* Raw = (bf16*)(sm + IN_QR);  // raw q, k, v tiles, rows c0-(W-1) .. c0+L-1, each SZ_TR bytes
    bf16 *Qr = (bf16*)(sm + IN_QR + HIST_B), *Kr = (bf16*)(sm + IN_KR + HIST_B), *Vr = (bf16*)(sm + IN_VR + HIST_B);
    bf16 *QA = (bf16*)(sm + IN_QA), *KA = (bf16*)(sm + IN_KA), *KX = (bf16*)(sm + IN_KX);
    float *Gf = (float*)(sm + IN_G), *Akk = (float*)(sm + IN_AKK), *Pt = (float*)(sm + IN_TAB);
    float *Rt = Pt + NUM_SUB * K, *Ct = Rt + NUM_SUB * K, *Xs = Ct + NUM_CROSS * K, *Bs = (float*)(sm + IN_VEC), *rq = Bs + L, *rk = rq + L;
    float* dqk = rk + L;  // each row's q.k (raw conv outputs)
    int* unsafe = (int*)(dqk + L);
    float* NegA = (float*)(unsafe + NUM_SUB);  // -exp(A_log[h])
#if QUAD_SPLIT
    bf16* Quad = (bf16*)(sm + IN_QUAD);
#endif
    bf16* Fs = QA;                     // raw f rows, until QA is built
    float* Tap = Akk;                  // conv taps [3][K][W] and dt_bias [K] of the head, until A_kk is built
    float* Tm = (float*)(sm + IN_KA);  // T, once KA is dead
    bf16* Tb = (bf16*)(sm + IN_KX);    // T diag(beta), once KX is dead
    bf16* KG = Qr;                     // beta-free W right-hand side e^G k^, once raw q is dead

    const int cid = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    STAMP(11);  // the entry (bench only): the sequence lookup's cycles are STAMP(0) - STAMP(11)
    // the tile that starts on this SM next (linear block id + prefetch_ahead = + the resident CTAs of the GPU, in the
    // block scheduler's dispatch order): its rows are prefetched into L2 while this tile's copies fly
    const int nxt = blockIdx.y * gridDim.x + blockIdx.x + prefetch_ahead;
    const int cid2 = nxt % gridDim.x, h2 = nxt / gridDim.x;
    const bool pf_next = prefetch_ahead > 0 && h2 < (int)gridDim.y;  // uniform over the block
#if LOOKUP_BOUNDS
    static_assert(EARLY_LOOKUP && COPY_ROWS, "kda_prefill_intra: LOOKUP_BOUNDS is built on EARLY_LOOKUP and COPY_ROWS");
    int seq, seq2, bounds[2], bounds2[2];
    sequence_bounds_of_chunk_pair(cu_seqlens, num_seqs, cid, pf_next ? cid2 : cid, seq, seq2, bounds, bounds2);
    const int start2 = bounds2[0], len2 = bounds2[1] - start2;
    const float a_log = __ldg(A_log + h);
    const int start = bounds[0], len = bounds[1] - start;
#else
#if EARLY_LOOKUP
    int seq, seq2;
    sequence_of_chunk_pair(cu_seqlens, num_seqs, cid, pf_next ? cid2 : cid, seq, seq2);
    const int start2 = __ldg(cu_seqlens + seq2), len2 = __ldg(cu_seqlens + seq2 + 1) - start2;
    const float a_log = __ldg(A_log + h);
#else
    const int seq = sequence_of_chunk(cu_seqlens, num_seqs, cid);
#endif
    const int start = __ldg(cu_seqlens + seq), len = __ldg(cu_seqlens + seq + 1) - start;
#endif
    const bool fresh = __ldg(context_lens + seq) == 0;
    const size_t slot = (size_t)__ldg(state_slots + seq), tile = (size_t)cid * num_heads + h;
    const int c0 = (cid - seq - start / L) * L;  // cid - chunk_base(seq)
    if (c0 >= len) return;  // an unused id
    STAMP(0);
    const int n = min(L, len - c0), P = num_heads * K;

    // ---- (a) every global input of the tile in one round trip (16-byte cp.async pieces, coalesced):
    // raw q, k, v rows c0-(W-1) .. c0+L-1 into the conv tiles (history before the sequence from the
    // conv-state slot; zeros past the end and for a fresh sequence), raw f rows into QA, the head's
    // conv taps and dt_bias into the A_kk tile; beta and -exp(A_log) meanwhile (stored to smem before
    // the barrier, so their loads overlap the copies).  Then conv + SiLU in place (thread: channel c,
    // CONV_ROWS rows from r0, or with CONV_PAIRS channels c and c + 1, CONV_ROWS / 2 rows; it reads its
    // W-1 history values before a barrier, then only its own rows), gates; padded rows are 0.
    {
        constexpr int PIECES = K / 8, RAW = (L + CONV_W - 1) * PIECES, TAPP = K * CONV_W / 4;
#if BETA_EARLY
        const float beta_raw = tid < n ? to_f32(b[(size_t)(start + c0 + tid) * ldb + h]) : 0.f;
#endif
#if COPY_ROWS
        {  // thread: piece c of rows r1, r1 + RPP, ..; each row's q, k, v pieces from one base and a stride
            constexpr int RPP = INTRA_THREADS / PIECES;
            static_assert(INTRA_THREADS % PIECES == 0, "kda_prefill_intra: COPY_ROWS's map");
            const int c = (tid % PIECES) * 8, r1 = tid / PIECES;
#if LOOKUP_BOUNDS
            // rows from RPP on (p = c0 - (W - 1) + rr >= 0: no conv-state slot, nor the loads of fresh and slot to
            // wait for) first, then row r1 with the rule below
            static_assert(RPP >= CONV_W - 1, "kda_prefill_intra: LOOKUP_BOUNDS's rows without history");
#pragma unroll
            for (int rr = r1 + RPP; rr < RAW / PIECES; rr += RPP) {
                const int p = c0 - (CONV_W - 1) + rr;
                const bool real = p < len;
                const bf16* src = qkv + (size_t)(start + p) * 3 * P + h * K + c;
#pragma unroll
                for (int i = 0; i < 3; ++i)
                    cp_async16(Raw + i * (SZ_TR / 2) + rr * LDB + c, real ? src + i * (size_t)P : qkv, real ? 16 : 0);
            }
#pragma unroll
            for (int rr = r1; rr < L; rr += RPP)
                cp_async16(Fs + rr * LDB + c, rr < n ? f + (size_t)(start + c0 + rr) * P + h * K + c : f, rr < n ? 16 : 0);
            {
                const int rr = r1;  // the one row of the thread that can read the slot (if r1 < W - 1)
#else
#pragma unroll
            for (int rr = r1; rr < RAW / PIECES; rr += RPP) {
#endif
                const int p = c0 - (CONV_W - 1) + rr;  // position in the sequence; < 0 reads the slot
                const bool real = p < len && (p >= 0 || !fresh);
                const bf16* src = p >= 0 ? qkv + (size_t)(start + p) * 3 * P + h * K + c
                                         : conv_pool + ((slot * 3) * (CONV_W - 1) + (CONV_W - 1 + p)) * P + h * K + c;
                const size_t step = p >= 0 ? (size_t)P : (size_t)(CONV_W - 1) * P;  // q -> k -> v
#pragma unroll
                for (int i = 0; i < 3; ++i)
                    cp_async16(Raw + i * (SZ_TR / 2) + rr * LDB + c, real ? src + i * step : qkv, real ? 16 : 0);
            }
#if !LOOKUP_BOUNDS
#pragma unroll
            for (int rr = r1; rr < L; rr += RPP)
                cp_async16(Fs + rr * LDB + c, rr < n ? f + (size_t)(start + c0 + rr) * P + h * K + c : f, rr < n ? 16 : 0);
#endif
        }
#else
        for (int idx = tid; idx < 3 * RAW; idx += INTRA_THREADS) {
            const int i = idx / RAW, rr = (idx % RAW) / PIECES, c = (idx % PIECES) * 8;
            const int p = c0 - (CONV_W - 1) + rr;  // position in the sequence; < 0 reads the slot
            const bool real = p < len && (p >= 0 || !fresh);
            const bf16* src = !real ? qkv
                            : p >= 0 ? qkv + (size_t)(start + p) * 3 * P + i * P + h * K + c
                                     : conv_pool + ((slot * 3 + i) * (CONV_W - 1) + (CONV_W - 1 + p)) * P + h * K + c;
            cp_async16(Raw + i * (SZ_TR / 2) + rr * LDB + c, src, real ? 16 : 0);
        }
        for (int idx = tid; idx < L * PIECES; idx += INTRA_THREADS) {
            const int rr = idx / PIECES, c = (idx % PIECES) * 8;
            cp_async16(Fs + rr * LDB + c, rr < n ? f + (size_t)(start + c0 + rr) * P + h * K + c : f, rr < n ? 16 : 0);
        }
#endif
        for (int idx = tid; idx < 3 * TAPP + K / 4; idx += INTRA_THREADS) {  // Tap [3][K][W], then dt_bias [K]
            const float* src = idx < 3 * TAPP ? conv_w + (size_t)((idx / TAPP) * P + h * K) * CONV_W + (idx % TAPP) * 4
                                              : dt_bias + h * K + (idx - 3 * TAPP) * 4;
            cp_async16(Tap + idx * 4, src, 16);
        }
        cp_async_commit();
        STAMP(12);  // thread 0's copies issued (bench only)
        // while the copies fly: L2 prefetch of the q, k, v, f rows of the next tile on this SM (above), so that its
        // copies hit L2
        if (pf_next) {
#if !EARLY_LOOKUP
            const int seq2 = sequence_of_chunk(cu_seqlens, num_seqs, cid2);
            const int start2 = __ldg(cu_seqlens + seq2), len2 = __ldg(cu_seqlens + seq2 + 1) - start2;
#endif
            const int c02 = (cid2 - seq2 - start2 / L) * L, n2 = min(L, len2 - c02);
            for (int idx = tid; idx < 8 * n2; idx += INTRA_THREADS) {  // 4 row segments of 2 x 128 B
                const int r = idx >> 3, seg = (idx >> 1) & 3, half = idx & 1;
                const size_t row = (size_t)(start2 + c02 + r);
                const bf16* p = (seg < 3 ? qkv + row * 3 * P + seg * P : f + row * P) + h2 * K + half * 64;
                asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
            }
        }
        STAMP(13);  // thread 0's next-tile prefetch issued (bench only)
#if BETA_EARLY
        if (tid < L) Bs[tid] = tid < n ? sigmoid(beta_raw) : 0.f;
#else
        if (tid < L) Bs[tid] = tid < n ? sigmoid(to_f32(b[(size_t)(start + c0 + tid) * ldb + h])) : 0.f;
#endif
#if EARLY_LOOKUP
        if (tid == 0) *NegA = -expf(a_log);
#else
        if (tid == 0) *NegA = -expf(A_log[h]);  // the gate's -exp(A_log), hoisted out of the row loops
#endif
        if (tid < NUM_SUB) unsafe[tid] = 0;
        cp_async_wait<0>();
        __syncthreads();
        STAMP(1);  // every copy has landed

        constexpr int CW = CONV_PAIRS ? 2 : 1, CR = CONV_ROWS / CW;  // channels (adjacent) and rows a thread
        static_assert(CONV_ROWS % CW == 0 && LDF % 2 == 0 && IN_G % 8 == 0, "kda_prefill_intra: CONV_PAIRS's map");
        const int c = CW * (tid & (K / CW - 1)), r0 = (tid / (K / CW)) * CR;
        float taps[3][CW][CONV_W], hist[3][CW][CONV_W - 1], bias[CW];
#pragma unroll
        for (int i = 0; i < 3; ++i) {
#pragma unroll
            for (int e = 0; e < CW; ++e) {
#pragma unroll
                for (int j = 0; j < CONV_W; ++j) taps[i][e][j] = Tap[(i * K + c + e) * CONV_W + j];
            }
#pragma unroll
            for (int j = 0; j < CONV_W - 1; ++j) {
                float hv[CW];
                ld_row_bf16<CW>(Raw + i * (SZ_TR / 2) + (r0 + j) * LDB + c, hv);
#pragma unroll
                for (int e = 0; e < CW; ++e) hist[i][e][j] = hv[e];
            }
        }
        const float na = *NegA;
#pragma unroll
        for (int e = 0; e < CW; ++e) bias[e] = Tap[3 * K * CONV_W + c + e];
        __syncthreads();  // a thread's history rows are the last rows of the previous thread's, rewritten below
        STAMP(2);
#pragma unroll
        for (int i = 0; i < 3; ++i) {
            bf16* dst = Raw + i * (SZ_TR / 2) + (CONV_W - 1 + r0) * LDB + c;
#pragma unroll 8
            for (int rr = 0; rr < CR; ++rr) {
                float x[CW], y[CW];
                ld_row_bf16<CW>(dst + rr * LDB, x);  // 0 past the end (zero-filled)
#pragma unroll
                for (int e = 0; e < CW; ++e) {
                    y[e] = conv_silu_nr<CONV_W>(taps[i][e], hist[i][e], x[e]);
                    if (!PAD_FIXUP) y[e] = r0 + rr < n ? y[e] : 0.f;
#pragma unroll
                    for (int j = 0; j < CONV_W - 2; ++j) hist[i][e][j] = hist[i][e][j + 1];
                    hist[i][e][CONV_W - 2] = x[e];
                }
                st_row_bf16<CW>(dst + rr * LDB, y);
            }
        }
#pragma unroll 8
        for (int rr = 0; rr < CR; ++rr) {
            const int r = r0 + rr;
            float fr[CW], gv[CW];
            ld_row_bf16<CW>(Fs + r * LDB + c, fr);
#pragma unroll
            for (int e = 0; e < CW; ++e) {
#if EXP_ACCURATE_EXP
                gv[e] = r < n ? LOG2E * (na * kda_softplus(fr[e], bias[e])) : 0.f;  // == LOG2E * kda_log_decay
#elif GATE_POLY
                const float g = (LOG2E * na) * kda_softplus_poly(fr[e], bias[e]);  // one multiply a gate (hoisted)
                gv[e] = PAD_FIXUP || r < n ? g : 0.f;
#elif GATE_FAST
                // computed for every row (padded rows read zero-filled f) and selected: no branch around it
                const float g = LOG2E * (na * kda_softplus_fast(fr[e], bias[e]));
                gv[e] = PAD_FIXUP || r < n ? g : 0.f;
#else
                gv[e] = r < n ? LOG2E * (na * kda_softplus_approx(fr[e], bias[e])) : 0.f;
#endif
            }
            st_row_f32<CW>(Gf + r * LDF + c, gv);
        }
#if PAD_FIXUP
        if (n < L) {  // a sequence's last chunk: its rows past the end are 0 in q, k, v and the gates (as the selects gave)
            const float zero[CW] = {};
#pragma unroll
            for (int rr = 0; rr < CR; ++rr) {
                if (r0 + rr < n) continue;
#pragma unroll
                for (int i = 0; i < 3; ++i) st_row_bf16<CW>(Raw + i * (SZ_TR / 2) + (CONV_W - 1 + r0 + rr) * LDB + c, zero);
                st_row_f32<CW>(Gf + (r0 + rr) * LDF + c, zero);
            }
        }
#endif
    }
    __syncthreads();
    STAMP(3);

    // ---- (b) row norms (ROW_NORM_SPREAD: warps 0-7, 8 rows each; else warp w: rows 4w..4w+3); gate bookkeeping per
    // channel d (ROW_NORM_SPREAD: the last K threads; else threads < K):
    // Lam in place; tables P_I = 2^G(n_I), R_J = 2^(sum of the blocks after J), C_IJ = 2^(G(n_I) - G(last row
    // of J)) (exponents are sums of gates, no differences: every entry <= 1); G_last -> workspace; unsafe
    // diagonal sub-blocks.  Also each row's q.k (the A_qk diagonal of an unsafe sub-block, where E = 1)
#if ROW_NORM_SPREAD
    // rows on warps 0 .. NORM_WARPS - 1, RPW each: the butterfly sums leave every row's sums in every lane (the same
    // bits in each: a + b == b + a), and lane i < RPW finishes row RPW w + i (ROW_SCATTER: lane 4 i, from its
    // reduce-scatter), so the rows' square roots and quotients run side by side instead of one after another on lane
    // 0; the channels' gate bookkeeping below runs on the last K / 32 warps, which have no rows, so neither chain
    // waits for the other (bit-identical to the default build)
    constexpr int NORM_WARPS = 8, RPW = L / NORM_WARPS;
    static_assert(L % NORM_WARPS == 0 && RPW <= 32 && NORM_WARPS * 32 <= INTRA_THREADS - K,
                  "kda_prefill_intra: ROW_NORM_SPREAD's row and gate warps");
    if (warp < NORM_WARPS) {
        float sq[RPW], sk[RPW], sqk[RPW];
#pragma unroll
        for (int i = 0; i < RPW; ++i) {  // unrolled: shuffle chains interleave
            const int r = RPW * warp + i;
            sq[i] = 0.f, sk[i] = 0.f, sqk[i] = 0.f;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float2 q2 = ld_bf16x2(Qr + r * LDB + 4 * lane + 2 * e), k2 = ld_bf16x2(Kr + r * LDB + 4 * lane + 2 * e);
                sq[i] = fmaf(q2.x, q2.x, fmaf(q2.y, q2.y, sq[i])), sk[i] = fmaf(k2.x, k2.x, fmaf(k2.y, k2.y, sk[i]));
                sqk[i] = fmaf(q2.x, k2.x, fmaf(q2.y, k2.y, sqk[i]));
            }
#if !ROW_SCATTER
            sq[i] = warp_sum(sq[i]), sk[i] = warp_sum(sk[i]), sqk[i] = warp_sum(sqk[i]);
#endif
        }
#if ROW_SCATTER
        // the butterfly's sums of warp_sum (lanes paired over 16, 8, 4, 2, 1: a + b, the same bits on both lanes), but
        // over 16, 8 and 4 each lane passes on the half of its rows its partner keeps: 12 + 6 + 3 shuffles, then 3 x 2
        // for the last row, 27 in all instead of 120; lane 4 i ends with row i's sums
        static_assert(RPW == 8, "kda_prefill_intra: ROW_SCATTER halves 8 rows three times");
        float v[3 * RPW];
#pragma unroll
        for (int i = 0; i < RPW; ++i) v[3 * i] = sq[i], v[3 * i + 1] = sk[i], v[3 * i + 2] = sqk[i];
        halve_sums<12>(v, 16, lane), halve_sums<6>(v, 8, lane), halve_sums<3>(v, 4, lane);
#pragma unroll
        for (int j = 0; j < 3; ++j) v[j] += __shfl_xor_sync(0xffffffffu, v[j], 2), v[j] += __shfl_xor_sync(0xffffffffu, v[j], 1);
        if ((lane & 3) == 0) {
            const int r = RPW * warp + (lane >> 2);
            rq[r] = rsqrtf((float)K) / sqrtf(v[0] + 1e-6f), rk[r] = 1.f / sqrtf(v[1] + 1e-6f), dqk[r] = v[2];
        }
#else
        float nq = sq[0], nk = sk[0], qk = sqk[0];  // this lane's row's sums
#pragma unroll
        for (int i = 1; i < RPW; ++i) nq = lane == i ? sq[i] : nq, nk = lane == i ? sk[i] : nk, qk = lane == i ? sqk[i] : qk;
        if (lane < RPW) {
            const int r = RPW * warp + lane;
            rq[r] = rsqrtf((float)K) / sqrtf(nq + 1e-6f), rk[r] = 1.f / sqrtf(nk + 1e-6f), dqk[r] = qk;
        }
#endif
    }
    if (tid >= INTRA_THREADS - K) {
        const int d = tid - (INTRA_THREADS - K);
#else
#pragma unroll
    for (int r = (L / INTRA_WARPS) * warp; r < (L / INTRA_WARPS) * (warp + 1); ++r) {  // unrolled: shuffle chains interleave
        float sq = 0.f, sk = 0.f, sqk = 0.f;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float2 q2 = ld_bf16x2(Qr + r * LDB + 4 * lane + 2 * e), k2 = ld_bf16x2(Kr + r * LDB + 4 * lane + 2 * e);
            sq = fmaf(q2.x, q2.x, fmaf(q2.y, q2.y, sq)), sk = fmaf(k2.x, k2.x, fmaf(k2.y, k2.y, sk));
            sqk = fmaf(q2.x, k2.x, fmaf(q2.y, k2.y, sqk));
        }
        sq = warp_sum(sq), sk = warp_sum(sk), sqk = warp_sum(sqk);
        if (lane == 0) rq[r] = rsqrtf((float)K) / sqrtf(sq + 1e-6f), rk[r] = 1.f / sqrtf(sk + 1e-6f), dqk[r] = sqk;
    }
    if (tid < K) {
        const int d = tid;
#endif
        float first[NUM_SUB], total[NUM_SUB];
        int bad = 0;
#pragma unroll
        for (int I = 0; I < NUM_SUB; ++I) {
            float* g = Gf + I * SUB * LDF + d;
            first[I] = g[0];
            g[0] = 0.f;
            float acc = 0.f;
#pragma unroll
            for (int r = 1; r < SUB; ++r) acc += g[r * LDF], g[r * LDF] = acc;
            total[I] = first[I] + acc;
            bad |= (acc < -DIAG_SPAN) << I;
        }
        float run = 0.f;
#pragma unroll
        for (int I = 0; I < NUM_SUB; ++I) Pt[I * K + d] = exp2f(run + first[I]), run += total[I];
        ws_g[tile * K + d] = run;  // G_last (log2)
        run = 0.f;
#pragma unroll
        for (int J = NUM_SUB - 1; J >= 0; --J) Rt[J * K + d] = exp2f(run), run += total[J];
#pragma unroll
        for (int I = 1; I < NUM_SUB; ++I) {
#pragma unroll
            for (int J = 0; J < I; ++J) {
                float acc = first[I];
#pragma unroll
                for (int B = J + 1; B < I; ++B) acc += total[B];
                Ct[cross_index(I, J) * K + d] = exp2f(acc);
            }
        }
#pragma unroll
        for (int I = 0; I < NUM_SUB; ++I)
            if (bad >> I & 1) unsafe[I] = 1;  // benign race: every writer stores 1
    }
    __syncthreads();
    STAMP(4);

    // ---- (c) scaled tiles (two channels per thread and step) and the workspace's qg, kd.  Every
    // factor is 2^Lam_r or 2^(Lam_last(I) - Lam_r) (<= 15 gates) times a table entry (whole blocks): three
    // exp2f per element (each <= 1, so their products underflow to 0 exactly where the exponent sums do).
    // pair (r, d..d+1) of row r (sub-block I, row rr of it)
    auto scale_pair = [&](const int r, const int rr, const int d, const int I) {
        const float2 q2 = ld_bf16x2(Qr + r * LDB + d), k2 = ld_bf16x2(Kr + r * LDB + d);
        const float q[2] = {q2.x * rq[r], q2.y * rq[r]}, k[2] = {k2.x * rk[r], k2.y * rk[r]};
        float qa[2], ka[2], kx[2], qg[2], kd[2], kb[NUM_SUB][2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float lam = Gf[r * LDF + d + e], tail = Gf[(I * SUB + SUB - 1) * LDF + d + e] - lam;
            const float el = EXP2_ELEM(lam), et = EXP2_ELEM(tail);  // both <= 1, as every table entry
            qa[e] = q[e] * el, ka[e] = k[e] * el;
            kx[e] = k[e] * EXP2_ELEM(fminf(-lam, DIAG_SPAN + 4.f));  // read only when block I is safe
            qg[e] = q[e] * (Pt[I * K + d + e] * el);
            kd[e] = k[e] * (et * Rt[I * K + d + e]);
#pragma unroll
            for (int I2 = 1; I2 < NUM_SUB; ++I2)
                kb[I2][e] = I2 > I ? k[e] * (et * Ct[cross_index(I2, I) * K + d + e]) : 0.f;
        }
        st_bf16x2(QA + r * LDB + d, qa[0], qa[1]);
        st_bf16x2(KA + r * LDB + d, ka[0], ka[1]);
        st_bf16x2(KX + (pair_index(I, I) * SUB + rr) * LDB + d, kx[0], kx[1]);
#pragma unroll
        for (int I2 = 1; I2 < NUM_SUB; ++I2)
            if (I2 > I) st_bf16x2(KX + (pair_index(I2, I) * SUB + rr) * LDB + d, kb[I2][0], kb[I2][1]);
        st_bf16x2(ws_q + (tile * L + r) * K + d, qg[0], qg[1]);
        st_bf16x2(ws_k + (tile * L + r) * K + d, kd[0], kd[1]);
#if QUAD_SPLIT
        if (unsafe[I]) {  // the quadrant's factors around row 8 of the sub-block (both exponents <= 0)
            bf16* Qd = Quad + I * QUAD_ROWS * LDB;
            float e[2];
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const float diff = Gf[r * LDF + d + c] - Gf[(I * SUB + 8) * LDF + d + c];
                e[c] = EXP2_ELEM(rr >= 8 ? fminf(diff, 0.f) : fminf(-diff, 0.f));
            }
            if (rr >= 8) {
                st_bf16x2(Qd + (rr - 8) * LDB + d, k[0] * e[0], k[1] * e[1]);
                st_bf16x2(Qd + rr * LDB + d, q[0] * e[0], q[1] * e[1]);
            } else {
                st_bf16x2(Qd + (16 + rr) * LDB + d, k[0] * e[0], k[1] * e[1]);
            }
        }
#endif
    };
#if SCALE_UNROLL
    {  // the thread's column pair fixed, rows r8 + RPP j: the sub-block, its table rows and stores known at compile time
        constexpr int RPP = INTRA_THREADS / (K / 2);  // rows a pass
        static_assert(INTRA_THREADS % (K / 2) == 0 && SUB % RPP == 0 && L % RPP == 0, "kda_prefill_intra: (c)'s row passes");
        const int r8 = tid / (K / 2), d = 2 * (tid % (K / 2));
#pragma unroll
        for (int j = 0; j < L / RPP; ++j) scale_pair(r8 + RPP * j, r8 + (RPP * j) % SUB, d, RPP * j / SUB);
    }
#else
    for (int idx = tid; idx < L * K / 2; idx += INTRA_THREADS) {
        const int r = idx / (K / 2), d = 2 * (idx % (K / 2)), I = r / SUB;
        scale_pair(r, r % SUB, d, I);
    }
#endif
    __syncthreads();
    STAMP(5);

    // ---- (d) A_qk and beta A_kk, 16 x 16 sub-block pairs (I, J <= I) on tensor cores: 2 products x
    // NUM_PAIRS tasks over the warps; a diagonal pair of an unsafe sub-block is left to (e) (QUAD_SPLIT: but for its
    // lower-left quadrant, both products in one task here)
    // ---- (e) unsafe diagonal sub-blocks in fp32 from the raw tiles; the diagonal (E = 1) from the row's q.k of (b).
    // QUAD_SPLIT = 0: per element, pair (r > s) per thread (480 pairs: one round of the 512 threads).  QUAD_SPLIT:
    // only the pairs inside the two 8 x 8 halves (4 x 56 pairs): by row scans, a warp a half and product (E_SCAN,
    // below), or (E_SCAN = 0) per element, each pair over two threads (half the channels each, adjacent lanes summed
    // by a shuffle): 448 threads (14 warps' parts), one round of half the length.  (d) and (e) write disjoint
    // elements and read only what (c) left: one phase.
    {
        const int g = lane >> 2, t = lane & 3;
        auto d_task = [&](const int task) {
            const bool kk = task >= NUM_PAIRS;
            const int p = kk ? task - NUM_PAIRS : task;
            int I = 0;
            while (pair_index(I + 1, 0) <= p) ++I;
            const int J = p - pair_index(I, 0);
            if (J == I && unsafe[I]) {
#if QUAD_SPLIT
                if (kk) return;  // the A_qk task computes both: rows 0-7 of its product are A_kk's, rows 8-15 A_qk's
                const bf16* Qd = Quad + I * QUAD_ROWS * LDB;
                float acc[4] = {};
#pragma unroll
                for (int ks = 0; ks < K / 16; ++ks) {
                    unsigned a[4], b[2];
                    frag_a(a, Qd + ks * 16, LDB);
                    // B: rows 16-23 (n = S), k contiguous; ldmatrix x2 (lanes 0-7: k 0-7, lanes 8-15: k 8-15)
                    const bf16* bp = Qd + (16 + (lane & 7)) * LDB + ks * 16 + ((lane >> 3) & 1) * 8;
                    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                                 : "=r"(b[0]), "=r"(b[1]) : "r"(smem_addr(bp)));
                    mma_bf16(acc, a, b[0], b[1]);
                }
                const int R = I * SUB + 8 + g, S = I * SUB + 2 * t;  // acc[0, 1]: A_kk (R, S, S + 1); acc[2, 3]: A_qk
                Akk[R * LDT + S] = Bs[R] * acc[0], Akk[R * LDT + S + 1] = Bs[R] * acc[1];
                st_bf16x2(ws_a + (tile * L + R) * L + S, acc[2], acc[3]);
                ws_a[(tile * L + S) * L + R] = to_bf16(0.f);  // the upper-right quadrant of the diagonal block
                ws_a[(tile * L + S + 1) * L + R] = to_bf16(0.f);
#endif
                return;
            }
            float acc[2][4] = {};
            const bf16* A = (kk ? KA : QA) + I * SUB * LDB;
            const bf16* Bt = KX + p * SUB * LDB;
#pragma unroll
            for (int ks = 0; ks < K / 16; ++ks) {
                unsigned a[4], bb[4];
                frag_a(a, A + ks * 16, LDB);
                frag_b_nk(bb, Bt + ks * 16, LDB);
                mma_bf16(acc[0], a, bb[0], bb[1]);
                mma_bf16(acc[1], a, bb[2], bb[3]);
            }
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int rl = g + 8 * hh, sl = 8 * nt + 2 * t, R = I * SUB + rl, S = J * SUB + sl;
                    float v0 = acc[nt][2 * hh], v1 = acc[nt][2 * hh + 1];
                    if (!kk) {
                        if (J == I) v0 = sl <= rl ? v0 : 0.f, v1 = sl + 1 <= rl ? v1 : 0.f;
                        st_bf16x2(ws_a + (tile * L + R) * L + S, v0, v1);
                    } else {
                        if (J == I) v0 = sl < rl ? v0 : 0.f, v1 = sl + 1 < rl ? v1 : 0.f;
                        Akk[R * LDT + S] = Bs[R] * v0, Akk[R * LDT + S + 1] = Bs[R] * v1;
                    }
                }
            }
        };
#if QUAD_SPLIT && E_SCAN
        // (e) by scans: warp w takes the 8 x 8 half (w >> 1) & 1 of sub-block w >> 2, its A_qk (w even) or its A_kk (w
        // odd), each lane four channels.  Row r = 1 .. 7 of the half in turn: each earlier row s's k carried as
        // k_s 2^(Lam_r - Lam_s), one factor 2^(Lam_r - Lam_(r-1)) <= 1 a channel and row multiplying them all (7
        // exponentials a channel and warp; the products underflow to 0 where the exponent sums do), then
        // the pairs (r, s < r) as the lane's 4-channel dot products; the 28 pairs' sums over the lanes by a
        // reduce-scatter (28 shuffles), lane j (j mod 8 < 7) ending with pair 14 (j >> 4 & 1) + 7 (j >> 3 & 1) + j mod 8.
        static_assert(INTRA_WARPS == 4 * NUM_SUB && K == 4 * 32, "kda_prefill_intra: E_SCAN's warp and lane maps");
        auto e_scan = [&](const int w) {
            const int I = w >> 2, r0 = I * SUB + 8 * ((w >> 1) & 1), d = 4 * lane;
            const bool kk = w & 1;
            if (!unsafe[I]) return;  // warp-uniform
            float acc[28], y[7][4], lam[4];
            {
                const float4 k0 = ld_bf16x4(Kr + r0 * LDB + d), g0 = *reinterpret_cast<const float4*>(Gf + r0 * LDF + d);
                y[0][0] = k0.x, y[0][1] = k0.y, y[0][2] = k0.z, y[0][3] = k0.w;
                lam[0] = g0.x, lam[1] = g0.y, lam[2] = g0.z, lam[3] = g0.w;
            }
#pragma unroll
            for (int r = 1; r < 8; ++r) {
                const float4 g4 = *reinterpret_cast<const float4*>(Gf + (r0 + r) * LDF + d);
                const float4 x4 = ld_bf16x4((kk ? Kr : Qr) + (r0 + r) * LDB + d);
                const float gr[4] = {g4.x, g4.y, g4.z, g4.w}, xr[4] = {x4.x, x4.y, x4.z, x4.w};
                float a[4];
#pragma unroll
                for (int c = 0; c < 4; ++c) a[c] = EXP2_ELEM(fminf(gr[c] - lam[c], 0.f)), lam[c] = gr[c];
#pragma unroll
                for (int s = 0; s < r; ++s) {
#pragma unroll
                    for (int c = 0; c < 4; ++c) y[s][c] *= a[c];
                    acc[r * (r - 1) / 2 + s] = fmaf(xr[0], y[s][0], fmaf(xr[1], y[s][1], fmaf(xr[2], y[s][2], xr[3] * y[s][3])));
                }
                if (r < 7) {
                    const float4 k4 = ld_bf16x4(Kr + (r0 + r) * LDB + d);
                    y[r][0] = k4.x, y[r][1] = k4.y, y[r][2] = k4.z, y[r][3] = k4.w;
                }
            }
            halve_sums<14>(acc, 16, lane), halve_sums<7>(acc, 8, lane);
            acc[7] = 0.f;  // 7 sums over 8 slots
            halve_sums<4>(acc, 4, lane), halve_sums<2>(acc, 2, lane), halve_sums<1>(acc, 1, lane);
            if ((lane & 7) == 7) return;
            const int p = 14 * ((lane >> 4) & 1) + 7 * ((lane >> 3) & 1) + (lane & 7);
            int rl = 1;
            while (rl * (rl + 1) / 2 <= p) ++rl;
            const int R = r0 + rl, S = r0 + p - rl * (rl - 1) / 2;
            if (kk) {
                Akk[R * LDT + S] = acc[0] * Bs[R] * rk[R] * rk[S];
            } else {
                ws_a[(tile * L + R) * L + S] = to_bf16(acc[0] * rq[R] * rk[S]);
                ws_a[(tile * L + S) * L + R] = to_bf16(0.f);  // upper triangle of the diagonal block
            }
        };
#elif QUAD_SPLIT
        constexpr int E_THREADS = NUM_SUB * 2 * 28 * 2;
        static_assert(E_THREADS <= INTRA_THREADS && E_THREADS % 32 == 0,
                      "kda_prefill_intra: the halves' pairs take whole warps of one round");
        // (e)'s thread vt < E_THREADS (called by whole warps: the pair's two lanes meet at a shuffle)
        auto e_part = [&](const int vt) {
            const int dh = vt & 1, pi = vt >> 1, I = pi / 56, half = (pi / 28) % 2, p = pi % 28;
            const bool act = unsafe[I];  // (no early exit: both lanes of a pair meet at the shuffle)
            int rl = 1;
            while (rl * (rl + 1) / 2 <= p) ++rl;
            const int sl = p - rl * (rl - 1) / 2, R = I * SUB + 8 * half + rl, S = I * SUB + 8 * half + sl;
            float aqk = 0.f, akk = 0.f;
            if (act) {
                for (int d = dh * (K / 2); d < (dh + 1) * (K / 2); d += 2) {
                    const float2 q2 = ld_bf16x2(Qr + R * LDB + d), kr2 = ld_bf16x2(Kr + R * LDB + d), ks2 = ld_bf16x2(Kr + S * LDB + d);
                    const float e0 = EXP2_ELEM(fminf(Gf[R * LDF + d] - Gf[S * LDF + d], 0.f));
                    const float e1 = EXP2_ELEM(fminf(Gf[R * LDF + d + 1] - Gf[S * LDF + d + 1], 0.f));
                    aqk = fmaf(q2.x * ks2.x, e0, fmaf(q2.y * ks2.y, e1, aqk));
                    akk = fmaf(kr2.x * ks2.x, e0, fmaf(kr2.y * ks2.y, e1, akk));
                }
            }
            aqk += __shfl_xor_sync(0xffffffffu, aqk, 1);
            akk += __shfl_xor_sync(0xffffffffu, akk, 1);
            if (act && dh == 0) {
                ws_a[(tile * L + R) * L + S] = to_bf16(aqk * rq[R] * rk[S]);
                Akk[R * LDT + S] = akk * Bs[R] * rk[R] * rk[S];
                ws_a[(tile * L + S) * L + R] = to_bf16(0.f);  // upper triangle of the diagonal block
            }
        };
#endif
        for (int task = warp; task < 2 * NUM_PAIRS; task += INTRA_THREADS / 32) d_task(task);
#if QUAD_SPLIT && E_SCAN
        e_scan(warp);
#elif QUAD_SPLIT
        if (tid < E_THREADS) e_part(tid);
#endif
    }
#if !QUAD_SPLIT
    for (int idx = tid; idx < NUM_SUB * (SUB * (SUB - 1) / 2); idx += INTRA_THREADS) {
        const int I = idx / (SUB * (SUB - 1) / 2);
        if (!unsafe[I]) continue;
        const int p = idx % (SUB * (SUB - 1) / 2);
        int rl = 1;
        while (rl * (rl + 1) / 2 <= p) ++rl;
        const int sl = p - rl * (rl - 1) / 2, R = I * SUB + rl, S = I * SUB + sl;
        float aqk = 0.f, akk = 0.f;
        for (int d = 0; d < K; d += 2) {
            const float2 q2 = ld_bf16x2(Qr + R * LDB + d), kr2 = ld_bf16x2(Kr + R * LDB + d), ks2 = ld_bf16x2(Kr + S * LDB + d);
            const float e0 = EXP2_ELEM(fminf(Gf[R * LDF + d] - Gf[S * LDF + d], 0.f));
            const float e1 = EXP2_ELEM(fminf(Gf[R * LDF + d + 1] - Gf[S * LDF + d + 1], 0.f));
            aqk = fmaf(q2.x * ks2.x, e0, fmaf(q2.y * ks2.y, e1, aqk));
            akk = fmaf(kr2.x * ks2.x, e0, fmaf(kr2.y * ks2.y, e1, akk));
        }
        ws_a[(tile * L + R) * L + S] = to_bf16(aqk * rq[R] * rk[S]);
        Akk[R * LDT + S] = akk * Bs[R] * rk[R] * rk[S];
        ws_a[(tile * L + S) * L + R] = to_bf16(0.f);  // upper triangle of the diagonal block
    }
#endif
    if (tid < L && unsafe[tid / SUB]) {
        ws_a[(tile * L + tid) * L + tid] = to_bf16(dqk[tid] * rq[tid] * rk[tid]);
        Akk[tid * LDT + tid] = 0.f;
    }
    __syncthreads();
    STAMP(6);

    // ---- (f) T = (I + A_kk)^-1.  Diagonal blocks: thread (I, column c) < 64 by forward substitution;
    // meanwhile the others build W's right-hand side e^G k^ (bf16) over the raw q tile.
    if (tid < L) {
        const int I = tid / SUB, c = tid % SUB;
        const float* A = Akk + I * SUB * LDT + I * SUB;
        float x[SUB];
#pragma unroll
        for (int i = 0; i < SUB; ++i) x[i] = i == c ? 1.f : 0.f;
#pragma unroll
        for (int i = 1; i < SUB; ++i) {
            float acc = 0.f;
#pragma unroll
            for (int j = 0; j < i; ++j) acc = fmaf(A[i * LDT + j], x[j], acc);
            x[i] = i > c ? -acc : x[i];
        }
#pragma unroll
        for (int i = 0; i < SUB; ++i) Tm[(I * SUB + i) * LDT + I * SUB + c] = x[i];
#if T_HALVES
        const float bs = Bs[I * SUB + c];  // x[i] = +0 above the diagonal: the same bits as the pass's 0
#pragma unroll
        for (int i = 0; i < SUB; ++i) Tb[(I * SUB + i) * LDA + I * SUB + c] = to_bf16(x[i] * bs);
#endif
    } else {
        for (int idx = tid - L; idx < L * K / 2; idx += INTRA_THREADS - L) {
            const int r = idx / (K / 2), d = 2 * (idx % (K / 2)), I = r / SUB;
            const float2 k2 = ld_bf16x2(Kr + r * LDB + d);
            const float e0 = Pt[I * K + d] * EXP2_ELEM(Gf[r * LDF + d]);
            const float e1 = Pt[I * K + d + 1] * EXP2_ELEM(Gf[r * LDF + d + 1]);
            st_bf16x2(KG + r * LDB + d, k2.x * rk[r] * e0, k2.y * rk[r] * e1);
        }
    }
    __syncthreads();
    STAMP(7);
    static_assert(T_ROWS == 1 || T_ROWS == 2 || T_ROWS == 4, "kda_prefill_intra: T_ROWS is 1, 2 or 4");
#if T_HALVES
    // T's off-diagonal blocks by halves: level 1, T_10 (hf 0) and T_32 (hf 1): X = A_IJ D_J into Xs block hf, then
    // T_IJ = -D_I X; level 2, Y = A_BA T_AA (A rows 32-63, columns 0-31; T_AA = [D_0 0; T_10 D_1]) into T's upper
    // blocks (Y_M,J at rows (M - 2) 16, columns (2 + J) 16), then T_BA = -T_BB Y (T_2J = -D_2 Y_2J, T_3J = -[T_32 D_3]
    // [Y_2J; Y_3J]); each T_IJ written into T and, as bf16, into T diag(beta) (whose upper blocks (g) never reads).
    {  // T_ROWS rows a thread (rr + RS i), 2 x 16 x RS threads, the rest idle
        static_assert(NUM_SUB == 4 && SUB % T_ROWS == 0, "kda_prefill_intra: T_ROWS's map");
        constexpr int R = T_ROWS, RS = SUB / R, TPP = SUB * RS;  // threads a product
        const bool on = tid < 2 * TPP;
        const int hf = (tid / TPP) & 1, e = tid % TPP, rr = e / SUB, cc = e % SUB;
        auto put = [&](int R_, int S, float v) { Tm[R_ * LDT + S] = v, Tb[R_ * LDA + S] = to_bf16(v * Bs[S]); };
        const int I1 = hf ? 3 : 1, J1 = I1 - 1;
        if (on) {  // level 1: X = A_IJ D_J
            float acc[R][2] = {};
            dot16_rows<R>(Akk + (I1 * SUB + rr) * LDT + J1 * SUB, RS * LDT, Tm + (J1 * SUB) * LDT + J1 * SUB + cc, LDT, acc);
#pragma unroll
            for (int i = 0; i < R; ++i) Xs[(hf * SUB + rr + RS * i) * SUB + cc] = acc[i][0] + acc[i][1];
        }
        __syncthreads();
        if (on) {  // T_IJ = -D_I X (D_I lower: k > row reads 0)
            float acc[R][2] = {};
            dot16_rows<R>(Tm + (I1 * SUB + rr) * LDT + I1 * SUB, RS * LDT, Xs + hf * SUB * SUB + cc, SUB, acc);
#pragma unroll
            for (int i = 0; i < R; ++i) put(I1 * SUB + rr + RS * i, J1 * SUB + cc, -(acc[i][0] + acc[i][1]));
        }
        __syncthreads();
        if (on) {  // level 2: Y = A_BA T_AA into T's upper blocks
            const float* a = Akk + ((2 + hf) * SUB + rr) * LDT;
            float y0[R][2] = {}, y1[R][2] = {};
            dot16_rows<R>(a, RS * LDT, Tm + cc, LDT, y0);                          // D_0
            dot16_rows<R>(a + SUB, RS * LDT, Tm + SUB * LDT + cc, LDT, y0);        // T_10
            dot16_rows<R>(a + SUB, RS * LDT, Tm + SUB * LDT + SUB + cc, LDT, y1);  // D_1
#pragma unroll
            for (int i = 0; i < R; ++i) {
                Tm[(hf * SUB + rr + RS * i) * LDT + 2 * SUB + cc] = y0[i][0] + y0[i][1];
                Tm[(hf * SUB + rr + RS * i) * LDT + 3 * SUB + cc] = y1[i][0] + y1[i][1];
            }
        }
        __syncthreads();
        if (on) {  // T_BA = -T_BB Y
            const float* y = Tm + (2 + hf) * SUB + cc;
            float u[R][2] = {}, w[R][2] = {};
            dot16_rows<R>(Tm + (2 * SUB + rr) * LDT + 2 * SUB, RS * LDT, y, LDT, u);  // D_2 (lower)
            dot16_rows<R>(Tm + (3 * SUB + rr) * LDT + 2 * SUB, RS * LDT, y, LDT, w);  // T_32
            dot16_rows<R>(Tm + (3 * SUB + rr) * LDT + 3 * SUB, RS * LDT, y + SUB * LDT, LDT, w);  // D_3
#pragma unroll
            for (int i = 0; i < R; ++i) {
                put(2 * SUB + rr + RS * i, hf * SUB + cc, -(u[i][0] + u[i][1]));
                put(3 * SUB + rr + RS * i, hf * SUB + cc, -(w[i][0] + w[i][1]));
            }
        }
        __syncthreads();
    }
    STAMP(8);
    STAMP(9);
#else
    // off-diagonal blocks, one block row I at a time: X_J = sum_{J <= M < I} A_IM T_MJ, T_IJ = -D_I X_J;
    // element (rr, cc) of a 16 x 16 block per thread, J = 0 on the first 256 threads and J >= 1 on the
    // others (the same FMA count for the last block row)
    {
        const int hf = tid / (SUB * SUB), rr = (tid / SUB) % SUB, cc = tid % SUB;
#pragma unroll 1
        for (int I = 1; I < NUM_SUB; ++I) {
            const int jlo = hf == 0 ? 0 : 1, jhi = hf == 0 ? 1 : I;
            // A rows as 16-byte loads (broadcast across the 16 threads of a row), two accumulators (even and
            // odd k) to halve the FMA chain
            for (int J = jlo; J < jhi; ++J) {
                float acc0 = 0.f, acc1 = 0.f;
                for (int M = J; M < I; ++M)
                    dot16(reinterpret_cast<const float4*>(Akk + (I * SUB + rr) * LDT + M * SUB),
                          Tm + (M * SUB) * LDT + J * SUB + cc, LDT, acc0, acc1);
                Xs[(J * SUB + rr) * SUB + cc] = acc0 + acc1;
            }
            __syncthreads();
            for (int J = jlo; J < jhi; ++J) {
                float acc0 = 0.f, acc1 = 0.f;  // D_I lower: k > rr reads 0
                dot16(reinterpret_cast<const float4*>(Tm + (I * SUB + rr) * LDT + I * SUB), Xs + J * SUB * SUB + cc,
                      SUB, acc0, acc1);
                Tm[(I * SUB + rr) * LDT + J * SUB + cc] = -(acc0 + acc1);
            }
            __syncthreads();
        }
    }
    STAMP(8);
    // T diag(beta) -> bf16, zero above the diagonal
    for (int idx = tid; idx < L * L; idx += INTRA_THREADS) {
        const int r = idx / L, s = idx % L;
        Tb[r * LDA + s] = to_bf16(s <= r ? Tm[r * LDT + s] * Bs[s] : 0.f);
    }
    __syncthreads();
    STAMP(9);
#endif

    // ---- (g) W = T diag(beta) e^G k^,  U = T diag(beta) v: warp -> rows 16 mt, columns GC nh ..
    // the pairs (r, c .. c + 1) of W and U: to the workspace, or (G_STAGED) to rows LDB apart over the dead QA and fp32
    // T tiles (4-byte stores on distinct banks), copied out below in 16-byte pieces
#if G_STAGED
    bf16 *Wst = QA, *Ust = (bf16*)(sm + IN_KA);
    auto put_wu = [&](const int r, const int c, const float* w, const float* u) {
        st_bf16x2(Wst + r * LDB + c, w[0], w[1]);
        st_bf16x2(Ust + r * LDB + c, u[0], u[1]);
    };
#else
    auto put_wu = [&](const int r, const int c, const float* w, const float* u) {
        const size_t o = (tile * L + r) * K + c;
        st_bf16x2(ws_w + o, w[0], w[1]);
        st_bf16x2(ws_u + o, u[0], u[1]);
    };
#endif
#if G_BALANCE
    // warp -> the row blocks p and 3 - p (p = warp & 1: 1 + 4 or 2 + 3 k steps of the lower-triangular T), columns
    // 16 cg .. 16 cg + 15 (cg = warp >> 1)
    {
        static_assert(INTRA_WARPS == 16 && K == 128 && NUM_SUB == 4, "kda_prefill_intra: G_BALANCE's map");
        const int p = warp & 1, cg = warp >> 1, g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int which = 0; which < 2; ++which) {
            const int mt = which ? 3 - p : p;
            float accw[2][4] = {}, accu[2][4] = {};
            for (int ks = 0; ks <= mt; ++ks) {
                unsigned a[4], bw[4], bu[4];
                frag_a(a, Tb + mt * 16 * LDA + ks * 16, LDA);
                frag_b_kn(bw, KG + ks * 16 * LDB + cg * 16, LDB);
                frag_b_kn(bu, Vr + ks * 16 * LDB + cg * 16, LDB);
                mma_bf16(accw[0], a, bw[0], bw[1]);
                mma_bf16(accw[1], a, bw[2], bw[3]);
                mma_bf16(accu[0], a, bu[0], bu[1]);
                mma_bf16(accu[1], a, bu[2], bu[3]);
            }
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    put_wu(mt * 16 + g + 8 * hh, cg * 16 + nt * 8 + 2 * t, accw[nt] + 2 * hh, accu[nt] + 2 * hh);
                }
            }
        }
    }
#else
    {
        constexpr int GC = K / (INTRA_WARPS / 4), GT = GC / 8;
        const int mt = warp & 3, nh = warp >> 2, g = lane >> 2, t = lane & 3;
        float accw[GT][4] = {}, accu[GT][4] = {};
        for (int ks = 0; ks <= mt; ++ks) {
            unsigned a[4];
            frag_a(a, Tb + mt * 16 * LDA + ks * 16, LDA);
#pragma unroll
            for (int np = 0; np < GT / 2; ++np) {
                unsigned bw[4], bu[4];
                frag_b_kn(bw, KG + ks * 16 * LDB + nh * GC + np * 16, LDB);
                frag_b_kn(bu, Vr + ks * 16 * LDB + nh * GC + np * 16, LDB);
                mma_bf16(accw[2 * np], a, bw[0], bw[1]);
                mma_bf16(accw[2 * np + 1], a, bw[2], bw[3]);
                mma_bf16(accu[2 * np], a, bu[0], bu[1]);
                mma_bf16(accu[2 * np + 1], a, bu[2], bu[3]);
            }
        }
#pragma unroll
        for (int nt = 0; nt < GT; ++nt) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                put_wu(mt * 16 + g + 8 * hh, nh * GC + nt * 8 + 2 * t, accw[nt] + 2 * hh, accu[nt] + 2 * hh);
            }
        }
    }
#endif
#if G_STAGED
    __syncthreads();
    constexpr int PIECES = K / 8;  // 16-byte pieces of a row
#pragma unroll
    for (int i = tid; i < 2 * L * PIECES; i += INTRA_THREADS) {
        const int u = i / (L * PIECES), r = (i / PIECES) % L, c = (i % PIECES) * 8;
        const uint4 v = *reinterpret_cast<const uint4*>((u ? Ust : Wst) + r * LDB + c);
        *reinterpret_cast<uint4*>((u ? ws_u : ws_w) + (tile * L + r) * K + c) = v;
    }
#endif
    STAMP(10);
}

// dynamic shared memory plan of kda_prefill_state, bytes.  STATE_PF (the launcher's rule, ops/kda_prefill.py) picks how
// far ahead a chunk's tiles stream in: 0 (one buffer each: W, qg, U after phase (1) of the chunk before, A_qk and kd
// after its phase (3)), 1 (A_qk and kd in two buffers, requested a whole chunk ahead), 2 (every tile in two buffers,
// all requested a whole chunk ahead)
#ifndef STATE_PF
#define STATE_PF 0
#endif
#if STATE_PF < 0 || STATE_PF > 2
#error "kda_prefill.cu: STATE_PF must be 0, 1 or 2"
#endif
#define NB_WQU (STATE_PF == 2 ? 2 : 1)        // buffers of W, qg, U
#define NB_AK (STATE_PF >= 1 ? 2 : 1)         // buffers of A_qk, kd
#define ST_W 0                                // W [NB_WQU][L][LDB]
#define ST_Q (ST_W + NB_WQU * L * LDB * 2)    // qg [NB_WQU][L][LDB]
#define ST_U (ST_Q + NB_WQU * L * LDB * 2)    // U[:, vb] [NB_WQU][L][LDV]
#define ST_K (ST_U + NB_WQU * L * LDV * 2)    // kd [NB_AK][L][LDB]
#define ST_A (ST_K + NB_AK * L * LDB * 2)     // A_qk [NB_AK][L][LDA]
#define ST_S (ST_A + NB_AK * L * LDA * 2)     // bf16 copy of S[:, vb] [K][LDV]
#define ST_V (ST_S + K * LDV * 2)             // V_new[:, vb] [L][LDV]
#define STATE_SMEM (ST_V + L * LDV * 2)

extern "C" __global__ void __launch_bounds__(32 * STATE_WARPS) kda_prefill_state(
    const bf16* __restrict__ ws_q, const bf16* __restrict__ ws_k, const bf16* __restrict__ ws_w,
    const bf16* __restrict__ ws_u, const bf16* __restrict__ ws_a, const float* __restrict__ ws_g,
    const bf16* __restrict__ qkv, bf16* __restrict__ conv_pool, float* __restrict__ rec_pool,
    const int* __restrict__ cu_seqlens, const int* __restrict__ context_lens, const int* __restrict__ state_slots,
    bf16* __restrict__ out, int num_heads, const int* __restrict__ snap) {
    KDA_PDL_ENTRY();
    constexpr int THREADS = 32 * STATE_WARPS, NT = WN / 8;
    extern __shared__ float4 smem4[];
    char* sm = reinterpret_cast<char*>(smem4);
    bf16 *Ws0 = (bf16*)(sm + ST_W), *Qs0 = (bf16*)(sm + ST_Q), *Us0 = (bf16*)(sm + ST_U), *Ks0 = (bf16*)(sm + ST_K);
    bf16 *As0 = (bf16*)(sm + ST_A), *Sb = (bf16*)(sm + ST_S), *Vn = (bf16*)(sm + ST_V);
    const int vb = blockIdx.x, h = blockIdx.y, seq = blockIdx.z, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, wr = warp & 3, wc = warp >> 2, g = lane >> 2, t = lane & 3;
    const int P = num_heads * K, col0 = vb * VB;  // first state column of this CTA
    const int start = cu_seqlens[seq], len = cu_seqlens[seq + 1] - start;
    const bool fresh = context_lens[seq] == 0;
    const size_t slot = (size_t)state_slots[seq];
    const int base = chunk_base(cu_seqlens, seq), num_chunks = (len + L - 1) / L;
    // a snapshot (prefix cache; snap [B, 2] or null): the state after the first snap_len tokens of this step (a
    // multiple of L in [L, len); -1 chunks: none) also goes to slot snap_slot, conv history included
    const int snap_chunk = snap != nullptr && snap[2 * seq] > 0 ? snap[2 * seq] / L : -1;
    const size_t snap_slot = snap_chunk > 0 ? (size_t)snap[2 * seq + 1] : 0;

    // ---- conv state <- the last W-1 raw inputs (old history for sequences shorter than W-1); the
    // intra kernel has read the old history already.  Entry j reads old entry len + j > j, so
    // ascending j never reads what it already replaced.
    if (vb == 0) {
        for (int idx = tid; idx < 3 * K; idx += THREADS) {
            const int i = idx / K, ch = h * K + idx % K;
            bf16* hist = conv_pool + (slot * 3 + i) * (CONV_W - 1) * P + ch;
#pragma unroll
            for (int j = 0; j < CONV_W - 1; ++j) {
                const int p = len - (CONV_W - 1) + j;
                hist[(size_t)j * P] = p >= 0 ? qkv[(size_t)(start + p) * 3 * P + i * P + ch]
                                    : fresh  ? to_bf16(0.f)
                                             : hist[(size_t)(len + j) * P];
            }
            if (snap_chunk > 0) {  // (snap_len >= L > W-1: its history is this step's inputs alone)
                bf16* shist = conv_pool + (snap_slot * 3 + i) * (CONV_W - 1) * P + ch;
#pragma unroll
                for (int j = 0; j < CONV_W - 1; ++j)
                    shist[(size_t)j * P] = qkv[(size_t)(start + snap_chunk * L - (CONV_W - 1) + j) * 3 * P + i * P + ch];
            }
        }
    }

    // chunk c's W, qg, U into buffer buf (of NB_WQU), its A_qk, kd into buffer buf (of NB_AK); the caller commits
    auto load_wqu = [&](int c, int buf) {
        const size_t tl = (size_t)c * num_heads + h;
        tile_async<L, K, THREADS>(Ws0 + buf * L * LDB, LDB, ws_w + tl * L * K, K);
        tile_async<L, K, THREADS>(Qs0 + buf * L * LDB, LDB, ws_q + tl * L * K, K);
        tile_async<L, VB, THREADS>(Us0 + buf * L * LDV, LDV, ws_u + tl * L * K + col0, K);
    };
    auto load_ak = [&](int c, int buf) {
        const size_t tl = (size_t)c * num_heads + h;
        tile_async<L, L, THREADS>(As0 + buf * L * LDA, LDA, ws_a + tl * L * L, L);
        tile_async<L, K, THREADS>(Ks0 + buf * L * LDB, LDB, ws_k + tl * L * K, K);
    };
    if (num_chunks > 0) load_wqu(base, 0), load_ak(base, 0), cp_async_commit();

    // ---- state S[32 wr + 16 mt + g (+8), col0 + WN wc + 8 nt + 2t (+1)] in mma accumulators
    float* state = rec_pool + (slot * num_heads + h) * K * K;
    float st[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int d = 32 * wr + 16 * mt + g + 8 * (e >> 1), v = col0 + WN * wc + 8 * nt + 2 * t + (e & 1);
                st[mt][nt][e] = fresh ? 0.f : state[d * K + v];
            }
    auto store_sb = [&]() {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh)
                    st_bf16x2(Sb + (32 * wr + 16 * mt + g + 8 * hh) * LDV + WN * wc + 8 * nt + 2 * t,
                              st[mt][nt][2 * hh], st[mt][nt][2 * hh + 1]);
    };
    store_sb();
    auto store_state = [&](float* dst) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int d = 32 * wr + 16 * mt + g + 8 * hh, v = col0 + WN * wc + 8 * nt + 2 * t;
                    *reinterpret_cast<float2*>(dst + d * K + v) = make_float2(st[mt][nt][2 * hh], st[mt][nt][2 * hh + 1]);
                }
    };

#pragma unroll 1
    for (int j = 0; j < num_chunks; ++j) {
        const int c = base + j, c0 = j * L, n = min(L, len - c0);
        const int bw = STATE_PF == 2 ? j & 1 : 0, ba = STATE_PF >= 1 ? j & 1 : 0;  // this chunk's buffers
        const bf16 *Ws = Ws0 + bw * L * LDB, *Qs = Qs0 + bw * L * LDB, *Us = Us0 + bw * L * LDV;
        const bf16 *Ks = Ks0 + ba * L * LDB, *As = As0 + ba * L * LDA;
        float decay[2][2];  // e^G_last of this thread's state rows
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
                decay[mt][hh] = exp2f(ws_g[((size_t)c * num_heads + h) * K + 32 * wr + 16 * mt + g + 8 * hh]);
        cp_async_wait<0>();  // this chunk's tiles (every group in flight is this chunk's)
        __syncthreads();
        // STATE_PF >= 1: the next chunk's tiles whose other buffer is free now (its readers, the chunk before, are past
        // the barrier above) stream in during this whole chunk
        if (STATE_PF >= 1 && j + 1 < num_chunks) {
            if (STATE_PF == 2) load_wqu(c + 1, bw ^ 1);
            load_ak(c + 1, ba ^ 1);
            cp_async_commit();
        }

        // ---- (1) V_new = U - W S and O = qg S for rows 16 wr .., columns WN wc ..
        float accv[NT][4] = {}, acco[NT][4] = {};
#pragma unroll
        for (int ks = 0; ks < K / 16; ++ks) {
            unsigned aw[4], aq[4];
            frag_a(aw, Ws + wr * 16 * LDB + ks * 16, LDB);
            frag_a(aq, Qs + wr * 16 * LDB + ks * 16, LDB);
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                unsigned bs[4];
                frag_b_kn(bs, Sb + ks * 16 * LDV + WN * wc + 16 * np, LDV);
                mma_bf16(accv[2 * np], aw, bs[0], bs[1]);
                mma_bf16(accv[2 * np + 1], aw, bs[2], bs[3]);
                mma_bf16(acco[2 * np], aq, bs[0], bs[1]);
                mma_bf16(acco[2 * np + 1], aq, bs[2], bs[3]);
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int r = wr * 16 + g + 8 * hh, cl = WN * wc + 8 * nt + 2 * t;
                const float2 u = ld_bf16x2(Us + r * LDV + cl);
                accv[nt][2 * hh] = u.x - accv[nt][2 * hh], accv[nt][2 * hh + 1] = u.y - accv[nt][2 * hh + 1];
            }
        // V_new's readers of the chunk before (phases (2), (3)) are past this chunk's first barrier
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
                st_bf16x2(Vn + (wr * 16 + g + 8 * hh) * LDV + WN * wc + 8 * nt + 2 * t, accv[nt][2 * hh], accv[nt][2 * hh + 1]);
        __syncthreads();  // V_new is whole; W, qg, U and S are consumed (STATE_PF < 2: the next W, qg, U may stream in)
        if (STATE_PF < 2 && j + 1 < num_chunks) load_wqu(c + 1, 0), cp_async_commit();

        // ---- (2) O += A_qk V_new (A_qk lower: column blocks <= wr), bf16(O) -> out
        for (int ks = 0; ks <= wr; ++ks) {
            unsigned a[4];
            frag_a(a, As + wr * 16 * LDA + ks * 16, LDA);
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                unsigned bv[4];
                frag_b_kn(bv, Vn + ks * 16 * LDV + WN * wc + 16 * np, LDV);
                mma_bf16(acco[2 * np], a, bv[0], bv[1]);
                mma_bf16(acco[2 * np + 1], a, bv[2], bv[3]);
            }
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = wr * 16 + g + 8 * hh;
            if (r < n) {
                bf16* o = out + (size_t)(start + c0 + r) * P + h * K + col0 + WN * wc + 2 * t;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) st_bf16x2(o + 8 * nt, acco[nt][2 * hh], acco[nt][2 * hh + 1]);
            }
        }

        // ---- (3) S <- diag(e^G_last) S + kd^T V_new: rows 32 wr + 16 mt, k = the chunk's tokens
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) st[mt][nt][e] *= decay[mt][e >> 1];
#pragma unroll
        for (int ks = 0; ks < L / 16; ++ks) {
            unsigned a[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) frag_a_trans(a[mt], Ks + ks * 16 * LDB + 32 * wr + 16 * mt, LDB);
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                unsigned bv[4];
                frag_b_kn(bv, Vn + ks * 16 * LDV + WN * wc + 16 * np, LDV);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    mma_bf16(st[mt][2 * np], a[mt], bv[0], bv[1]);
                    mma_bf16(st[mt][2 * np + 1], a[mt], bv[2], bv[3]);
                }
            }
        }
        if (STATE_PF == 0) {
            __syncthreads();  // A_qk and kd are consumed
            if (j + 1 < num_chunks) load_ak(c + 1, 0), cp_async_commit();
        }
        store_sb();  // S's readers (phase (1)) are past the V_new barrier
        if (j + 1 == snap_chunk) store_state(rec_pool + ((size_t)__ldg(snap + 2 * seq + 1) * num_heads + h) * K * K);
    }

    store_state(state);  // ---- final state back to the slot
}

// the gated norm of a thread's 8 channels of a (token, head) row: y = bf16(O) / sqrt(mean(bf16(O)^2) + eps) * w *
// sigmoid(gate), with o8 = bf16(O) as floats, ss the row's sum of their squares and w = o_norm_w at their channels
__device__ __forceinline__ bf16x8 gated_norm8(const float (&o8)[8], float ss, const bf16x8& gv, const float* w, float eps) {
    const float inv = rsqrtf(ss / (float)K + eps);
    bf16x8 res;
#pragma unroll
    for (int j = 0; j < 8; ++j) res.v[j] = to_bf16(o8[j] * inv * w[j] * sigmoid(to_f32(gv.v[j])));
    return res;
}

// 16 threads per (token, head) row of 128 channels, 8 each: in place over out, which holds bf16(O)
extern "C" __global__ void __launch_bounds__(256) kda_prefill_norm(
    const bf16* __restrict__ gate, const float* __restrict__ o_norm_w, bf16* __restrict__ out, int num_rows, float eps) {
    KDA_PDL_ENTRY();
    const int gid = blockIdx.x * blockDim.x + threadIdx.x, row = gid >> 4, c = 8 * (gid & 15);
    const bool ok = row < num_rows;  // rows of K channels: (token, head) pairs, contiguous in out
    bf16x8 o, gv;
    float y[8], ss = 0.f;
    if (ok) o = *reinterpret_cast<const bf16x8*>(out + (size_t)row * K + c), gv = *reinterpret_cast<const bf16x8*>(gate + (size_t)row * K + c);
#pragma unroll
    for (int j = 0; j < 8; ++j) y[j] = ok ? to_f32(o.v[j]) : 0.f, ss = fmaf(y[j], y[j], ss);
    ss = warp_sum<16>(ss);
    if (!ok) return;
    *reinterpret_cast<bf16x8*>(out + (size_t)row * K + c) = gated_norm8(y, ss, gv, o_norm_w + c, eps);
}

// kda_prefill_norm_e4m3 (sm_89+; the launcher's e4m3_out): one token a block of num_heads x 16 threads (thread i:
// channels 8i .. 8i + 7 of the token's P = num_heads * K), the same y as kda_prefill_norm, and the token's row of y
// also as e4m3 codes with one fp32 scale, e4m3.cuh's activation rule: the codes and scale quant.cu's
// quantize_activations_e4m3 gives the stored bf16 row (a NaN scale, codes left as they are, for a row with a
// non-finite value).  They are the source of o_proj's FP8 prefill GEMM (ops/dense_w8a8), so y is not read again
// to quantize it.  Shapes: q [T, P] uint8, qs [T] fp32; grid = T.
extern "C" __global__ void __launch_bounds__(1024) kda_prefill_norm_e4m3(
    const bf16* __restrict__ gate, const float* __restrict__ o_norm_w, bf16* __restrict__ out, float eps,
    unsigned char* __restrict__ q, float* __restrict__ qs) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    KDA_PDL_ENTRY();
    __shared__ float scratch[64];  // one max a head (16 lanes: an odd head count leaves a half warp)
    const int token = blockIdx.x, c = 8 * threadIdx.x, cw = c % K;  // cw: the channel within the head
    const size_t base = (size_t)token * (blockDim.x * 8) + c;
    const bf16x8 o = *reinterpret_cast<const bf16x8*>(out + base), gv = *reinterpret_cast<const bf16x8*>(gate + base);
    float y[8], ss = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) y[j] = to_f32(o.v[j]), ss = fmaf(y[j], y[j], ss);
    ss = warp_sum<16>(ss);
    const bf16x8 res = gated_norm8(y, ss, gv, o_norm_w + cw, eps);
    float amax = 0.f;
    bool finite = true;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        y[j] = to_f32(res.v[j]);  // the stored value: its codes
        finite = finite && isfinite(y[j]);
        amax = fmaxf(amax, fabsf(y[j]));
    }
    *reinterpret_cast<bf16x8*>(out + base) = res;
    amax = warp_max<16>(amax);  // (within the head's 16 lanes: never a shuffle with a lane past the block)
    if ((threadIdx.x & 15) == 0) scratch[threadIdx.x >> 4] = amax;
    const bool bad = __syncthreads_or(!finite);
    for (int hd = 0; hd < (int)(blockDim.x >> 4); ++hd) amax = fmaxf(amax, scratch[hd]);
    if (bad) {
        if (threadIdx.x == 0) qs[token] = __int_as_float(0x7fc00000);
        return;
    }
    const E4m3Row qr = e4m3_row(amax);
    if (threadIdx.x == 0) qs[token] = qr.scale;
    unsigned pair[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) pair[i] = qr.zero ? 0u : e4m3x2_codes(y[2 * i] * qr.r, y[2 * i + 1] * qr.r);
    *reinterpret_cast<uint2*>(q + base) = make_uint2(pair[0] | pair[1] << 16, pair[2] | pair[3] << 16);
#else
    __trap();  // (the launcher refuses e4m3_out below sm_89)
#endif
}
