"""Where kda_prefill_intra's time goes, phase by phase: the kernel built with -DPHASE_CLOCK (bench-only; the
runtime's build has no stamps, byte-identical SASS), thread 0 of each CTA stamping clock64() at the phase
boundaries (kernels_cu/kda_prefill.cu, STAMP(i)).  Per shape: the kernel's time (CUDA events), the mean
cycles of each phase over the CTAs, its share, and the mean CTA length in us at the measured clock.

    PYTHONPATH=. python tests/gpu/bench_kda_phases.py [--shapes 32x2048,1x32768] [--ab EXP_ACCURATE_EXP] [--solo 8,132]
    PYTHONPATH=. python tests/gpu/bench_kda_phases.py --ab T_ROWS=1:2:4      (one define at several values)
Inputs as tests/gpu/bench_kda_prefill.py (random N(0, 1) bf16, |g| ~ 1 per token).

--solo N[,N...]: after each shape's table, the phases of a launch of only the first N tiles of head 0 (grid (N, 1)),
each alone on its SM: with N below the SM count no other SM competes for DRAM and L2, so the copies' phase against
the whole grid's says how much of it is the wave's CTAs copying at once (the CTAs of a wave start together) rather
than the SM's own issue of its copies."""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)

PHASES = ["start: copies issued -> landed (after the sequence lookup)", "conv taps / history to registers",
          "conv + SiLU + gates (a)", "row norms, gate sums, tables (b)", "scaled tiles, qg / kd out (c)",
          "A_qk, A_kk on tensor cores + unsafe blocks (d, e)", "T diagonal blocks | e^G k^ (f)",
          "T off-diagonal blocks", "T diag(beta) to bf16", "W, U on tensor cores + stores (g)"]


