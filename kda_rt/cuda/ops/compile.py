"""Compile `kernels_cu/*.cu` with NVRTC and load them: the only place kernels are built.

- Arch comes from the device: `sm_90a` on Hopper (9.0), `sm_100a` on Blackwell (10.0), plain
  `sm_XY` elsewhere.  Hopper-only code must be guarded in the source with `KDA_RT_HOPPER`
  (defined only for sm_90a) and `#error` when a kernel needs it and it is absent, so it can
  never compile out silently.
- Options: C++17, `kernels_cu/` on the include path, compile-time constants as `-D` (part of
  the cache key).  We call NVRTC ourselves (cupy.RawModule would append its own -arch and
  -ftz=true) and load the cubin with `cupy.cuda.function.Module`.
- A kernel that launches with more than 48 KB of dynamic shared memory must opt in first:
  `get_kernel(..., max_dynamic_smem=bytes)` does it once per kernel.
- Disk cache under KDA_RT_CACHE_DIR keyed by sha256 of (this source, every header in
  kernels_cu/, options, arch, NVRTC version), so a stale binary is never used; a msgpack
  manifest lists what each entry was built from; a hit refreshes its file's time (what a run used:
  tests/gpu/device_run.sh returns those for the next device call).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import msgpack

from kda_rt import env

__all__ = ["KERNEL_DIR", "CompileError", "arch_number", "device_arch", "device_name", "compile_cubin", "get_kernel",
           "sm_count", "startup_log"]

logger = logging.getLogger(__name__)

_PACKAGE = Path(__file__).resolve().parents[2]  # .../kda_rt
KERNEL_DIR = _PACKAGE.parent / "kernels_cu"  # a source checkout: kernels_cu/ beside kda_rt/
if not KERNEL_DIR.is_dir():  # installed (non-editable): kernels ship as the kda_rt.kernels_cu package
    KERNEL_DIR = _PACKAGE / "kernels_cu"
_lock = threading.Lock()
_smem_allowed: dict[int, int] = {}  # CUfunction handle -> dynamic shared memory bytes it has opted in to
_carveout: dict[int, int] = {}  # CUfunction handle -> the shared-memory carveout it was given (env.smem_carveout)
_ATTR_PREFERRED_SHARED_MEMORY_CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT


class CompileError(RuntimeError):
    """NVRTC rejected a kernel; the message carries the file, the options and NVRTC's log."""


def _cupy():
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError(
            "the CUDA backend needs CuPy: pip install 'kda_rt[cuda12]' (CUDA 12 driver) or 'kda_rt[cuda13]'"
        ) from exc
    return cupy


def arch_for(major: int, minor: int) -> str:
    if (major, minor) == (9, 0):
        return "sm_90a"
    if major == 10 and minor == 0:
        return "sm_100a"
    return f"sm_{major}{minor}"


def device_arch() -> str:
    forced = env.arch_override()
    if forced:
        return forced
    # CuPy gives the capability as digits, major then one digit of minor ("90" on Hopper, "100" on B200): split
    # by value, not by characters (the first character of "100" is not its major)
    major, minor = divmod(int(_cupy().cuda.Device().compute_capability), 10)
    return arch_for(major, minor)


def arch_number(arch: str) -> int:
    """The capability in an arch name as major * 10 + minor: "sm_90a" -> 90, "sm_100a" -> 100, "compute_89" -> 89."""
    m = re.fullmatch(r"(?:sm|compute)_(\d+)[a-z]?", arch)
    if m is None:
        raise ValueError(f"not a CUDA arch name: {arch!r} (expected e.g. sm_90a or sm_100a)")
    return int(m.group(1))


@functools.cache
def compute_capability(device_id: int) -> int:
    """Compute capability of CUDA device `device_id` as major * 10 + minor (90 on Hopper)."""
    return int(_cupy().cuda.Device(device_id).compute_capability)


