"""What a decode graph's padding rows cost (EngineConfig.cuda_graph_sizes, fifty-second session; measured in the
fifty-third, whose default sizes step by 1.5x and 2x).  With graph sizes of powers of two a decode step of B live
sequences replays the smallest graph of at least B rows, the rest padding rows (they run the kernels on the pad slot
and page: the KDA state pass, the MoE routing, the GEMMs' rows; the sampler samples the live rows only).  On the
full 27-layer shape (random weights, router bias std 0.05), for each batch B
a decode step of B live sequences at ~2K context (helpers.full_model.decode_full_batch) is replayed on the B-row
graph ("exact") and on the next power of two's ("padded"), alternating, 5 chunks of 20 replays each; prints ms a
replay (median of the chunks), the experts touched a MoE layer and the graph's own workspace (MiB: what a size costs
without the shared graph workspace, so this tool sets KDA_RT_SHARED_GRAPH_WS=0 unless it is given), one JSON line each.

    PYTHONPATH=. python tests/gpu/graph_pad_check.py [--batches 96,160,192] [--rounds 2] [--quantization fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)


def _next_pow2(b: int) -> int:
    return 1 << (b - 1).bit_length()


def _time(engine, rows: int, batch: int) -> tuple[float, float, int]:
    """ms a replay of the `rows`-row graph after a decode step of `batch` live sequences ran on it, the experts its
    replays touch a MoE layer, and the bytes of the graph's own workspace (what each captured size costs)."""
    from helpers.full_model import decode_full_batch, time_replays

    runner = engine.runner
    buckets = runner.buckets
    runner.buckets = [rows]  # (every pure decode step of up to `rows` sequences on this graph)
    try:
        decode_full_batch(engine, batch, 2048, seed=7)
    finally:
        runner.buckets = buckets
    ms, touched = time_replays(runner, runner.graphs[rows])
    return ms, sum(touched.values()) / max(1, len(touched)), runner.graphs[rows].ws.nbytes()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="96,160,192")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    if not batches or min(batches) < 1:
        ap.error(f"--batches: positive batch sizes, got {args.batches!r}")

    os.environ.setdefault("KDA_RT_SHARED_GRAPH_WS", "0")  # (each graph's own workspace: its bytes printed)
    from helpers.full_model import full_engine

    seqs = max(_next_pow2(b) for b in batches)
    _, engine = full_engine(max_num_seqs=seqs, quantization=args.quantization, exact_graphs=batches)
    for r in range(args.rounds):
        for b in batches:
            kinds = (("exact", b), ("padded", _next_pow2(b)))
            for kind, rows in kinds if r % 2 == 0 else kinds[::-1]:
                ms, experts, ws_bytes = _time(engine, rows, b)
                print(json.dumps({"round": r, "batch": b, "graph_rows": rows, "kind": kind, "step_ms": round(ms, 4),
                                  "experts": round(experts, 1), "workspace_mib": round(ws_bytes / 2**20, 1),
                                  "skip_pad": engine.runner.model.skip_pad}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
