// moe_gemv.cu — one-row products (batch-1 decode) as GEMVs whose work is cut evenly over every warp of a grid of
// one wave, bf16 in, fp32 accumulate: the gate/up projection of a one-token MoE step, (DOWN = 1,
// moe_gemv_down) its down projection, and (DENSE = 1, gemv_dense at the end of the file, launched by
// kda_rt/cuda/ops/gemv.py) a dense one-row projection (or 2-4 rows in one launch, MROWS):
//
//   moe_gemv_gate_up: same math and rounding as moe_gemm_tc.cu's FUSE_SILU = 1 (spec §5.1) (WFMT = 1: w13 in e4m3
//   with scale13 [E, 2·INTER] fp32, g and u each their row's scale times the fp32 sum, then the same roundings):
//       h[r, f] = bf16( bf16(SiLU(bf16(g))) · bf16(u) ),   g = x · W[e, f]ᵀ,  u = x · W[e, INTER + f]ᵀ
//     for the rows r of the plan's tiles (moe_align.cu, any BT): at one token every pair has its own expert
//     (the top-k ids are distinct, the shared slot is bin E), so tile t is the single row tile_row[t] of
//     expert e = tile_expert[t].  x [1, KW], W = w13 [E, 2·INTER, KW] (gate rows first), h [N, INTER] bf16.
//     A unit of work is one feature: its gate and up rows.
//
// Why: the tiled kernels cut a one-token product into blocks of 64 or more weight rows, a few per SM, so some
// SMs stream one block's bytes more than the rest: at batch 1 the MoE gate/up ran 288 CTAs of 64 rows (9
// experts x 32 feature blocks), 2.18 per SM; tests/gpu/probe_stream.py (H200, 2026-12-01) streamed those 85 MB
// in that grid's order at 3.37 TB/s and spread evenly over 396 CTAs at 3.77 TB/s (a plain copy: 4.06).  Here
// warp w of the W warps in the grid takes units [w U / W, (w + 1) U / W), so every SM streams the same bytes
// within one unit.  Lane l holds the 16-byte pieces l, l + 32, .. of both rows of its unit (KW / 256 loads of
// each in flight per lane), multiplies them by the matching pieces of x (staged once per CTA in shared memory,
// read from there at each unit), and the warp sums by shuffles; with PIPE = 1 the next unit's rows are loaded
// before the current one is reduced (~167 registers a thread against ~102).  Weight loads skip L1 (each byte
// is read once).  In moe_gemv_gate_up everything an earlier kernel writes (x, the plan) is read after the
// programmatic-launch wait (ROUTED: after the routing kernel's signal instead, below); moe_gemv_down reads the plan
// before its wait (see there).
//
// The same scheme for dense one-row projections lost to cuBLAS in isolation, which already spreads them evenly (H200,
// 2026-12-01, bench_skinny.py --rows 1 with commit f8079ab's first gemv_dense: q|k|v 17.3 against 16.2 us, q|kv_a
// 11.9 / 10.9, dense gate|up 24.2 / 23.9, lm_head 182.8 / 170.5); in the model it wins once it loads its first
// weight rows before the programmatic-launch wait, which cuBLAS cannot (gemv_dense below; lm_head stays on cuBLAS).
//
// ROUTED = 1 (the routed variant of moe_gemv_gate_up): the GEMV does not wait for the whole routing kernel
// (moe_route.cu's moe_route_fused, launched with signal_ready): once every routing block has stored its logits and
// the normalised x (done[1] counted up to `ready_target`, acquire), warp 0 of each CTA runs the same warp selection
// on those logits (moe_select.cuh: the same ids) and ranks the token's bins (its top_k experts and, with SHARED,
// the shared slot E) in ascending order, which is the routing kernel's plan at one token: tile t = the t-th bin,
// row t.  So the weight stream starts while the routing kernel's last block still selects and buckets (for the down
// GEMM and the combine).  The CTA's extra warp (WARPS + 1 warps) alone waits for the routing kernel to complete and
// only then lets the next launch go (moe_gemv_down, or the tiled down GEMM with EARLY_B, reads the plan before its
// own wait); the other warps sync by a
// named barrier.  The CTA that counts done[2] up to the grid size resets done[1] and done[2] to 0 for the next
// launch.
// SHARED_FIRST = 1 (with ROUTED and SHARED): the shared expert's units (its slot E is the largest bin, so tile top_k)
// are spread over every warp ahead of the routed ones, and the first of a warp's is loaded before the routing
// kernel's signal (its weights do not depend on the choice), so that ~1/9 of the bytes stream while the routing
// kernel still runs; the routed tiles 0 .. top_k - 1 follow in contiguous runs.  Each unit's math is unchanged.
// Measured (H200, 2026-12-01, tests/gpu/bench_ab.py --env KDA_RT_GEMV_SHARED_FIRST --values 1,0 --rounds 3 --prompts 0
// --replays 1, full-model graph replays): batch 1 2.2787 against 2.2898 ms (-0.5%, every round).
// SIGNAL_OVERLAP = 1 (with ROUTED): after the signal, warp 0 selects while warp 1 takes the CTA's count (an atomic
// round trip that thread 0 otherwise makes before the selection) and warps 2 .. stage x, so the first routed loads
// go out one L2 round trip or two sooner.  Measured (H200, 2026-12-01, bench_ab.py --env
// KDA_RT_DOWN_GEMV,KDA_RT_GEMV_SIGNAL_OVERLAP --values 0:0,0:1,1:1,2:1 --rounds 3 --prompts 0 --replays 1; value 2
// was moe_gemv_down's register variant, since removed): batch 1 2.1950 against 2.2079 ms (-0.6%, every round).
// Tried on branch next/gemv-fused-down: the down projection as this kernel's second phase (items wait on per-tile
// counts of stored h features): 2.3406 against 2.2923 ms (+2.1%): its down loads start only after the gate/up
// units, where the separate down GEMM copies its first weights while the GEMV still runs.
// Compile-time constants: KW (the reduction width, a multiple of 8), INTER, WARPS (warps per CTA), PIPE (0 / 1);
// ROUTED, and then NE (routed experts), MAX_TOP_K, SHARED (0 / 1), SHARED_FIRST (0 / 1), SIGNAL_OVERLAP (0 / 1).
// WFMT (every kernel here): 0 bf16 weights, 1 e4m3 with an fp32 scale a row (KW % 16 == 0, sm_89+).
// DENSE = 1: KW, WARPS, DENSE_PRE (0, 1 or 2), WFMT and MROWS (1-4 x rows) only.  DOWN = 1 (moe_gemv_down): KW, WARPS, NOUT, MAX_TILES, STAGES.
#include "common.cuh"

