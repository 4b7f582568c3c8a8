"""What the engine's small copies between two decode steps cost on the GPU: the captured decode graph of
`--batch` rows (its last launch: a decode step of `--batch` live sequences) replayed back to back, with or without, before each
replay, copies like the engine's (a pinned-memory round trip of the graph's block table, the way the next step's
metadata goes up and the sampled tokens come down, a strided device copy like the table's columns, and the
sampled ids copied into the graph's input ids), and with those copies and the runner's greedy sampler
(sampler/sampling.sample on the graph's logits, its ids copied down; the runner also uploads the sampling settings
and copies down flags and logprobs in one packed buffer, left out here).  The differences between the rows are what
those pieces add to a step (CUDA events; no profiler attached).  With --trace, one more pass of each variant under
torch.profiler (CUPTI; torch is on the device image, never a kda_rt dependency): the median idle from one replay's
last kernel to the next replay's first kernel and from the last copy before a replay to its first kernel, to
compare with trace_decode.py --run's idle between the engine's steps.

    PYTHONPATH=. python tests/gpu/bench_graph_gap.py [--batch 32] [--layers 27] [--reps 20] [--rounds 3] [--trace]
One JSON line per variant and round (ms per step), then a summary line of medians with the engine's own decode
step in the short run (that run's steps also carry the host), then with --trace one line per variant.
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
    ap.add_argument("--trace", action="store_true", help="also trace one pass of each variant (torch.profiler)")
    args = ap.parse_args()

    import cupy
    import numpy as np

    from helpers.full_model import decode_full_batch, full_engine
    from kda_rt.bench import run_bench
    from kda_rt.sampler.sampling import sample

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
        B = args.batch
        greedy = dict(temperature=cupy.zeros(B, np.float32), top_k=cupy.zeros(B, np.int32),
                      top_p=cupy.ones(B, np.float32), min_p=cupy.zeros(B, np.float32),
                      seeds=cupy.zeros(B, np.uint64), steps=cupy.zeros(B, np.int32))
        out_ids, out_flags = cupy.empty(B, np.int32), cupy.empty(B, np.int32)
    results_host = cupy.cuda.alloc_pinned_memory(4 * B)
    stream.synchronize()

    def copies():
        rt.memcpyAsync(pinned.ptr, table.data.ptr, nbytes, rt.memcpyDeviceToHost, stream.ptr)
        rt.memcpyAsync(table.data.ptr, pinned.ptr, nbytes, rt.memcpyHostToDevice, stream.ptr)
        rt.memcpy2DAsync(scratch.data.ptr, 64, scratch.data.ptr + 8192, 32, 32, 32, rt.memcpyDeviceToDevice,
                         stream.ptr)
        rt.memcpyAsync(g.batch.input_ids.data.ptr, ids.data.ptr, 4 * args.batch, rt.memcpyDeviceToDevice, stream.ptr)

    def sampler():
        sample(g.logits[:B], greedy["temperature"], greedy["top_k"], greedy["top_p"], greedy["min_p"],
               greedy["seeds"], greedy["steps"], out_ids=out_ids, out_flags=out_flags, stream=stream)
        rt.memcpyAsync(results_host.ptr, out_ids.data.ptr, 4 * B, rt.memcpyDeviceToHost, stream.ptr)

    variants = {"graph only": (False, False), "graph + copies": (True, False), "graph + copies + sampler": (True, True)}

    def one_pass(with_copies: bool, with_sampler: bool) -> None:
        for _ in range(args.reps):
            if with_copies:
                copies()
            g.graph.launch(stream)
            if with_sampler:
                sampler()

    results: dict[str, list[float]] = {k: [] for k in variants}
    with stream:
        for _ in range(3):
            g.graph.launch(stream)
        sampler()  # builds the sampler's kernel outside the timing
        stream.synchronize()
        for r in range(args.rounds):
            for name, parts in (variants.items() if r % 2 == 0 else reversed(variants.items())):
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record(stream)
                one_pass(*parts)
                end.record(stream)
                end.synchronize()
                ms = cupy.cuda.get_elapsed_time(start, end) / args.reps
                results[name].append(ms)
                print(json.dumps({"variant": name, "round": r, "step_ms": round(ms, 4)}), flush=True)
    print(json.dumps({"summary": {k: round(statistics.median(v), 4) for k, v in results.items()},
                      "engine_decode_step_ms": round(decode["decode_step_s_mean"] * 1e3, 3),
                      "batch": args.batch}), flush=True)
    if args.trace:
        for name, parts in variants.items():
            print(json.dumps({"variant": name, **_traced_gaps(stream, lambda p=parts: one_pass(*p))}), flush=True)
    return 0


def _traced_gaps(stream, body) -> dict:
    """One traced pass of `body`: the median idle (us) before each replay's first kernel (after the kernel before
    it) and after the last copy before it; replays are found by the pass's first kernel's name (the graph's first
    kernel, the embedding gather, once a replay)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with stream, profile(activities=[ProfilerActivity.CUDA]) as prof:
        body()
        stream.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as fh:
        prof.export_chrome_trace(fh.name)
        with open(fh.name) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    copies = sorted((e for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset") and "dur" in e),
                    key=lambda e: e["ts"])
    # a replay starts with the graph's first kernel: the first kernel's name, recurring once a replay
    first = kernels[0]["name"]
    starts = [i for i, e in enumerate(kernels) if e["name"] == first]
    gaps, copy_gaps = [], []
    for i in starts[1:]:
        prev_end = kernels[i - 1]["ts"] + kernels[i - 1]["dur"]
        gaps.append(kernels[i]["ts"] - prev_end)
        before = [c for c in copies if prev_end <= c["ts"] <= kernels[i]["ts"]]
        if before:
            copy_gaps.append(kernels[i]["ts"] - (before[-1]["ts"] + before[-1]["dur"]))
    med = lambda v: round(statistics.median(v), 1) if v else None  # noqa: E731
    return {"replays_seen": len(starts), "idle_before_replay_us": med(gaps), "after_last_copy_us": med(copy_gaps),
            "kernels": len(kernels), "copies": len(copies)}


if __name__ == "__main__":
    raise SystemExit(main())
