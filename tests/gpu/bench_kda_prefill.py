"""KDA prefill, one layer (H = 32, K = V = 128, W = 4): ours (kda_prefill: intra + state + norm) vs
the previous one-CTA-per-(head, sequence) kernel and fla's chunk_kda.

    PYTHONPATH=. python tests/gpu/bench_kda_prefill.py [--shapes 32x2048,1x32768] [--quick]  (fla: PYTHONPATH=/tmp/fla:.)
    PYTHONPATH=. python tests/gpu/bench_kda_prefill.py --state-pf [--shapes 1x32768,8x2048] [--rounds 5]

--state-pf: the whole launcher at each of kda_prefill_state's prefetch depths (STATE_PF 0, 1, 2; state width as the
launcher picks it), interleaved rounds (the order reversed every other round), medians per depth and shape, and
the depth the launcher's rule picks.

Per shape: median of CUDA-event times over ITERS warm calls of each.  ours = the whole launcher
(conv, l2norm, gates, beta, chunked delta rule, gated RMSNorm, slot writes, workspace allocation
from CuPy's pool).  fla = chunk_kda alone (l2norm, gate and beta sigmoid in kernel, final state
out; its short conv and output norm are separate kernels, not timed).  old = kernels_cu/
kda_prefill_legacy.cu when present.  Also times ours at every state-column width (vb) and prints
the registers / local memory of each kernel.  Random inputs: qkv, f, gate, b ~ N(0, 1) bf16,
dt_bias ~ N(0, 1), A_log ~ U(-1, 1) (|g| ~ 1 per token, the tensor-core diagonal path).
Bytes touched (rough floor): qkv 768 + f 256 + gate 256 + out 256 B per token and head, plus the
bf16 workspace (~1.1 KB per token and head) written once and read once.
"""

from __future__ import annotations

import functools
import statistics

import cupy
import numpy as np

from kda_rt.cuda.ops.check import BF16, f32, i32, leading_dim
from kda_rt.cuda.ops.compile import KERNEL_DIR, get_kernel, sm_count
from kda_rt.cuda.ops.kda_prefill import kda_prefill

H, K, W, ITERS = 32, 128, 4, 10
SHAPES = [(1, 2048), (8, 2048), (32, 2048), (1, 32768)]


def make(num_seqs, seqlen):
    T, P = num_seqs * seqlen, H * K
    rs = cupy.random.RandomState(0)
    bf = lambda *s: rs.standard_normal(s, dtype=np.float32).astype(BF16)  # noqa: E731
    return dict(qkv=bf(T, 3 * P), f=bf(T, P), b=bf(T, H), gate=bf(T, P),
                conv_w=(0.5 * rs.standard_normal((3 * P, W), dtype=np.float32)),
                A_log=rs.uniform(-1, 1, H).astype(np.float32), dt_bias=rs.standard_normal(P, dtype=np.float32),
                o_norm_w=cupy.ones(K, dtype=np.float32),
                conv_pool=cupy.zeros((num_seqs, 3, W - 1, P), dtype=BF16),
                rec_pool=cupy.zeros((num_seqs, H, K, K), dtype=np.float32),
                cu_seqlens=cupy.arange(0, T + 1, seqlen, dtype=np.int32),
                context_lens=cupy.zeros(num_seqs, dtype=np.int32), state_slots=cupy.arange(num_seqs, dtype=np.int32))


ARGS = ("qkv", "f", "b", "gate", "conv_w", "A_log", "dt_bias", "o_norm_w", "conv_pool", "rec_pool", "cu_seqlens",
        "context_lens", "state_slots")


def ours(d, out, vb=None):
    kda_prefill(*[d[n] for n in ARGS], num_heads=H, head_dim=K, eps=1e-5, out=out, state_columns=vb)


