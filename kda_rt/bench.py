"""`python -m kda_rt.bench`: offline throughput and latency of the engine; prints one JSON line.

    python -m kda_rt.bench --model DIR --batch 32 --input-len 2048 --output-len 512
    python -m kda_rt.bench --config config.json --random-weights --batch 2 --input-len 64 --output-len 8

`--batch` requests of `--input-len` random token ids each generate exactly `--output-len` tokens
(greedy, EOS ignored), all added at once and run through `LLMEngine.step()`.  Reported:
total tok/s ((input + output) tokens / wall time), output tok/s, time to first token (per request,
from the start), time per output token (after the first), mean decode-only step time, steps,
preemptions, steps launched ahead (async scheduling) and peak memory (process RSS on the NumPy backend), and
beside the times their floors
(`kda_rt.floors`): the decode step's bytes at the copy bandwidth, from the experts the run actually
routed (counted on the GPU per MoE layer; uniform-routing estimate on the NumPy backend), and the
prefill's FLOPs at the bf16 peak, each with the ratio measured / floor.  `--random-weights` builds the
weights in memory from the config alone (same names, shapes and value scales as
`kda_rt.random_checkpoint`), so any shape can be measured without a checkpoint on disk.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import os
import statistics
import sys
import time
from typing import TYPE_CHECKING

import numpy as np

from kda_rt.cli import model_dir_problem
from kda_rt.engine.config import EngineConfig
from kda_rt.random_checkpoint import random_weights

if TYPE_CHECKING:
    from kda_rt.engine import LLMEngine
    from kda_rt.loader.config import ModelConfig

__all__ = ["build_parser", "floors", "main", "random_weights", "reads_e4m3_rows", "run_bench"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kda_rt.bench", description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory")
    src.add_argument("--config", help="config.json (hub layout) or a preset name (kimi-linear-48b-a3b); needs "
                                      "--random-weights")
    ap.add_argument("--num-layers", type=int, default=None, help="with a preset: cut it to this many layers")
    ap.add_argument("--router-bias-std", type=float, default=0.05,
                    help="--random-weights: std of the router correction biases (small, so routing follows the data)")
    ap.add_argument("--random-weights", action="store_true", help="random weights built in memory from the config (also --load-format dummy)")
    ap.add_argument("--batch", type=int, default=32, help="number of requests")
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--also", default="",
                    help="more workloads on the same engine after the first, as BATCH:INPUT:OUTPUT[,...] "
                         "(one JSON line each; saves loading the model again)")
    ap.add_argument("--random-range-ratio", type=float, default=0.0,
                    help="each request's input and output lengths drawn uniformly from [L * (1 - R), L * (1 + R)] "
                         "(seeded; vLLM's bench flag): requests end at different steps, as in serving; 0 (the "
                         "default): every request the workload's lengths")
    ap.add_argument("--structured-every", type=int, default=0, metavar="N",
                    help="every N-th request (the first, the N+1-th, ...) is constrained by --structured-regex (a "
                         "structured-output row among unconstrained ones, as in serving; needs a tokenizer: the "
                         "--model's, or --tokenizer) ")
    ap.add_argument("--structured-regex", default="[a-z]+( [a-z]+)*",
                    help="the constrained requests' regex (default: words without end, so max_tokens ends them)")
    ap.add_argument("--tokenizer", default=None,
                    help="a directory with a tokenizer (tiktoken.model + tokenizer_config.json) for "
                         "--structured-every when the model has none (--config; e.g. the bundled demo's)")
    ap.add_argument("--prefix-len", type=int, default=0,
                    help="the first N tokens of every prompt of a run are the same (a shared system prompt; with "
                         "prefix caching, on by default, later requests resume after it); each run starts from an "
                         "empty prefix cache")
    ap.add_argument("--no-warmup", action="store_true",
                    help="time the first run too (the same as --num-iters-warmup 0)")
    ap.add_argument("--num-iters-warmup", type=int, default=1,
                    help="untimed runs of each workload first, with at most 4 output tokens (they build every "
                         "kernel variant the timed runs use)")
    ap.add_argument("--num-iters", type=int, default=1,
                    help="timed runs of each workload; with more than one, each number reported is the median "
                         "over the runs and the runs' own reports are under \"iters\"")
    ap.add_argument("--profile", action="store_true",
                    help="cuda backend: after the run, time each model op of one prefill step and one (eager) "
                         "decode step with CUDA events; tables on stderr, numbers in the JSON line")
    ap.add_argument("--sampling", default="", metavar="KEY=VALUE,...",
                    help="sampling settings of every request instead of greedy, e.g. temperature=0.8,top_p=0.95,"
                         f"frequency_penalty=0.5 (keys: {', '.join(_SAMPLING_KEYS)}); EOS is always ignored")
    ap.add_argument("-v", "--verbose", action="store_true")
    EngineConfig.add_cli_args(ap, max_num_seqs=None)  # --max-num-seqs default: --batch; --seed seeds weights too
    return ap


_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed")


def parse_sampling(text: str) -> dict:
    """`--sampling`'s KEY=VALUE,... as SamplingParams keyword arguments (ValueError naming what is wrong)."""
    from kda_rt.sampler.params import SamplingParams

    out: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in _SAMPLING_KEYS:
            raise ValueError(f"--sampling: {item!r} is not KEY=VALUE with KEY one of {', '.join(_SAMPLING_KEYS)}")
        try:
            out[key] = int(value) if key in ("top_k", "seed") else float(value)
        except ValueError:
            raise ValueError(f"--sampling: {key} takes a number, got {value!r}") from None
    try:
        SamplingParams(max_tokens=1, **out)  # (each value checked as a request's would be)
    except ValueError as exc:
        raise ValueError(f"--sampling: {exc}") from None
    return out


