"""Where the engine's decode step goes beyond its graph (issue 12), by CUDA events on the runner's stream and no
profiler: the seed run's batch-32 step (9.18 ms, 2026-12-04) is ~0.5 ms longer than a replay of the same graph with
the engine's copies and sampler (bench_graph_gap.py: 8.70 ms), while under the profiler (trace_decode.py) the two
differ by ~0.1 ms.  For every launch of the `--batch`-row decode graph in a run, events are recorded at the launch's
start (before the metadata copy), right before and right after the graph launch, and at its end (after the results'
copy is queued).  Over the steady window (every row live, the next launch also a full decode step) it prints the
medians of:

- period: one launch's start to the next's (the GPU's step, idle included),
- pre: start to the graph (the metadata copies), graph: the graph itself, post: the sampler and the results' copy,
- idle: period - (pre + graph + post): the GPU waiting for the host to queue the next launch,
- host: the host's time inside runner.launch and between two launches' starts,

then the same graph replayed back to back on a full decode step (decode_full_batch), as bench_graph_gap.py does:
`--reps` replays (the short form bench_graph_gap.py times), then `--sustain` more in chunks of 50, each chunk's time:
whether a replay slows down when the GPU is kept busy for seconds, as the engine's run keeps it.  Beside each phase,
the medians of nvidia-smi's SM clock, memory clock and power draw sampled every 100 ms (the GPU's clocks dropping
under a sustained load would slow the engine's steps and not the short replays).

    PYTHONPATH=. python tests/gpu/step_events.py [--batch 32] [--input-len 2048] [--output-len 512] [--layers 27]
One JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)


class _Clocks:
    """nvidia-smi sampling SM clock, memory clock (MHz) and power draw (W) every 100 ms in the background.  Each sample
    carries nvidia-smi's own timestamp, and `mark(name)` stamps the start of a phase, so a sample lands in the phase
    it was taken in even when nvidia-smi's output reaches the pipe in blocks."""

    def __init__(self) -> None:
        import subprocess
        import threading

        self.samples: list[tuple[float, list[float]]] = []
        self.phases: list[tuple[float, str]] = []
        self.mark("load")
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw",
                                          "--format=csv,noheader,nounits", "-lms", "100"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def mark(self, name: str) -> None:
        self.phases.append((time.time(), name))

    def _read(self) -> None:
        from datetime import datetime

        for line in self.proc.stdout:
            stamp, *values = (v.strip() for v in line.split(","))
            try:
                t = datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()  # local time, as time.time()
                self.samples.append((t, [float(v) for v in values]))
            except ValueError:
                continue

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=5)

    def medians(self) -> dict:
        self.stop()
        by_phase: dict[str, list[list[float]]] = {}
        for t, values in self.samples:
            started = [name for t0, name in self.phases if t0 <= t]
            if started:
                by_phase.setdefault(started[-1], []).append(values)
        out = {}
        for phase, rows in by_phase.items():
            out[phase] = {k: statistics.median(r[i] for r in rows)
                          for i, k in enumerate(("sm_mhz", "mem_mhz", "watts"))}
            out[phase]["samples"] = len(rows)
        return out


class _TimedGraph:
    """A captured graph whose launches record an event on each side into `slot` (the current launch's record)."""

    def __init__(self, graph, cupy, slot: dict) -> None:
        self.graph, self.cupy, self.slot = graph, cupy, slot

    def launch(self, stream) -> None:
        before, after = self.cupy.cuda.Event(), self.cupy.cuda.Event()
        before.record(stream)
        self.graph.launch(stream)
        after.record(stream)
        self.slot["before"], self.slot["after"] = before, after

    def __getattr__(self, name):
        return getattr(self.graph, name)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sustain", type=int, default=600, help="replays after the short ones, timed in chunks of 50")
    args = ap.parse_args()
    clocks = _Clocks()
    try:
        return _run(args, clocks)
    finally:
        clocks.stop()


