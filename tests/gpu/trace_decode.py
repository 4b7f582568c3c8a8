"""Per-kernel timeline of decode-graph replays on the full 27-layer shape: which kernels run, their
summed time, and the idle gaps between them (the launch cost inside the graph).

A measurement tool for the device only: the kernel timestamps come from CUPTI through torch.profiler
(torch is on the device image, never a kda_rt dependency).

    PYTHONPATH=. python tests/gpu/trace_decode.py [--batches 1,32] [--layers 27] [--trace-dir DIR]
        [--timeline FROM:COUNT] [--env KDA_RT_X --values 1,0]
One JSON line per batch (and value of --env) on stdout (replay wall, kernels, busy and gap time, largest
kernels, and "advance": what each kernel adds to the replay's span, the per-op cost under programmatic launch;
with --timeline the start and end of kernels FROM .. FROM+COUNT-1 of the last replay).

    PYTHONPATH=. python tests/gpu/trace_decode.py --batches '' --prefill 4x2048,1x32768
Per-kernel totals of whole prefills instead (B prompts of L tokens, 2 output tokens, after one warm-up run
of the same shape; steps of max_num_batched_tokens = --step-tokens, default 8192): one JSON line per shape (with
--env / --values: per shape and value).

    PYTHONPATH=. python tests/gpu/trace_decode.py --batches '' --run 32:2048:64
The decode steps of a whole engine run (B prompts of I tokens, O output tokens, after a warm-up run of the
same shape): GPU time per step (kernels, idle between them and between steps, each kernel's "advance") beside the
host's time per engine.step() split into launching, waiting for results and the rest (postprocess, scheduling), so
a step slower than its graph replay shows whether the GPU or the host sets the pace, and the copies between two
steps (each one's start after the step's last kernel, and its duration) (with --env / --values: once per value).

--run's steady steps are those where every sequence decodes: the steps before the last prompt's entry and the
run's last ceil(B I / step tokens) - 1 steps (the sequences finish over as many steps as they entered) are left out.

The decode replays (--batches) repeat a graph's last launch, made a decode step of every sequence by
helpers/full_model.decode_full_batch (until the forty-seventh session it was a run's end: at batch 32 in 8192-token
steps 20 live sequences and 12 padding rows, in 16384-token steps 24 and 8).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)


def _short(name: str) -> str:
    name = re.sub(r"<.*", "", name)
    return name[:60]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--trace-dir", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--prefill", default="", help="BxL shapes whose whole prefill is traced, e.g. 4x2048")
    ap.add_argument("--timeline", default="", help="FROM:COUNT: kernels FROM .. FROM+COUNT-1 of the last replay "
                    "with start and end (us from the replay's first kernel), e.g. 40:40")
    ap.add_argument("--env", default="", help="a KDA_RT_* switch: the traces run once per --values entry")
    ap.add_argument("--values", default="", help="values of --env, e.g. 1,0 (graphs captured again for each)")
    ap.add_argument("--step-tokens", type=int, default=8192, help="max_num_batched_tokens of the engine (the offline "
                    "default on an H200 is 16384; 8192 keeps the earlier traces comparable)")
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="EngineConfig.quantization (fp8: e4m3 "
                    "expert stacks)")
    ap.add_argument("--run", default="", help="B:I:O workloads whose decode steps are traced, e.g. 32:2048:64")
    args = ap.parse_args()
    from kda_rt.env import READ_AT_START

    if args.env in READ_AT_START:
        ap.error(f"--env {args.env} is read once when the runner starts: run one process a value")

    from helpers.full_model import decode_full_batch, full_engine
    from kda_rt.bench import run_bench

    batches = [int(b) for b in args.batches.split(",") if b]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.prefill.split(",") if s]
    runs = [tuple(int(v) for v in s.split(":")) for s in args.run.split(",") if s]
    seqs = max(batches + [b for b, _ in shapes] + [b for b, _, _ in runs])
    _, engine = full_engine(args.layers, max_num_seqs=seqs, max_num_batched_tokens=args.step_tokens,
                            quantization=args.quantization, exact_graphs=batches)
    runner = engine.runner

    from torch.profiler import ProfilerActivity, profile

    settings = [(args.env, v) for v in args.values.split(",")] if args.env else [("", "")]
    for (name, value), (num, length) in [(sv, s) for sv in settings for s in shapes]:
        if name:
            os.environ[name] = value
        run_bench(engine, num, length, 2, seed=3)
        host: collections.defaultdict[str, list[float]] = collections.defaultdict(list)
        saved = [_timed(host, obj, name, key) for obj, name, key in (
            (runner, "launch", "launch"), (runner, "collect", "collect"), (engine, "_postprocess", "postprocess"),
            (engine.scheduler, "schedule", "schedule"), (engine, "build_batch", "build_batch"))]
        ts = time.perf_counter()
        try:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                report = run_bench(engine, num, length, 2, seed=4)
        finally:
            for obj, name, inner in saved:
                setattr(obj, name, inner)
        wall = time.perf_counter() - ts
        path = os.path.join(args.trace_dir, f"trace_prefill_{num}x{length}.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
        kernels = [e for e in events if e.get("cat") == "kernel"]
        # the host's CUDA API calls (CUPTI): where it blocks (synchronize, cudaFree, blocking copies)
        api = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e]
        api_total: collections.Counter[str] = collections.Counter()
        api_count: collections.Counter[str] = collections.Counter()
        for e in api:
            api_total[e["name"]] += e["dur"]
            api_count[e["name"]] += 1
        per_kernel: collections.Counter[str] = collections.Counter()
        count: collections.Counter[str] = collections.Counter()
        for e in kernels:
            per_kernel[_short(e["name"])] += e["dur"]
            count[_short(e["name"])] += 1
        busy = sum(per_kernel.values())
        # idle time between consecutive kernels (the GPU waiting for the host), by the kernel that ends it
        kernels.sort(key=lambda e: e["ts"])
        gap_before: collections.Counter[str] = collections.Counter()
        big = []
        for a, b in zip(kernels, kernels[1:], strict=False):
            gap = max(0.0, b["ts"] - (a["ts"] + a["dur"]))
            gap_before[_short(b["name"])] += gap
            big.append((gap, _short(a["name"]), _short(b["name"])))
        big.sort(reverse=True)
        print(json.dumps({
            **({name: value} if name else {}), "prefill": f"{num}x{length}", "wall_s": round(wall, 3),
            "ttft_s_max": round(report["ttft_s_max"], 4),
            "kernels": len(kernels),
            # host time of each call in the run, in order (ms): a step's launch returns once its kernels are
            # queued; collect waits for its results; the GPU idles from a step's end to the next step's first kernel
            "host_ms": {k: [round(v * 1e3, 2) for v in vs] for k, vs in host.items()},
            "busy_ms": round(busy / 1e3, 2),
            "span_ms": round((kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) / 1e3, 2),
            "idle_ms": round(sum(gap_before.values()) / 1e3, 2),
            "idle_before": [{"name": k, "ms": round(v / 1e3, 2)} for k, v in gap_before.most_common(15)],
            "largest_gaps": [{"us": round(g, 1), "after": a, "before": b} for g, a, b in big[:15]],
            "host_api": [{"name": k, "n": api_count[k], "ms": round(v / 1e3, 2)} for k, v in api_total.most_common(12)],
            "host_api_longest": [{"name": e["name"], "us": round(e["dur"], 1)}
                                 for e in sorted(api, key=lambda e: -e["dur"])[:15]],
            "top": [{"name": k, "n": count[k], "ms": round(v / 1e3, 2), "share": round(v / busy, 3)}
                    for k, v in per_kernel.most_common(45)],
        }), flush=True)

    for (name, value), run in [(sv, r) for sv in settings for r in runs]:
        if name:
            os.environ[name] = value
            runner.graphs.clear()  # decode graphs keep the kernels they captured
        rep = _trace_run(engine, *run, args.trace_dir, profile, ProfilerActivity)
        print(json.dumps({name: value, **rep} if name else rep), flush=True)

    for (name, value), batch in [(sv, b) for sv in settings for b in batches]:
        if name:
            os.environ[name] = value
            runner.graphs.clear()  # decode graphs keep the kernels they captured
        rows = next(b for b in runner.buckets if b >= batch)
        decode_full_batch(engine, batch, args.input_len, seed=3)  # the graph's last launch: a full decode step
        g = runner.graphs[rows]
        with runner.stream:
            for _ in range(3):
                g.graph.launch(runner.stream)
            runner.stream.synchronize()
            walls = []
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.replays):
                    ts = time.perf_counter()
                    g.graph.launch(runner.stream)
                    runner.stream.synchronize()
                    walls.append(time.perf_counter() - ts)
                    time.sleep(0.002)  # a clear break between replays in the timeline
        path = os.path.join(args.trace_dir, f"trace_decode_b{batch}.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
        kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
        # split into replays at gaps of more than 1 ms
        replays, cur = [], []
        for e in kernels:
            if cur and e["ts"] - (cur[-1]["ts"] + cur[-1]["dur"]) > 1000:
                replays.append(cur)
                cur = []
            cur.append(e)
        if cur:
            replays.append(cur)
        stats = []
        advance: collections.Counter[str] = collections.Counter()
        for rep in replays:
            for k, v in critical_advance(rep).items():
                advance[k] += v / len(replays)
        per_kernel: collections.Counter[str] = collections.Counter()
        count: collections.Counter[str] = collections.Counter()
        gap_after: collections.Counter[str] = collections.Counter()
        gaps_all = []
        for rep in replays:
            span = rep[-1]["ts"] + rep[-1]["dur"] - rep[0]["ts"]
            busy = sum(e["dur"] for e in rep)
            gaps = [max(0.0, b["ts"] - (a["ts"] + a["dur"])) for a, b in zip(rep, rep[1:], strict=False)]
            gaps_all += gaps
            for a, gap in zip(rep, gaps, strict=False):
                gap_after[_short(a["name"])] += gap / len(replays)
            for e in rep:
                per_kernel[_short(e["name"])] += e["dur"] / len(replays)
                count[_short(e["name"])] += 1 / len(replays)
            stats.append((len(rep), span, busy))
        print(json.dumps({
            "batch": batch, "env": f"{name}={value}" if name else "", "graph_rows": rows, "replay_wall_ms": round(statistics.fmean(walls) * 1e3, 3),
            "replays_seen": len(replays), "kernels_per_replay": [s[0] for s in stats],
            "span_ms": round(statistics.fmean(s[1] for s in stats) / 1e3, 3),
            "busy_ms": round(statistics.fmean(s[2] for s in stats) / 1e3, 3),
            "gap_ms": round(statistics.fmean(s[1] - s[2] for s in stats) / 1e3, 3),
            "gap_us_median": round(statistics.median(gaps_all), 2) if gaps_all else None,
            "gap_us_p90": round(sorted(gaps_all)[int(0.9 * len(gaps_all))], 2) if gaps_all else None,
            "kernels": [{"name": k, "n": round(count[k], 1), "us": round(v, 1), "gap_after_us": round(gap_after[k], 1)}
                        for k, v in per_kernel.most_common(40)],
            # what each kernel adds to the replay's span (critical_advance): meaningful under programmatic launch,
            # where the kernels' own intervals overlap and their sum ("busy") is not
            "advance": [{"name": k, "n": round(count[k], 1), "us": round(v, 1), "us_each": round(v / count[k], 2),
                         "share": round(v / sum(advance.values()), 3)} for k, v in advance.most_common(40)],
            "timeline": _timeline(replays[-1], args.timeline) if args.timeline and replays else [],
        }), flush=True)
    return 0


def _between(gaps: list[list[tuple]]) -> list[dict]:
    """Median start and duration of the i-th copy in the gaps that have the most common number of copies."""
    if not gaps:
        return []
    n = collections.Counter(len(g) for g in gaps).most_common(1)[0][0]
    same = [g for g in gaps if len(g) == n]
    return [{"name": same[0][i][2][:40], "start_us": round(statistics.median(g[i][0] for g in same), 1),
             "dur_us": round(statistics.median(g[i][1] for g in same), 1)} for i in range(n)] + [
        {"gaps_with_this_many_copies": len(same), "of": len(gaps)}]


def critical_advance(rep: list[dict]) -> collections.Counter[str]:
    """Per kernel name (summed over its launches), how far each launch moves the frontier of finished work: the
    kernels in start order, launch i adds max(0, end_i - max(end_j, j < i)), and the first its whole duration, so
    the values add up to the replay's span.  Under programmatic dependent launch a kernel starts (its first CTA
    runs) long before its wait returns, so its own duration overstates it; this is the "+end" of a timeline."""
    frontier, out = None, collections.Counter()
    for e in sorted(rep, key=lambda e: e["ts"]):
        end = e["ts"] + e["dur"]
        out[_short(e["name"])] += end - e["ts"] if frontier is None else max(0.0, end - frontier)
        frontier = end if frontier is None else max(frontier, end)
    return out


def _timeline(rep: list[dict], spec: str) -> list[list]:
    """[start, end, name] (us from the replay's first kernel) of kernels FROM .. FROM+COUNT-1: under programmatic
    launch a kernel's start is when its first CTA ran, before its wait, so overlaps show."""
    first, n = (int(v) for v in spec.split(":"))
    t0 = rep[0]["ts"]
    return [[round(e["ts"] - t0, 2), round(e["ts"] + e["dur"] - t0, 2), _short(e["name"])] for e in rep[first:first + n]]


def _timed(host: dict[str, list[float]], obj, name: str, key: str) -> tuple:
    """Wrap obj.name so that each call's host time is appended to host[key]; returns what restores it."""
    inner = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            host[key].append(time.perf_counter() - t)
    setattr(obj, name, wrapper)
    return obj, name, inner


def _trace_run(engine, batch: int, input_len: int, output_len: int, trace_dir: str, profile, activity) -> dict:
    """One engine run's decode steps: host time per step by phase, GPU kernels and idle per step."""
    from kda_rt.bench import run_bench

    runner = engine.runner
    host: collections.defaultdict[str, list[float]] = collections.defaultdict(list)

    run_bench(engine, batch, input_len, min(output_len, 8), seed=3)
    saved = [_timed(host, obj, name, key) for obj, name, key in (
        (runner, "launch", "launch"), (runner, "collect", "collect"), (runner.staging, "wait", "wait"),
        (engine, "_postprocess", "postprocess"))]
    try:
        with profile(activities=[activity.CUDA]) as prof:
            report = run_bench(engine, batch, input_len, output_len, seed=4)
    finally:
        for obj, name, inner in saved:
            setattr(obj, name, inner)
    path = os.path.join(trace_dir, f"trace_run_{batch}x{input_len}x{output_len}.json")
    prof.export_chrome_trace(path)
    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    copies = sorted((e for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset") and "dur" in e),
                    key=lambda e: e["ts"])
    # the decode steps: from the first kernel after the last prefill-sized gap; steps end at the sampler's last
    # kernel (the results copy follows it), found as the kernel name that occurs once per step at the end
    names = [_short(e["name"]) for e in kernels]
    last = names[-1]
    ends = [i for i, n in enumerate(names) if n == last]
    steps, advances, between = [], [], []
    for a, b in zip(ends, ends[1:], strict=False):
        # the copies from step a's last kernel to step b's first: (start after a's end, duration, name), us
        t_end, t_next = kernels[a]["ts"] + kernels[a]["dur"], kernels[a + 1]["ts"]
        between.append([(e["ts"] - t_end, e["dur"], e["name"]) for e in copies if t_end - 1 <= e["ts"] <= t_next])
        seg = kernels[a + 1:b + 1]
        busy = sum(e["dur"] for e in seg)
        span = seg[-1]["ts"] + seg[-1]["dur"] - seg[0]["ts"]
        lead = seg[0]["ts"] - (kernels[a]["ts"] + kernels[a]["dur"])  # idle between the steps
        steps.append((len(seg), busy, span, lead))
        advances.append(critical_advance(seg))
    # steady decode steps: every sequence decoding.  The prompts enter over `chunks` steps and so finish over as
    # many: the run's last chunks - 1 steps decode fewer rows (28, 24, ... 4 at 32 x 2048 in 8192-token steps) and
    # are left out, as are the steps up to the last prompt's entry
    chunks = -(-batch * input_len // engine.scheduler.config.max_num_batched_tokens)
    ramp = chunks - 1
    full = len(steps) - ramp
    keep = max(1, min(full, output_len - chunks - 2))
    window = slice(max(0, full - keep), full)
    tail = steps[window]
    keep = len(tail)
    advance: collections.Counter[str] = collections.Counter()
    for adv in advances[window]:
        for k, v in adv.items():
            advance[k] += v / keep
    gap_before: collections.Counter[str] = collections.Counter()
    for x, y in zip(kernels, kernels[1:], strict=False):
        gap_before[_short(y["name"])] += max(0.0, y["ts"] - (x["ts"] + x["dur"]))
    mean = lambda v: round(statistics.fmean(v), 3) if v else None  # noqa: E731
    return {
        "run": f"{batch}:{input_len}:{output_len}", "decode_step_ms": round(report["decode_step_s_mean"] * 1e3, 3),
        "steps_seen": len(steps), "steady_steps": len(tail), "ramp_down_steps_left_out": ramp,
        "gpu_kernels_per_step": mean([s[0] for s in tail]),
        "gpu_busy_ms": mean([s[1] / 1e3 for s in tail]), "gpu_span_ms": mean([s[2] / 1e3 for s in tail]),
        "gpu_idle_in_step_ms": mean([(s[2] - s[1]) / 1e3 for s in tail]),
        "gpu_idle_between_steps_ms": mean([s[3] / 1e3 for s in tail]),
        "gpu_idle_between_steps_max_ms": round(max(s[3] for s in tail) / 1e3, 3) if tail else None,
        # medians: the means would carry the prefill steps' eager launches and waits
        "host_ms_per_call_median": {k: round(statistics.median(v) * 1e3, 3) for k, v in host.items() if v},
        "host_calls": {k: len(v) for k, v in host.items()},
        "idle_before": [{"name": k, "ms": round(v / 1e3, 2)} for k, v in gap_before.most_common(10)],
        # what each kernel adds to a steady step's span (us a step, summed over its launches in the step)
        "advance_us": [{"name": k, "us": round(v, 1)} for k, v in advance.most_common(20)],
        # what the GPU does between two steady steps (the sampler's results copy, the next step's metadata copies,
        # the graph's start): each copy's median start after the step's last kernel and median duration, us
        "between_steps": _between(between[window]),
        "report": {k: report[k] for k in ("elapsed_s", "ttft_s_max", "num_decode_steps")},
    }


if __name__ == "__main__":
    raise SystemExit(main())
