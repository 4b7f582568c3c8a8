"""Where a one-token MoE step's routing chain spends its time (issue 12, batch 1): the full model's batch-1 decode
graph replayed with the fused routing kernel and the routed gate/up GEMV built with CHAIN_PROBE
(kernels_cu/common.cuh), which stamp %globaltimer at each link; one device call.

    PYTHONPATH=. python tests/gpu/probe_route_chain.py [--layers 27] [--replays 20]

The trace (tests/gpu/trace_decode.py --batches 1) has the routing kernel advancing the step ~10.5 us a MoE layer
after o_proj for ~0.55 us of bytes, and the GEMV ~19.9 us after it; these stamps split that chain.  Times are ns
from the routing kernel's return from its programmatic-launch wait (o_proj has completed by then), medians over
the MoE layers and replays:

  routing kernel: its first block resident (negative: it started early), the wait returned (0), x staged and
    normalised (last block), logits stored and signalled (last block), the last block's selection, its bucketing;
  GEMV: its first CTA resident, the signal seen (first and last CTA), every CTA's selection done, the first
    routed unit reduced (first warp), the last unit (last warp: the GEMV's end).

Times are printed in us.  Also printed: the smallest step between distinct stamps (a coarse %globaltimer tick,
e.g. 1 us, shows there: links below it are then seen only in the medians).  The blocks keep their stamps in
registers and post them at their end, so the probed replay differs from the plain one by the timer reads, the
posts after the work and one barrier in each kernel's last part; compare its replay time with trace_decode.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)

ROWS = 64  # CHAIN_PROBE rows: more than the MoE layers of the model
EVENTS = 8  # PROBE_EVENTS of common.cuh
ROUTE = ("route first block resident", "route wait returned", "route norm staged", "route logits signalled",
         "route select done", "route bucket done")
GEMV = ("gemv first CTA resident", "gemv signal seen (first)", "gemv signal seen (last)", "gemv selection done",
        "gemv first routed unit", "gemv end")
MIN_EVENTS = {"moe_route.cu": (0, 1), "moe_gemv.cu": (0, 1, 4)}  # earliest-of slots; the others keep the latest


def _views(mod):
    """(chain_probe [ROWS, EVENTS] uint64, chain_probe_blocks [1] uint32) of a module, as CuPy arrays."""
    import cupy

    def view(name, shape, dtype):
        ptr = mod.get_global_var(name)
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if isinstance(ptr, int):
            ptr = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, nbytes, mod), 0)
        return cupy.ndarray(shape, dtype, memptr=ptr)

    return view("chain_probe", (ROWS, EVENTS), np.uint64), view("chain_probe_blocks", (1,), np.uint32)


def _reset(views) -> None:
    for filename, (stamps, count) in views:
        stamps.fill(0)
        stamps[:, list(MIN_EVENTS[filename])] = np.iinfo(np.uint64).max
        count.fill(0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--input-len", type=int, default=2048)
    args = ap.parse_args()
    if args.replays < 1:
        ap.error("--replays must be >= 1")
    os.environ["KDA_RT_CHAIN_PROBE"] = str(ROWS)  # before any kernel is built

    from helpers.full_model import full_engine
    from kda_rt.bench import run_bench
    from kda_rt.cuda.ops.compile import PROBED

    _, engine = full_engine(args.layers, max_num_seqs=1, max_num_batched_tokens=8192)
    runner = engine.runner
    run_bench(engine, 1, args.input_len, 8, seed=3)  # builds and captures the batch-1 decode graph
    g = runner.graphs[next(b for b in runner.buckets if b >= 1)]
    views = [(f, _views(m)) for f, m in PROBED if f in MIN_EVENTS]
    if not {f for f, _ in views} >= set(MIN_EVENTS):
        print(f"error: probed modules {[f for f, _ in views]}: the routing chain was not built with CHAIN_PROBE",
              file=sys.stderr)
        return 2
    links: dict[str, list[float]] = {name: [] for name in ROUTE + GEMV}
    steps: list[int] = []
    walls = []
    with runner.stream:
        for _ in range(3):
            g.graph.launch(runner.stream)
        runner.stream.synchronize()
        for _ in range(args.replays):
            _reset(views)
            runner.stream.synchronize()
            t = time.perf_counter()
            g.graph.launch(runner.stream)
            runner.stream.synchronize()
            walls.append(time.perf_counter() - t)
            got: dict[str, list] = {f: [] for f in MIN_EVENTS}
            for filename, (stamps, count) in views:
                if int(count.get()[0]):  # a variant this graph ran (other variants of the file were only built)
                    got[filename].append(stamps.get())
            if any(len(v) != 1 for v in got.values()):
                print(f"error: variants that ran, per file: { {f: len(v) for f, v in got.items()} } (one each "
                      "expected: the routed GEMV and the fused routing kernel at one token)", file=sys.stderr)
                return 2
            (route,), (gemv,) = got["moe_route.cu"], got["moe_gemv.cu"]
            # row r: the r-th launch of each kernel in the replay (every block of a launch counts once), so the
            # same MoE layer for both at one token (one routing launch and one GEMV a layer)
            unset = np.iinfo(np.uint64).max
            used = [r for r in range(ROWS) if route[r, 1] != unset and gemv[r, 1] != unset]
            stamps_seen = set()
            for r in used:
                t0 = int(route[r, 1])
                for i, name in enumerate(ROUTE):
                    links[name].append((int(route[r, i]) - t0) / 1e3)
                for i, name in enumerate(GEMV):
                    links[name].append((int(gemv[r, i]) - t0) / 1e3)
                stamps_seen.update(int(v) for v in list(route[r, :6]) + list(gemv[r, :6]) if 0 < v < unset)
            ordered = sorted(stamps_seen)
            steps += [b - a for a, b in zip(ordered, ordered[1:], strict=False)]
    out = {"what": "route chain (us from the routing kernel's wait returning)", "layers_per_replay": len(used),
           "replays": args.replays, "replay_ms_median": round(1e3 * statistics.median(walls), 4),
           "smallest_stamp_step_ns": min(steps) if steps else None,
           "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("KDA_RT_")},  # the switches it ran under
           "median_us": {k: round(statistics.median(v), 2) for k, v in links.items() if v},
           "p10_p90_us": {k: [round(float(np.percentile(v, 10)), 2), round(float(np.percentile(v, 90)), 2)]
                          for k, v in links.items() if v}}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
