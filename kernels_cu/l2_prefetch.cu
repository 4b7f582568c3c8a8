// l2_prefetch.cu — pull a weight region into L2 while a latency-bound kernel runs, so that the projection
// after it reads its weights from L2 instead of DRAM (decode graphs: ops/l2_prefetch.py says where).
//
// Grid ceil(chunks / 128), block 128: thread i asks L2 for bytes [i·CHUNK, (i + 1)·CHUNK) of the
// concatenation of two regions (p0, n0) and (p1, n1) with one bulk prefetch (sm_90+:
// cp.async.bulk.prefetch.L2, fire and forget; older archs: one prefetch.global.L2 per 128-byte line).
// Nothing is written.
//
// Stream order under programmatic dependent launch (common.cuh): the kernel reads only weights, so it lets
// the next launch go at once (KDA_PDL_ENTRY_DEFERRED) and issues its prefetches while the kernel before it
// may still run; it ends with KDA_PDL_WAIT(), so that it completes only after that kernel has, and the
// kernel after it (whose wait is on this one) still sees every write of the one before.
// Shapes: p0, p1 16-byte aligned, n0, n1 multiples of 16 (n1 may be 0).  Compile-time constant: CHUNK
// (bytes per thread, a multiple of 128).
#include "common.cuh"

#ifndef CHUNK
#error "l2_prefetch.cu needs -DCHUNK"
#endif
#if CHUNK % 128 != 0
#error "l2_prefetch.cu: CHUNK must be a multiple of 128"
#endif

__device__ __forceinline__ void prefetch_l2(const char* p, unsigned n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(n) : "memory");
#else
    for (unsigned off = 0; off < n; off += 128) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p + off));
#endif
}

extern "C" __global__ void __launch_bounds__(128) l2_prefetch(const char* __restrict__ p0, unsigned long long n0,
                                                              const char* __restrict__ p1, unsigned long long n1) {
    KDA_PDL_ENTRY_DEFERRED();  // weights only: the next launch may go now
    const unsigned long long c0 = (n0 + CHUNK - 1) / CHUNK, c = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const char* p = c < c0 ? p0 : p1;
    const unsigned long long n = c < c0 ? n0 : n1, off = (c < c0 ? c : c - c0) * CHUNK;
    if (off < n) prefetch_l2(p + off, (unsigned)(n - off < CHUNK ? n - off : CHUNK));
    KDA_PDL_WAIT();  // complete only after the kernel before has
}