#ifndef DENSE
#define DENSE 0
#endif
#ifndef DOWN
#define DOWN 0
#endif
#if !defined(KW) || !defined(WARPS) || (!DENSE && !DOWN && (!defined(PIPE) || !defined(INTER)))
#error "moe_gemv.cu needs -DKW -DWARPS and (unless DENSE or DOWN) -DPIPE -DINTER"
#endif
#if DOWN && (DOWN != 1 || !defined(NOUT) || !defined(MAX_TILES) || NOUT % 2 || !defined(STAGES))
#error "moe_gemv.cu with DOWN = 1 needs -DNOUT (even) -DMAX_TILES -DSTAGES"
#endif
#ifndef ROUTED
#define ROUTED 0
#endif
#ifndef SHARED_FIRST
#define SHARED_FIRST 0
#endif
#ifndef SIGNAL_OVERLAP
#define SIGNAL_OVERLAP 0
#endif
#if ROUTED && SIGNAL_OVERLAP && WARPS < 3
#error "moe_gemv.cu: SIGNAL_OVERLAP needs 3 or more compute warps (warp 0 selects, warp 1 counts, the rest stage x)"
#endif
#if ROUTED && (!defined(NE) || !defined(MAX_TOP_K) || !defined(SHARED) || MAX_TOP_K + SHARED > 32)
#error "moe_gemv.cu with ROUTED needs -DNE -DMAX_TOP_K -DSHARED (MAX_TOP_K + SHARED <= 32)"
#endif
#if KW % 8
#error "moe_gemv.cu: KW must be a multiple of 8 (16-byte pieces)"
#endif
#define PIECES (KW / 8)                  // 16-byte pieces of one bf16 row (x, and bf16 weight rows)
#define PER_LANE ((PIECES + 31) / 32)    // pieces of one row per lane
#ifndef WFMT
#define WFMT 0
#endif
#if WFMT == 1  // e4m3 weights, one fp32 scale a row (loader/quant.py): 16 weights a 16-byte piece
#if KW % 16
#error "moe_gemv.cu: WFMT = 1 (e4m3 weights) needs KW % 16 == 0"
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#error "moe_gemv.cu: WFMT = 1 needs sm_89 or newer (cvt.rn.f16x2.e4m3x2)"
#endif
#define W_PIECES (KW / 16)
typedef unsigned char wtype;  // e4m3 bits
#elif WFMT == 0
#define W_PIECES PIECES
typedef bf16 wtype;
#else
#error "moe_gemv.cu: WFMT must be 0 (bf16) or 1 (e4m3 with row scales)"
#endif
#define W_PER_LANE ((W_PIECES + 31) / 32)  // weight pieces of one row per lane

__device__ __forceinline__ uint4 ld_once(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Σ over the 8 bf16 pairs of two 16-byte pieces, into acc (fp32 FMA in element order)
__device__ __forceinline__ float dot8(uint4 w, uint4 x, float acc) {
    const unsigned wv[4] = {w.x, w.y, w.z, w.w}, xv[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 a = bf16x2_to_float2(wv[i]), b = bf16x2_to_float2(xv[i]);
        acc = fmaf(a.x, b.x, acc);
        acc = fmaf(a.y, b.y, acc);
    }
    return acc;
}

#if WFMT == 1
// two e4m3 values (the low byte first in memory) as floats, exactly (e4m3 -> f16 -> f32 loses nothing)
__device__ __forceinline__ float2 e4m3x2_to_float2(unsigned pair) {
    unsigned h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)pair));
    float lo, hi;
    asm("{.reg .b16 l, u;\n mov.b32 {l, u}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, u;}" : "=f"(lo), "=f"(hi) : "r"(h));
    return make_float2(lo, hi);
}