def length_range(length: int, ratio: float) -> tuple[int, int]:
    """The lengths `--random-range-ratio` draws from, both ends included: [L * (1 - R), L * (1 + R)], at least 1."""
    return max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))


def run_bench(engine: LLMEngine, batch: int, input_len: int, output_len: int, seed: int = 0,
              sampling: dict | None = None, prefix_len: int = 0, range_ratio: float = 0.0,
              structured: tuple[int, str] | None = None) -> dict:
    """Run the workload on `engine` (greedy, or `sampling`'s settings, EOS ignored; every prompt's first `prefix_len`
    tokens the same; `range_ratio` > 0: each request's input and output lengths drawn from `length_range`;
    `structured` (every, regex): requests 0, every, 2 * every, ... constrained by the regex); returns the timing
    part of the report (with "_prompt_lens", the prompts' lengths, for the floors)."""
    from kda_rt.sampler.params import SamplingParams

    rng = np.random.default_rng(seed)
    in_lens, out_lens = [input_len] * batch, [output_len] * batch
    if range_ratio:  # (drawn only then: a run without it makes the same prompts as before)
        lo, hi = length_range(input_len, range_ratio)
        in_lens = rng.integers(max(lo, prefix_len + 1), hi + 1, batch).tolist()
        lo, hi = length_range(output_len, range_ratio)
        out_lens = rng.integers(lo, hi + 1, batch).tolist()
    base = {"temperature": 0.0, **(sampling or {})}
    params = [SamplingParams(**base, max_tokens=n, ignore_eos=True,
                             **({"structured_outputs": {"regex": structured[1]}}
                                if structured and i % structured[0] == 0 else {}))
              for i, n in enumerate(out_lens)]
    vocab = engine.model_config.vocab_size
    steps0, preempt0 = engine.counters["steps"], engine.scheduler.num_preemptions
    ahead0 = engine.counters["steps_launched_ahead"]
    built0 = _build_stats(engine)
    rows0 = list(getattr(engine.runner, "graph_rows", ()))  # (CUDA: decode rows replayed on graphs, live / padding)
    prefix = rng.integers(0, vocab, prefix_len).tolist()
    prompts = [prefix + rng.integers(0, vocab, n - prefix_len).tolist()  # (made before the clock starts)
               for n in in_lens]
    cache = engine.scheduler.cache
    # (each run from an empty cache: a run repeats the last one's prompts, which would resume or form junctions;
    # --prefix-len measures the sharing inside one run)
    engine.reset_prefix_cache()
    hits0 = cache.hits if cache is not None else 0
    gc_time = _GcTimer()
    gc.callbacks.append(gc_time)
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"bench-{i}", {"prompt_token_ids": ids}, params[i], output_kind="delta")
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    decode_steps: list[float] = []
    while engine.has_unfinished_requests():
        prompt_before = engine.counters["prefill_tokens"]
        ts = time.perf_counter()
        outs = engine.step()
        te = time.perf_counter()
        if engine.counters["prefill_tokens"] == prompt_before:
            decode_steps.append(te - ts)
        for out in outs:
            first.setdefault(out.request_id, te - t0)
            if out.finished:
                done[out.request_id] = te - t0
    elapsed = time.perf_counter() - t0
    gc.callbacks.remove(gc_time)
    ttft = [first[r] for r in done]
    out_len_of = {f"bench-{i}": n for i, n in enumerate(out_lens)}
    tpot = [(done[r] - first[r]) / (out_len_of[r] - 1) for r in done if out_len_of[r] > 1] or [0.0]
    return {
        "elapsed_s": elapsed,
        "total_tok_s": (sum(in_lens) + sum(out_lens)) / elapsed,
        "output_tok_s": sum(out_lens) / elapsed,
        **({"input_tokens": sum(in_lens), "output_tokens": sum(out_lens)} if range_ratio else {}),
        "ttft_s_mean": statistics.fmean(ttft),
        "ttft_s_max": max(ttft),
        "tpot_s_mean": statistics.fmean(tpot),
        "decode_step_s_mean": statistics.fmean(decode_steps) if decode_steps else None,
        "num_steps": engine.counters["steps"] - steps0,
        "num_decode_steps": len(decode_steps),
        "preemptions": engine.scheduler.num_preemptions - preempt0,
        # steps queued before the previous one's tokens reached the host (async scheduling; the others waited for it)
        "steps_launched_ahead": engine.counters["steps_launched_ahead"] - ahead0,
        **({"prefix_cache_hit_tokens": cache.hits - hits0} if cache is not None else {}),
        # the interpreter's garbage collections inside the timed run (all generations) and their time
        "gc_collections": gc_time.count, "gc_s": gc_time.seconds,
        # kernel variants first built inside the timed run (their build time is in the numbers above)
        **({"kernels_built": built[0] - built0[0], "kernel_build_s": built[1] - built0[1]}
           if (built := _build_stats(engine)) is not None and built0 is not None else {}),
        # the share of the decode graphs' rows that were padding (a batch replays the smallest captured graph that
        # holds it: --cuda-graph-sizes)
        **_padding_share(rows0, list(getattr(engine.runner, "graph_rows", ()))),
        "_prompt_lens": in_lens,
    }


