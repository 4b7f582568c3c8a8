// kda_decode.cu — one fused KDA decode step per (sequence, head): conv-state shift + conv + SiLU,
// l2norm(q, k), gate, beta, one delta-rule step on the fp32 state, gated RMSNorm (spec §3.2–3.8).
//
//   x = raw q|k|v of the token; hist = previous W-1 raw inputs (zeros when context_lens == 0)
//   q, k, v = bf16(SiLU(conv(hist, x)));  q <- q / sqrt(|q|^2 + 1e-6) * K^-1/2;  k <- k / sqrt(|k|^2 + 1e-6)
//   g = -exp(A_log) softplus(f + dt_bias);  beta = sigmoid(b)
//   S <- diag(exp(g)) S;  r = S^T k;  S <- S + beta k (v - r)^T;  o = S^T q
//      computed as o = (S_decayed^T q) + (q.k) beta (v - r), so S is swept once
//   y = bf16(o) / sqrt(mean(bf16(o)^2) + eps) * o_norm_w * sigmoid(gate)  -> bf16
//
// Rounding points: conv outputs bf16 (as fla); l2norm, gate, state and norm math fp32; o bf16
// before the norm; y bf16.
//
// Column split.  The value columns of S are independent in the delta rule (r, o and the update of
// column j read only column j of S); only the output RMSNorm over the K values of o couples them.
// So a head's state is split into SPLIT column blocks of VC = K / SPLIT columns, one CTA each, and
// the SPLIT CTAs of a head form a thread-block cluster (sm_90+): CTA rank c owns channels
// [c VC, (c+1) VC) of q, k, v, f and gate.  It runs the conv (and conv-state shift) and the decay of
// its channels only and stores q, k and the decay into the shared memory of every CTA of the cluster
// (distributed shared memory), so each CTA then holds the whole q, k and decay; the sum of squares of
// its o block goes the same way for the norm.  Pushing (remote stores before a cluster barrier,
// local reads after it) means no CTA reads a peer's shared memory, so none must outlive a reader.
// SPLIT == 1 is the plain one-CTA-per-head kernel (no cluster, any sm_80+).
//
// Low-rank gates (FUSE_FG = 1, small batches): f = bf16(f_a_out f_b^T) and gate = bf16(g_a_out g_b^T)
// are computed here for the CTA's channels instead of by two cuBLAS GEMVs before the launch: the
// CTA copies its VC rows of f_b and g_b (2 VC R bf16, R <= 256) and the token's two low-rank rows into
// shared memory with cp.async while the state loads are in flight; 2 threads per row, fp32 sums.
//
// Grid: (H * SPLIT, B), x = h * SPLIT + c; cluster (SPLIT, 1, 1); token b belongs to sequence b (T == B).
// Block: THREADS threads.  State map: CT = VC / 4 lanes cover one row block (a float4 each), so
// RG = THREADS / CT row groups of RPT = K / RG consecutive rows; every state element is read and
// written once, as 16-byte vectors (a warp touches 32 / CT rows of VC * 4 contiguous bytes).  The
// state loads are issued before the prologue, so its dependent loads, the cluster exchange and the
// reductions overlap them.
// Shapes: qkv [B, 3P] bf16 rows ldq apart (a column block of the decode step's q|k|v|f_a|g_a|b GEMM); f, gate [B, P] bf16; b [B, ldb] bf16 (column h); conv_w [3P, W] fp32;
// A_log [H], dt_bias [P], o_norm_w [K] fp32; conv_pool [S, 3, W-1, P] bf16 (oldest first);
// rec_pool [S, H, K, V] fp32; context_lens, state_slots [B] int32 (with SKIP_PAD a negative slot is a padding
// row); out [B, P] bf16.  With FUSE_FG:
// f [B, ldr] (first RANK_F columns: the f_a output), gate [B, ldr] (first RANK_G: the g_a output),
// f_b [P, RANK_F], g_b [P, RANK_G] bf16 (16-byte aligned rows).
// Compile-time constants (chosen in kda_rt/cuda/ops/kda_decode.py): HEAD_DIM (K = V, must be 128),
// CONV_W (W), THREADS, SPLIT (1, 2, 4 or 8; > 1 needs sm_90+), MIN_BLOCKS (launch-bounds occupancy),
// FUSE_FG (0 / 1), RANK_F, RANK_G (multiples of 8, <= 256; 0 when FUSE_FG is 0), EARLY_STATE (0 / 1).
// Registers (sm_90a ptxas, no spills): SPLIT 1 x 256 threads 122, 2 x 128 116, 2 x 256 92, 4 x 128 71,
// 8 x 128 63; fused 4 x 128 85 (21 KB smem), 8 x 128 69.
// Measured (H200, graph replay, H = 32), the unsplit kernel before this split (same math, 126 registers):
// B=1 5.4 us, B=8 9.6 us (3.5 TB/s), B=32 50.2 us (2.67 TB/s).  This version (tests/gpu/check_kda_decode.sh,
// 2026-11-30), us (TB/s of the fp32 state read + written):
//   B      1x256          4x128          8x128          fused 4x128 (incl. f_b, g_b)
//   1      -              4.7 (0.89)     5.0            5.6 (cuBLAS GEMVs + 4x128: 9.7)
//   8      9.3 (3.59)     13.4 (2.51)    16.7           16.0
//   32     46.3 (2.90)    50.2 (2.67)    64.5           56.7
//   128    164 (3.27)     180 (2.99)     240            -
//   256    314 (3.42)     347 (3.10)     472            -
// so the launcher splits (and fuses the gates) only up to 4 sequences (ops/kda_decode.py).
#include "kda_common.cuh"

