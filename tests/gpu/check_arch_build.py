"""Do the kernel variants the runner builds at start compile for another arch?  No GPU needed: the launchers'
builders run with get_kernel replaced by a recorder (their own defines, as check_pdl_order.py takes them), the arch
and SM count set to the target's, and nvcc builds each recorded variant for it.

    PYTHONPATH=. python tests/gpu/check_arch_build.py [--arch sm_100a] [--sms 148] [--nvcc PATH]

Covers moe.precompile (bf16 and e4m3 stacks: bucketing, the tiled, wgmma and fused decode GEMMs, the norm with e4m3 codes, the one-token
GEMVs, the routing kernels) and kda_prefill.precompile for the 48B shape.  Exit status 1 when a variant fails.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

_MODULES = ("kda_rt.cuda.ops.moe_gemm_tc", "kda_rt.cuda.ops.moe_gemm_wg", "kda_rt.cuda.ops.moe_gemv",
            "kda_rt.cuda.ops.gemv", "kda_rt.cuda.ops.kda_prefill", "kda_rt.cuda.ops.moe_route",
            "kda_rt.cuda.ops.moe_align", "kda_rt.cuda.ops.quant", "kda_rt.cuda.ops.rmsnorm", "kda_rt.cuda.moe")


def variants(arch: str, sms: int) -> list[tuple[str, str, dict]]:
    """(file, kernel, defines) of every variant moe.precompile and kda_prefill.precompile build for `arch`."""
    import kda_rt.cuda.ops.compile as compile_mod
    import kda_rt.cuda.ops.pdl as pdl
    from kda_rt.demo.presets import kimi_linear_48b_a3b
    from kda_rt.loader.config import parse_config

    built: list[tuple[str, str, dict]] = []

    def spy(filename, name, **kw):
        built.append((filename, name, {k: v for k, v in kw.items() if k != "max_dynamic_smem"}))
        return lambda *a, **k: None

    compile_mod.device_arch = lambda: arch
    pdl.resident_per_sm = lambda *a, **k: 1
    for name in _MODULES:
        m = importlib.import_module(name)
        for attr, value in (("get_kernel", spy), ("device_arch", lambda: arch), ("sm_count", lambda *a: sms)):
            if hasattr(m, attr):
                setattr(m, attr, value)
    moe, kp = importlib.import_module("kda_rt.cuda.moe"), importlib.import_module("kda_rt.cuda.ops.kda_prefill")
    cfg = parse_config(kimi_linear_48b_a3b(4))
    for e4m3 in (False, True):
        moe.precompile(cfg.moe, cfg.hidden_size, cfg.moe.intermediate_size, True, e4m3)
    kp.precompile(cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.conv_kernel_size, sms=sms)
    unique = {(f, n, tuple(sorted(d.items()))): (f, n, d) for f, n, d in built}
    return list(unique.values())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_100a")
    ap.add_argument("--sms", type=int, default=148)
    ap.add_argument("--nvcc", default="nvcc")
    args = ap.parse_args()
    failed = 0
    todo = variants(args.arch, args.sms)
    for filename, name, defines in todo:
        opts = [f"-D{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(defines.items()) if k != "FAST_MATH"]
        if args.arch == "sm_90a":
            opts.append("-DKDA_RT_HOPPER=1")  # (as compile._options)
        out = subprocess.run([args.nvcc, "-cubin", f"-arch={args.arch}", "--std=c++17", f"-I{REPO / 'kernels_cu'}", *opts,
                              "-o", "/dev/null", str(REPO / "kernels_cu" / filename)], capture_output=True, text=True)
        if out.returncode:
            failed += 1
            print(f"FAILED {filename} {name} {defines}\n{out.stderr[-800:]}", flush=True)
    print(f"{args.arch}: {len(todo) - failed} of {len(todo)} variants built", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
