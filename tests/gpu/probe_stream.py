"""Probe (one device call, ~30 s): how fast can one launch stream the bytes of a batch-1 MoE gate/up step (9
experts x 2048 rows x 2304 bf16 = 85 MB) on this GPU, and does the order of the copies matter?

The batch-1 gate/up kernel (moe_grouped_gemm_tc, 16 x 64 tiles, 6 cp.async stages) streams its 85 MB at ~3.1 TB/s
(27.6 us on the critical path, thirteenth session's trace) against ~4.3 TB/s for a large copy.  Every CTA there
copies, per stage, 128 bytes of each of its 64 weight rows (4608-byte rows): 64 pieces 4.6 KB apart.  This probe
times pure streaming kernels (no products; each thread XORs what landed, so nothing is optimised away), each as a
CUDA graph of 20 launches over 4 copies of the data (340 MB, so no launch finds its bytes in the 50 MB L2):

  strided   the MoE kernel's order: stage s of row block b = 64 rows x 128 bytes (cp.async ring of STAGES x 8 KB)
  contig    the same stages, each one contiguous 8 KB (as a tile-major weight layout would store them)
  copy      a grid-stride loop of 16-byte loads over the whole 85 MB (the copy ceiling at this size)

with the work cut into 288 CTAs (the kernel's grid: 2.18 per SM, so 24 SMs hold three) or spread evenly over
132 x k CTAs.  If `contig` beats `strided` by much, re-laying the expert weights out tile-major is the fix for the
batch-1 MoE; if both sit near `copy`, the gap is in the GEMM kernel itself (its barriers, its tail).

Run: PYTHONPATH=. python tests/gpu/probe_stream.py   (one JSON line per variant: us per launch, TB/s)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)

ROW_U4 = 2304 * 2 // 16  # 16-byte pieces per weight row (288)
ROWS = 9 * 2048  # gate/up rows of 9 experts at batch 1
BLOCK_ROWS = 64  # rows per CTA tile in the MoE kernel
STAGE_U4 = BLOCK_ROWS * 8  # 16-byte pieces per stage: 64 rows x 128 bytes = 8 KB
STAGES_PER_BLOCK = ROW_U4 // 8  # 36
TOTAL_STAGES = ROWS // BLOCK_ROWS * STAGES_PER_BLOCK  # 10368
COPIES = 4

SRC = r"""
#include <cuda_runtime.h>
__device__ __forceinline__ void cp16(void* dst, const void* src) {
    unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(s), "l"(src));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void wait_n() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// global stage g (0 <= g < total): strided: row block g / SPB, stage g % SPB (64 rows x 8 pieces of 16 bytes);
// contiguous: pieces [g * STAGE_U4, (g + 1) * STAGE_U4).  CTA c takes stages [c * total / n, (c + 1) * total / n).
extern "C" __global__ void __launch_bounds__(256) stream_stages(const uint4* __restrict__ base, int strided, int total,
                                                               unsigned long long* __restrict__ out) {
    extern __shared__ __align__(16) uint4 ring[];  // [STAGES][STAGE_U4]
    const int n = gridDim.x, c = blockIdx.x, tid = threadIdx.x, T = blockDim.x;
    const int g0 = (int)((long long)c * total / n), g1 = (int)((long long)(c + 1) * total / n);
    auto src = [&](int g, int i) -> const uint4* {
        if (!strided) return base + (size_t)g * STAGE_U4 + i;
        const int b = g / SPB, s = g - b * SPB;
        return base + ((size_t)b * BLOCK_ROWS + i / 8) * ROW_U4 + s * 8 + (i & 7);
    };
    auto issue = [&](int g) {
        if (g < g1) {
            uint4* dst = ring + ((g - g0) % STAGES) * STAGE_U4;
            for (int i = tid; i < STAGE_U4; i += T) cp16(dst + i, src(g, i));
        }
        commit();
    };
    for (int k = 0; k < STAGES - 1; ++k) issue(g0 + k);
    unsigned long long acc = 0;
    for (int g = g0; g < g1; ++g) {
        wait_n<STAGES - 2>();
        __syncthreads();
        const uint4* st = ring + ((g - g0) % STAGES) * STAGE_U4;
        for (int i = tid; i < STAGE_U4; i += T) acc ^= (unsigned long long)st[i].x ^ ((unsigned long long)st[i].w << 32);
        __syncthreads();
        issue(g + STAGES - 1);
    }
    if (acc == 0x9e3779b97f4a7c15ull) out[c] = acc;  // (never: keeps the loads)
}

