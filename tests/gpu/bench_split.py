"""Where the time of a step goes, on the full 27-layer shape (one device call, one model load):

1. prefill: TTFT max of 32 x 2048 prompts under several `max_num_batched_tokens` budgets (the
   scheduler's budget is swapped on the same engine; the eager workspace grows as needed);
2. decode, per batch: the engine's mean decode step with async scheduling off and on (bytes floor
   from the experts routed in that run beside it), and the decode graph's replay alone (launch + sync,
   10 times; it repeats a decode step of all `batch` sequences (helpers.full_model.decode_full_batch), whose routing
   may differ from the run's mean: the experts it touches are printed beside it).

    PYTHONPATH=. python tests/gpu/bench_split.py [--budgets 8192,16384,32768] [--batches 1,32]
One JSON line per measurement on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--budgets", default="8192,16384,32768")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()

    from helpers.full_model import decode_full_batch, full_engine
    from kda_rt.bench import floors, run_bench

    budgets = [int(b) for b in args.budgets.split(",") if b]
    batches = [int(b) for b in args.batches.split(",") if b]
    cfg, engine = full_engine(args.layers, max_num_seqs=max(batches + [args.prompts]),
                              max_num_batched_tokens=max(budgets), exact_graphs=batches)
    sched = engine.scheduler
    for budget in budgets:
        sched.config = dataclasses.replace(sched.config, max_num_batched_tokens=budget)
        run_bench(engine, args.prompts, args.input_len, 2, seed=1)  # warm: compiles, grows the workspace
        rows = [run_bench(engine, args.prompts, args.input_len, 2, seed=2 + k) for k in range(2)]
        print(json.dumps({"what": "prefill", "budget": budget, "prompts": args.prompts, "input_len": args.input_len,
                          "ttft_max_s": [round(r["ttft_s_max"], 4) for r in rows],
                          "ttft_mean_s": [round(r["ttft_s_mean"], 4) for r in rows],
                          "steps": [r["num_steps"] for r in rows]}), flush=True)
    sched.config = dataclasses.replace(sched.config, max_num_batched_tokens=8192)

    runner = engine.runner
    for batch in batches:
        rows = next(b for b in runner.buckets if b >= batch)
        for ahead in (False, True):
            engine.config = dataclasses.replace(engine.config, async_scheduling=ahead)
            run_bench(engine, batch, args.input_len, 4, seed=5)
            runner.experts_touched(reset=True)
            rep = run_bench(engine, batch, args.input_len, args.output_len, seed=6)
            fl = floors(cfg, (batch, args.input_len, args.output_len), rep, runner.experts_touched(reset=True))
            print(json.dumps({"what": "decode", "batch": batch, "async_scheduling": ahead,
                              "step_ms": round(rep["decode_step_s_mean"] * 1e3, 3),
                              "floor_ms": round(fl["decode_floor_ms"], 3), "ratio": round(fl["decode_ratio"], 3),
                              "experts": fl["experts_per_moe_layer"], "elapsed_s": round(rep["elapsed_s"], 3),
                              "ttft_max_s": round(rep["ttft_s_max"], 4),
                              "launched_ahead": engine.counters["steps_launched_ahead"]}), flush=True)
        # (a run to completion ends on partial steps of smaller graphs, whose metadata the shared graph workspace
        # holds now: the batch's own graph must be the last one launched before it is replayed)
        decode_full_batch(engine, batch, args.input_len)
        g = runner.graphs[rows]
        runner.experts_touched(reset=True)
        with runner.stream:
            walls = []
            for _ in range(10):  # one replay at a time: launch + sync
                ts = time.perf_counter()
                g.graph.launch(runner.stream)
                runner.stream.synchronize()
                walls.append(time.perf_counter() - ts)
        touched = runner.experts_touched(reset=True)  # the replayed step's routing (padding rows route too)
        print(json.dumps({"what": "replay", "batch": batch, "graph_rows": rows,
                          "replay_wall_ms": round(statistics.fmean(walls) * 1e3, 3),
                          "experts_per_moe_layer": round(statistics.fmean(touched.values()), 1) if touched else None}),
              flush=True)
    print(runner.report(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