def _padding_share(before: list[int], after: list[int]) -> dict:
    """{"decode_graph_padding": padding rows / all rows replayed on decode graphs between two `graph_rows` readings},
    or {} (no graphs: the NumPy runner, --enforce-eager, or no graph replay in between)."""
    if len(before) != 2 or len(after) != 2:
        return {}
    live, pad = after[0] - before[0], after[1] - before[1]
    return {"decode_graph_padding": round(pad / (live + pad), 4)} if live + pad else {}


class _GcTimer:
    """A `gc.callbacks` entry adding up the collections it sees and the time they take."""

    def __init__(self) -> None:
        self.count, self.seconds, self._start = 0, 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._start


def _median_report(runs: list[dict]) -> dict:
    """One report from several timed runs of a workload: each number the median over the runs, the runs'
    own reports under "iters"."""
    if len(runs) == 1:
        return runs[0]
    out = {k: (statistics.median(r[k] for r in runs) if isinstance(v, (int, float)) and not isinstance(v, bool)
               and all(isinstance(r.get(k), (int, float)) for r in runs) else v)
           for k, v in runs[0].items()}
    out["iters"] = runs
    return out


def _build_stats(engine: LLMEngine) -> tuple[int, float] | None:
    """(kernel modules loaded, seconds spent building them) so far, on the cuda backend; else None."""
    if engine.runner.name != "cuda":
        return None
    from kda_rt.cuda.ops.compile import BUILD_STATS

    return BUILD_STATS["loaded"], BUILD_STATS["seconds"]


