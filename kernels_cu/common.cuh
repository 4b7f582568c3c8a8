// common.cuh — shared helpers for every kda_rt kernel: bf16 <-> fp32, warp/block reductions,
// accurate sigmoid / SiLU, the bf16 tensor-core MMA, vector loads.  Included by each
// kernels_cu/<op>.cu; compiled by NVRTC (kda_rt/cuda/ops/compile.py) with -std=c++17 and the arch
// of the device (sm_90a on Hopper, sm_100a on Blackwell).
#pragma once
#include <cuda_bf16.h>
// NVRTC has no libc headers: use the built-in fixed-width types (int64_t etc. come with cuda_bf16.h)

typedef __nv_bfloat16 bf16;

// Programmatic dependent launch (sm_90+).  Every kernel starts with KDA_PDL_ENTRY(): it waits until the
// kernel before it in the stream has completed and its writes are visible (griddepcontrol.wait; a no-op
// unless this launch carried the programmatic-serialization attribute), then lets the next such launch
// be scheduled (griddepcontrol.launch_dependents), so that its launch and ramp overlap this kernel's
// run.  Waiting first, before any memory access, keeps the stream order exact for every kernel that
// follows (kda_rt/cuda/ops/pdl.py launches with the attribute while a decode graph is captured;
// tests/kernels/test_pdl.py checks that every __global__ in kernels_cu/ starts with this line).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KDA_PDL_ENTRY()                                             \
    do {                                                            \
        asm volatile("griddepcontrol.wait;\n" ::: "memory");        \
        asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); \
    } while (0)
// A kernel that first reads only what no earlier kernel of the same decode graph writes may start with
// KDA_PDL_ENTRY_DEFERRED() instead: the next launch is let go at once, and the kernel itself executes
// KDA_PDL_WAIT() before its first access to anything an earlier kernel of the graph writes, and before any write
// (tests/kernels/test_pdl.py allows this form only in the kernels it lists).  What such a kernel may read first:
// weights; the plan when the kernel before it let it go only after the plan's writer finished; the step's
// metadata and a KDA layer's recurrent state.  This holds because the attribute is set only while a decode graph
// is captured (pdl.py): replays never overlap, the metadata is copied in outside the graph, a decode graph holds no
// prefill kernel, and each layer's pools are written only by that layer's one decode kernel.  Adding programmatic
// launches to eager or mixed steps, or several steps to one graph, means revisiting these kernels.
#define KDA_PDL_ENTRY_DEFERRED() asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory")
#define KDA_PDL_WAIT() asm volatile("griddepcontrol.wait;\n" ::: "memory")
// KDA_PDL_WAIT_AFTER(dep): the same wait, issued only once the 32-bit value `dep` is in a register.  ptxas issues
// griddepcontrol.wait as early as it can, above loads into registers that do not feed it (nvcc 13 SASS for sm_90a,
// 2026-12-01: moe_route_fused's and skinny_gemm_cl's early weight loads went out after the wait, so they did not
// stream while the kernel before ran; cp.async copies stay in place).  A kernel that loads weights into registers
// before its wait passes a value made from every such load (an OR of one word of each): the loads are then issued
// first and have arrived when the wait is issued, which costs nothing while the kernel before still runs.  Both
// arms of the predicate wait.  PDL_DEP=0 (bench switch KDA_RT_PDL_DEP=0) builds the plain wait instead.
#ifndef PDL_DEP
#define PDL_DEP 1
#endif
#if PDL_DEP
#define KDA_PDL_WAIT_AFTER(dep)                                                                        \
    asm volatile("{\n .reg .pred p;\n setp.ne.u32 p, %0, 0;\n @p griddepcontrol.wait;\n @!p griddepcontrol.wait;\n}\n" \
                 ::"r"(dep) : "memory")
#else
#define KDA_PDL_WAIT_AFTER(dep) KDA_PDL_WAIT()
#endif
#else
#define KDA_PDL_ENTRY() \
    do {                \
    } while (0)
#define KDA_PDL_ENTRY_DEFERRED() \
    do {                         \
    } while (0)
#define KDA_PDL_WAIT() \
    do {               \
    } while (0)
#define KDA_PDL_WAIT_AFTER(dep) \
    do {                        \
        (void)(dep);            \
    } while (0)
#endif