def clusters_supported() -> bool:
    """Thread-block clusters (sm_90+) on the current device."""
    return compute_capability(_cupy().cuda.Device().id) >= 90


@functools.cache
def sm_count(device_id: int) -> int:
    """Streaming multiprocessors of CUDA device `device_id` (grids sized to one wave, occupancy)."""
    return int(_cupy().cuda.runtime.deviceGetAttribute(16, device_id))  # cudaDevAttrMultiProcessorCount


@functools.cache
def smem_optin(device_id: int) -> int:
    """The most shared memory (static + dynamic, bytes) one block of CUDA device `device_id` may opt in to."""
    return int(_cupy().cuda.runtime.deviceGetAttribute(97, device_id))  # cudaDevAttrMaxSharedMemoryPerBlockOptin


def device_name(device_id: int) -> str:
    """The name of CUDA device `device_id` (e.g. "NVIDIA H200")."""
    name = _cupy().cuda.runtime.getDeviceProperties(device_id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    from cupy.cuda import nvrtc

    return tuple(nvrtc.getVersion())


def _headers() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(KERNEL_DIR.glob("*.cuh"))}


def _options(arch: str, defines: dict[str, Any]) -> list[str]:
    opts = [f"--gpu-architecture={arch}", "--std=c++17", f"--include-path={KERNEL_DIR}", "-default-device",
            "--use_fast_math" if defines.pop("FAST_MATH", False) else "--fmad=true"]
    cuda_include = _cuda_include_dir()
    if cuda_include:
        opts.append(f"--include-path={cuda_include}")
    if arch == "sm_90a":
        opts.append("-DKDA_RT_HOPPER=1")
    for key in sorted(defines):
        value = defines[key]
        value = int(value) if isinstance(value, bool) else value
        opts.append(f"-D{key}={value}")
    return opts