extern "C" __global__ void __launch_bounds__(256) stream_copy(const uint4* __restrict__ base, long long n16,
                                                             unsigned long long* __restrict__ out) {
    unsigned long long acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
            asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(base + i + u * stride));
#pragma unroll
        for (int u = 0; u < 4; ++u) acc ^= (unsigned long long)v[u].x ^ ((unsigned long long)v[u].w << 32);
    }
    for (; i < n16; i += stride) acc ^= base[i].x;
    if (acc == 0x9e3779b97f4a7c15ull) out[blockIdx.x] = acc;
}
"""

# (name, kernel, strided, ctas, threads, stages of the ring (the copy kernel uses none))
VARIANTS = [
    ("strided-288x64-s6", "stream_stages", 1, 288, 64, 6),
    ("contig-288x64-s6", "stream_stages", 0, 288, 64, 6),
    ("strided-396x64-s6", "stream_stages", 1, 396, 64, 6),
    ("contig-396x64-s6", "stream_stages", 0, 396, 64, 6),
    ("strided-264x128-s8", "stream_stages", 1, 264, 128, 8),
    ("contig-264x128-s8", "stream_stages", 0, 264, 128, 8),
    ("strided-132x256-s12", "stream_stages", 1, 132, 256, 12),
    ("copy-528x256", "stream_copy", 0, 528, 256, 6),
]


def main() -> int:
    import cupy

    from helpers.gpu import graph_us
    from kda_rt.cuda.ops.compile import device_arch

    n16 = ROWS * ROW_U4
    nbytes = n16 * 16
    data = [cupy.random.default_rng(i).integers(0, 2**31, n16 * 4, dtype=np.int32) for i in range(COPIES)]
    out = cupy.zeros(1024, dtype=np.uint64)
    modules = {}
    for name, fn, strided, ctas, threads, stages in VARIANTS:
        if stages not in modules:
            opts = ("--std=c++17", f"--gpu-architecture={device_arch()}", f"-DSTAGES={stages}",
                    f"-DSTAGE_U4={STAGE_U4}", f"-DSPB={STAGES_PER_BLOCK}", f"-DBLOCK_ROWS={BLOCK_ROWS}",
                    f"-DROW_U4={ROW_U4}")
            modules[stages] = cupy.RawModule(code=SRC, options=opts)
        kernel = modules[stages].get_function(fn)
        smem = stages * STAGE_U4 * 16
        if smem > 48 * 1024:
            kernel.max_dynamic_shared_size_bytes = smem
        turn = [0]

        def call(stream, kernel=kernel, fn=fn, strided=strided, ctas=ctas, threads=threads, smem=smem, turn=turn):
            buf = data[turn[0] % COPIES]
            turn[0] += 1
            if fn == "stream_copy":
                kernel((ctas,), (threads,), (buf, np.int64(n16), out), stream=stream)
            else:
                kernel((ctas,), (threads,), (buf, np.int32(strided), np.int32(TOTAL_STAGES), out), shared_mem=smem,
                       stream=stream)

        us = min(graph_us(call) for _ in range(3))
        print(json.dumps({"variant": name, "MB": round(nbytes / 1e6, 1), "us": round(us, 2),
                          "tb_s": round(nbytes / us / 1e6, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
