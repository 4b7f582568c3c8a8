"""Decode kernels swept over batch and context (issue 12), one device call:

    PYTHONPATH=. python tests/gpu/bench_decode_sweep.py [--quick] [--parts=kda,mla,moe]

- kda_decode (H = 32, K = V = 128): batch 1 ... 256; bytes = the fp32 state read and written
  (2 * B * H * K * K * 4; q/k/v/gate rows are < 1%).
- mla_attention, absorbed decode (H = 32, latent 512 + rope 64, pages of 64): batch 1 ... 256 x
  context 1K ... 128K (a shape whose latent pool would pass 8 GB is skipped); bytes = the latent rows
  read once + the kv_b weights.
- the MoE decode GEMMs: `tests/gpu/bench_moe_decode.py` (batch 1 ... 256), run after these.

Every time is a CUDA graph of 20 calls replayed once (helpers.gpu.graph_us) (GPU time without Python launch gaps), per
call; TB/s against the ~4.3 TB/s copy ceiling of the H200.  Random inputs, never zeros.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)

COPY = 4.3e12


def line(name: str, us: float, nbytes: float) -> None:
    rate = nbytes / us / 1e6
    print(f"{name:44s} {us:9.1f} us {nbytes / 1e6:10.1f} MB {rate:6.2f} TB/s {100 * rate * 1e12 / COPY:5.1f}%",
          flush=True)


def sweep_kda(batches) -> None:
    from helpers.gpu import graph_us
    from helpers.kda_kernel import make_inputs, run_op, upload
    from kda_rt.cuda.ops.kda_decode import kda_decode

    H, K = 32, 128
    for B in batches:
        rng = np.random.default_rng(B)
        dev = upload(make_inputs(rng, [1] * B, H, fresh=[False] * B, num_slots=B))
        out = run_op(kda_decode, dev, H)
        us = graph_us(lambda s, dev=dev, out=out: run_op(kda_decode, dev, H, out=out, stream=s))
        line(f"kda_decode B={B}", us, 2 * B * H * K * K * 4)


def sweep_mla(batches, contexts) -> None:
    import cupy

    from helpers.gpu import BF16, graph_us
    from helpers.mla_kernel import DN, DR, DV, SCALE, R
    from kda_rt.cuda.ops.mla_attn import decode_workspace_bytes, mla_attention

    H, S = 32, 64
    for B in batches:
        for L in contexts:
            M = -(-L // S) + 1
            if B * M * S * (R + DR) * 2 > 8e9:
                print(f"mla decode B={B} L={L}: skipped (latent pool > 8 GB)", flush=True)
                continue
            rng = cupy.random.default_rng(B * 100003 + L)
            pool = rng.standard_normal((B * M, S, R + DR), dtype=np.float32).astype(BF16)
            tables = cupy.arange(B * M, dtype=np.int32).reshape(B, M)
            ctx = cupy.full((B,), L - 1, dtype=np.int32)
            cu = cupy.arange(B + 1, dtype=np.int32)
            q = rng.standard_normal((B, H, DN + DR), dtype=np.float32).astype(BF16)
            w_kvb = (rng.standard_normal((H * (DN + DV), R), dtype=np.float32) / 23).astype(BF16)
            out = cupy.empty((B, H * DV), dtype=BF16)
            ws = cupy.empty(decode_workspace_bytes(B, H, M, S), dtype=np.uint8)

            def call(stream, q=q, pool=pool, w_kvb=w_kvb, cu=cu, ctx=ctx, tables=tables, out=out, ws=ws):
                mla_attention(q, pool, w_kvb, cu, ctx, tables, num_heads=H, scale=SCALE, max_seqlen=1, decode=True,
                              out=out, workspace=ws, stream=stream)

            line(f"mla decode B={B} L={L}", graph_us(call), B * L * (R + DR) * 2 + w_kvb.nbytes)
            del pool, ws
            cupy.get_default_memory_pool().free_all_blocks()


def main() -> None:
    quick = "--quick" in sys.argv
    parts = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--parts=")), "kda,mla,moe").split(",")
    batches = (1, 8, 32, 128) if quick else (1, 2, 4, 8, 16, 32, 64, 128, 256)
    if "kda" in parts:
        sweep_kda(batches)
    if "mla" in parts:
        sweep_mla((1, 32, 128) if quick else (1, 8, 32, 128, 256),
                  (1024, 8192, 32768) if quick else (1024, 4096, 16384, 32768, 131072))
    if "moe" in parts:
        moe = Path(__file__).with_name("bench_moe_decode.py")
        subprocess.run([sys.executable, str(moe), "--tokens", "1,8,32,128" if quick else "1,8,32,64,128,256"],
                       check=False)


if __name__ == "__main__":
    main()
