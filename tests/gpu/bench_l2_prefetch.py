"""Would prefetching a decode GEMM's weights into L2 (while latency-bound kernels run) pay?  Times the
batch-1 / batch-32 projections of the 48B shape through cuBLAS (kda_rt.cuda.gemm.linear) with their
weights cold (L2 flushed by a 160 MB write), cold after the chain below without a prefetch, and
the overlap case: a chain of SPIN short dependent kernels on the main stream while a side stream
prefetches, then the GEMM (its time = the whole minus the chain alone).  CUDA-graph replay of each case, median of 20.

    PYTHONPATH=. python tests/gpu/bench_l2_prefetch.py
One JSON line per (shape, batch, case).
"""

from __future__ import annotations

import json
import statistics

import cupy
import numpy as np

from kda_rt.cuda.gemm import linear
from kda_rt.cuda.ops.check import BF16

SOURCE = r"""
extern "C" __global__ void prefetch_l2(const char* __restrict__ p, unsigned long long bytes) {
    const unsigned long long chunk = 32768;
    for (unsigned long long off = (blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x) * chunk; off < bytes;
         off += (unsigned long long)gridDim.x * blockDim.x * chunk) {
        const unsigned n = (unsigned)(bytes - off < chunk ? bytes - off : chunk);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p + off), "r"(n) : "memory");
    }
}
extern "C" __global__ void spin_chain(float* __restrict__ buf, int n) {  // a short latency-bound step
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) buf[i] = buf[i] * 0.5f + 1.f;
}
extern "C" __global__ void flush(float4* __restrict__ buf, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        buf[i] = make_float4(1.f, 2.f, 3.f, (float)i);
}
"""
SPIN = 8  # short kernels on the main stream while the side stream prefetches (~1 us each)
SHAPES = {"o_proj": (4096, 2304), "q|k|v": (2304, 12288), "f_a|g_a|b": (2304, 288), "mla q_proj": (2304, 6144),
          "expert gate/up x9": (2304, 9 * 2048), "expert down x9": (9 * 1024, 2304)}


def graph_ms(stream, body, reps=20) -> float:
    with stream:
        body()
        stream.begin_capture()
        body()
        g = stream.end_capture()
        times = []
        for _ in range(reps):
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record(stream)
            g.launch(stream)
            b.record(stream)
            b.synchronize()
            times.append(cupy.cuda.get_elapsed_time(a, b))
    return statistics.median(times)


def main() -> int:
    mod = cupy.RawModule(code=SOURCE, options=("--std=c++17", "--gpu-architecture=sm_90a"))
    prefetch, spin, flush = (mod.get_function(n) for n in ("prefetch_l2", "spin_chain", "flush"))
    main_s, side = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    junk = cupy.empty(160 << 20 >> 2, dtype=np.float32)
    spin_buf = cupy.ones(132 * 256, dtype=np.float32)
    rng = cupy.random.default_rng(0)

    def do_flush():
        flush((528,), (256,), (junk, np.uint64(junk.size // 4)), stream=main_s)

    def do_spin(k):
        for _ in range(k):
            spin((132,), (256,), (spin_buf, np.int32(spin_buf.size)), stream=main_s)

    for name, (K, N) in SHAPES.items():
        w = (rng.standard_normal((N, K), dtype=np.float32) * 0.02).astype(BF16)
        nbytes = np.uint64(w.nbytes)
        for M in (1, 32):
            x = rng.standard_normal((M, K), dtype=np.float32).astype(BF16)
            out = cupy.empty((M, N), dtype=BF16)

            def gemm(x=x, w=w, out=out):
                with main_s:
                    linear(x, w, out=out)

            def pf(w=w, nbytes=nbytes, stream=main_s):
                prefetch((8,), (128,), (w, nbytes), stream=stream)

            base = graph_ms(main_s, do_flush)
            spin_only = graph_ms(main_s, lambda: (do_flush(), do_spin(SPIN)))
            cold = graph_ms(main_s, lambda: (do_flush(), gemm())) - base
            after_spin = graph_ms(main_s, lambda: (do_flush(), do_spin(SPIN), gemm())) - spin_only

            def overlap(pf=pf):
                do_flush()
                ev = cupy.cuda.Event(disable_timing=True)
                ev.record(main_s)
                side.wait_event(ev)
                pf(stream=side)
                do_spin(SPIN)
                done = cupy.cuda.Event(disable_timing=True)
                done.record(side)
                main_s.wait_event(done)
                gemm()

            both = graph_ms(main_s, overlap) - spin_only
            print(json.dumps({"shape": name, "M": M, "K": K, "N": N, "MB": round(w.nbytes / 1e6, 1),
                              "gemm_cold_us": round(cold * 1e3, 2), "gemm_after_spin_us": round(after_spin * 1e3, 2),
                              "spin_us": round((spin_only - base) * 1e3, 2),
                              "gemm_after_spin_with_side_prefetch_us": round(both * 1e3, 2),
                              "cold_tb_s": round(w.nbytes / cold / 1e9, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