def intra_only(d, **defines):
    """kda_prefill_intra alone, launched as kda_prefill launches it (`defines`: extra -D values of kda_prefill.cu, e.g.
    E_SCAN=0): returns a no-argument runner."""
    from kda_rt.cuda.ops import kda_prefill as kp

    T, B, L = d["qkv"].shape[0], d["cu_seqlens"].shape[0] - 1, 64
    chunks = B + T // L
    ws = cupy.empty((4, chunks, H, L, K), dtype=BF16)
    a_qk, g_last = cupy.empty((chunks, H, L, L), dtype=BF16), cupy.empty((chunks, H, K), dtype=np.float32)
    smem = kp._intra_smem_bytes(K, L, W)
    fn = get_kernel("kda_prefill.cu", "kda_prefill_intra", max_dynamic_smem=smem, HEAD_DIM=K, CONV_W=W, CHUNK=L,
                    VB=32, INTRA_THREADS=kp._INTRA_THREADS, QUAD_SPLIT=int(kp._QUAD_SPLIT), **defines)
    args = (d["qkv"], d["f"], d["b"], i32(leading_dim(d["b"])), d["conv_w"], d["A_log"], d["dt_bias"], d["conv_pool"],
            d["cu_seqlens"], d["context_lens"], d["state_slots"], ws[0], ws[1], ws[2], ws[3], a_qk, g_last, i32(B),
            i32(H), i32(sm_count(cupy.cuda.Device().id)))
    return lambda: fn((chunks, H), (kp._INTRA_THREADS,), args, shared_mem=smem)


def old(d, out):
    """The previous launcher, verbatim in effect: prep to an fp32 workspace, one CTA per (head, seq)."""
    T, B = d["qkv"].shape[0], d["cu_seqlens"].shape[0] - 1
    c = dict(HEAD_DIM=K, CONV_W=W, CHUNK=64, SUB=16, LD=K + 4, THREADS=256)
    work = cupy.empty((4, H, T, K), dtype=np.float32)
    beta = cupy.empty((H, T), dtype=np.float32)
    prep = get_kernel("kda_prefill_legacy.cu", "kda_prefill_prep", **c)
    prep((T, H), (K,), (d["qkv"], d["f"], d["b"], i32(leading_dim(d["b"])), d["conv_w"], d["A_log"], d["dt_bias"],
                        d["conv_pool"], d["cu_seqlens"], d["context_lens"], d["state_slots"], work[0], work[1],
                        work[2], work[3], beta, i32(T), i32(B), i32(H)))
    smem = 4 * (K * K + 4 * 64 * c["LD"] + 64 * 64 + (6 + 8) * K + 64)
    chunk = get_kernel("kda_prefill_legacy.cu", "kda_prefill_chunk", max_dynamic_smem=smem, **c)
    chunk((H, B), (256,), (work[0], work[1], work[2], work[3], beta, d["qkv"], d["gate"], d["o_norm_w"],
                           d["conv_pool"], d["rec_pool"], d["cu_seqlens"], d["context_lens"], d["state_slots"], out,
                           i32(T), i32(H), f32(1e-5)), shared_mem=smem)


def median_ms(fn, iters=ITERS):
    fn()
    fn()
    times = []
    for _ in range(iters):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b))
    return statistics.median(times)


def fla_runner(d, num_seqs, seqlen):
    """chunk_kda on the same conv outputs' shapes (random bf16 stand-ins), or None without fla."""
    try:
        import torch
        from fla.ops.kda import chunk_kda
    except Exception as exc:  # noqa: BLE001 - optional dependency
        print(f"fla unavailable: {type(exc).__name__}: {exc}")
        return None
    T = num_seqs * seqlen
    dev = torch.device("cuda", cupy.cuda.Device().id)
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v, g = (torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    beta = torch.randn(1, T, H, device=dev, dtype=torch.bfloat16, generator=gen)
    A_log = torch.empty(H, device=dev).uniform_(-1, 1)
    dt_bias = torch.randn(H * K, device=dev)
    h0 = torch.zeros(num_seqs, H, K, K, device=dev, dtype=torch.float32)
    cu = torch.arange(0, T + 1, seqlen, device=dev, dtype=torch.long)

    def run():
        with torch.inference_mode():
            chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                      use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                      cu_seqlens=cu)

    def timed(iters=ITERS):
        run()
        run()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    return timed


def kernel_report():
    from cupy_backends.cuda.api import driver

    from kda_rt.cuda.ops import kda_prefill as kp

    for vb in (16, 32, 64, 128):
        for name in ("kda_prefill_intra", "kda_prefill_state", "kda_prefill_norm"):
            fn = get_kernel("kda_prefill.cu", name, HEAD_DIM=K, CONV_W=W, CHUNK=64, VB=vb, INTRA_THREADS=512,
                            QUAD_SPLIT=int(kp._QUAD_SPLIT))
            fn = getattr(fn, "fn", fn)
            regs = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_NUM_REGS, fn.ptr)
            local = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, fn.ptr)
            print(f"  vb={vb:3d} {name}: {regs} registers, {local} B local")


