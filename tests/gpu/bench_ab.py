"""A/B of one KDA_RT_* switch on the full 27-layer shape with one model load: the seed benchmark's
prefill (32 x 2048 prompts, 2 output tokens: TTFT max) and optionally a decode run, alternating the
switch's values so that drift in the GPU's state hits both alike.  The switch must be one the runtime
reads at each call (e.g. KDA_RT_SKINNY), not one read once at start; the decode graphs are captured
again after each flip (they keep the kernels they captured).

    PYTHONPATH=. python tests/gpu/bench_ab.py --env KDA_RT_MOE_B_TMA --values 1,0 [--rounds 3]
        [--decode 1:2048:64,8:2048:64] [--replays 1,32] [--prompts 0]
Several switches flip together with --env A,B --values 1:1,0:0,1:0 (one value per switch, ':'-joined).
A switch named engine.FIELD sets an EngineConfig field instead (a boolean one by 1 / 0, an int one to the value,
the scheduler's copy too), e.g. --env engine.async_scheduling or engine.prefill_tail_tokens --values 0,256.
--replays times the captured decode graph of each batch (graph replays of one full decode step at ~2K context,
helpers/full_model.decode_full_batch; CUDA events, median of 5 x 20).  Each replay updates the recurrent state and
cache it reads, so the replays' routing drifts, alike for every value only when the kernels compared are
bit-identical: the experts touched over the timed replays are printed beside each time.  The replays repeat one
step's tokens, whose routing settles on fewer experts than the engine's changing tokens touch (batch 32: ~66 against
~71 a MoE layer, ~0.083 ms a step an expert: tests/gpu/replay_routing.py), so a replay is faster than the engine's
step; compare values with each other, and headline steps with `python -m kda_rt.bench`.
--prompts 0 skips the prefill runs.  The values run in turn, in reverse order every other round.  One JSON line
per run on stdout (prefill runs: TTFT max and mean), then one summary line per value (medians).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", required=True)
    ap.add_argument("--values", default="1,0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--replays", default="", help="decode batch sizes whose graph replays are timed, e.g. 1,32")
    ap.add_argument("--decode", default="", help="batch:input:output of decode runs per round, e.g. 1:2048:64,8:2048:64")
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="--decode runs draw each request's lengths as bench's --random-range-ratio (no decode floor)")
    ap.add_argument("--structured-every", type=int, default=0,
                    help="--decode runs: every N-th request constrained by a regex, as bench's flag (the bundled "
                         "demo's tokenizer; llguidance on the device: carry .whl/extra)")
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="EngineConfig.quantization of the model")
    args = ap.parse_args()
    envs = args.env.split(",")
    if not all(e.startswith(("KDA_RT_", "engine.")) for e in envs):
        ap.error(f"--env must name KDA_RT_ switches or engine.FIELD, got {args.env!r}")
    from kda_rt.env import unknown_variables

    if unknown := unknown_variables(dict.fromkeys(e for e in envs if e.startswith("KDA_RT_"))):
        ap.error(f"--env: {', '.join(unknown)} is read nowhere (kda_rt/env.py): the A/B would time one build twice")
    from kda_rt.env import READ_AT_START

    if at_start := [e for e in envs if e in READ_AT_START]:
        ap.error(f"--env: {', '.join(at_start)} is read once when the runner starts: flipping it on this engine "
                 "would time one setting twice (run one process a value)")
    values = args.values.split(",")
    if any(len(v.split(":")) != len(envs) for v in values):
        ap.error(f"each of --values {args.values!r} needs one ':'-joined part per switch in {envs}")

    from helpers.full_model import full_engine
    from kda_rt.bench import floors, reads_e4m3_rows, run_bench
    from kda_rt.floors import decode_floor

    replays = [int(b) for b in args.replays.split(",") if b]
    decodes = [tuple(int(p) for p in d.split(":")) for d in args.decode.split(",") if d]
    seqs = max(32, args.prompts, *replays, *(b for b, *_ in decodes))  # (every run's batch admitted at once)
    # a graph of exactly each replay batch's rows (until the fifty-second session a batch that was neither a power of
    # two nor the largest ran the next graph up, padding rows and all: "160" and "192" replayed the 256-row graph)
    tokenizer = None
    if args.structured_every:
        from kda_rt.demo import demo_path
        from kda_rt.text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(demo_path())
    cfg, engine = full_engine(args.layers, max_num_seqs=seqs, quantization=args.quantization, exact_graphs=replays,
                              tokenizer=tokenizer)
    structured = (args.structured_every, "[a-z]+( [a-z]+)*") if args.structured_every else None
    if args.prompts:
        run_bench(engine, args.prompts, args.input_len, 2, seed=1)  # warm
    ttft: dict[str, list[float]] = {v: [] for v in values}
    ttft_mean: dict[str, list[float]] = {v: [] for v in values}
    steps: dict[tuple, list[float]] = {(v, d): [] for v in values for d in decodes}
    steps.update({(v, ("replay", b)): [] for v in values for b in replays})
    elapsed: dict[tuple, list[float]] = {(v, d): [] for v in values for d in decodes}
    for r in range(args.rounds):
        for v in values if r % 2 == 0 else values[::-1]:  # the order alternates, so neither value always runs first
            for name, value in zip(envs, v.split(":"), strict=True):
                if name.startswith("engine."):  # an EngineConfig field, read at each step (a scheduler one too)
                    field = name[len("engine."):]
                    typed = value == "1" if isinstance(getattr(engine.config, field), bool) else int(value)
                    engine.config = dataclasses.replace(engine.config, **{field: typed})
                    if hasattr(engine.scheduler.config, field):  # (the default tail follows the budget)
                        engine.scheduler.config = dataclasses.replace(
                            engine.scheduler.config, **{field: typed, "prefill_tail_tokens": engine.config.tail_tokens()})
                else:
                    os.environ[name] = value
            if engine.runner.graphs:  # decode graphs keep the kernels they captured: capture them again
                engine.runner.graphs.clear()
                for b, *_ in decodes:  # (the decode runs' buckets now, outside their timing)
                    run_bench(engine, b, 64, 4, seed=99)
            for b in replays:
                ms, touched = _replay_ms(engine, b, args.input_len)
                steps[v, ("replay", b)].append(ms / 1e3)
                # (the replays capture exact graphs: b rows; fp8 steps of up to KDA_RT_FP8_DECODE_GEMV_MAX_T rows read
                # the dense projections' e4m3 rows where the value being timed lets them)
                gemv8 = args.quantization == "fp8" and reads_e4m3_rows(engine, b)
                fl = decode_floor(cfg, b, args.input_len + 8, touched, quantization=args.quantization, e4m3_gemv=gemv8)
                print(json.dumps({"what": "replay", args.env: v, "round": r, "batch": b, "step_ms": round(ms, 4),
                                  "floor_ms": round(fl["seconds"] * 1e3, 4), "ratio": round(ms / (fl["seconds"] * 1e3), 3),
                                  "experts": round(sum(touched.values()) / max(1, len(touched)), 1)}), flush=True)
            if args.prompts:
                rep = run_bench(engine, args.prompts, args.input_len, 2, seed=2 + r)
                ttft[v].append(rep["ttft_s_max"])
                ttft_mean[v].append(rep["ttft_s_mean"])
                row = {"what": "prefill", args.env: v, "round": r, "ttft_max_s": round(rep["ttft_s_max"], 4),
                       "ttft_mean_s": round(rep["ttft_s_mean"], 4), "kernels_built": rep.get("kernels_built")}
                print(json.dumps(row), flush=True)
            for b, i, o in decodes:
                engine.runner.experts_touched(reset=True)
                dec = run_bench(engine, b, i, o, seed=50 + r, range_ratio=args.range_ratio, structured=structured)
                lens = dec.pop("_prompt_lens")
                fl = floors(cfg, (b, i, o), dec, engine.runner.experts_touched(reset=True), args.quantization,
                            e4m3_gemv=reads_e4m3_rows(engine, b), prompt_lens=lens if args.range_ratio else None)
                steps[v, (b, i, o)].append(dec["decode_step_s_mean"])
                elapsed[v, (b, i, o)].append(dec["elapsed_s"])
                row = {"what": "decode", args.env: v, "round": r, "workload": f"{b}:{i}:{o}",
                       "step_ms": round(dec["decode_step_s_mean"] * 1e3, 3), "floor_ms": fl["decode_floor_ms"] and round(fl["decode_floor_ms"], 3),
                       "ratio": fl["decode_ratio"] and round(fl["decode_ratio"], 3), "experts": fl["experts_per_moe_layer"],
                       "elapsed_s": round(dec["elapsed_s"], 4), "ttft_max_s": round(dec["ttft_s_max"], 4),
                       "steps_launched_ahead": dec["steps_launched_ahead"], "num_steps": dec["num_steps"],
                       "kernels_built": dec.get("kernels_built")}
                print(json.dumps(row), flush=True)
    for v in values:
        print(json.dumps({"summary": args.env, "value": v, "ttft_max_s": [round(t, 4) for t in ttft[v]],
                          "ttft_median_s": round(statistics.median(ttft[v]), 4) if ttft[v] else None,
                          "ttft_mean_median_s": round(statistics.median(ttft_mean[v]), 4) if ttft_mean[v] else None,
                          **{f"step_ms_median {':'.join(map(str, d))}": round(statistics.median(steps[v, d]) * 1e3, 4)
                             for d in [*decodes, *(("replay", b) for b in replays)]},
                          **{f"elapsed_s_median {':'.join(map(str, d))}": round(statistics.median(elapsed[v, d]), 4)
                             for d in decodes}}), flush=True)
    return 0


def _replay_ms(engine, batch: int, input_len: int) -> tuple[float, dict[int, float]]:
    """ms per replay of the decode graph of `batch` rows (captured now by a short run at input_len context),
    and the experts its routing touches per MoE layer (the replays' own count: their bytes floor)."""
    from helpers.full_model import decode_full_batch, time_replays

    runner = engine.runner
    # the graph's last launch a decode step of all `batch` sequences (a run to completion ends on partial steps:
    # until the forty-seventh session these replays repeated 24 live rows and 8 padding rows at batch 32)
    decode_full_batch(engine, batch, input_len, seed=7)
    rows = next(b for b in runner.buckets if b >= batch)
    if rows != batch:
        raise ValueError(f"bench_ab: no {batch}-row decode graph (buckets {runner.buckets}): the replays would time "
                         f"the {rows}-row graph")
    return time_replays(runner, runner.graphs[rows])


if __name__ == "__main__":
    raise SystemExit(main())