// Σ over 16 e4m3 weights (one 16-byte piece) times the matching 16 bf16 x values (two pieces), into acc (fp32
// FMA in element order)
__device__ __forceinline__ float dot16_e4m3(uint4 w, uint4 x0, uint4 x1, float acc) {
    const unsigned wv[4] = {w.x, w.y, w.z, w.w}, xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float2 a = e4m3x2_to_float2(wv[i / 2] >> (16 * (i & 1))), b = bf16x2_to_float2(xv[i]);
        acc = fmaf(a.x, b.x, acc);
        acc = fmaf(a.y, b.y, acc);
    }
    return acc;
}
#endif

// the lane's pieces of a unit's two weight rows (WFMT = 1: also the rows' scales, set by the caller)
struct Rows {
    uint4 a[W_PER_LANE], b[W_PER_LANE];
#if WFMT == 1
    float sa, sb;
#endif
};

// the lane's pieces of two weight rows of W_PIECES 16-byte pieces (bf16: 8 weights a piece; e4m3: 16)
__device__ __forceinline__ void load_rows(Rows& r, const void* ra, const void* rb, int lane) {
    const uint4 *a = reinterpret_cast<const uint4*>(ra), *b = reinterpret_cast<const uint4*>(rb);
#pragma unroll
    for (int j = 0; j < W_PER_LANE; ++j) {
        const int p = lane + 32 * j;
        r.a[j] = p < W_PIECES ? ld_once(a + p) : make_uint4(0, 0, 0, 0);
        r.b[j] = p < W_PIECES ? ld_once(b + p) : make_uint4(0, 0, 0, 0);
    }
}

// both rows' products with x (shared memory), summed over the warp (every lane gets them); WFMT = 1: times the
// rows' scales after the sum
__device__ __forceinline__ float2 reduce_rows(const Rows& r, const uint4* xs, int lane) {
    float sa = 0.f, sb = 0.f;
#pragma unroll
    for (int j = 0; j < W_PER_LANE; ++j) {
        if (lane + 32 * j >= W_PIECES) continue;  // (its rows are zeros)
#if WFMT == 1
        const int p = lane + 32 * j;
        const uint4 x0 = xs[2 * p], x1 = xs[2 * p + 1];
        sa = dot16_e4m3(r.a[j], x0, x1, sa);
        sb = dot16_e4m3(r.b[j], x0, x1, sb);
#else
        const uint4 xv = xs[lane + 32 * j];     // 16 bytes a lane, consecutive: no bank conflicts
        sa = dot8(r.a[j], xv, sa);
        sb = dot8(r.b[j], xv, sb);
#endif
    }
#if WFMT == 1
    return make_float2(warp_sum(sa) * r.sa, warp_sum(sb) * r.sb);
#else
    return make_float2(warp_sum(sa), warp_sum(sb));
#endif
}

// barrier of the WARPS compute warps (the routed variant's extra warp never joins it)
__device__ __forceinline__ void compute_sync() {
#if ROUTED
    asm volatile("bar.sync 1, %0;\n" :: "n"(32 * WARPS) : "memory");
#else
    __syncthreads();
#endif
}

// x [KW] bf16 into shared memory (every compute thread of the CTA takes part)
__device__ __forceinline__ void stage_x(uint4* xs, const bf16* __restrict__ x) {
    for (int p = threadIdx.x; p < PIECES; p += 32 * WARPS) xs[p] = __ldcg(reinterpret_cast<const uint4*>(x) + p);
    compute_sync();
}

// The units [u0, u1) of this warp over `units`
__device__ __forceinline__ int2 warp_units(long long units) {
    const long long warps = (long long)gridDim.x * WARPS, warp = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5);
    return make_int2((int)(warp * units / warps), (int)((warp + 1) * units / warps));
}

#if !DENSE && !DOWN
// WFMT = 1: the scales of a unit's gate row (index g of w13's rows) and its up row (g + INTER); nothing for bf16
__device__ __forceinline__ void row_scales(Rows& r, const float* __restrict__ scale13, size_t g) {
#if WFMT == 1
    r.sa = __ldg(scale13 + g);
    r.sb = __ldg(scale13 + g + INTER);
#endif
}

struct Unit {  // feature f of tile t: expert e, output row `row`
    int t, e, row;
};

#if ROUTED
#include "moe_select.cuh"

// Only the extra warp waits for the kernel before (the routing kernel) and then lets the next launch go; the
// compute warps start on the routing kernel's signal (await_signal) instead (tests/kernels/test_pdl.py lists this
// entry).
#define GEMV_PDL_ENTRY()                                                                                     \
    do {                                                                                                     \
        if (threadIdx.x >= 32 * WARPS) {                                                                     \
            KDA_PDL_ENTRY();                                                                                 \
            return;                                                                                          \
        }                                                                                                    \
    } while (0)

// Spin until the routing kernel's blocks have all signalled (acquire; thread 0 of the CTA).  A signal that never
// comes (a routing launch without signal_ready before this one: a launcher bug) traps after some seconds instead of
// hanging the GPU.
__device__ __forceinline__ void await_signal(const int* done, int target) {
    unsigned v;
    for (long long spins = 0;; ++spins) {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(done + 1) : "memory");
        if ((int)v >= target) break;
        if (spins > (1ll << 22)) __trap();
        __nanosleep(64);
    }
}