// ---------------------------------------------------------------------------------------------
// conversions

__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 to_bf16(float x) { return __float2bfloat16_rn(x); }
// x rounded to the nearest bf16, kept in fp32: where a reference stores a bf16 tensor
__device__ __forceinline__ float round_bf16(float x) { return to_f32(to_bf16(x)); }
// two packed bf16 (low half first) -> float2;  four bf16 at p (8-byte aligned) -> float4
__device__ __forceinline__ float2 bf16x2_to_float2(unsigned u) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
}
__device__ __forceinline__ float4 ld_bf16x4(const bf16* p) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const float2 lo = bf16x2_to_float2(u.x), hi = bf16x2_to_float2(u.y);
    return make_float4(lo.x, lo.y, hi.x, hi.y);
}

// four floats -> four bf16 at p (8-byte aligned), each rounded to nearest even
__device__ __forceinline__ void st_bf16x4(bf16* p, float a, float b, float c, float d) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(a, b), hi = __floats2bfloat162_rn(c, d);
    uint2 packed;
    packed.x = *reinterpret_cast<unsigned*>(&lo);
    packed.y = *reinterpret_cast<unsigned*>(&hi);
    *reinterpret_cast<uint2*>(p) = packed;
}

// -inf (NVRTC has no math.h INFINITY)
__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// ---------------------------------------------------------------------------------------------
// reductions (all lanes / threads get the result)

// Sum / max over aligned groups of Lanes lanes (a power of two <= 32; the whole warp by default).
// Template parameters are mixed case: kernels pass their upper-case constants as -D macros.
template <int Lanes = 32>
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = Lanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <int Lanes = 32>
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = Lanes / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sums of Count values per thread, added in warp order.  `scratch` is shared memory with
// one row per warp of the block.  Ends with a barrier so scratch can be reused right after.
template <int Warps, int Count>
__device__ __forceinline__ void block_sum(float (&v)[Count], float (&scratch)[Warps][Count]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int i = 0; i < Count; ++i) v[i] = warp_sum(v[i]);
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < Count; ++i) scratch[warp][i] = v[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < Count; ++i) v[i] = 0.f;
#pragma unroll
    for (int w = 0; w < Warps; ++w) {
#pragma unroll
        for (int i = 0; i < Count; ++i) v[i] += scratch[w][i];
    }
    __syncthreads();
}

// one value per thread
template <int Warps>
__device__ __forceinline__ float block_sum(float v, float (&scratch)[Warps]) {
    float total[1] = {v};
    block_sum(total, reinterpret_cast<float(&)[Warps][1]>(scratch));
    return total[0];
}

