"""What the engine's small copies between two decode steps cost on the GPU: the captured decode graph of
`--batch` rows (its last launch: a decode step of `--batch` live sequences) replayed back to back, with or without, before each
replay, copies like the engine's (a pinned-memory round trip of the graph's block table, the way the next step's
metadata goes up and the sampled tokens come down, a strided device copy like the table's columns, and the
sampled ids copied into the graph's input ids).  The difference between the two rows is what those copies add to
a step.  A device-only measurement (CUDA events; no profiler attached).

    PYTHONPATH=. python tests/gpu/bench_graph_gap.py [--batch 32] [--layers 27] [--reps 20] [--rounds 3]
One JSON line per variant and round (ms per step), then a summary line of medians with the engine's own decode
step in the short run (that run's steps also carry the sampler and the host).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import cupy

    from helpers.full_model import decode_full_batch, full_engine
    from kda_rt.bench import run_bench

    _, engine = full_engine(args.layers, max_num_seqs=args.batch)
    runner = engine.runner
    decode = run_bench(engine, args.batch, args.input_len, 64, seed=3)  # captures the graph
    decode_full_batch(engine, args.batch, args.input_len, seed=3)  # its last launch: a full decode step
    rows = next(b for b in runner.buckets if b >= args.batch)
    g = runner.graphs[rows]
    rt = cupy.cuda.runtime
    stream = runner.stream

    table = g.batch.block_tables  # the graph's own table: the round trip writes back its own values
    nbytes = min(4 * 4096, int(table.nbytes))
    pinned = cupy.cuda.alloc_pinned_memory(nbytes)
    with stream:
        scratch = cupy.zeros(4096, cupy.int32)
        ids = g.batch.input_ids[:args.batch].copy()  # (the same values written back)
    stream.synchronize()

    def copies():
        rt.memcpyAsync(pinned.ptr, table.data.ptr, nbytes, rt.memcpyDeviceToHost, stream.ptr)
        rt.memcpyAsync(table.data.ptr, pinned.ptr, nbytes, rt.memcpyHostToDevice, stream.ptr)
        rt.memcpy2DAsync(scratch.data.ptr, 64, scratch.data.ptr + 8192, 32, 32, 32, rt.memcpyDeviceToDevice,
                         stream.ptr)
        rt.memcpyAsync(g.batch.input_ids.data.ptr, ids.data.ptr, 4 * args.batch, rt.memcpyDeviceToDevice, stream.ptr)

    variants = {"graph only": False, "graph + copies": True}
    results: dict[str, list[float]] = {k: [] for k in variants}
    with stream:
        for _ in range(3):
            g.graph.launch(stream)
        stream.synchronize()
        for r in range(args.rounds):
            for name, with_copies in (variants.items() if r % 2 == 0 else reversed(variants.items())):
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record(stream)
                for _ in range(args.reps):
                    if with_copies:
                        copies()
                    g.graph.launch(stream)
                end.record(stream)
                end.synchronize()
                ms = cupy.cuda.get_elapsed_time(start, end) / args.reps
                results[name].append(ms)
                print(json.dumps({"variant": name, "round": r, "step_ms": round(ms, 4)}), flush=True)
    print(json.dumps({"summary": {k: round(statistics.median(v), 4) for k, v in results.items()},
                      "engine_decode_step_ms": round(decode["decode_step_s_mean"] * 1e3, 3),
                      "batch": args.batch}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