// Count this CTA in done[2] (acq_rel: the CTA's read of done[1], before it in the CTA's order, comes before the last
// one's reset); that last CTA resets both words (every CTA has stopped reading done[1] by then).  One thread.
__device__ __forceinline__ void count_reset(int* done) {
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(old) : "l"(done + 2) : "memory");
    if (old == gridDim.x - 1) {
        done[1] = 0;
        done[2] = 0;
    }
}

#else
#define GEMV_PDL_ENTRY() KDA_PDL_ENTRY()
#endif

extern "C" __global__ void __launch_bounds__(32 * (WARPS + ROUTED))
moe_gemv_gate_up(const bf16* __restrict__ x, const wtype* __restrict__ w13, const int* __restrict__ tile_expert,
                 const int* __restrict__ tile_row, const int* __restrict__ num_tiles, bf16* __restrict__ h,
                 const float* __restrict__ logits, const float* __restrict__ bias, int top_k, int* done,
                 int ready_target, const float* __restrict__ scale13) {
    GEMV_PDL_ENTRY();
#if ROUTED
#ifdef CHAIN_PROBE
    // thread 0's stamps (in shared memory: registers are at the cap here): 0 resident, 1 / 2 the signal seen
    // (earliest / latest CTA), 3 the CTA's selection done; from the warps' own (probe_w, lane 0 of each): 4 the first
    // routed unit reduced (earliest; with SHARED_FIRST, else the warp's first unit), 5 the last unit (the GEMV's end)
    __shared__ unsigned long long probe_t[PROBE_EVENTS], probe_w[WARPS][2];
    if (threadIdx.x == 0) probe_t[0] = probe_now();
    if ((threadIdx.x & 31) == 0) probe_w[threadIdx.x >> 5][0] = ~0ull, probe_w[threadIdx.x >> 5][1] = 0ull;
#endif
    __shared__ int bins_sh[32];
    __shared__ uint4 xs[PIECES];
    const int lane = threadIdx.x & 31;
    auto rows = [&](Rows& r, Unit& c, int u) {  // loads unit u's rows
        const int t = u / INTER;
        if (t != c.t) c.t = t, c.e = bins_sh[t], c.row = t;
        const size_t gate = (size_t)c.e * 2 * INTER + (u - t * INTER);  // the unit's gate row in w13
        load_rows(r, w13 + gate * KW, w13 + (gate + INTER) * KW, lane);
        row_scales(r, scale13, gate);
    };
    Rows cur;
    Unit c{-1, 0, 0};
#if SHARED && SHARED_FIRST
    // the shared expert's units first, spread over every warp (its slot E is the largest bin: tile top_k), the
    // first one's rows loaded before the routing kernel's signal; then the routed tiles 0 .. top_k - 1
    const int2 sh = warp_units(INTER), rt = warp_units((long long)top_k * INTER);
    const int nsh = sh.y - sh.x, n = nsh + rt.y - rt.x;
    auto unit_of = [&](int i) { return i < nsh ? top_k * INTER + sh.x + i : rt.x + i - nsh; };
    if (nsh > 0) c = Unit{top_k, NE, top_k}, rows(cur, c, unit_of(0));
#else
    const int2 range = warp_units((long long)(top_k + SHARED) * INTER);
    const int n = range.y - range.x, nsh = 0;  // (nothing loaded before the signal)
    auto unit_of = [&](int i) { return range.x + i; };
#endif
#if SIGNAL_OVERLAP
    if (threadIdx.x == 0) {
        await_signal(done, ready_target);
#ifdef CHAIN_PROBE
        probe_t[1] = probe_t[2] = probe_now();
#endif
    }
    compute_sync();  // (orders thread 0's read of the signal before warp 1's count below)
    if (threadIdx.x >= 32 && threadIdx.x < 64) {
        if (threadIdx.x == 32) count_reset(done);  // the count's round trip off warp 0's path
    } else if (threadIdx.x >= 64) {  // meanwhile x into shared memory (warps 2 ..)
        for (int p = threadIdx.x - 64; p < PIECES; p += 32 * (WARPS - 2))
            xs[p] = __ldcg(reinterpret_cast<const uint4*>(x) + p);
    }
#else
    if (threadIdx.x == 0) {
        await_signal(done, ready_target);
#ifdef CHAIN_PROBE
        probe_t[1] = probe_t[2] = probe_now();
#endif
        count_reset(done);
    }
    compute_sync();
#endif
    if (threadIdx.x < 32) {  // warp 0: the routing kernel's choice, then the bins in ascending order (tile t, row t)
        int id;
        float w;
        warp_route_token<NE, MAX_TOP_K>([&](int e) { return __ldcg(logits + e); }, bias, top_k, 0, 0, 1.f, &id, &w);
        const int bins = top_k + SHARED;
        const int bin = lane < top_k ? min(max(id, 0), NE - 1) : NE;  // lane top_k: the shared slot (SHARED)
        int rank = 0;
        for (int j = 0; j < bins; ++j) rank += __shfl_sync(0xffffffffu, bin, j) < bin;
        if (lane < bins) bins_sh[rank] = bin;
    }
    compute_sync();
#ifdef CHAIN_PROBE
    if (threadIdx.x == 0) probe_t[3] = probe_now();  // the CTA's selection done
#endif
    if (nsh == 0 && n > 0) rows(cur, c, unit_of(0));  // in flight while x lands in shared memory
#else
    __shared__ uint4 xs[PIECES];
    const int lane = threadIdx.x & 31;
    const int2 range = warp_units((long long)__ldcg(num_tiles) * INTER);
    const int n = range.y - range.x;
    auto unit_of = [&](int i) { return range.x + i; };
    auto rows = [&](Rows& r, Unit& c, int u) {  // loads unit u's rows, the tile's plan entries when it changes
        const int t = u / INTER;
        if (t != c.t) c.t = t, c.e = __ldcg(tile_expert + t), c.row = __ldcg(tile_row + t);
        const size_t gate = (size_t)c.e * 2 * INTER + (u - t * INTER);  // the unit's gate row in w13
        load_rows(r, w13 + gate * KW, w13 + (gate + INTER) * KW, lane);
        row_scales(r, scale13, gate);
    };
    Rows cur;
    Unit c{-1, 0, 0};
    if (n > 0) rows(cur, c, unit_of(0));  // in flight while x lands in shared memory
#endif
#if !(ROUTED && SIGNAL_OVERLAP)
    stage_x(xs, x);
#endif
    for (int i = 0; i < n; ++i) {
        const Unit here = c;
        const int u = unit_of(i);
#if PIPE
        Rows next;
        if (i + 1 < n) rows(next, c, unit_of(i + 1));
#endif
        const float2 s = reduce_rows(cur, xs, lane);
        if (lane == 0)
            h[(size_t)here.row * INTER + (u - here.t * INTER)] =
                to_bf16(round_bf16(silu(round_bf16(s.x))) * round_bf16(s.y));
#if ROUTED && defined(CHAIN_PROBE)
        if (lane == 0 && i == nsh) probe_w[threadIdx.x >> 5][0] = probe_now();  // this warp's first routed unit
        if (lane == 0 && i == n - 1) probe_w[threadIdx.x >> 5][1] = probe_now();  // this warp's last unit
#endif
#if PIPE
        cur = next;
#else
        if (i + 1 < n) rows(cur, c, unit_of(i + 1));
#endif
    }
#if ROUTED && defined(CHAIN_PROBE)
    compute_sync();  // (probe builds only) every warp's stamps in probe_w
    if (threadIdx.x == 0) {
        unsigned long long pt[PROBE_EVENTS] = {probe_t[0], probe_t[1], probe_t[2], probe_t[3], ~0ull, 0ull};
        for (int w = 0; w < WARPS; ++w) pt[4] = min(pt[4], probe_w[w][0]), pt[5] = max(pt[5], probe_w[w][1]);
        probe_post(pt, 0x3fu, 0x13u, gridDim.x);  // earliest: 0, 1, 4
    }
#endif
}
#endif  // !DENSE && !DOWN

