"""Kernel-test helpers (CuPy is imported inside the functions, never at import time): bf16 upload/download, poisoned outputs, and the error measures of
STYLE.md habit 5 (exact for copies, atol+rtol for elementwise, RMS ratio for reductions)."""

from __future__ import annotations

import functools
from pathlib import Path

import ml_dtypes
import numpy as np

__all__ = ["BF16", "to_gpu_bf16", "to_np", "poison", "bf16_round", "rms_rel", "assert_close", "rand_bf16",
           "median_ms", "graph_us", "KERNELS", "inline_module", "unused_defines"]

BF16 = np.dtype(ml_dtypes.bfloat16)
KERNELS = Path(__file__).resolve().parents[2] / "kernels_cu"  # the CUDA sources (their headers for inline modules)


def unused_defines(filename: str, names) -> list[str]:
    """The names among `names` that neither kernels_cu/<filename> nor a kernels_cu header spells: a misspelt define
    in an A/B (bench_kda_phases.py --ab, bench_moe_gemm.py --define) would build one kernel twice and time it."""
    import re

    text = "\n".join(p.read_text() for p in [KERNELS / filename, *sorted(KERNELS.glob("*.cuh"))])
    code = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)  # a dropped define's note in a comment reads nothing
    return [n for n in names if not re.search(rf"\b{re.escape(n)}\b", code)]


def inline_module(code: str):
    """A test's own CUDA source, compiled by NVRTC for this GPU with kernels_cu/ on the include path."""
    import cupy

    from kda_rt.cuda.ops.compile import device_arch

    return cupy.RawModule(code=code, options=("--std=c++17", f"-I{KERNELS}", f"--gpu-architecture={device_arch()}"))


POISON_SMEM_SRC = r"""
extern "C" __global__ void poison_smem(int words) {
    extern __shared__ unsigned smem_words[];
    for (int i = threadIdx.x; i < words; i += blockDim.x) smem_words[i] = 0xFFFFFFFFu;  // NaN in fp32, bf16, fp16
}
"""


def poison_shared_memory() -> None:
    """Fill every SM's shared memory with NaN bytes (4 blocks an SM of the opt-in maximum each), so a kernel that reads
    shared memory it never wrote sees NaN instead of what the previous launch left there."""
    import cupy

    fn, nbytes, sms = _poison_kernel(cupy.cuda.Device().id)
    fn((4 * sms,), (1024,), (np.int32(nbytes // 4),), shared_mem=nbytes)
    cupy.cuda.get_current_stream().synchronize()


@functools.cache
def _poison_kernel(dev: int):
    """poison_smem built once a device, with its shared-memory opt-in set; the opt-in bytes and the SM count."""
    import cupy

    rt = cupy.cuda.runtime
    nbytes = rt.deviceGetAttribute(getattr(rt, "cudaDevAttrMaxSharedMemoryPerBlockOptin", 97), dev) // 16 * 16
    fn = inline_module(POISON_SMEM_SRC).get_function("poison_smem")  # a cupy.RawKernel
    fn.max_dynamic_shared_size_bytes = nbytes
    return fn, nbytes, rt.deviceGetAttribute(getattr(rt, "cudaDevAttrMultiProcessorCount", 16), dev)


def to_gpu_bf16(a: np.ndarray):
    import cupy

    return cupy.asarray(np.asarray(a, dtype=np.float32).astype(BF16))


def to_np(a) -> np.ndarray:
    """Device array -> float64 NumPy."""
    import cupy

    return cupy.asnumpy(a).astype(np.float64)


def poison(a) -> None:
    """Fill an output buffer with NaN so unwritten elements fail every check."""
    a[...] = np.nan


def bf16_round(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).astype(BF16).astype(np.float64)


def rms_rel(out: np.ndarray, ref: np.ndarray) -> float:
    """RMS(out - ref) / RMS(ref); NaN anywhere gives inf."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.sqrt(np.mean((out - ref) ** 2)) / max(np.sqrt(np.mean(ref**2)), 1e-30))


def assert_close(out: np.ndarray, ref: np.ndarray, *, atol: float, rtol: float, name: str = "out") -> None:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out)), f"{name}: {np.count_nonzero(~np.isfinite(out))} non-finite (unwritten?) elements"
    err = np.abs(out - ref)
    bad = err > atol + rtol * np.abs(ref)
    assert not bad.any(), (f"{name}: {bad.sum()} elements out of tolerance; max abs err {err.max():.3e}, "
                           f"max rel {np.max(err / np.maximum(np.abs(ref), 1e-30)):.3e}")


def rand_bf16(rng, shape, scale):
    """Random normal bf16 on the GPU from a cupy Generator, drawn in slices along axis 0 (expert stacks
    are GBs)."""
    import cupy

    out = cupy.empty(shape, dtype=BF16)
    step = max(1, (1 << 26) // max(1, int(np.prod(shape[1:]))))
    for i in range(0, shape[0], step):
        n = min(step, shape[0] - i)
        out[i:i + n] = (rng.standard_normal((n, *shape[1:]), dtype=np.float32) * scale).astype(BF16)
    return out


def median_ms(fn, reps: int = 20, warm: int = 3) -> float:
    """Median milliseconds of `fn()` over `reps` calls after `warm` warm-ups, CUDA events on the current stream."""
    import cupy

    for _ in range(warm):
        fn()
    ev = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    ev[-1][1].synchronize()
    return float(np.median([cupy.cuda.get_elapsed_time(a, b) for a, b in ev]))


def graph_us(fn, calls: int = 20) -> float:
    """Microseconds per call of fn(stream): `calls` calls captured in one CUDA graph (after a warm-up
    call that compiles and allocates), replayed once untimed, then once timed: GPU time without
    Python launch gaps."""
    import cupy

    # the caller's inputs were made on the legacy default stream, which a non-blocking stream does not
    # wait for: without this, the first call may read them (e.g. block tables) before they exist
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn(stream)
        stream.synchronize()
        stream.begin_capture()
        for _ in range(calls):
            fn(stream)
        graph = stream.end_capture()
        graph.launch(stream)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / calls * 1e3
