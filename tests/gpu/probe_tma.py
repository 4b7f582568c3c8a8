"""Probe (one device call): can we build a Hopper tensor map through ctypes on libcuda
(cuTensorMapEncodeTiled, no CUDA Python bindings), keep it in global memory, and load a
128-byte-swizzled bf16 tile with cp.async.bulk.tensor (plain and multicast over a cluster of 2)?
H200, 2026-12-01: all three cases land as expected (docs/PERFORMANCE.md, tenth session).  The maps
come from kda_rt/cuda/ops/tma.py (what moe_gemm_wg.cu's B_TMA launcher uses: 2-D, 128-byte swizzle).
Prints what landed against the expected swizzled layout.  Run: PYTHONPATH=. python tests/gpu/probe_tma.py"""

from __future__ import annotations

import numpy as np

SRC = r"""
#include <cuda_bf16.h>
__device__ __forceinline__ unsigned sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
extern "C" __global__ void __cluster_dims__(1, 2, 1) probe(const void* tmap, unsigned short* out, int row0, int col0, int mc) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* buf = (unsigned char*)(((size_t)smem_raw + 1023) & ~(size_t)1023);
    __shared__ __align__(8) unsigned long long bar;
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(sa(&bar)));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("prefetch.tensormap [%0];" :: "l"(tmap) : "memory");
    }
    asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
    const unsigned bytes = 128 * 128;  // box 64 cols x 128 rows of bf16
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(sa(&bar)), "r"(bytes) : "memory");
        if (!mc) {
            asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                         :: "r"(sa(buf)), "l"(tmap), "r"(col0), "r"(row0), "r"(sa(&bar)) : "memory");
        } else {
            // each CTA loads half the rows (64) and multicasts them to both CTAs (mask 0b11)
            const unsigned short mask = 3;
            asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;"
                         :: "r"(sa(buf + rank * 64 * 128)), "l"(tmap), "r"(col0), "r"(row0 + 64 * (int)rank), "r"(sa(&bar)), "h"(mask) : "memory");
        }
    }
    // wait for phase 0
    asm volatile("{\n.reg .pred p;\nW: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n@!p bra W;\n}" :: "r"(sa(&bar)) : "memory");
    for (int i = threadIdx.x; i < bytes / 2; i += blockDim.x) out[rank * (bytes / 2) + i] = ((unsigned short*)buf)[i];
    asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
"""

def main():
    import cupy

    from kda_rt.cuda.ops.tma import map_2d_swizzled

    rows, cols = 1000, 256
    a = cupy.arange(rows * cols, dtype=np.uint32).astype(np.uint16).reshape(rows, cols)  # bf16 bits = index
    maps = {box: map_2d_swizzled(a, box, "the probe's array") for box in (128, 64)}  # multicast: 64-row boxes a CTA
    mod = cupy.RawModule(code=SRC, options=("--std=c++17", "-arch=sm_90a"))
    fn = mod.get_function("probe")
    fn.max_dynamic_shared_size_bytes = 128 * 128 + 1024
    for mc, row0, col0 in ((0, 3, 64), (1, 200, 128), (0, 936, 192)):
        out = cupy.full(2 * 128 * 64, 0xFFFF, dtype=np.uint16)
        fn((1, 2), (128,), (maps[64 if mc else 128], out, np.int32(row0), np.int32(col0), np.int32(mc)), shared_mem=128 * 128 + 1024)
        cupy.cuda.Device().synchronize()
        got = out.get().reshape(2, 128, 64)
        host = a.get()
        exp = np.zeros((128, 64), np.uint16)
        for r in range(128):
            for c in range(8):
                sc = c ^ (r & 7)
                src_r = row0 + r
                vals = host[src_r, col0 + 8 * c: col0 + 8 * c + 8] if src_r < rows else np.zeros(8, np.uint16)
                exp[r, 8 * sc: 8 * sc + 8] = vals
        ok = [bool((got[k] == exp).all()) for k in range(2)]
        print(f"tma probe mc={mc} row0={row0} col0={col0}: cta0 {ok[0]} cta1 {ok[1]}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        raise SystemExit(1) from None