@functools.lru_cache(maxsize=1)
def _cuda_include_dir() -> str | None:
    """Directory holding cuda_bf16.h etc.: CuPy's bundled CUDA headers or a CUDA toolkit."""
    candidates = []
    try:
        import cupy

        candidates += [Path(cupy.__file__).parent / "_core" / "include" / "cupy" / "_cuda" / "cuda-13",
                       Path(cupy.__file__).parent / "_core" / "include"]
    except ImportError:
        pass
    try:
        import nvidia.cu13  # type: ignore[import-not-found]

        candidates.insert(0, Path(nvidia.cu13.__path__[0]) / "include")
    except ImportError:
        pass
    for root in (os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates.append(Path(root) / "include")
    for c in candidates:
        if (c / "cuda_bf16.h").exists():
            return str(c)
    return None


def compile_cubin(filename: str, defines: dict[str, Any] | None = None, arch: str | None = None) -> bytes:
    """cubin bytes of `kernels_cu/<filename>` built with `defines`; cached on disk."""
    from cupy.cuda import nvrtc

    arch = arch or device_arch()
    source = (KERNEL_DIR / filename).read_text()
    headers = _headers()
    opts = _options(arch, dict(defines or {}))
    digest = hashlib.sha256()
    for part in (filename, source, *(f"{k}\0{v}" for k, v in headers.items()), *opts, arch, str(nvrtc_version())):
        digest.update(part.encode())
        digest.update(b"\0")
    key = digest.hexdigest()
    cache = env.cache_dir()
    path = cache / f"{key}.cubin"
    if path.exists():
        with contextlib.suppress(OSError):  # a hit's time: what a run used (tests/gpu/device_run.sh keeps those)
            os.utime(path)
        return path.read_bytes()
    # CuPy's binding takes str source/name and bytes headers/include names
    prog = nvrtc.createProgram(source, filename, [v.encode() for v in headers.values()], [k.encode() for k in headers])
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise CompileError(f"NVRTC failed on kernels_cu/{filename} (arch {arch}, options {opts}):\n{log}") from exc
        cubin = nvrtc.getCUBIN(prog)
        BUILD_STATS["compiled"] += 1
    finally:
        nvrtc.destroyProgram(prog)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(cubin)
        os.replace(tmp, path)
        with _lock, open(cache / "manifest.msgpack", "ab") as fh:
            fh.write(msgpack.packb({"key": key, "file": filename, "arch": arch, "options": opts,
                                    "nvrtc": list(nvrtc_version())}))
    except OSError as exc:  # a read-only cache only costs recompiles
        logger.warning("kernel cache %s is not writable (%s); kernels will be rebuilt next run", cache, exc)
    return cubin


# kernel variants built in this process: modules loaded, of which NVRTC compiled (not in the disk cache),
# and the seconds both took; the bench reports what a timed run spent here
BUILD_STATS = {"loaded": 0, "compiled": 0, "seconds": 0.0}
# (file, module) of every variant built with CHAIN_PROBE (KDA_RT_CHAIN_PROBE, bench only): the probe tool reads their
# chain_probe arrays (tests/gpu/probe_route_chain.py)
PROBED: list[tuple[str, Any]] = []


@functools.cache
def _module(filename: str, frozen_defines: tuple[tuple[str, Any], ...], arch: str):
    from cupy.cuda import function

    t0 = time.perf_counter()
    compiled = BUILD_STATS["compiled"]
    mod = function.Module()
    mod.load(compile_cubin(filename, dict(frozen_defines), arch))
    if any(name == "CHAIN_PROBE" for name, _ in frozen_defines):
        PROBED.append((filename, mod))
    seconds = time.perf_counter() - t0
    BUILD_STATS["loaded"] += 1
    BUILD_STATS["seconds"] += seconds
    logger.info("kernels_cu/%s %s: %s in %.3f s", filename, dict(frozen_defines),
                "compiled" if BUILD_STATS["compiled"] > compiled else "loaded from the cache", seconds)
    return mod


def get_kernel(filename: str, name: str, *, max_dynamic_smem: int = 0, **defines: Any):
    """The `extern "C"` kernel `name` of `kernels_cu/<filename>` specialised by `defines`.
    Call it as kernel(grid, block, args, shared_mem=bytes, stream=stream) with exact scalar types;
    `max_dynamic_smem` is the most dynamic shared memory (bytes) its launches will ask for.  With
    KDA_RT_SMEM_CARVEOUT set (a bench switch) every kernel gets that preferred shared-memory carveout."""
    mod = _module(filename, tuple(sorted(defines.items())), device_arch())
    fn = mod.get_function(name)
    if max_dynamic_smem > _smem_allowed.get(fn.ptr, 0):  # > 48 KB needs an explicit opt-in, once
        from cupy_backends.cuda.api import driver

        driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, max_dynamic_smem)
        _smem_allowed[fn.ptr] = max_dynamic_smem
    carveout = env.smem_carveout()
    if carveout is not None and _carveout.get(fn.ptr) != carveout:
        from cupy_backends.cuda.api import driver

        driver.funcSetAttribute(fn.ptr, _ATTR_PREFERRED_SHARED_MEMORY_CARVEOUT, carveout)
        _carveout[fn.ptr] = carveout
    from kda_rt.cuda.ops import pdl, trace

    kernel = pdl.Kernel(fn)  # (launched with PDL inside a decode-graph capture: ops/pdl.py)
    return trace.Counted(kernel, f"{filename}:{name}") if trace.active() is not None else kernel


def startup_log() -> str:
    """One line: GPU, arch, driver, NVRTC and CuPy versions (logged once when the backend starts)."""
    cupy = _cupy()
    rt = cupy.cuda.runtime
    dev = cupy.cuda.Device().id
    drv = rt.driverGetVersion()
    line = (f"GPU {device_name(dev)} ({sm_count(dev)} SMs), arch {device_arch()}, driver CUDA {drv // 1000}.{drv % 1000 // 10}, "
            f"NVRTC {'.'.join(map(str, nvrtc_version()))}, CuPy {cupy.__version__}")
    logger.info(line)
    return line