def _run(args, clocks: _Clocks) -> int:
    import cupy

    from helpers.full_model import decode_full_batch, full_engine
    from kda_rt.bench import run_bench

    _, engine = full_engine(args.layers, max_num_seqs=args.batch)
    runner = engine.runner
    run_bench(engine, args.batch, args.input_len, 16, seed=3)  # builds and captures every graph of the run
    rows = next(b for b in runner.buckets if b >= args.batch)
    g = runner.graphs[rows]
    records: list[dict] = []
    stats = runner.model.expert_stats  # [layer, (experts touched summed over decode calls, calls)] on the device
    moe_layers = engine.model_config.mlp_types.count("moe")
    snaps = cupy.zeros(4 * (args.output_len + 64), dtype=cupy.int64)  # experts touched so far, after each launch
    real_launch = runner.launch  # the bound method; the wrapper below shadows it on the instance

    def launch(batch, sampling, **kw):
        rec = {"rows": batch.num_seqs, "start": cupy.cuda.Event(), "host_t0": time.perf_counter()}
        rec["start"].record(runner.stream)
        records.append(rec)
        g.graph.slot = rec  # the graph's events land in this launch's record
        pending = real_launch(batch, sampling, **kw)
        rec["end"] = cupy.cuda.Event()
        rec["end"].record(runner.stream)
        if len(records) <= len(snaps):
            with runner.stream:
                snaps[len(records) - 1] = stats[:, 0].sum()
        rec["host_t1"] = time.perf_counter()
        return pending

    g.graph = _TimedGraph(g.graph, cupy, {})
    runner.launch = launch
    clocks.mark("engine run")
    try:
        report = run_bench(engine, args.batch, args.input_len, args.output_len, seed=5)
    finally:
        del runner.launch  # the bound method again (the instance attribute shadowed it)
        g.graph = g.graph.graph
    runner.stream.synchronize()

    ms = cupy.cuda.get_elapsed_time
    steady = [i for i in range(len(records) - 1)
              if records[i]["rows"] == args.batch and "before" in records[i]
              and records[i + 1]["rows"] == args.batch and "before" in records[i + 1]]
    parts: dict[str, list[float]] = {k: [] for k in ("period", "pre", "graph", "post", "idle", "host_launch",
                                                     "host_between")}
    for i in steady:
        r, nxt = records[i], records[i + 1]
        period, pre = ms(r["start"], nxt["start"]), ms(r["start"], r["before"])
        graph, post = ms(r["before"], r["after"]), ms(r["after"], r["end"])
        for k, v in (("period", period), ("pre", pre), ("graph", graph), ("post", post),
                     ("idle", period - pre - graph - post), ("host_launch", 1e3 * (r["host_t1"] - r["host_t0"])),
                     ("host_between", 1e3 * (nxt["host_t0"] - r["host_t0"]))):
            parts[k].append(v)
    touched = snaps.get()
    experts = [float(touched[i] - touched[i - 1]) / moe_layers for i in steady if 0 < i < len(touched)]
    graphs = [ms(records[i]["before"], records[i]["after"]) for i in steady if 0 < i < len(touched)]
    fit = None
    if len(experts) > 2:
        # graph ms = a + b * experts a MoE layer + c * position in the run (the context grows one token a step)
        import numpy as np

        X = np.column_stack([np.ones(len(experts)), experts, np.arange(len(experts), dtype=float)])
        coef = np.linalg.lstsq(X, np.asarray(graphs), rcond=None)[0]
        fit = {"intercept_ms": round(float(coef[0]), 4), "ms_per_expert": round(float(coef[1]), 5),
               "ms_per_step": round(float(coef[2]), 6)}

    clocks.mark("setup")
    decode_full_batch(engine, args.batch, args.input_len, seed=3)  # the graph's inputs: a full decode step
    stream = runner.stream

    def replays(n: int) -> float:
        """ms a replay over n back-to-back replays."""
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(n):
            g.graph.launch(stream)
        end.record(stream)
        end.synchronize()
        return ms(start, end) / n

    with stream:
        for _ in range(3):
            g.graph.launch(stream)
        stream.synchronize()
        clocks.mark("short replay")
        short = replays(args.reps)
        clocks.mark("sustained replay")
        runner.experts_touched(reset=True)
        chunks = [round(replays(50), 4) for _ in range(args.sustain // 50)]
        per_layer = runner.experts_touched(reset=True)  # MoE layer -> mean experts a replay
        replay_experts = statistics.fmean(per_layer.values()) if per_layer else None
    med = {k: round(statistics.median(v), 4) if v else None for k, v in parts.items()}
    print(json.dumps({"batch": args.batch, "steady_launches": len(steady), "median_ms": med,
                      "replay_ms": round(short, 4),
                      "run_experts_per_moe_layer": {"median": statistics.median(experts) if experts else None,
                                                    "min": min(experts, default=None),
                                                    "max": max(experts, default=None)},
                      "run_graph_fit": fit, "replay_experts_per_moe_layer": replay_experts,
                      "sustained_replay_ms_by_50": chunks,
                      "run_decode_step_ms": (round(report["decode_step_s_mean"] * 1e3, 3)
                                             if report.get("decode_step_s_mean") is not None else None),
                      "launches": len(records), "clocks": clocks.medians()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
