"""Decode kernels swept over batch and context (issue 12), one device call:

    PYTHONPATH=. python tests/gpu/bench_decode_sweep.py [--quick] [--parts=kda,mla,moe]
        [--kda-batches=1,8,32] [--kda-variants] [--kda-define=STATE_HINTS=0,1,2,3]
        [--kda-define=KDA_RT_KDA_SMEM_STATE=0,1]

- kda_decode (H = 32, K = V = 128): batch 1 ... 256; bytes = the fp32 state read and written
  (2 * B * H * K * K * 4; q/k/v/gate rows are < 1%); --kda-variants adds every column-split variant;
  --kda-define builds the kernel with each value of a bench-only define (or runs it under each value of a KDA_RT_
  switch), three interleaved rounds.
- mla_attention, absorbed decode (H = 32, latent 512 + rope 64, pages of 64): batch 1 ... 256 x
  context 1K ... 128K (a shape whose latent pool would pass 8 GB is skipped); bytes = the latent rows
  read once + the kv_b weights.  Each line also names S (the split count of the grid) and, in
  brackets, the time of the up-projections alone (mla_absorb_q / mla_expand_out or the two cuBLAS bmm)
  so the attention kernels' share is the difference.  `--mla-batches=1,32 --mla-contexts=1024,4096`
  narrow the MLA sweep (tests/gpu/check_mla_decode.sh).
- the MoE decode GEMMs: `tests/gpu/bench_moe_decode.py` (batch 1 ... 256), run after these.

Every time is a CUDA graph of 20 calls replayed once (helpers.gpu.graph_us) (GPU time without Python launch gaps), per
call; TB/s against the ~4.3 TB/s copy ceiling of the H200.  Random inputs, never zeros.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)

COPY = 4.3e12


def line(name: str, us: float, nbytes: float, extra: str = "") -> None:
    rate = nbytes / us / 1e6
    print(f"{name:44s} {us:9.1f} us {nbytes / 1e6:10.1f} MB {rate:6.2f} TB/s {100 * rate * 1e12 / COPY:5.1f}%{extra}",
          flush=True)


KDA_VARIANTS = ((1, 256), (2, 128), (2, 256), (4, 128), (8, 128))  # (split, threads), ops/kda_decode.py


def kda_bench_inputs(B: int, H: int):
    """Device inputs of B continuing sequences in B permuted slots: the token rows and weights from
    helpers.kda_kernel.make_inputs, the B-slot pools drawn on the GPU (the host draw takes ~10 s at B = 256)."""
    import cupy

    from helpers.gpu import BF16
    from helpers.kda_kernel import W, make_inputs, upload

    rng = np.random.default_rng(B)
    inp = make_inputs(rng, [1] * B, H, fresh=[False] * B, num_slots=1)
    inp["state_slots"] = rng.permutation(B).astype(np.int32)
    dev = upload(inp)
    crng = cupy.random.default_rng(B)
    dev["rec_pool"] = crng.standard_normal((B, H, 128, 128), dtype=np.float32) * np.float32(0.1)
    dev["conv_pool"] = crng.standard_normal((B, 3, W - 1, H * 128), dtype=np.float32).astype(BF16)
    cupy.cuda.Device().synchronize()
    return dev


def sweep_kda(batches, variants=(None,), define: str = "", rounds: int = 1) -> None:
    """`variants`: (split, threads) pairs of kda_decode, None = the launcher's choice.  `define` "NAME=v1,v2":
    the kernel built with each value of a bench-only define (kda_decode.cu's STATE_HINTS), or, for a NAME that
    starts with KDA_RT_, run under each value of that environment switch (KDA_RT_KDA_SMEM_STATE); `rounds`
    interleaved rounds of all of them."""
    import cupy

    import kda_rt.cuda.ops.kda_decode as kd
    from helpers.gpu import graph_us
    from helpers.kda_kernel import run_op
    from kda_rt.cuda.ops.kda_decode import decode_config, kda_decode

    H, K = 32, 128
    name, values = define.split("=") if define else ("", "")
    if name == "SMEM_STATE":  # (a build of it launched with no dynamic shared memory would copy past its end)
        raise SystemExit("--kda-define: SMEM_STATE needs the launcher's shared memory and launch bounds: use "
                         "--kda-define=KDA_RT_KDA_SMEM_STATE=0,1,2")
    values = [int(v) for v in values.split(",")] if define else [None]
    real_get = kd.get_kernel
    for B in batches:
        dev = kda_bench_inputs(B, H)
        for _ in range(rounds):
            for variant in variants:
                for value in values:
                    if name.startswith("KDA_RT_"):  # a launcher switch (ops/kda_decode.py reads it at each call)
                        os.environ[name] = str(value)
                    else:
                        kd.get_kernel = real_get if value is None else (
                            lambda *a, _v=value, **k: real_get(*a, **{**k, name: _v}))
                    kw = {} if variant is None else {"split": variant[0], "threads": variant[1]}
                    out = run_op(kda_decode, dev, H, **kw)
                    # the uploads (async, from pinned staging) and this warm-up ran on the legacy default stream,
                    # which graph_us's non-blocking stream does not wait for: without this sync its first call
                    # could read state_slots before they arrived (the illegal address seen at B=128)
                    cupy.cuda.Device().synchronize()
                    us = graph_us(lambda s, dev=dev, out=out, kw=kw: run_op(kda_decode, dev, H, out=out, stream=s,
                                                                           **kw))
                    split, threads, _ = decode_config(**kw)
                    tag = ("" if variant is None else f" split={split}x{threads}") + (
                        "" if value is None else f" {name}={value}")
                    line(f"kda_decode B={B}{tag}", us, 2 * B * H * K * K * 4)
        kd.get_kernel = real_get
        if name.startswith("KDA_RT_"):
            os.environ.pop(name, None)  # (the launcher's own choice again for what follows)
        del dev
        cupy.get_default_memory_pool().free_all_blocks()


def sweep_kda_low_rank(batches) -> None:
    """The layer's f / gate work at rank 128: the two cuBLAS GEMVs (f_b, g_b) + kda_decode, against
    kda_decode with f_b / g_b fused in (FUSE_MAX_SEQS in ops/kda_decode.py picks between them)."""
    import cupy

    from helpers.gpu import BF16, graph_us
    from helpers.kda_kernel import run_op
    from kda_rt.cuda.gemm import linear
    from kda_rt.cuda.ops.kda_decode import kda_decode

    H, K, R = 32, 128, 128
    for B in batches:
        dev = kda_bench_inputs(B, H)
        crng = cupy.random.default_rng(B)
        small = crng.standard_normal((B, 2 * R + H), dtype=np.float32).astype(BF16)  # f_a | g_a | b, as the model
        f_b, g_b = ((crng.standard_normal((H * K, R), dtype=np.float32) / 11).astype(BF16) for _ in range(2))
        fused_dev = dict(dev, f=small[:, :R], gate=small[:, R:2 * R])
        out = cupy.empty((B, H * K), dtype=BF16)

        def unfused(s, dev=dev, small=small, f_b=f_b, g_b=g_b, out=out):
            linear(small[:, :R], f_b, out=dev["f"])
            linear(small[:, R:2 * R], g_b, out=dev["gate"])
            run_op(kda_decode, dev, H, out=out, stream=s)

        def fused(s, fused_dev=fused_dev, f_b=f_b, g_b=g_b, out=out):
            run_op(kda_decode, fused_dev, H, out=out, stream=s, f_b=f_b, g_b=g_b)

        for name, fn in (("f_b + g_b GEMVs + kda_decode", unfused), ("kda_decode, f_b g_b fused", fused)):
            fn(None)
            cupy.cuda.Device().synchronize()  # see sweep_kda
            line(f"{name} B={B}", graph_us(fn), 2 * B * H * K * K * 4)
        del dev, fused_dev
        cupy.get_default_memory_pool().free_all_blocks()


def sweep_mla(batches, contexts) -> None:
    import cupy

    from helpers.gpu import BF16, graph_us
    from helpers.mla_kernel import DR, DV, SCALE, R, bench_decode_inputs
    from kda_rt.cuda.ops.mla_attn import decode_workspace_bytes, mla_attention, num_splits

    H, S = 32, 64
    for B in batches:
        for L in contexts:
            M = -(-L // S) + 1
            if B * M * S * (R + DR) * 2 > 8e9:
                print(f"mla decode B={B} L={L}: skipped (latent pool > 8 GB)", flush=True)
                continue
            case = bench_decode_inputs(B, L, H, S, seed=B * 100003 + L)
            q, pool, w_kvb, cu, ctx, tables = (case[k] for k in ("q", "pool", "w_kvb", "cu", "ctx", "tables"))
            out = cupy.empty((B, H * DV), dtype=BF16)
            ws = cupy.empty(decode_workspace_bytes(B, H, M, S), dtype=np.uint8)

            def call(stream, q=q, pool=pool, w_kvb=w_kvb, cu=cu, ctx=ctx, tables=tables, out=out, ws=ws):
                mla_attention(q, pool, w_kvb, cu, ctx, tables, num_heads=H, scale=SCALE, max_seqlen=1, decode=True,
                              out=out, workspace=ws, stream=stream)

            us = graph_us(call)
            # the up-projections alone: the same call on a 1-position context with one page slot
            # (one tiny split), so the difference is the attention over the L positions
            ctx1, tables1 = cupy.zeros((B,), dtype=np.int32), tables[:, :1].copy()

            def call1(stream, q=q, pool=pool, w_kvb=w_kvb, cu=cu, ctx=ctx1, tables=tables1, out=out, ws=ws):
                mla_attention(q, pool, w_kvb, cu, ctx, tables, num_heads=H, scale=SCALE, max_seqlen=1, decode=True,
                              out=out, workspace=ws, stream=stream)

            line(f"mla decode B={B} L={L}", us, B * L * (R + DR) * 2 + w_kvb.nbytes,
                 f"  S={num_splits(B, M, S)}  [L=1: {graph_us(call1):.1f} us]")
            del pool, ws
            cupy.get_default_memory_pool().free_all_blocks()


def main() -> None:
    quick = "--quick" in sys.argv
    parts = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--parts=")), "kda,mla,moe").split(",")
    batches = (1, 8, 32, 128) if quick else (1, 2, 4, 8, 16, 32, 64, 128, 256)
    if "kda" in parts:
        kda_batches = next((tuple(int(b) for b in a.split("=", 1)[1].split(",")) for a in sys.argv
                            if a.startswith("--kda-batches=")), batches)
        define = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--kda-define=")), "")
        sweep_kda(kda_batches, (None, *KDA_VARIANTS) if "--kda-variants" in sys.argv else (None,), define,
                  rounds=3 if define else 1)
        if not define:
            sweep_kda_low_rank(tuple(b for b in kda_batches if b <= 64))
    if "mla" in parts:
        arg = lambda key: next((tuple(map(int, a.split("=", 1)[1].split(","))) for a in sys.argv  # noqa: E731
                                if a.startswith(f"--mla-{key}=")), None)
        sweep_mla(arg("batches") or ((1, 32, 128) if quick else (1, 8, 32, 128, 256)),
                  arg("contexts") or ((1024, 8192, 32768) if quick else (1024, 4096, 16384, 32768, 131072)))
    if "moe" in parts:
        moe = Path(__file__).with_name("bench_moe_decode.py")
        subprocess.run([sys.executable, str(moe), "--tokens", "1,8,32,128" if quick else "1,8,32,64,128,256"],
                       check=False)


if __name__ == "__main__":
    main()
