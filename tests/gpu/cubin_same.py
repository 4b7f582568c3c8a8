"""Is a kernel build unchanged by an edit?  Compiles one kernels_cu file with NVRTC as it is now and as it was at a git
revision (its headers too), with the same defines, and compares the cubins byte for byte.  No GPU needed: NVRTC
compiles for an arch without a device (the `nvidia-cuda-nvrtc` wheel's libnvrtc, or a toolkit's), so a refactor of a
kernel that a GPU run tested can be shown to build the same machine code.  Options as ops/compile.py passes them.

    python tests/gpu/cubin_same.py moe_gemm_wg.cu --rev HEAD K=2304 NOUT=2048 FUSE_SILU=1 TOPK=8 BN=256 STAGES=4 \
        STAGED_OUT=0 [--arch sm_90a] [--nvrtc /path/libnvrtc.so.13] [--include DIR]

Prints "identical" or "differ" (exit status 0 / 1), or NVRTC's log when a build fails (2).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _libnvrtc(path: str | None) -> ctypes.CDLL:
    if path is None:
        site = Path(sys.prefix) / "lib/python*/site-packages/nvidia"  # the CUDA 13 wheel's path, then CUDA 12's
        found = sorted(glob.glob(str(site / "cu1*/lib/libnvrtc.so.*")))
        found += sorted(glob.glob(str(site / "cuda_nvrtc/lib/libnvrtc.so.*")))
        found = [f for f in found if "builtins" not in f] or ["libnvrtc.so"]
        path = found[-1]
    return ctypes.CDLL(path)


def _cuda_include() -> str | None:
    """cuda_bf16.h's folder as ops/compile.py finds it (CuPy's headers, the CUDA wheel's, a toolkit's)."""
    sys.path.insert(0, str(REPO))
    try:
        from kda_rt.cuda.ops.compile import _cuda_include_dir
    except ImportError:
        return None
    return _cuda_include_dir()


def compile_cubin(lib: ctypes.CDLL, kdir: Path, name: str, opts: list[str]) -> bytes:
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), (kdir / name).read_bytes(), name.encode(), 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    args = [f"--include-path={kdir}", *opts]
    arr = (ctypes.c_char_p * len(args))(*[a.encode() for a in args])
    if lib.nvrtcCompileProgram(prog, len(args), arr):
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        print(log.value.decode(errors="replace"))
        sys.exit(2)
    n = ctypes.c_size_t()
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    out = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, out)
    return out.raw


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("defines", nargs="*", help="NAME=value")
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--nvrtc")
    ap.add_argument("--include", action="append", default=[], help="CUDA headers (cuda_bf16.h), as many as needed")
    args = ap.parse_intermixed_args()
    lib = _libnvrtc(args.nvrtc)
    fast = "FAST_MATH=1" in args.defines  # (as ops/compile.py: a flag, not a define)
    defines = [d for d in args.defines if not d.startswith("FAST_MATH=")]
    include = args.include or [d for d in [_cuda_include()] if d]
    opts = [f"--gpu-architecture={args.arch}", "--std=c++17", "-default-device",
            "--use_fast_math" if fast else "--fmad=true", *(f"--include-path={d}" for d in include),
            *(f"-D{d}" for d in defines)]
    if args.arch == "sm_90a":
        opts.append("-DKDA_RT_HOPPER=1")
    with tempfile.TemporaryDirectory() as old:  # kernels_cu/ at the revision
        tar = subprocess.run(["git", "-C", str(REPO), "archive", args.rev, "kernels_cu"], check=True,
                             capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", old], input=tar, check=True)
        before = compile_cubin(lib, Path(old) / "kernels_cu", args.file, opts)
    now = compile_cubin(lib, REPO / "kernels_cu", args.file, opts)
    same = before == now
    print("identical" if same else "differ", f"({len(before)} / {len(now)} bytes)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
