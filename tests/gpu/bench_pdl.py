"""Programmatic dependent launch (kda_rt/cuda/ops/pdl.py) on a chain of dependent kernels: time per kernel
in CUDA-graph replay and eagerly, plain CuPy launches against PDL launches, and a check that the
chain's result is exact (each kernel adds 1 to what the previous one wrote: a kernel that read early
would lose an increment).

    PYTHONPATH=. python tests/gpu/bench_pdl.py
One JSON line per (shape, mode) on stdout.
"""

from __future__ import annotations

import json
import time

import cupy
import numpy as np

from kda_rt.cuda.ops import pdl

SOURCE = r"""
extern "C" __global__ void chain(const float* __restrict__ src, float* __restrict__ dst, int n, int work, int use_pdl) {
#if __CUDA_ARCH__ >= 900
    if (use_pdl) {
        asm volatile("griddepcontrol.wait;\n" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    }
#endif
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float acc = 0.f;
        for (int j = 0; j < work; ++j) acc = fmaf(acc, 0.5f, 1.f);  // stays below 2: adds nothing below
        dst[i] = src[i] + 1.f + (acc > 3.f ? 1.f : 0.f);
    }
}
"""
CHAIN, REPLAYS = 256, 10
SHAPES = {"tiny (132 x 256, no work)": (132, 256, 0), "one wave, ~3 us of work": (132 * 2, 256, 1500),
          "8 waves, short blocks": (132 * 16, 256, 100)}


def _chain(fn, stream, bufs, mode: str, blocks: int, threads: int, work: int) -> None:
    n, use = np.int32(bufs[0].size), np.int32(mode != "cupy")
    for k in range(CHAIN):
        args = (bufs[k % 2], bufs[(k + 1) % 2], n, np.int32(work), use)
        if mode == "pdl":
            pdl.launch(fn, (blocks,), (threads,), args, stream=stream)
        else:
            fn((blocks,), (threads,), args, stream=stream)


def _measure(fn, stream, mode: str, blocks: int, threads: int, work: int) -> dict:
    n = blocks * threads
    bufs = [cupy.arange(n, dtype=np.float32), cupy.empty(n, dtype=np.float32)]
    with stream:
        _chain(fn, stream, bufs, mode, blocks, threads, work)  # warm (module load)
        stream.synchronize()
        t0 = time.perf_counter()
        _chain(fn, stream, bufs, mode, blocks, threads, work)
        host_us = (time.perf_counter() - t0) / CHAIN * 1e6
        ev = [cupy.cuda.Event(), cupy.cuda.Event()]
        ev[0].record(stream)
        _chain(fn, stream, bufs, mode, blocks, threads, work)
        ev[1].record(stream)
        ev[1].synchronize()
        eager_us = cupy.cuda.get_elapsed_time(*ev) * 1e3 / CHAIN
        stream.begin_capture()
        _chain(fn, stream, bufs, mode, blocks, threads, work)
        graph = stream.end_capture()
        graph.launch(stream)
        ev[0].record(stream)
        for _ in range(REPLAYS):
            graph.launch(stream)
        ev[1].record(stream)
        ev[1].synchronize()
        graph_us = cupy.cuda.get_elapsed_time(*ev) * 1e3 / (CHAIN * REPLAYS)
    # chain runs: warm, host timing, eager timing, the first replay, REPLAYS replays; +1 each kernel
    expect = cupy.arange(n, dtype=np.float32) + CHAIN * (4 + REPLAYS)
    return {"graph_us_per_kernel": round(graph_us, 3), "eager_us_per_kernel": round(eager_us, 3),
            "host_us_per_launch": round(host_us, 2), "exact": bool((bufs[0] == expect).all())}


def main() -> int:
    fn = cupy.RawModule(code=SOURCE, options=("--std=c++17",)).get_function("chain")
    stream = cupy.cuda.Stream(non_blocking=True)
    for label, (blocks, threads, work) in SHAPES.items():
        for mode in ("cupy", "cupy+wait", "pdl"):
            row = _measure(fn, stream, mode, blocks, threads, work)
            print(json.dumps({"shape": label, "mode": mode, **row}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