def profile_steps(engine: LLMEngine, batch: int, input_len: int, seed: int = 0) -> dict:
    """Per-op times (ms) of the first prefill step and of one eager decode step of a fresh workload
    of `batch` prompts of `input_len` tokens (CUDA events around each model op), each op with the rate
    of its minimum work (`kda_rt.floors.op_work`: FLOPs in prefill, bytes in decode)."""
    from kda_rt.cuda.ops.trace import Profile
    from kda_rt.floors import op_work
    from kda_rt.sampler.params import SamplingParams

    if engine.has_pending_step():
        raise RuntimeError("profile_steps: a step launched ahead is still pending; run the engine dry first")
    rng = np.random.default_rng(seed)
    # enough tokens that every prompt is still running when the last one finishes its prefill (the
    # first ones decode while later ones prefill); the requests are aborted afterwards
    budget = engine.config.max_num_batched_tokens
    max_tokens = min(engine.config.max_model_len - input_len, -(-batch * input_len // budget) + 8)
    params = SamplingParams(temperature=0.0, max_tokens=max(2, max_tokens), ignore_eos=True)
    vocab = engine.model_config.vocab_size
    ids = [engine.add_request(f"profile-{i}", {"prompt_token_ids": rng.integers(0, vocab, input_len).tolist()}, params)
           for i in range(batch)]
    out: dict = {}
    # each profiled step alone: nothing launched ahead into its window (async scheduling off meanwhile)
    settings, engine.config = engine.config, dataclasses.replace(engine.config, async_scheduling=False)
    try:
        tokens = engine.counters["tokens_processed"]
        with Profile() as prof:
            engine.step()
        done = engine.counters["tokens_processed"] - tokens
        whole, rest = divmod(done, input_len)  # whole prompts, then the first chunk of the next one
        work = op_work(engine.model_config, decode=False, batch=batch, tokens=done, context=0,
                       prompt_lens=[input_len] * whole + ([rest] if rest else []))
        out["prefill"] = {"tokens": done, "ops": prof.summary(), "work": work}
        print(f"prefill step ({done} tokens):\n{prof.table(work)}", file=sys.stderr)
        while engine.has_unfinished_requests() and (engine.num_waiting() or any(
                s.in_prefill for s in engine.scheduler.running)):
            engine.step()
        runner = engine.runner
        count = getattr(runner, "experts_touched", None)
        # one eager decode step of the sequences still running
        eager = getattr(runner, "enforce_eager", None)  # the cuda runner's switch; None elsewhere
        if eager is not None:
            runner.enforce_eager = True
        try:
            running = len(engine.scheduler.running)
            if count is not None:
                count(reset=True)
            with Profile() as prof:
                engine.step()
        finally:
            if eager is not None:
                runner.enforce_eager = eager
        work = op_work(engine.model_config, decode=True, batch=running, tokens=running, context=input_len + 1,
                       touched=(count(reset=True) or None) if count is not None else None,
                       quantization=engine.config.quantization)
        out["decode"] = {"batch": running, "ops": prof.summary(), "work": work}
        print(f"decode step (eager, batch {running}):\n{prof.table(work)}", file=sys.stderr)
    finally:
        engine.config = settings
        for rid in ids:
            engine.abort(rid)
    return out


def floors(config: ModelConfig, shape: tuple[int, int, int], report: dict, touched: dict[int, float] | None,
           quantization: str | None = None, e4m3_gemv: bool = False, prompt_lens: list[int] | None = None) -> dict:
    """The decode bytes floor (from the experts routed in the run; `quantization` as EngineConfig's: the experts'
    bytes in that format; `e4m3_gemv`: the run's decode steps read the dense projections' e4m3 rows,
    KDA_RT_FP8_DECODE_GEMV and _MAX_T) and the prefill FLOPs floor of a (batch, input, output) run, with the
    measured / floor ratios; one summary line on stderr.  `prompt_lens` (a --random-range-ratio run): the prefill
    floor of those prompts, and no decode floor (its batch shrinks as requests end at different steps: a mean step
    has no one batch to compare with)."""
    from kda_rt.floors import COPY_BYTES_PER_S, decode_floor, prefill_floor

    batch, input_len, output_len = shape
    dec = decode_floor(config, batch, input_len + output_len / 2, touched or None, quantization=quantization,
                       e4m3_gemv=e4m3_gemv)
    pre = prefill_floor(config, prompt_lens or [input_len] * batch, quantization=quantization)
    step = report["decode_step_s_mean"]
    out = {"experts_per_moe_layer": round(dec["experts_per_moe_layer"], 1), "experts_counted": bool(touched),
           "decode_floor_ms": dec["seconds"] * 1e3, "decode_floor_gb": dec["bytes"] / 1e9,
           "decode_ratio": step / dec["seconds"] if step else None,
           # the floor's bytes over the measured step: the rate the step moved them at, whatever the GPU (the floor
           # itself is at the H200's copy rate, floors.COPY_BYTES_PER_S)
           "decode_tb_s": dec["bytes"] / step / 1e12 if step else None,
           "prefill_floor_s": pre["seconds"], "ttft_max_ratio": report["ttft_s_max"] / pre["seconds"]}
    if prompt_lens is not None:
        out.update(decode_floor_ms=None, decode_floor_gb=None, decode_ratio=None, decode_tb_s=None)
    fp8 = ""
    if "seconds_fp8" in pre:  # the e4m3 products at twice the bf16 rate
        out.update(prefill_floor_fp8_s=pre["seconds_fp8"], ttft_max_ratio_fp8=report["ttft_s_max"] / pre["seconds_fp8"])
        fp8 = f" (fp8 floor {pre['seconds_fp8']:.3f} s -> {out['ttft_max_ratio_fp8']:.2f}x)"
    floor = (f"floor {out['decode_floor_ms']:.2f} ms ({out['decode_floor_gb']:.1f} GB at {COPY_BYTES_PER_S / 1e12:.1f} "
             f"TB/s, {out['experts_per_moe_layer']} experts per MoE layer {'counted' if touched else 'estimated'}) -> "
             f"{out['decode_ratio'] or float('nan'):.2f}x, {out['decode_tb_s'] or float('nan'):.2f} TB/s"
             if prompt_lens is None else f"no floor (mixed lengths), {out['experts_per_moe_layer']} experts per MoE "
             f"layer {'counted' if touched else 'estimated'}")
    print(f"{batch} x {input_len} / {output_len}{' (lengths mixed)' if prompt_lens is not None else ''}: decode step "
          f"{step * 1e3 if step else float('nan'):.2f} ms, {floor}; "
          f"TTFT max {report['ttft_s_max']:.3f} s, prefill floor {pre['seconds']:.3f} s -> "
          f"{out['ttft_max_ratio']:.2f}x{fp8}", file=sys.stderr)
    return out


def reads_e4m3_rows(engine, batch: int) -> bool:
    """The engine's decode steps of `batch` sequences read e4m3 rows of dense projections (KDA_RT_FP8_DECODE_GEMV on,
    the weights made them at upload, and the step's rows, its decode graph's where one holds it, padding included,
    within KDA_RT_FP8_DECODE_GEMV_MAX_T)."""
    from kda_rt import env

    runner = engine.runner
    if not (env.fp8_decode_gemv() and runner.name == "cuda"):
        return False
    from kda_rt.cuda.weights import decode_rows

    if not decode_rows(runner.weights):
        return False
    rows = batch if runner.enforce_eager else min((g for g in runner.buckets if g >= batch), default=batch)
    return rows <= env.fp8_decode_gemv_max_t()


def _read_config(path: str) -> dict:
    """`--config FILE`'s JSON; each failure names the flag and the file."""
    from kda_rt.demo.presets import PRESETS
    from kda_rt.loader.jsonfile import read_json

    return read_json(path, label=f"--config {path!r}", missing=f"no such file, nor a preset ({', '.join(PRESETS)})",
                     want_object=False)  # parse_config names a top level that is not an object


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args.random_weights = args.random_weights or args.load_format == "dummy"  # vLLM's name for it
    if args.config and not args.random_weights:
        ap.error("--config needs --random-weights (there is no checkpoint to load)")
    try:
        shapes = [(args.batch, args.input_len, args.output_len)] + [
            tuple(int(v) for v in item.split(":")) for item in args.also.split(",") if item.strip()]
    except ValueError:
        ap.error(f"--also takes BATCH:INPUT:OUTPUT[,...], got {args.also!r}")
    if any(len(sh) != 3 or min(sh) < 1 for sh in shapes):
        ap.error("--batch, --input-len and --output-len (and each --also workload) must be >= 1")
    if args.num_iters < 1 or args.num_iters_warmup < 0:
        ap.error(f"--num-iters must be >= 1 and --num-iters-warmup >= 0, got {args.num_iters} and "
                 f"{args.num_iters_warmup}")
    if args.no_warmup:
        args.num_iters_warmup = 0
    if not 0.0 <= args.random_range_ratio < 1.0:  # (NaN fails too)
        ap.error(f"--random-range-ratio must be >= 0 and below 1, got {args.random_range_ratio}")
    if not 0 <= args.prefix_len < min(length_range(sh[1], args.random_range_ratio)[0] for sh in shapes):
        ap.error(f"--prefix-len must be >= 0 and below every workload's input length (with --random-range-ratio its "
                 f"shortest), got {args.prefix_len}")
    if args.num_layers is not None and (args.num_layers < 1 or not args.config):
        ap.error("--num-layers must be >= 1 and works with a preset --config only")
    if not 0.0 <= args.router_bias_std < math.inf:  # (NaN fails too)
        ap.error(f"--router-bias-std must be a finite number >= 0, got {args.router_bias_std}")
    if args.seed < 0:  # it seeds NumPy's generators (was: "error: expected non-negative integer", no flag named)
        ap.error(f"--seed must be >= 0 (it seeds the prompts and random weights), got {args.seed}")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:  # (was: 0 silently became the largest batch)
        ap.error(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    if (problem := model_dir_problem(args.model)) is not None:
        ap.error(problem)
    from kda_rt.demo import demo_path
    from kda_rt.llm import _has_tokenizer, build_engine

    if args.structured_every < 0:
        ap.error(f"--structured-every must be >= 0 (0: no constrained request), got {args.structured_every}")
    tokenizer_dir = args.tokenizer or (args.model if args.structured_every else None)
    if args.structured_every and (tokenizer_dir is None or not _has_tokenizer(tokenizer_dir)):
        ap.error(f"--structured-every needs a tokenizer (tiktoken.model + tokenizer_config.json): "
                 f"{'--tokenizer ' + repr(tokenizer_dir) + ' has none' if args.tokenizer else 'the model has none'}; "
                 f"give --tokenizer DIR (e.g. {demo_path()}, the bundled demo's)")
    try:
        sampling = parse_sampling(args.sampling)
    except ValueError as exc:
        ap.error(str(exc))
    from kda_rt.demo.presets import PRESETS
    from kda_rt.loader.config import load_config, parse_config
    from kda_rt.loader.weights import load_checkpoint
    from kda_rt.text.tokenizer import Tokenizer

    try:
        if args.config in PRESETS:
            raw = PRESETS[args.config](27 if args.num_layers is None else args.num_layers)
            model_config = parse_config(raw, source=f"preset {args.config}")
        elif args.config:
            if args.num_layers is not None:
                raise ValueError("--num-layers works with a preset --config only")
            model_config = parse_config(_read_config(args.config), source=args.config)
        else:
            model_config = load_config(args.model)
        t0 = time.perf_counter()
        weights = (random_weights(model_config, args.seed, router_bias_std=args.router_bias_std) if args.random_weights
                   else load_checkpoint(args.model, model_config))
        engine_config = EngineConfig.from_cli_args(args, max_num_seqs=args.max_num_seqs or max(b for b, _, _ in shapes))
        tokenizer = Tokenizer.from_dir(tokenizer_dir) if tokenizer_dir and _has_tokenizer(tokenizer_dir) else None
        if tokenizer is not None and tokenizer.vocab_size > model_config.vocab_size:
            raise ValueError(f"--tokenizer {tokenizer_dir!r}: {tokenizer.vocab_size} tokens, more than the model's "
                             f"{model_config.vocab_size}")
        engine = build_engine(model_config, weights, engine_config, tokenizer=tokenizer)
        load_s = time.perf_counter() - t0
        count = getattr(engine.runner, "experts_touched", None)
        structured = (args.structured_every, args.structured_regex) if args.structured_every else None
        for k, (batch, input_len, output_len) in enumerate(shapes):
            ratio = args.random_range_ratio
            for i in range(args.num_iters_warmup):  # same shapes: every kernel variant the runs need is built now
                run_bench(engine, batch, input_len, min(output_len, 4), args.seed + 1 + i, sampling, args.prefix_len,
                          ratio, structured)
            if count is not None:
                count(reset=True)
            runs = [run_bench(engine, batch, input_len, output_len, args.seed, sampling, args.prefix_len, ratio,
                              structured) for _ in range(args.num_iters)]
            prompt_lens = [r.pop("_prompt_lens") for r in runs][0]  # (the same seed: each run's the same)
            report = _median_report(runs)
            report.update(floors(model_config, (batch, input_len, output_len), report,
                                 count(reset=True) if count is not None else None, engine_config.quantization,
                                 e4m3_gemv=reads_e4m3_rows(engine, batch), prompt_lens=prompt_lens if ratio else None))
            if engine.runner.name != "cuda" and k == 0:
                print("(the floors are an H200's copy rate and bf16 peak: the ratios mean something on the cuda "
                      f"backend only, this run is on {engine.runner.name})", file=sys.stderr)
            if args.profile and k == 0:
                if engine.runner.name != "cuda":
                    raise ValueError("--profile needs the cuda backend (CUDA events)")
                report["profile"] = profile_steps(engine, batch, input_len, args.seed + 2)
            line = {"backend": engine.runner.name, "model": os.fspath(args.model) if args.model else None,
                    "config": args.config, "args": vars(args), "workload": [batch, input_len, output_len],
                    "load_s": load_s, **report, "peak_memory_bytes": engine.runner.peak_memory_bytes(),
                    **({"decode_graphs": sorted(engine.runner.graphs),  # (the sizes captured, their workspace and
                        "decode_graph_ws_bytes": engine.runner.graph_ws_bytes(),  # the seconds their capture took)
                        "decode_graph_capture_s": round(engine.runner.graph_capture_s, 2)}
                       if hasattr(engine.runner, "graph_ws_bytes") else {}),
                    "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("KDA_RT_")}}  # switches set
            print(json.dumps(line), flush=True)
    except (ValueError, OSError, RuntimeError, MemoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
