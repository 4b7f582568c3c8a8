// l2_probe.cu — which SMs share an L2 partition (ops/l2_partition.py): the GPU's L2 is split in partitions (two on
// H100/H200), each holding the lines of half the addresses and keeping copies of the far half's lines that its own
// SMs read; a line that SMs of both partitions read crosses the fabric between them.  Which SMs sit by which partition
// is not exposed, so it is measured: the latency of one L2 read of a line is higher from an SM whose partition holds
// neither the line nor a copy (a trip over the fabric) than from one whose partition holds it.
//   l2_touch: one CTA stores to every line (the lines land in the partitions that hold them; a store drops the other
//             partition's copies).
//   l2_probe: the first CTA that finds itself on SM `target` reads the lines one at a time, each read's address
//             depending on the one before (no overlap), and stores each read's latency in clock cycles; every other CTA
//             returns at once.  The launcher starts many small CTAs so that one lands on every SM, runs l2_touch before
//             each probe, and groups the SMs by the pattern of slow lines they see.
// lines: n (<= PROBE_MAX_LINES) lines of 128 bytes, `stride` 4-byte words apart.  out: [n] latencies (int64),
// written by one CTA after its last read; seen: a flag the launcher zeroes before the launch.  zero: 0 at run time (the dependency the compiler cannot drop).
#include "common.cuh"

extern "C" __global__ void l2_touch(unsigned* __restrict__ lines, int n, int stride) {
    KDA_PDL_ENTRY();
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        asm volatile("st.global.cg.u32 [%0], %1;" ::"l"(lines + (size_t)i * stride), "r"((unsigned)i) : "memory");
}

// l2_nsmid: %nsmid, the bound of the %smid values (not always the SM count: PTX does not promise contiguous ids)
extern "C" __global__ void l2_nsmid(int* __restrict__ out) {
    KDA_PDL_ENTRY();
    unsigned n;
    asm volatile("mov.u32 %0, %%nsmid;" : "=r"(n));
    if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = (int)n;
}

#define PROBE_MAX_LINES 512

extern "C" __global__ void l2_probe(const unsigned* __restrict__ lines, int n, int stride, int target,
                                    long long* __restrict__ out, int* __restrict__ seen, unsigned zero) {
    KDA_PDL_ENTRY();
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    if ((int)smid != target || threadIdx.x != 0 || atomicExch(seen, 1) != 0) return;
    __shared__ unsigned sink;
    __shared__ int lat[PROBE_MAX_LINES];  // (kept here until the last read: no global store between the reads)
    unsigned dep = 0;
    n = min(n, PROBE_MAX_LINES);
#pragma unroll 1
    for (int i = 0; i < n; ++i) {
        const long long t0 = clock64();
        unsigned v;
        asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(lines + (size_t)i * stride + dep) : "memory");
        // (the store waits for the value: the clock is read after it arrived)
        asm volatile("st.volatile.shared.u32 [%0], %1;" ::"r"(smem_addr(&sink)), "r"(v) : "memory");
        const long long t1 = clock64();
        lat[i] = (int)min(t1 - t0, 0x7fffffffll);
        dep = v * zero;
    }
    for (int i = 0; i < n; ++i) out[i] = lat[i];
}