#if !defined(HEAD_DIM) || !defined(CONV_W) || !defined(THREADS) || !defined(SPLIT) || !defined(MIN_BLOCKS) || \
    !defined(FUSE_FG) || !defined(RANK_F) || !defined(RANK_G)
#error "kda_decode.cu needs -DHEAD_DIM -DCONV_W -DTHREADS -DSPLIT -DMIN_BLOCKS -DFUSE_FG -DRANK_F -DRANK_G"
#endif
#if HEAD_DIM != 128
#error "kda_decode.cu: the thread map assumes HEAD_DIM == 128"
#endif
#if SPLIT > 1 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "kda_decode.cu: SPLIT > 1 uses thread-block clusters (sm_90+); use SPLIT=1 on older GPUs"
#endif
#ifndef EARLY_STATE
#define EARLY_STATE 0
#endif
// EARLY_STATE = 1: the next launch is let go at once and the weights, the step's metadata and the slot's recurrent
// state rows are loaded before the programmatic-launch wait (no earlier kernel of the decode graph writes them: the
// state last changed in this layer's kernel of an earlier replay, and the metadata is copied in before the replay;
// common.cuh's PDL note says what this rests on).  The conv history and the token's inputs are read after it.
// Measured (H200, 2026-12-01, tests/gpu/bench_ab.py --env KDA_RT_KDA_EARLY_STATE --values 1,0 --rounds 2 --prompts 0
// --replays 1,8,32): batch 1 2.2251 against 2.2462 ms (-0.9%; the kernel before is gemv_dense, which lets this one
// launch while it streams), batch 8 5.1088 / 5.1094, batch 32 7.9021 / 7.8997 (cuBLAS before it: no change).
// STATE_HINTS (bench: tests/gpu/bench_decode_sweep.py --kda-define): cache hints of the state's loads and stores.
// 0 plain; 1 loads without L1 allocation and streaming (evict-first) stores; 2 the loads only; 3 the stores only.
#ifndef STATE_HINTS
#define STATE_HINTS 0
#endif
// SMEM_STATE = 1 (SPLIT == 1, sm_90+): the head's 64 KB of state arrives in shared memory by bulk copies (one
// cp.async.bulk of its RPT rows a warp, issued by the warp's lane 0 and completing on the warp's own mbarrier) instead
// of as 16 float4 register loads a thread.  The copies go through the copy engine, not the load path; the registers
// they freed let three CTAs share an SM (launch bounds 256 x 3; 3 x ~74 KB of shared memory), so up to 192 KB of state
// is in flight an SM against 128 KB.  Each thread then reads exactly the float4s the register form holds, twice (the
// sweep, then the delta write, which decays them again: the same products), so outputs and pools are bit for bit the
// register form's (tests/kernels/test_kda_decode.py::test_kda_decode_smem_state).  The stores are unchanged.
// SMEM_STATE = 2: the stores too: each thread writes its new float4s over the ones it read, and the warp's lane 0
// copies the warp's rows back to global memory with one bulk copy (waiting for its reads of shared memory only at the
// kernel's end), so the state's 128 KB a head never pass through the load / store units.  Bit for bit the other forms
// (the same values stored), but slower (H200, 2026-12-04, tests/gpu/kda_smem_check.sh: the kernel alone, us, forms
// 0 / 1 / 2: B = 16 16.7 / 20.1 / 21.4, 64 77.5 / 80.1 / 81.8, 256 301.4 / 288.5 / 292.5; the model's decode replays
// at batch 32 / 256 8.731 / 8.708 / 8.741 and 22.703 / 22.414 / 22.497 ms): a bench form (KDA_RT_KDA_SMEM_STATE=2).
// SMEM_STATE = 3 (PERSIST; KDA_RT_KDA_SMEM_STATE=3, a bench form: measured 25-38% slower than forms 0 and 1, below): a
// persistent CTA an SM (grid min(B H, SMs), launch bounds 256 x 1) takes items (sequence i / H, head i % H) for
// i = blockIdx.x, + gridDim.x, ... into NBUF = PERSIST_BUFS (3) state buffers of 64 KB: before the first item it issues
// the bulk copies of its first NBUF items (before the programmatic-launch wait with EARLY_STATE, like form 1's one
// copy), and as item n starts, item n - 1's buffer (every warp reads only its own rows, so the warp's own reads of it
// are behind it, ordered before the copy by fence.proxy.async and __syncwarp: the PTX memory model's rule for
// generic-proxy reads of bytes an async-proxy copy then overwrites) takes item n - 1 + NBUF's copy, so the load
// stream does not pause at a head's prologue, reductions
// and stores as it does between form 1's CTAs.  Each buffer's copies complete on per-warp mbarriers whose parity
// flips at each wait; a fresh or padding item copies nothing and waits on nothing.  Per item the arithmetic, the
// reads of shared memory and the stores are form 1's, so outputs and pools are bit for bit the other forms'.  The
// shared scratch of an item (q_s .. gate_s) is reused by the next: every write of item n + 1's comes after a barrier
// that every thread passes only once done with item n's reads (the norm's barrier), except gate_s and ss_s, which
// warp 0 alone writes and reads.  PERSIST_PREFETCH = 1 (bench define): the next item's conv history lines
// prefetched into L2 at an item's start.  Measured (H100 80GB, 2026-12-05, tests/gpu/kda_persist_check.sh, the kernel
// alone, us, forms 0 / 1 / 3 / 3 + prefetch): B = 32 52.0 / 55.7 / 69.7 / 67.0, 64 100.8 / 103.0 / 137.4 / 132.2,
// 128 204.3 / 199.2 / 272.4 / 256.8, 256 400.6 / 390.4 / 538.1: one CTA of 8 warps takes ~8.8 us a head (prologue
// round trips, barriers, stores in one chain) against ~3.9 us of its bytes; forms 0 and 1 overlap 2-3 such chains an
// SM.  A persistent form needs two or more heads computing at once an SM (docs/PERFORMANCE.md, sixty-fifth session).
#ifndef SMEM_STATE
#define SMEM_STATE 0
#endif
__device__ __forceinline__ float4 ld_state(const float4* p) {
#if STATE_HINTS == 1 || STATE_HINTS == 2
    float4 v;
    asm volatile("ld.global.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p));
    return v;
#else
    return *p;
#endif
}
__device__ __forceinline__ void st_state(float4* p, float4 v) {
#if STATE_HINTS == 1 || STATE_HINTS == 3
    asm volatile("st.global.cs.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
                 : "memory");
#else
    *p = v;
#endif
}
// SKIP_PAD = 1 (KDA_RT_SKIP_PAD=1; the default is 2, below): a negative slot is a decode graph's
// padding row (the runner writes -1 for them instead of its padding slot): a fresh state and nothing stored, neither
// conv history nor state rows (nothing reads the padding slot: padding rows have context 0), so a padding row costs
// no state traffic (2 MiB of state stores a row a layer at 32 heads otherwise).  Its output row is computed as before.
// SKIP_PAD = 2 (KDA_RT_SKIP_PAD, the default since the fifty-fifth session: 160 rows on the 256-row graph 17.505 ->
// 16.959 ms a replay against 1): a padding row's CTAs do no work at all: they
// write zeros for their channels of its output row (after the programmatic-launch wait: an earlier kernel may still
// read `out`) and leave, before any copy is issued or any cluster barrier waited on (every CTA of a cluster is of
// the same row).  Nothing reads a padding row's output but the rest of its own padding row, whose MoE output the
// combine zeroes; the live rows bit for bit as with 1.
// Off, the build is the one before it (the compiler drops the test).
#ifndef SKIP_PAD
#define SKIP_PAD 0
#endif
#if EARLY_STATE
#define KD_PDL_ENTRY() KDA_PDL_ENTRY_DEFERRED()
#else
#define KD_PDL_ENTRY() KDA_PDL_ENTRY()
#endif
#define K HEAD_DIM
#define VC (K / SPLIT)           // value columns per CTA (= channels whose prologue it runs)
#define CT (VC / 4)              // lanes per row block, one float4 each
#define RG (THREADS / CT)        // row groups
#define RPT (K / RG)             // consecutive state rows per thread
#define NUM_WARPS (THREADS / 32)
static_assert(SPLIT == 1 || SPLIT == 2 || SPLIT == 4 || SPLIT == 8, "kda_decode.cu: SPLIT must be 1, 2, 4 or 8");
static_assert(SMEM_STATE >= 0 && SMEM_STATE <= 3, "kda_decode.cu: SMEM_STATE must be 0, 1, 2 or 3");
#define PERSIST (SMEM_STATE == 3)
#if PERSIST
#ifndef PERSIST_BUFS
#define PERSIST_BUFS 3
#endif
static_assert(PERSIST_BUFS >= 2 && PERSIST_BUFS <= 3, "kda_decode.cu: PERSIST_BUFS must be 2 or 3");
#define NBUF PERSIST_BUFS
#ifndef PERSIST_PREFETCH
#define PERSIST_PREFETCH 0  // 1: the next head's conv history lines prefetched into L2 at this head's start
#endif
#else
#define NBUF 1
#endif
#if SMEM_STATE
static_assert(SPLIT == 1 && CT == 32 && !FUSE_FG, "kda_decode.cu: SMEM_STATE needs SPLIT 1 (one row group a warp)");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "kda_decode.cu: SMEM_STATE uses bulk copies and mbarriers (sm_90+)"
#endif
#endif
static_assert(THREADS % 32 == 0 && THREADS >= K && CT <= 32 && K % RG == 0 && RPT >= 1,
              "kda_decode.cu: whole warps, one thread per channel for the norms, whole row blocks per warp");
#if FUSE_FG
static_assert(RANK_F % 8 == 0 && RANK_G % 8 == 0 && RANK_F > 0 && RANK_G > 0 && RANK_F <= 256 && RANK_G <= 256,
              "kda_decode.cu: low ranks must be multiples of 8 (16-byte rows), at most 256");
static_assert(VC <= 32 && 4 * VC <= THREADS, "kda_decode.cu: FUSE_FG needs SPLIT >= 4 (2 threads per f / gate row)");
#define RMAX (RANK_F > RANK_G ? RANK_F : RANK_G)
#define WROW (RMAX + 8)  // shared row pitch in bf16: 16 bytes of padding shift rows by 4 banks
#endif

// ---------------------------------------------------------------------------------------------
// thread-block cluster helpers (cluster_rank, cluster_arrive*, cluster_wait, st_cluster: common.cuh)

// v into `p` of every CTA of the cluster (just the local store when SPLIT == 1)
__device__ __forceinline__ void st_all(float* p, float v) {
#if SPLIT > 1
#pragma unroll
    for (unsigned r = 0; r < SPLIT; ++r) st_cluster(p, r, v);
#else
    *p = v;
#endif
}

#if FUSE_FG
// 2 VC rows (f rows then gate rows) x their rank: thread pair (2 row, 2 row + 1) halves one row.  The
// halves walk their 16-byte chunks rotated by half a row, so the 8 threads of a shared-memory phase
// (4 rows x 2 halves, rows 4 banks apart) hit 8 distinct 4-bank groups.  Returns the bf16-rounded
// value in fg_s[row] (f of channel c0 + row for row < VC, else gate of channel c0 + row - VC).
__device__ __forceinline__ void low_rank_rows(const bf16 (&w_s)[2 * VC][WROW], const bf16 (&a_s)[2][RMAX], float* fg_s) {
    const int row = threadIdx.x >> 1, half = threadIdx.x & 1;
    if (row < 2 * VC) {  // whole warps: 4 VC <= THREADS and VC % 8 == 0
        const int len = row < VC ? RANK_F : RANK_G, chunks = len / 16;  // 16-byte chunks per half
        const bf16* w = w_s[row];
        const bf16* a = a_s[row < VC ? 0 : 1];
        float acc = 0.f;
        for (int i = 0; i < chunks; ++i) {
            const int c = half * chunks + (i + half * (chunks / 2)) % chunks;
            const bf16x8 wv = *reinterpret_cast<const bf16x8*>(w + 8 * c), av = *reinterpret_cast<const bf16x8*>(a + 8 * c);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc = fmaf(to_f32(wv.v[e]), to_f32(av.v[e]), acc);
        }
        if (len % 16) {  // an odd number of chunks: the last one goes to half 0
            if (half == 0) {
                const bf16x8 wv = *reinterpret_cast<const bf16x8*>(w + len - 8), av = *reinterpret_cast<const bf16x8*>(a + len - 8);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc = fmaf(to_f32(wv.v[e]), to_f32(av.v[e]), acc);
            }
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        if (half == 0) fg_s[row] = round_bf16(acc);
    }
}
#endif

// ---------------------------------------------------------------------------------------------
// kernel

extern "C" __global__ void
#if SPLIT > 1
__cluster_dims__(SPLIT, 1, 1)
#endif
__launch_bounds__(THREADS, MIN_BLOCKS) kda_decode_step(
    const bf16* __restrict__ qkv, int ldq, const bf16* __restrict__ f, const bf16* __restrict__ b, int ldb,
    const bf16* __restrict__ gate, const float* __restrict__ conv_w, const float* __restrict__ A_log,
    const float* __restrict__ dt_bias, const float* __restrict__ o_norm_w, bf16* __restrict__ conv_pool,
    float* __restrict__ rec_pool, const int* __restrict__ context_lens, const int* __restrict__ state_slots,
    bf16* __restrict__ out, int num_heads, float eps, const bf16* __restrict__ f_b, const bf16* __restrict__ g_b,
    int ldr, int num_seqs) {
    KD_PDL_ENTRY();
    __shared__ float q_s[K], k_s[K], decay_s[K], v_s[VC], ss_s[SPLIT];
    __shared__ __align__(16) float red_r[NUM_WARPS][VC], red_o[NUM_WARPS][VC];
    __shared__ float red3[NUM_WARPS][3];
    __shared__ __align__(16) float norm_s[VC];
#if FUSE_FG
    __shared__ __align__(16) bf16 w_s[2 * VC][WROW];  // f_b rows, then g_b rows of this CTA's channels
    __shared__ __align__(16) bf16 a_s[2][RMAX];       // the token's f_a and g_a outputs
    __shared__ float fg_s[2 * VC];                    // f, gate of this CTA's channels (bf16 values)
#else
    __shared__ __align__(16) bf16 gate_s[VC];
#endif
#if SPLIT > 1
    cluster_arrive_relaxed();  // "started": waited for before the first remote store
    const int rank = (int)cluster_rank();
#else
    const int rank = 0;
#endif
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int c0 = rank * VC;  // first value column / channel of this CTA within the head
    const int P = num_heads * K;
#if PERSIST
    // (PERSIST's note) item i = (sequence i / H, head i % H); this CTA's items blockIdx.x + n gridDim.x, item n's
    // state in buffer n % NBUF.  meta(i): {state slot, context == 0} of item i's sequence ({0, -1}: no such item)
    extern __shared__ __align__(128) float4 state_s[];  // [NBUF][K][K / 4]
    __shared__ __align__(8) unsigned long long state_bar[NBUF][NUM_WARPS];
    const int num_items = num_seqs * num_heads;
    auto meta = [&](int n) -> int2 {
        const int i = blockIdx.x + n * gridDim.x;
        if (i >= num_items) return make_int2(0, -1);
        const int sq = i / num_heads;
        return make_int2(state_slots[sq], context_lens[sq] == 0);
    };
    // warp `warp`'s rows of item n's state into buffer n % NBUF (lane 0; nothing for a fresh, padding or missing item)
    auto issue = [&](int n, int2 m) {
        const bool none = m.y < 0 || m.y == 1 || (SKIP_PAD && m.x < 0);
        if (none || lane != 0) return;
        const int row0w = warp * (K / NUM_WARPS), hh = (blockIdx.x + n * gridDim.x) % num_heads;
        const unsigned bar = smem_addr(&state_bar[n % NBUF][warp]);
        mbar_arrive_expect_tx(bar, (K / NUM_WARPS) * K * 4);
        bulk_copy_g2s(smem_addr(state_s + (size_t)(n % NBUF) * K * (K / 4) + row0w * (K / 4)),
                      rec_pool + (((size_t)m.x * num_heads + hh) * K + row0w) * K, (K / NUM_WARPS) * K * 4, bar);
    };
    int2 ring[NBUF];  // meta of items n .. n + NBUF - 1 (their copies issued)
    if (lane == 0) {
#pragma unroll
        for (int b = 0; b < NBUF; ++b) mbar_init(smem_addr(&state_bar[b][warp]), 1);
    }
#pragma unroll
    for (int j = 0; j < NBUF; ++j) ring[j] = meta(j);
#pragma unroll
    for (int j = 0; j < NBUF; ++j) issue(j, ring[j]);
    if (tid >= THREADS - VC / 4) cp_async16(norm_s + 4 * (tid - (THREADS - VC / 4)), o_norm_w + 4 * (tid - (THREADS - VC / 4)), 16);
#if EARLY_STATE
    KDA_PDL_WAIT();  // (once: every item's inputs are the kernel before's output)
#endif
    unsigned phases = 0u;  // bit b: the parity of buffer b's next copy
    int2 nxt = make_int2(0, -1);
    for (int n = 0;; ++n) {
    const int item = blockIdx.x + n * gridDim.x;
    if (item >= num_items) break;
    if (n > 0) {  // item n - 1's buffer is free (this warp's reads of it are behind it): item n - 1 + NBUF into it
#pragma unroll
        for (int j = 0; j + 1 < NBUF; ++j) ring[j] = ring[j + 1];
        ring[NBUF - 1] = nxt;
        // this lane's generic-proxy reads of item n - 1's rows, ordered before the async-proxy copy that overwrites
        // them (the PTX memory model's cross-proxy rule: a barrier alone orders generic accesses only); the
        // __syncwarp also orders warp 0's reads of gate_s (item n - 1's norm) before this item's cp.async into it
        fence_proxy_async_smem();
        __syncwarp();
        issue(n - 1 + NBUF, ring[NBUF - 1]);
    }
    nxt = meta(n + NBUF);  // (its copy goes out at the next item's start)
#if PERSIST_PREFETCH
    {  // the next item's conv history (3 x (W - 1) rows of its 128 channels, 256 bytes each): L2 lines, one a thread
        const int2 m1 = ring[1];
        constexpr int LINES = 3 * (CONV_W - 1) * (K * 2 / 128);
        if (m1.y == 0 && !(SKIP_PAD && m1.x < 0) && tid < LINES) {
            const int i1 = blockIdx.x + (n + 1) * gridDim.x, hh = i1 % num_heads;
            const int half = tid % (K * 2 / 128), t = (tid / (K * 2 / 128)) % (CONV_W - 1);
            const int qi = tid / ((K * 2 / 128) * (CONV_W - 1));
            const bf16* line = conv_pool + ((size_t)m1.x * 3 + qi) * (CONV_W - 1) * P + (size_t)t * P + hh * K + half * 64;
            asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
        }
    }
#endif
    const int h = item % num_heads, seq = item / num_heads;
    const int slot_id = ring[0].x;
    const bool no_context = ring[0].y == 1;
#else
    const int h = blockIdx.x / SPLIT, seq = blockIdx.y;
    const bool no_context = context_lens[seq] == 0;
    const int slot_id = state_slots[seq];
#endif
    const bool pad = SKIP_PAD && slot_id < 0, fresh = pad || no_context;  // (SKIP_PAD's note)
    const size_t slot = pad ? 0 : (size_t)slot_id;
#if SKIP_PAD == 2
    if (pad) {  // (SKIP_PAD = 2's note)
#if EARLY_STATE && !PERSIST
        KDA_PDL_WAIT();
#endif
        for (int j = tid; j < VC; j += THREADS) out[(size_t)seq * P + h * K + c0 + j] = to_bf16(0.f);
#if PERSIST
        continue;
#else
        return;
#endif
    }
#endif
    // first what no earlier kernel of the graph writes (EARLY_STATE: before the programmatic-launch wait): the
    // metadata, the decay weights of this CTA's channels, (async, into shared memory) its f_b / g_b rows and norm
    // weights, the state rows; then the token's inputs: beta's b, the low-rank rows or f, and the output gate
    const bool decay_thread = tid >= THREADS - VC;  // the last threads: the conv loop starts at thread 0
    const int dj = decay_thread ? tid - (THREADS - VC) : 0, dch = h * K + c0 + dj;
    const float dt_b = decay_thread ? dt_bias[dch] : 0.f, a_log = A_log[h];
#if FUSE_FG
    for (int idx = tid; idx < VC * (RANK_F + RANK_G) / 8; idx += THREADS) {  // 16-byte chunks of f_b, g_b rows
        const bool is_f = idx < VC * RANK_F / 8;
        const int chunks = (is_f ? RANK_F : RANK_G) / 8, e = is_f ? idx : idx - VC * RANK_F / 8;
        const int row = e / chunks, c = e % chunks;
        cp_async16(w_s[(is_f ? 0 : VC) + row] + 8 * c, (is_f ? f_b : g_b) + (size_t)(h * K + c0 + row) * chunks * 8 + 8 * c, 16);
    }
#endif
#if !PERSIST
    if (tid >= THREADS - VC / 4) cp_async16(norm_s + 4 * (tid - (THREADS - VC / 4)), o_norm_w + c0 + 4 * (tid - (THREADS - VC / 4)), 16);
#endif

    // ---- the state rows: this CTA's K x VC block is in flight while the prologue runs
    const int ct = tid % CT, row0 = (tid / CT) * RPT;
    float4* state = reinterpret_cast<float4*>(rec_pool + (slot * num_heads + h) * K * K + c0) + ct;
#if PERSIST
    // (issued NBUF - 1 items ago, or before the loop)
    const int buf = n % NBUF;
    const unsigned bar = smem_addr(&state_bar[buf][warp]);
    float4* my_rows = state_s + (size_t)buf * K * (K / 4) + row0 * (K / 4) + ct;
#elif SMEM_STATE
    // warp w's rows [w RPT, (w + 1) RPT) of the head's state, one bulk copy into shared memory (CT == 32: the warp
    // is one row group); the warp's lanes wait on its barrier before their first read (the sweep)
    extern __shared__ __align__(128) float4 state_s[];  // [K][K / 4]
    __shared__ __align__(8) unsigned long long state_bar[NUM_WARPS];
    const unsigned bar = smem_addr(&state_bar[warp]);
    float4* my_rows = state_s + row0 * (K / 4) + ct;
    if (!fresh && lane == 0) {
        mbar_init(bar, 1);
        mbar_arrive_expect_tx(bar, RPT * K * 4);
        bulk_copy_g2s(smem_addr(state_s + row0 * (K / 4)), rec_pool + ((slot * num_heads + h) * K + row0) * K, RPT * K * 4,
                      bar);
    }
#else
    float4 s[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) s[i] = fresh ? make_float4(0.f, 0.f, 0.f, 0.f) : ld_state(state + (row0 + i) * (K / 4));
#endif
#if EARLY_STATE && !PERSIST
    KDA_PDL_WAIT();  // the token's q|k|v|f_a|g_a|b: the kernel before's output
#endif
    const float b_raw = to_f32(b[(size_t)seq * ldb + h]);
#if FUSE_FG
    if (tid < (RANK_F + RANK_G) / 8) {
        const bool is_f = tid < RANK_F / 8;
        const int c = is_f ? tid : tid - RANK_F / 8;
        cp_async16(a_s[is_f ? 0 : 1] + 8 * c, (is_f ? f : gate) + (size_t)seq * ldr + 8 * c, 16);
    }
    float f_raw = 0.f;  // computed after the prologue
#else
    const float f_raw = decay_thread ? to_f32(f[(size_t)seq * P + dch]) : 0.f;
    if (tid < VC / 8) cp_async16(gate_s + 8 * tid, gate + (size_t)seq * P + h * K + c0 + 8 * tid, 16);
#endif
    cp_async_commit();  // no registers held meanwhile
#if SPLIT > 1
    cluster_wait();
#endif

    // ---- prologue over this CTA's channels: conv step (and conv-state shift) of q, k, v; decay
    for (int idx = tid; idx < 3 * VC; idx += THREADS) {
        const int i = idx / VC, j = idx % VC, ch = h * K + c0 + j;
        bf16* hist_p = conv_pool + (slot * 3 + i) * (CONV_W - 1) * P + ch;
        float hist[CONV_W - 1];
#pragma unroll
        for (int t = 0; t < CONV_W - 1; ++t) hist[t] = fresh ? 0.f : to_f32(hist_p[(size_t)t * P]);
        const bf16 x = qkv[(size_t)seq * ldq + i * P + ch];
        const float y = kda_conv_silu<CONV_W>(conv_w + (size_t)(i * P + ch) * CONV_W, hist, to_f32(x));
        if (!pad) {
#pragma unroll
            for (int t = 0; t < CONV_W - 2; ++t) hist_p[(size_t)t * P] = to_bf16(hist[t + 1]);
            hist_p[(size_t)(CONV_W - 2) * P] = x;
        }
        if (i == 2) v_s[j] = y;
        else st_all((i == 0 ? q_s : k_s) + c0 + j, y);
    }
#if FUSE_FG
    cp_async_wait<0>();
    __syncthreads();
    low_rank_rows(w_s, a_s, fg_s);
    __syncthreads();
    if (decay_thread) f_raw = fg_s[dj];
#endif
    if (decay_thread) st_all(decay_s + c0 + dj, expf(kda_log_decay(f_raw, dt_b, a_log)));
    const float beta = sigmoid(b_raw);
#if SPLIT > 1
    cluster_arrive();  // q, k, decay of every channel are in every CTA after the wait
    cluster_wait();
#else
    __syncthreads();
#endif

    // ---- l2norm statistics over the whole head (thread tid < K: channel tid)
    float sums[3] = {0.f, 0.f, 0.f};  // -> |q|^2, |k|^2, q.k
    if (tid < K) {
        const float qv = q_s[tid], kv = k_s[tid];
        sums[0] = qv * qv, sums[1] = kv * kv, sums[2] = qv * kv;
    }
    block_sum(sums, red3);
    const float inv_q = rsqrtf((float)K) / sqrtf(sums[0] + 1e-6f), inv_k = 1.f / sqrtf(sums[1] + 1e-6f);
    const float qk = sums[2] * inv_q * inv_k;  // q_hat . k_hat

    // ---- state sweep: decay, partial S^T k and S^T q (raw q, k: scaled once after the sums)
    float4 pr = make_float4(0.f, 0.f, 0.f, 0.f), po = pr;
#if PERSIST
    if (!fresh) {
        mbar_wait(bar, (phases >> buf) & 1u);
        phases ^= 1u << buf;
    }
#elif SMEM_STATE
    if (!fresh) mbar_wait(bar, 0);
#endif
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const float dk = decay_s[row0 + i], kd = k_s[row0 + i], qd = q_s[row0 + i];
#if SMEM_STATE
        float4 si = fresh ? make_float4(0.f, 0.f, 0.f, 0.f) : my_rows[i * (K / 4)];
#else
        float4& si = s[i];
#endif
        si.x *= dk, si.y *= dk, si.z *= dk, si.w *= dk;
        pr.x = fmaf(kd, si.x, pr.x), pr.y = fmaf(kd, si.y, pr.y), pr.z = fmaf(kd, si.z, pr.z), pr.w = fmaf(kd, si.w, pr.w);
        po.x = fmaf(qd, si.x, po.x), po.y = fmaf(qd, si.y, po.y), po.z = fmaf(qd, si.z, po.z), po.w = fmaf(qd, si.w, po.w);
    }
    // row groups of one warp first (lanes ct, ct + CT, ...), then the warps through shared memory
#pragma unroll
    for (int o = CT; o < 32; o <<= 1) {
        pr.x += __shfl_xor_sync(0xffffffffu, pr.x, o), pr.y += __shfl_xor_sync(0xffffffffu, pr.y, o);
        pr.z += __shfl_xor_sync(0xffffffffu, pr.z, o), pr.w += __shfl_xor_sync(0xffffffffu, pr.w, o);
        po.x += __shfl_xor_sync(0xffffffffu, po.x, o), po.y += __shfl_xor_sync(0xffffffffu, po.y, o);
        po.z += __shfl_xor_sync(0xffffffffu, po.z, o), po.w += __shfl_xor_sync(0xffffffffu, po.w, o);
    }
    if (lane < CT) {
        reinterpret_cast<float4*>(red_r[warp])[lane] = pr;
        reinterpret_cast<float4*>(red_o[warp])[lane] = po;
    }
    __syncthreads();
    float r[4] = {0.f, 0.f, 0.f, 0.f}, o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
        const float4 a = reinterpret_cast<const float4*>(red_r[w])[ct], c = reinterpret_cast<const float4*>(red_o[w])[ct];
        r[0] += a.x, r[1] += a.y, r[2] += a.z, r[3] += a.w;
        o[0] += c.x, o[1] += c.y, o[2] += c.z, o[3] += c.w;
    }
    float delta[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) delta[j] = beta * (v_s[4 * ct + j] - r[j] * inv_k);

    // ---- delta write, one store per row block: S += k_hat delta^T
    float kdelta[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) kdelta[j] = delta[j] * inv_k;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const float kd = k_s[row0 + i];
#if SMEM_STATE
        const float dk = decay_s[row0 + i];  // the sweep's decayed values again, the same products
        float4 si = fresh ? make_float4(0.f, 0.f, 0.f, 0.f) : my_rows[i * (K / 4)];
        si.x *= dk, si.y *= dk, si.z *= dk, si.w *= dk;
#else
        float4& si = s[i];
#endif
        si.x = fmaf(kd, kdelta[0], si.x), si.y = fmaf(kd, kdelta[1], si.y);
        si.z = fmaf(kd, kdelta[2], si.z), si.w = fmaf(kd, kdelta[3], si.w);
#if SMEM_STATE == 2
        my_rows[i * (K / 4)] = si;  // over the float4 this thread read (no other thread touches it)
#else
        if (!pad) st_state(state + (row0 + i) * (K / 4), si);
#endif
    }
#if SMEM_STATE == 2
    fence_proxy_async_smem();  // this thread's new rows, then the warp's, to the copy engine
    __syncwarp();
    if (lane == 0 && !pad) {
        bulk_copy_s2g(rec_pool + ((slot * num_heads + h) * K + row0) * K, smem_addr(state_s + row0 * (K / 4)), RPT * K * 4);
        bulk_commit();
    }
#endif

    // ---- read-out and gated RMSNorm: lanes 0..CT-1 of warp 0 hold this CTA's VC outputs (4 each)
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        o[j] = round_bf16(fmaf(qk, delta[j], o[j] * inv_q));
        ss = fmaf(o[j], o[j], ss);
    }
    if (warp == 0) {
        ss = warp_sum(lane < CT ? ss : 0.f);
        if (lane == 0) st_all(ss_s + rank, ss);
    }
    cp_async_wait<0>();  // gate_s, norm_s: visible to warp 0 after the barrier below
#if SPLIT > 1
    cluster_arrive();
    cluster_wait();
#else
    __syncthreads();
#endif
    if (warp == 0 && lane < CT) {
        float total = 0.f;
#pragma unroll
        for (int c = 0; c < SPLIT; ++c) total += ss_s[c];  // rank order: every CTA gets the same sum
        const float inv = rsqrtf(total / (float)K + eps);
        const size_t base = (size_t)seq * P + h * K + c0 + 4 * lane;
        __align__(8) bf16 res[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
#if FUSE_FG
            res[j] = to_bf16(o[j] * inv * norm_s[4 * lane + j] * sigmoid(fg_s[VC + 4 * lane + j]));
#else
            res[j] = to_bf16(o[j] * inv * norm_s[4 * lane + j] * sigmoid(to_f32(gate_s[4 * lane + j])));
#endif
        *reinterpret_cast<uint2*>(out + base) = *reinterpret_cast<const uint2*>(res);
    }
#if SMEM_STATE == 2
    if (lane == 0) bulk_wait_read<0>();  // the warp's rows read out of shared memory before the CTA leaves
#endif
#if PERSIST
    }  // the next item
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // (a CTA of padding items alone never waited for norm_s's copy)
#endif
}