def bench_shape(num_seqs, seqlen, have_old, all_widths=True):
    d = make(num_seqs, seqlen)
    T = num_seqs * seqlen
    out = cupy.empty((T, H * K), dtype=BF16)
    widths = {vb: median_ms(lambda vb=vb: ours(d, out, vb)) for vb in ((16, 32, 64, 128) if all_widths else ())}
    new = median_ms(lambda: ours(d, out))
    ms_intra = median_ms(intra_only(d))
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    tiles = (num_seqs + num_seqs * seqlen // 64) * H
    print(f"{num_seqs}x{seqlen}: intra alone {ms_intra:.3f} ms = {1e3 * ms_intra / (tiles / sms):.1f} us per CTA "
          f"and SM ({tiles} CTAs, {sms} SMs)", flush=True)
    ms_old = median_ms(lambda: old(d, out), iters=3) if have_old else float("nan")
    timed = fla_runner(d, num_seqs, seqlen)
    ms_fla = timed() if timed else float("nan")
    shape = f"{num_seqs}x{seqlen}"
    print(f"{shape:>8}: old {ms_old:7.3f} ms  new {new:7.3f} ms ({T / new / 1e3:6.2f} M tok/s)  fla {ms_fla:7.3f} ms  "
          f"fla/new {ms_fla / new:5.2f}" + ("  | new by vb: " + ", ".join(f"{vb}: {t:.3f}" for vb, t in widths.items())
                                           if widths else ""), flush=True)
    cupy.get_default_memory_pool().free_all_blocks()
    return shape, ms_old, new, ms_fla


def ab_state_prefetch(shapes, rounds):
    from kda_rt.cuda.ops import kda_prefill as kp

    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    for num_seqs, seqlen in shapes:
        d = make(num_seqs, seqlen)
        out = cupy.empty((num_seqs * seqlen, H * K), dtype=BF16)
        vb = kp._state_columns(num_seqs, H, K)
        times = {pf: [] for pf in (0, 1, 2)}
        for r in range(rounds):
            for pf in (0, 1, 2) if r % 2 == 0 else (2, 1, 0):
                run = functools.partial(kda_prefill, *[d[n] for n in ARGS], num_heads=H, head_dim=K, eps=1e-5, out=out,
                                        state_prefetch=pf)
                times[pf].append(median_ms(run))
        med = {pf: statistics.median(t) for pf, t in times.items()}
        rule = kp._state_prefetch(num_seqs, H, K, vb, sms)
        print(f"{num_seqs}x{seqlen} (vb {vb}, {K // vb * H * num_seqs} state CTAs, rule picks {rule}): "
              + ", ".join(f"pf {pf} {m:.3f} ms ({100 * (m / med[0] - 1):+.1f}%)" for pf, m in med.items())
              + "  rounds " + "; ".join(f"{pf}: " + " ".join(f"{t:.3f}" for t in ts) for pf, ts in times.items()),
              flush=True)
        cupy.get_default_memory_pool().free_all_blocks()


def main():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--state-pf", action="store_true", help="A/B of kda_prefill_state's prefetch depths only")
    ap.add_argument("--shapes", default="", help="sequences x length, comma-joined (default: SHAPES; with --state-pf "
                                                  "1x2048,2x2048,8x2048,32x2048,1x32768,2x16384,1x131072)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="no kernel report and no state-width sweep: the launcher at "
                                                          "its own width, the intra kernel alone and fla (whose first "
                                                          "call compiles and autotunes its Triton kernels)")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    if args.state_pf:
        ab_state_prefetch(shapes or [(1, 2048), (2, 2048), (8, 2048), (32, 2048), (1, 32768), (2, 16384), (1, 131072)],
                          args.rounds)
        return
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    print(f"GPU {props['name'].decode() if isinstance(props['name'], bytes) else props['name']}, H={H}, K=V={K}")
    if not args.quick:
        try:
            kernel_report()
        except Exception as exc:  # noqa: BLE001 - report only
            print(f"kernel report unavailable: {exc}")
    have_old = (KERNEL_DIR / "kda_prefill_legacy.cu").exists()
    rows = [bench_shape(num_seqs, seqlen, have_old, not args.quick) for num_seqs, seqlen in shapes or SHAPES]
    print("\n| shape | ours-old ms | ours-new ms | fla chunk_kda ms | fla / new |\n|---|---|---|---|---|")
    for shape, o, n, fl in rows:
        print(f"| {shape} | {o:.3f} | {n:.3f} | {fl:.3f} | {fl / n:.2f} |")


if __name__ == "__main__":
    main()
