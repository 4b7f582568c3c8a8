"""Do the kernels that load weights before their programmatic-launch wait really issue those loads first?  ptxas
issues griddepcontrol.wait (SASS ACQBULK) as early as it can, above register loads that do not feed it, so the
source order alone proves nothing (kernels_cu/common.cuh KDA_PDL_WAIT_AFTER).  This builds each deferred-entry
kernel variant the decode steps use (the launchers' own defines, taken from their builders) for sm_90a,
disassembles it with nvdisasm and prints, for every ACQBULK, how many global loads (LDG, LDGSTS) come before it.

    PYTHONPATH=. python tests/gpu/check_pdl_order.py [--nvdisasm PATH] [--nvcc]

On the device the kernels are built by NVRTC (kda_rt.cuda.ops.compile.compile_cubin, the runtime's compiler);
--nvcc (or no CuPy) builds them with nvcc instead.  nvdisasm: --nvdisasm, $NVDISASM, PATH, or the pip wheel
nvidia-cuda-nvdisasm (carried to the device like the fla wheels).  Exit status 1 when a kernel listed in
EARLY_LOADS has no load before its last wait.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# kernels whose loads before the wait are the point of their deferred entry (their last wait is the main path's)
EARLY_LOADS = ("moe_route_fused", "skinny_gemm_cl", "skinny_gemm_staged", "gemv_dense", "moe_gemv_down",
               "kda_decode_step", "moe_grouped_gemm_tc")


def variants() -> list[tuple[str, str, dict]]:
    """(file, kernel, defines) of the decode steps' deferred-entry kernels, from the launchers' builders."""
    import kda_rt.cuda.ops.gemv as gv
    import kda_rt.cuda.ops.kda_decode as kd
    import kda_rt.cuda.ops.moe_gemm_tc as tc
    import kda_rt.cuda.ops.moe_gemv as mg
    import kda_rt.cuda.ops.moe_route as mr
    import kda_rt.cuda.ops.skinny_gemm as sk

    built: list[tuple[str, str, dict]] = []

    def spy(f, n, **kw):
        built.append((f, n, {k: v for k, v in kw.items() if k != "max_dynamic_smem"}))

    for m in (mr, mg, gv, sk, kd, tc):
        m.get_kernel = spy
    kd._clusters = lambda: True  # noqa: SLF001 (sm_90: the split variants)
    sk._sms = lambda: 132  # noqa: SLF001 (H200)
    mr.fused_kernel(1, 256, 2304, 16, True, norm=True)  # a one-token MoE step's routing
    gv._kernel(2304)  # noqa: SLF001 (one-row projections from the hidden size)
    mg.down_kernel(1024, 2304)
    rows, _ = sk.staged_plan(2304, 4096, 132)  # o_proj at batch 1-8
    sk._staged_kernel(False, rows, 4096)  # noqa: SLF001
    fpc, splits, nt = sk.wide_plan(32, 2304, 4096)  # o_proj at batch 9-32
    sk._wide_kernel(False, fpc, splits, nt, 4096)  # noqa: SLF001
    split, threads, min_blocks = kd.decode_config(None, None, True, num_seqs=1)
    built.append(("kda_decode.cu", "kda_decode_step", dict(HEAD_DIM=128, CONV_W=4, THREADS=threads, SPLIT=split,
                                                           MIN_BLOCKS=min_blocks, FUSE_FG=1, RANK_F=128, RANK_G=128,
                                                           EARLY_STATE=1, STATE_HINTS=kd.state_hints(1))))
    tc.tc_kernel(tc._DECODE_SMALL, 1024, 2304, False, 8)  # noqa: SLF001 (the down GEMM with EARLY_B)
    return built


def cubin(filename: str, defines: dict, use_nvcc: bool) -> bytes:
    if not use_nvcc:
        from kda_rt.cuda.ops.compile import compile_cubin

        return compile_cubin(filename, defines, "sm_90a")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "k.cubin"
        flags = [f"-D{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(defines.items())]
        subprocess.run([os.environ.get("NVCC", "nvcc"), "-cubin", "-arch=sm_90a", "-DKDA_RT_HOPPER=1", "--std=c++17",
                        "--fmad=true", f"-I{REPO / 'kernels_cu'}", *flags, str(REPO / "kernels_cu" / filename),
                        "-o", str(out)], check=True)
        return out.read_bytes()


def order(sass: str, kernel: str) -> list[int]:
    """Global loads before each ACQBULK of `kernel`'s code."""
    m = re.search(r"\.text\." + re.escape(kernel) + r":(.*?)(?=\n\s*\.section|\Z)", sass, re.S)
    ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", m.group(1) if m else "")
    waits = [int(o, 16) for o, t in ins if "ACQBULK" in t]
    loads = [int(o, 16) for o, t in ins if re.search(r"\b(LDG|LDGSTS)\b", t)]
    return [sum(1 for x in loads if x < w) for w in waits]


def find_nvdisasm(given: str | None) -> str | None:
    if given or os.environ.get("NVDISASM"):
        return given or os.environ["NVDISASM"]
    if shutil.which("nvdisasm"):
        return shutil.which("nvdisasm")
    try:  # the pip wheel nvidia-cuda-nvdisasm
        import nvidia

        for base in nvidia.__path__:
            for p in Path(base).glob("*/bin/nvdisasm"):
                return str(p)
    except ImportError:
        pass
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvdisasm", default=None)
    ap.add_argument("--nvcc", action="store_true", help="build with nvcc instead of NVRTC")
    args = ap.parse_args()
    tool = find_nvdisasm(args.nvdisasm)
    if tool is None:
        print("error: no nvdisasm (--nvdisasm, $NVDISASM, PATH or the nvidia-cuda-nvdisasm wheel)", file=sys.stderr)
        return 2
    try:
        import cupy  # noqa: F401

        use_nvcc = args.nvcc
    except ImportError:
        use_nvcc = True
    bad = []
    with tempfile.TemporaryDirectory() as tmp:
        for filename, kernel, defines in variants():
            path = Path(tmp) / f"{kernel}.cubin"
            path.write_bytes(cubin(filename, defines, use_nvcc))
            run = subprocess.run([tool, str(path)], capture_output=True, text=True)
            if run.returncode:
                print(f"error: {tool} failed on {kernel} ({filename}, {len(path.read_bytes())} bytes, starts "
                      f"{path.read_bytes()[:4]!r}): {run.stderr.strip()[:400]}", file=sys.stderr)
                return 2
            sass = run.stdout
            counts = order(sass, kernel)
            flag = ""
            if kernel in EARLY_LOADS and (not counts or counts[-1] == 0):
                flag, _ = "  <- no load before its wait", bad.append(kernel)
            print(f"{kernel:22s} loads before each wait: {counts}{flag}", flush=True)
    print(f"built with {'nvcc' if use_nvcc else 'NVRTC'}; {len(bad)} kernel(s) without early loads: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
