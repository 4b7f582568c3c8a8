"""Does the routing changing from step to step cost the batch-32 decode graph time?  (Issue 12: the engine's
batch-32 step, 9.15 ms at 71.1 experts a MoE layer, against a full-step replay of the same graph, 8.67-8.69 ms at
70.8 experts in tests/gpu/bench_ab.py --replays 32.)  One model load (the full 27-layer shape, random weights, router
bias std 0.05), a decode step of 32 live sequences at ~2K context (helpers.full_model.decode_full_batch), then its
graph replayed in chunks of 20, each replay preceded by a device copy of 32 token ids into the graph's input:
  same: the step's own ids every time (the replays of bench_ab, plus the copy);
  vary: a different set of random ids every replay (the routing changes each replay, as in the engine's steps).
Prints ms a replay (median of chunks, the copies included) and the experts touched a MoE layer for each, alternating.

    PYTHONPATH=. python tests/gpu/replay_routing.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    import cupy
    import numpy as np

    from helpers.full_model import decode_full_batch, full_engine

    cfg, engine = full_engine(max_num_seqs=args.batch)  # (the batch the largest graph: exactly its rows)
    runner = engine.runner
    decode_full_batch(engine, args.batch, 2048, seed=7)
    rows = next(b for b in runner.buckets if b >= args.batch)
    g = runner.graphs[rows]
    ids = g.batch.input_ids
    own = ids[: args.batch].copy()
    rng = np.random.default_rng(1)
    sets = {"same": [own] * 20,
            "vary": [cupy.asarray(rng.integers(0, cfg.vocab_size, args.batch).astype(np.int32)) for _ in range(20)]}
    cpy = cupy.cuda.runtime
    stream = runner.stream

    def chunk(src) -> float:
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for s in src:
            cpy.memcpyAsync(ids.data.ptr, s.data.ptr, 4 * args.batch, cpy.memcpyDeviceToDevice, stream.ptr)
            g.graph.launch(stream)
        end.record(stream)
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) / len(src)

    with stream:
        for name in ("same", "vary"):  # warm-up
            chunk(sets[name])
        for r in range(args.rounds):
            for name in (("same", "vary") if r % 2 == 0 else ("vary", "same")):
                runner.experts_touched(reset=True)
                times = [chunk(sets[name]) for _ in range(5)]
                touched = runner.experts_touched(reset=True)
                experts = sum(touched.values()) / max(1, len(touched))
                print(f"round {r} {name}: {statistics.median(times):.4f} ms a replay "
                      f"({min(times):.4f}-{max(times):.4f}), {experts:.1f} experts a MoE layer", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
