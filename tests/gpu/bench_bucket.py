"""MoE bucketing of a prefill step (kernels_cu/moe_align.cu): the one-block moe_bucket against the three
launches over many blocks (moe_bucket_count / _plan / _scatter), E = 256 experts + the shared slot, top-8,
128-row tiles, uniform random routing.  GPU time per call: 20 calls captured in one CUDA graph (the eager
launches' Python cost, ~15 us a kernel, is hidden behind a prefill step's GEMMs in the model).

    PYTHONPATH=. python tests/gpu/bench_bucket.py [--tokens 512,2048,8192,16384,32768]
One line per T: us of each path, and whether both plans agree (tests/helpers/moe_plan.py invariants)."""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)

E, A, BT = 256, 8, 128


def main() -> int:
    import cupy

    from helpers.gpu import graph_us
    from helpers.moe_plan import assert_plan
    from kda_rt.cuda.ops.moe_align import MoEPlan, bucket_scratch_words, max_tiles, moe_bucket

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,1024,2048,4096,8192,16384,32768")
    args = ap.parse_args()
    for T in map(int, args.tokens.split(",")):
        rng = np.random.default_rng(T)
        ids_h = np.argsort(rng.random((T, E)), axis=1)[:, :A].astype(np.int32)
        ids = cupy.asarray(ids_h)
        N, bins = T * (A + 1), E + 1
        tiles = max_tiles(N, bins, BT)
        scratch = cupy.empty(max(1, bucket_scratch_words(N, bins), bins * 65), np.int32)
        row = [f"T={T:6d} pairs={N:7d}"]
        for wide in (False, True):
            plan = MoEPlan(*(cupy.full(n, -7, np.int32) for n in (bins + 1, N, N, tiles, tiles, 1)), BT)
            call = partial(moe_bucket, ids, E, plan, shared_slot=True, scratch=scratch, wide=wide)
            us = graph_us(lambda stream, c=call: c(stream=stream))
            assert_plan(plan, ids_h, E, True)
            row.append(f"{'three launches' if wide else 'one block'} {us:8.1f} us")
        print(" | ".join(row) + " | plans valid", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