#if DENSE
#ifndef DENSE_PRE
#define DENSE_PRE 1
#endif
#ifndef MROWS
#define MROWS 1
#endif
#if MROWS < 1 || MROWS > 4
#error "moe_gemv.cu: gemv_dense takes 1 to 4 rows of x (MROWS)"
#endif
#if MROWS > 1 && DENSE_PRE == 2
#error "moe_gemv.cu: DENSE_PRE = 2 holds two row buffers, past the registers with 2-4 x rows (ptxas spills)"
#endif
#if MROWS > 1
// MROWS rows of x (the fp8 decode GEMVs of 2-4 sequences, KDA_RT_FP8_DECODE_GEMV_MAX_T; bf16 projections of 2-4 rows,
// KDA_RT_DENSE_GEMV_MAX_T): both weight rows' products with each x row (row m's pieces at xs[m * PIECES]), each
// weight pair widened once for all MROWS rows; per x row the FMAs run in reduce_rows's order (pieces in j order,
// elements in order), so row m's sums are bit for bit those of a one-row launch on x row m
#if WFMT == 1
#define DENSE_PAIRS 8  // a piece's 16 e4m3 weights: pair i against word i % 4 of x piece 2p + i / 4
#define X_PIECE(p, i) (2 * (p) + (i) / 4)
__device__ __forceinline__ float2 weight_pair(const uint4& w, int i) {
    const unsigned v[4] = {w.x, w.y, w.z, w.w};
    return e4m3x2_to_float2(v[i / 2] >> (16 * (i & 1)));
}
#else
#define DENSE_PAIRS 4  // a piece's 8 bf16 weights: pair i against word i of x piece p
#define X_PIECE(p, i) (p)
__device__ __forceinline__ float2 weight_pair(const uint4& w, int i) {
    const unsigned v[4] = {w.x, w.y, w.z, w.w};
    return bf16x2_to_float2(v[i]);
}
#endif
__device__ __forceinline__ void reduce_rows_m(const Rows& r, const uint4* xs, int lane, float (&sa)[MROWS],
                                              float (&sb)[MROWS]) {
#pragma unroll
    for (int m = 0; m < MROWS; ++m) sa[m] = sb[m] = 0.f;
#pragma unroll
    for (int j = 0; j < W_PER_LANE; ++j) {
        const int p = lane + 32 * j;
        if (p >= W_PIECES) continue;  // (its rows are zeros)
#pragma unroll
        for (int i = 0; i < DENSE_PAIRS; ++i) {
            const float2 a = weight_pair(r.a[j], i), b = weight_pair(r.b[j], i);
#pragma unroll
            for (int m = 0; m < MROWS; ++m) {
                const uint4 xq = xs[m * PIECES + X_PIECE(p, i)];
                const unsigned xw[4] = {xq.x, xq.y, xq.z, xq.w};
                const float2 x = bf16x2_to_float2(xw[i & 3]);
                sa[m] = fmaf(a.x, x.x, sa[m]);
                sa[m] = fmaf(a.y, x.y, sa[m]);
                sb[m] = fmaf(b.x, x.x, sb[m]);
                sb[m] = fmaf(b.y, x.y, sb[m]);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MROWS; ++m) {
#if WFMT == 1
        sa[m] = warp_sum(sa[m]) * r.sa;
        sb[m] = warp_sum(sb[m]) * r.sb;
#else
        sa[m] = warp_sum(sa[m]);
        sb[m] = warp_sum(sb[m]);
#endif
    }
}
#endif
// gemv_dense (DENSE = 1): y[n] = bf16(x · W[n]ᵀ) for n < N (fp32 sums in the lanes' piece order, then the warp's
// shuffles), x [1, KW], W [N, KW], y [N] bf16; a unit is two rows (2v, 2v + 1; the last one alone when N is odd),
// cut over the grid's warps as above, the next unit's rows loaded before the current one is reduced.  The weights
// are no kernel's output: each warp loads its first DENSE_PRE (0, 1 or 2) units' rows before the programmatic-launch
// wait, so they stream while the kernel before still runs (cuBLAS, which a one-row projection otherwise takes,
// starts only when that kernel ends), and the next launch is let go at once.
// DENSE_PRE = 2 holds two row buffers in turn (239 registers a thread against 160).
// Measured (H200, 2026-12-01, tests/gpu/bench_ab.py --env KDA_RT_DENSE_GEMV,KDA_RT_DENSE_GEMV_PRE --values
// 1:1,1:2,1:0,0:1 --rounds 3 --prompts 0 --replays 1): batch-1 replay 2.2197 ms (1 unit before the wait), 2.2400 (2),
// 2.2324 (0), cuBLAS 2.2694: -2.2% with 1.  The timeline (trace_decode.py --timeline) shows the cost of loading
// early: the combine kernel before it ends ~4.7 us after the down GEMM instead of ~2.3 (its loads queue behind the
// GEMV's), more so with 2 units (19 MB); the KDA decode kernel after it then ended ~8.6 us after the GEMV (6.4
// after cuBLAS) until it loaded its state before its own wait too (kda_decode.cu EARLY_STATE).
// WFMT = 1: w holds e4m3 weights (KW bytes a row) and scale[n] each row's fp32 scale (loader/quant.py), loaded with
// the row: y[n] = bf16(scale[n] · Σ_k x[k] · float(w[n, k])) (the scale applied once, to the fp32 sum).
// MROWS > 1: x [MROWS, KW] with rows x_stride elements apart (16-byte aligned), y [MROWS, n] with rows y_stride
// apart (unused for one row).
extern "C" __global__ void __launch_bounds__(32 * WARPS)
gemv_dense(const bf16* __restrict__ x, const wtype* __restrict__ w, int n, bf16* __restrict__ y,
           const float* __restrict__ scale, int x_stride, int y_stride) {
    KDA_PDL_ENTRY_DEFERRED();
    __shared__ uint4 xs[MROWS * PIECES];
    const int lane = threadIdx.x & 31;
    const int2 range = warp_units((n + 1) / 2);
    auto rows = [&](Rows& r, int u) {  // rows 2u and 2u + 1 (2u again past the end)
        const wtype* a = w + (size_t)(2 * u) * KW;
        load_rows(r, a, 2 * u + 1 < n ? a + KW : a, lane);
#if WFMT == 1
        r.sa = __ldg(scale + 2 * u);
        r.sb = __ldg(scale + (2 * u + 1 < n ? 2 * u + 1 : 2 * u));
#endif
    };
#if MROWS == 1
    auto finish = [&](const Rows& r, int u) {  // unit u's two outputs
        const float2 s = reduce_rows(r, xs, lane);
        if (lane == 0) y[2 * u] = to_bf16(s.x);
        if (lane == 1 && 2 * u + 1 < n) y[2 * u + 1] = to_bf16(s.y);
    };
    auto stage = [&]() { stage_x(xs, x); };
#else
    auto finish = [&](const Rows& r, int u) {  // unit u's two outputs of each x row (lanes 2m and 2m + 1 store row m's)
        float sa[MROWS], sb[MROWS];
        reduce_rows_m(r, xs, lane, sa, sb);
#pragma unroll
        for (int m = 0; m < MROWS; ++m) {
            if (lane == 2 * m) y[(size_t)m * y_stride + 2 * u] = to_bf16(sa[m]);
            if (lane == 2 * m + 1 && 2 * u + 1 < n) y[(size_t)m * y_stride + 2 * u + 1] = to_bf16(sb[m]);
        }
    };
    auto stage = [&]() {  // the MROWS x rows into shared memory
        for (int p = threadIdx.x; p < MROWS * PIECES; p += 32 * WARPS) {
            const int m = p / PIECES;
            xs[p] = __ldcg(reinterpret_cast<const uint4*>(x + (size_t)m * x_stride) + (p - m * PIECES));
        }
        compute_sync();
    };
#endif
#if DENSE_PRE == 2
    Rows ra, rb;
    if (range.x < range.y) rows(ra, range.x);
    if (range.x + 1 < range.y) rows(rb, range.x + 1);
    KDA_PDL_WAIT();  // x is the kernel before's output; y may still be read by an earlier kernel
    stage();
    for (int u = range.x; u < range.y; u += 2) {
        finish(ra, u);
        if (u + 2 < range.y) rows(ra, u + 2);
        if (u + 1 >= range.y) break;
        finish(rb, u + 1);
        if (u + 3 < range.y) rows(rb, u + 3);
    }
#else
    Rows cur;
#if DENSE_PRE == 1
    if (range.x < range.y) rows(cur, range.x);
    KDA_PDL_WAIT();  // x is the kernel before's output; y may still be read by an earlier kernel
#else
    KDA_PDL_WAIT();
    if (range.x < range.y) rows(cur, range.x);
#endif
    stage();
    for (int u = range.x; u < range.y; ++u) {
        Rows next;
        if (u + 1 < range.y) rows(next, u + 1);
        finish(cur, u);
        cur = next;
    }
#endif
}
#endif  // DENSE

#if DOWN
// moe_gemv_down (DOWN = 1): the down projection of a one-token MoE step, y[r_t, d] = bf16(h[r_t] · w2[e_t, d]ᵀ)
// (fp32 sums) for every tile t of the plan (at one token a tile is one row r_t = tile_row[t], of expert e_t =
// tile_expert[t]), h [rows, KW] (KW = the expert width), w2 [E, NOUT, KW], y [rows, NOUT] bf16, rows <= MAX_TILES.
// A unit is two output features (2p, 2p + 1) of one tile; the grid's warps take contiguous runs of units as above.
// The plan is complete when this kernel launches (the gate/up GEMV before it lets the next launch go only once the
// kernel that writes the plan has finished) and the weights are no kernel's output: each warp issues its first
// STAGES units' weight rows before the programmatic-launch wait, so they stream while the gate/up GEMV still runs;
// h (the GEMV's output) is read after it.  The rows go through a ring of STAGES shared-memory stages per warp by
// cp.async (a lane copies and later reads only its own 16-byte pieces, so no barrier guards a stage), and the CTA
// stages the h rows of its own tiles after the wait: (WARPS·STAGES·2 + rows)·KW·2 bytes of shared memory (WFMT = 1:
// WARPS·STAGES·2·KW + rows·KW·2 + WARPS·STAGES·8).
// Measured (H200, 2026-12-01, full-model batch-1 graph replays): 2.1711 ms against 2.1950 with the tiled down GEMM
// (-1.1%).  A variant holding two units a warp in registers (no dynamic shared memory, so its CTAs fit beside the
// gate/up GEMV's by registers) ran 2.3961 ms (+9% on the tiled GEMM, +10% on this one) and was removed.  Ring
// depths (KDA_RT_DOWN_STAGES, branch next/down-stages): 3 2.2836, 4 2.2186, 6 2.1841 / 2.1771, 7 2.1767, 8 2.1853.
// WFMT = 1: w2 in e4m3 (KW bytes a row, KW % 16 == 0) with scale2 [E, NOUT] fp32, each output its row's scale
// times the fp32 sum (the pair of scales copied with the unit's rows, 8 bytes, by lane 0, which stores the outputs).
// Compile-time constants: KW (a multiple of 8), NOUT (even), WARPS, MAX_TILES, STAGES, WFMT.

// Σ of a unit's two rows times h (the lane's weight pieces; hv holds the matching h pieces: one a weight piece for
// bf16, two for e4m3, 2j and 2j + 1), summed over the warp
__device__ __forceinline__ float2 dot_h(const uint4* a, const uint4* b, const uint4* hv, int lane) {
    float sa = 0.f, sb = 0.f;
#pragma unroll
    for (int j = 0; j < W_PER_LANE; ++j) {
        if (lane + 32 * j >= W_PIECES) continue;
#if WFMT == 1
        sa = dot16_e4m3(a[j], hv[2 * j], hv[2 * j + 1], sa);
        sb = dot16_e4m3(b[j], hv[2 * j], hv[2 * j + 1], sb);
#else
        sa = dot8(a[j], hv[j], sa);
        sb = dot8(b[j], hv[j], sb);
#endif
    }
    return make_float2(warp_sum(sa), warp_sum(sb));
}

extern "C" __global__ void __launch_bounds__(32 * WARPS)
moe_gemv_down(const bf16* __restrict__ h, const wtype* __restrict__ w2, const int* __restrict__ tile_expert,
              const int* __restrict__ tile_row, const int* __restrict__ num_tiles, int rows, bf16* __restrict__ y,
              const float* __restrict__ scale2) {
    KDA_PDL_ENTRY_DEFERRED();
    __shared__ int te[MAX_TILES], tr[MAX_TILES];
    const int lane = threadIdx.x & 31;
    const int tiles = min(__ldcg(num_tiles), min(rows, MAX_TILES));  // one token: a tile a row (<= rows)
    if (threadIdx.x < tiles)
        te[threadIdx.x] = __ldcg(tile_expert + threadIdx.x), tr[threadIdx.x] = __ldcg(tile_row + threadIdx.x);
    __syncthreads();
    constexpr int UPT = NOUT / 2;  // units a tile
    const int2 range = warp_units((long long)tiles * UPT);
    // dynamic shared memory: [WARPS][STAGES][2][W_PIECES] weight stages, the CTA's h rows [.][PIECES], and with
    // WFMT = 1 the stages' row scales [WARPS][STAGES] float2 (lane 0 copies and reads its warp's)
    extern __shared__ uint4 dsm[];
    uint4* ring = dsm + (size_t)(threadIdx.x >> 5) * STAGES * 2 * W_PIECES;  // this warp's stages
#if WFMT == 1
    float2* scale_ring = reinterpret_cast<float2*>(dsm + (size_t)WARPS * STAGES * 2 * W_PIECES + (size_t)rows * PIECES) +
                         (threadIdx.x >> 5) * STAGES;
#endif
    auto store = [&](int i, int u, float2 s) {  // the unit's two outputs, one 4-byte store (NOUT even: aligned)
        const int t = u / UPT, p = u - t * UPT;
        if (lane == 0) {
#if WFMT == 1
            const float2 sc = scale_ring[i % STAGES];  // (lane 0's own copy: landed with the stage)
            s.x *= sc.x;
            s.y *= sc.y;
#endif
            *reinterpret_cast<__nv_bfloat162*>(y + (size_t)tr[t] * NOUT + 2 * p) = __floats2bfloat162_rn(s.x, s.y);
        }
    };
    auto issue = [&](int i) {  // unit range.x + i into stage i % STAGES; one commit group a unit, empty past the end
        const int u = range.x + i;
        if (u < range.y) {
            const int t = u / UPT, p = u - t * UPT;
            const uint4* src = reinterpret_cast<const uint4*>(w2 + ((size_t)te[t] * NOUT + 2 * p) * KW);
            uint4* dst = ring + (i % STAGES) * 2 * W_PIECES;
            for (int j = lane; j < W_PIECES; j += 32) {
                cp_async16(dst + j, src + j, 16);
                cp_async16(dst + W_PIECES + j, src + W_PIECES + j, 16);
            }
#if WFMT == 1
            if (lane == 0) cp_async8(scale_ring + i % STAGES, scale2 + (size_t)te[t] * NOUT + 2 * p);
#endif
        }
        cp_async_commit();
    };
#pragma unroll
    for (int i = 0; i < STAGES; ++i) issue(i);
    KDA_PDL_WAIT();  // h: the gate/up GEMV's output; y may still be read by an earlier kernel
    // the h rows of this CTA's tiles (its warps' units are contiguous: tiles t_lo .. t_hi)
    const long long all = (long long)tiles * UPT, warps = (long long)gridDim.x * WARPS;
    const int t_lo = (int)((long long)blockIdx.x * WARPS * all / warps) / UPT;
    const int t_hi = min(tiles - 1, (int)(((long long)(blockIdx.x + 1) * WARPS * all / warps - 1) / UPT));
    uint4* hs = dsm + (size_t)WARPS * STAGES * 2 * W_PIECES;
    for (int idx = threadIdx.x; idx < (t_hi - t_lo + 1) * PIECES; idx += 32 * WARPS)
        hs[idx] = __ldcg(reinterpret_cast<const uint4*>(h + (size_t)tr[t_lo + idx / PIECES] * KW) + idx % PIECES);
    __syncthreads();
    for (int i = 0; range.x + i < range.y; ++i) {
        cp_async_wait<STAGES - 1>();  // this lane's pieces of unit i have landed
        asm volatile("" ::: "memory");  // (the stage's loads below stay below the wait)
        const int u = range.x + i, t = u / UPT;
        const uint4* st = ring + (i % STAGES) * 2 * W_PIECES;
        constexpr int HV = WFMT == 1 ? 2 : 1;  // h pieces a weight piece
        uint4 a[W_PER_LANE], b[W_PER_LANE], hv[HV * W_PER_LANE];
#pragma unroll
        for (int j = 0; j < W_PER_LANE; ++j) {
            const int p = lane + 32 * j;
            a[j] = p < W_PIECES ? st[p] : make_uint4(0, 0, 0, 0);
            b[j] = p < W_PIECES ? st[W_PIECES + p] : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int k = 0; k < HV; ++k)
                hv[HV * j + k] = p < W_PIECES ? hs[(t - t_lo) * PIECES + HV * p + k] : make_uint4(0, 0, 0, 0);
        }
        store(i, u, dot_h(a, b, hv, lane));
        asm volatile("" ::: "memory");  // the stage's loads above stay above its refill
        issue(i + STAGES);
    }
    cp_async_wait<0>();
}
#endif  // DOWN