def main() -> int:
    import cupy
    from gpu.bench_kda_prefill import H, K, W, make

    from helpers.gpu import median_ms, unused_defines
    from kda_rt.cuda.ops import kda_prefill as kp
    from kda_rt.cuda.ops.check import i32, leading_dim
    from kda_rt.cuda.ops.compile import _module, device_arch, get_kernel, sm_count

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="32x2048,8x2048,1x32768")
    ap.add_argument("--ab", default="", help="a define (e.g. EXP_ACCURATE_EXP, SCALE_UNROLL) or several, comma-joined: "
                                              "the build with them 0 and with them 1, timed in interleaved rounds, "
                                              "phases of each; NAME=a:b:c builds NAME = a, b, c (the first the "
                                              "reference of the bit-for-bit check)")
    ap.add_argument("--ldb", type=int, default=0, help="beta as a column block of a [T, ldb] array (the model's "
                                                       "f_a | g_a | b: 288), not a contiguous [T, H]")
    ap.add_argument("--solo", default="", help="tile counts N: the phases of a launch of the first N tiles alone")
    args = ap.parse_args()
    cap = 40000
    smem = kp._intra_smem_bytes(K, 64, W)
    names = [n for n in args.ab.split(",") if n]  # several: all off against all on
    if unused := unused_defines("kda_prefill.cu", [n.split("=")[0] for n in names]):
        ap.error(f"--ab: kda_prefill.cu does not read {', '.join(unused)}")
    if len(names) == 1 and "=" in names[0]:  # one define at several values
        name, values = names[0].split("=")
        variants = [{name: int(v)} for v in values.split(":")]
    else:
        variants = [dict.fromkeys(names, 0), dict.fromkeys(names, 1)] if names else [{}]
    built = []
    for extra in variants:
        consts = dict(HEAD_DIM=K, CONV_W=W, CHUNK=64, VB=32, INTRA_THREADS=kp._INTRA_THREADS, PHASE_CLOCK=cap, **extra)
        fn = get_kernel("kda_prefill.cu", "kda_prefill_intra", max_dynamic_smem=smem, **consts)
        mod = _module("kda_prefill.cu", tuple(sorted(consts.items())), device_arch())
        ptr = mod.get_global_var("kda_phase_clk")
        if isinstance(ptr, int):
            ptr = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, cap * 14 * 8, mod), 0)
        built.append((extra, fn, cupy.ndarray((cap, 14), np.int64, memptr=ptr)))
    mhz = float(cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrClockRate, 0)) / 1e3
    for shape in args.shapes.split(","):
        B, S = map(int, shape.split("x"))
        d = make(B, S)
        if args.ldb:  # beta as the model passes it: a column block of the [T, ldb] f_a | g_a | b projection
            d["b"] = cupy.random.RandomState(1).standard_normal((B * S, args.ldb), dtype=np.float32).astype(
                d["b"].dtype)[:, args.ldb - H:]
        T, L = B * S, 64
        chunks = B + T // L
        ws = cupy.empty((4, chunks, H, L, K), dtype=np.uint16)
        a_qk, g_last = cupy.empty((chunks, H, L, L), dtype=np.uint16), cupy.empty((chunks, H, K), dtype=np.float32)
        launch = (d["qkv"], d["f"], d["b"], i32(leading_dim(d["b"])), d["conv_w"], d["A_log"], d["dt_bias"],
                  d["conv_pool"], d["cu_seqlens"], d["context_lens"], d["state_slots"], ws[0], ws[1], ws[2], ws[3],
                  a_qk, g_last, i32(B), i32(H), i32(sm_count(cupy.cuda.Device().id)))

        def run(fn, grid=(chunks, H), launch=launch):
            fn(grid, (kp._INTRA_THREADS,), launch, shared_mem=smem)

        times = [[] for _ in built]
        for _ in range(5 if len(built) > 1 else 1):  # interleaved rounds: the GPU's clock drifts as it heats
            for i, (_, fn, _) in enumerate(built):
                times[i].append(median_ms(partial(run, fn), reps=5, warm=2))
        first = None
        for (extra, fn, clk), ts in zip(built, times, strict=True):
            clk.fill(0)
            for a in (ws, a_qk, g_last):
                a.fill(0xFF if a.dtype != np.float32 else np.nan)
            run(fn)
            cupy.cuda.Device().synchronize()
            outs = [a.copy() for a in (ws, a_qk, g_last)]
            if first is None:
                first = outs
            else:  # every variant against the first, bit for bit (EXP_ACCURATE_EXP changes roundings)
                same = all(bool(cupy.array_equal(a.view(np.uint8), b.view(np.uint8)))
                           for a, b in zip(outs, first, strict=True))
                print(f"{shape} {extra}: outputs bit-identical to {built[0][0]}: {same}", flush=True)
            ms = float(np.median(ts))
            c = stamped(clk, min(cap, chunks * H))
            total = (c[:, 10] - c[:, 0]).astype(np.float64)
            tag = f" {extra}" if extra else ""
            print(f"{shape}{tag}: kernel {ms:.3f} ms (rounds {[round(t, 3) for t in ts]}), {len(c)} CTAs stamped, mean "
                  f"CTA {total.mean():.0f} cycles ({total.mean() / mhz:.1f} us at {mhz:.0f} MHz), CTAs x mean / SMs = "
                  f"{len(c) * total.mean() / mhz / 1e3 / sm_count(0):.3f} ms", flush=True)
            print_phases(c)
            for n in (int(v) for v in args.solo.split(",") if v):
                for _ in range(2):  # the second launch finds its tiles' rows in L2 (the first, after the full
                    clk.fill(0)  # grid's runs, mostly not)
                    run(fn, grid=(min(n, chunks), 1))
                    cupy.cuda.Device().synchronize()
                c = stamped(clk, min(n, chunks))
                print(f"{shape}{tag}: the first {len(c)} tiles alone, launched twice, the second's stamps (grid "
                      f"({min(n, chunks)}, 1)): mean CTA "
                      f"{(c[:, 10] - c[:, 0]).mean():.0f} cycles", flush=True)
                print_phases(c)
    return 0


def stamped(clk, n: int) -> np.ndarray:
    """The stamps of the first n CTAs that stamped both ends."""
    c = clk.get()[:n]
    return c[(c[:, 0] != 0) & (c[:, 10] != 0)]


def print_phases(c: np.ndarray) -> None:
    """Each phase's mean cycles over the CTAs and its share (phase 1 -> 2 is the register loads; STAMP(2) comes
    before the conv loop)."""
    dt = np.diff(c[:, :11], axis=1).astype(np.float64)
    total = (c[:, 10] - c[:, 0]).astype(np.float64)
    print(f"  {'(before the stamps) sequence lookup: entry -> STAMP(0)':<52s} "
          f"{(c[:, 0] - c[:, 11]).astype(np.float64).mean():8.0f} cycles", flush=True)
    for i, (name, col) in enumerate(zip(PHASES, dt.T, strict=True)):
        print(f"  {name:<52s} {col.mean():8.0f} cycles  {col.mean() / total.mean():6.1%}", flush=True)
        if i == 0:  # the copies' phase, split at thread 0's stamps 12 and 13
            for part, a, b in (("thread 0: its copies issued", 0, 12),
                               ("thread 0: the next tile's lookup + prefetch", 12, 13),
                               ("thread 0: beta, -exp(A_log), then the copies' wait", 13, 1)):
                print(f"  {'  of which ' + part:<52s} {(c[:, b] - c[:, a]).astype(np.float64).mean():8.0f} cycles",
                      flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