// ---------------------------------------------------------------------------------------------
// math: accurate expf (no __expf), as every reference computes these in fp32 or better

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }
// silu with the quotient x / (1 + e^-x) from one Newton step on the hardware reciprocal (within an ulp of
// IEEE division, so the same after a bf16 rounding but for rare ties): IEEE division compiles around a
// slow-path call whose branches keep the compiler from overlapping neighbouring quotients.  e^-x = inf
// (x < -88) gives -0, as the division does.
__device__ __forceinline__ float silu_quotient(float x, float y) {  // x / y, y = 1 + e^-x
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(y));
    const float q0 = x * r, q = fmaf(fmaf(-y, q0, x), r, q0);
    return y == __int_as_float(0x7f800000) ? 0.f * x : q;
}
__device__ __forceinline__ float silu_nr(float x) { return silu_quotient(x, 1.f + expf(-x)); }
// 2^x by the hardware exponential alone (ex2.approx.ftz: relative error ~2^-22; 0 below 2^-126, inf above
// 2^128): no range reduction, for callers whose result is rounded to bf16 or feeds a log1p
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ---------------------------------------------------------------------------------------------
// tensor cores and async copies (sm_80+)

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; src_bytes = 0 zero-fills the destination.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
// 8-byte async copy global -> shared (through L1: .cg takes only 16 bytes)
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// mbarriers and bulk copies (sm_90+).  A bulk copy (cp.async.bulk) is one instruction of one thread for a whole
// contiguous piece (16-byte aligned, a multiple of 16 bytes), done by the copy engine off the load/store path; it
// completes by its bytes on an mbarrier, and a thread whose wait on that barrier returns sees them.
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// one arrival on bar, with the bytes the copies completing on it will bring
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_copy_g2s(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// `bytes` of shared memory at src into global memory at dst by the copy engine (bulk group of the issuing thread).
// Every thread that wrote those bytes must have run fence_proxy_async_smem() and met the issuing thread at a barrier
// first; the issuing thread commits and, before the CTA may leave (the shared memory must outlive the copy's reads),
// waits with bulk_wait_read<0>().
__device__ __forceinline__ void bulk_copy_s2g(void* dst, unsigned src, unsigned bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"); }
// a box of a 2D tensor map (cp.async.bulk.tensor, TMA; map: the generic address of a CUtensorMap in global memory,
// ops/tma.py) at coordinates (c0 inner, c1 outer) into shared memory at dst, completing by its bytes on bar
__device__ __forceinline__ void tma_load_2d(unsigned dst, const void* map, int c0, int c1, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
                 "[%4];\n" ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
// the generic proxy's earlier shared-memory accesses ordered before the async proxy's (bulk copies) that follow
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    for (unsigned done = 0; !done;)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}


// c[16x8] += a[16x16] · b[16x8], bf16 inputs, fp32 accumulators (standard fragment layouts:
// a0..a3 and b0, b1 are packed bf16 pairs in the PTX order)
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---------------------------------------------------------------------------------------------
// varlen batches

// Index b of the sequence holding flat token t: the largest b with cu_seqlens[b] <= t.
__device__ __forceinline__ int sequence_of(const int* __restrict__ cu_seqlens, int num_seqs, int t) {
    int lo = 0, hi = num_seqs;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (__ldg(cu_seqlens + mid) <= t) lo = mid; else hi = mid;
    }
    return lo;
}

// 8 bf16 = 16 bytes: one vector load / store
struct __align__(16) bf16x8 { bf16 v[8]; };

// ---------------------------------------------------------------------------------------------
// thread-block clusters (sm_90+ PTX: only kernels that launch as clusters call these)

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// every thread of every CTA of the cluster calls arrive then wait (uniform control flow)
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
// the shared::cluster address of the shared variable `p` in the CTA of cluster rank `rank`
__device__ __forceinline__ unsigned peer_addr(const void* p, unsigned rank) {
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_addr(p)), "r"(rank));
    return r;
}
// v -> the same shared variable `p` in the CTA of cluster rank `rank`
__device__ __forceinline__ void st_cluster(float* p, unsigned rank, float v) {
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(peer_addr(p, rank)), "f"(v) : "memory");
}

// ---------------------------------------------------------------------------------------------
// CHAIN_PROBE (bench only: tests/gpu/probe_route_chain.py, KDA_RT_CHAIN_PROBE=rows): kernels built with it stamp
// %globaltimer (ns) at the links of a one-token MoE step's routing chain.  A block keeps its stamps in registers
// (nothing is added to its path but the timer reads) and posts them once, at its end, into chain_probe[row][event]
// of its own module: row = the launch's index since the tool last zeroed chain_probe_blocks (every block of a
// launch counts once, after the kernel's wait, so a launch counts only after the previous one has completed); a
// slot keeps the earliest or the latest time over the launch's blocks.  The tool sets the slots to ~0 or 0 before
// each replay.  Undefined (every runtime build), none of this exists.
#ifdef CHAIN_PROBE
#define PROBE_EVENTS 8
__device__ unsigned long long chain_probe[CHAIN_PROBE][PROBE_EVENTS];
__device__ unsigned chain_probe_blocks;
__device__ __forceinline__ unsigned long long probe_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory");
    return t;
}
// One thread of the block: its stamps t[i] for the events of bit mask `events`; the events of `earliest` keep the
// launch's earliest time, the others its latest.  blocks = the launch's block count.
__device__ __forceinline__ void probe_post(const unsigned long long (&t)[PROBE_EVENTS], unsigned events,
                                           unsigned earliest, unsigned blocks) {
    const int row = (int)(atomicAdd(&chain_probe_blocks, 1u) / blocks) % CHAIN_PROBE;
#pragma unroll
    for (int i = 0; i < PROBE_EVENTS; ++i) {
        if (!(events >> i & 1)) continue;
        if (earliest >> i & 1) atomicMin(&chain_probe[row][i], t[i]);
        else atomicMax(&chain_probe[row][i], t[i]);
    }
}
#endif
