"""Host work of one engine decode step, without a model: `python tests/engine/host_overhead.py
[BATCH] [OUTPUT_KIND] [-p] [--async]`.  A runner that returns fixed tokens stands in for the model, so what
is timed is the scheduler, the flat batches, postprocess and the RequestOutputs: the part of a GPU
decode step that the GPU waits for (`--async`: the runner also launches and collects, so the engine's async
scheduling runs each step's early schedule too, work the GPU does not wait for then).  Prompts of 2048 tokens on the 48B-shaped 4-layer config,
prefill done first, then $STEPS (default 100) decode steps (`-p`: cProfile, sorted by own time; `--no-cache`:
prefix caching off, which is on by default).
`--prefill`: instead, the host work before and between the steps of the seed benchmark's prefill (32 x 2048
prompts, 16384-token steps): add_request for every prompt (in the bench's TTFT), then each engine.step()."""

from __future__ import annotations

import cProfile
import dataclasses
import os
import pstats
import sys
import time

import numpy as np

from kda_rt import SamplingParams
from kda_rt.demo.presets import kimi_linear_48b_a3b
from kda_rt.engine import EngineConfig, LLMEngine
from kda_rt.engine.pools import plan_pools
from kda_rt.loader.config import parse_config
from kda_rt.sampler.batch import StepOutput


class FixedTokens:
    name = "fixed"

    def __init__(self, config, settings) -> None:
        self.plan = plan_pools(config, settings, itemsize=2, memory_bytes=2**40, padding=True)

    def execute(self, batch, sampling):
        n = sampling.num_rows
        return StepOutput([7 + (i % 100) for i in range(n)], [None] * n, [None] * n)

    def score(self, batch):
        raise NotImplementedError

    def report(self) -> str:
        return "fixed tokens"

    def launch(self, batch, sampling, **kw):  # (--async only: see main)
        return self.execute(batch, sampling)

    def collect(self, handle):
        return handle

    def copy_slots(self, src, dst):  # (the prefix cache's copies: nothing to move here)
        pass

    def copy_pages(self, src, dst):
        pass

    def peak_memory_bytes(self) -> int:
        return 0


def prefill() -> None:
    config = parse_config(kimi_linear_48b_a3b(4))
    settings = EngineConfig(max_num_seqs=32, max_model_len=4096, max_num_batched_tokens=16384,
                            enable_prefix_caching="--no-cache" not in sys.argv)
    runner = FixedTokens(config, settings)
    engine = LLMEngine(config, runner, None, dataclasses.replace(settings, max_model_len=runner.plan.max_model_len),
                       num_slots=runner.plan.engine_slots, num_blocks=runner.plan.engine_blocks,
                       snapshot_slots=runner.plan.snapshot_slots)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompts = [rng.integers(0, 1000, 2048).tolist() for _ in range(32)]
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params, output_kind="delta")
    added = time.perf_counter() - t0
    steps = []
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - ts)
    print(f"32 x 2048 prompts: add_request {added * 1e3:.2f} ms for all; engine.step host ms "
          f"{[round(s * 1e3, 2) for s in steps]}")


def main() -> None:
    if "--prefill" in sys.argv:
        return prefill()
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    batch = int(args[0]) if args else 32
    kind = args[1] if len(args) > 1 else "cumulative"
    config = parse_config(kimi_linear_48b_a3b(4))
    settings = EngineConfig(max_num_seqs=batch, max_model_len=4096, max_num_batched_tokens=8192,
                            enable_prefix_caching="--no-cache" not in sys.argv)
    runner = FixedTokens(config, settings)
    if "--async" not in sys.argv:  # (a runner without launch / collect: every step synchronous)
        runner.launch = runner.collect = None
    engine = LLMEngine(config, runner, None, dataclasses.replace(settings, max_model_len=runner.plan.max_model_len),
                       num_slots=runner.plan.engine_slots, num_blocks=runner.plan.engine_blocks,
                       snapshot_slots=runner.plan.snapshot_slots)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=2048, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), rng.integers(0, 1000, 2048).tolist(), params, output_kind=kind)
    while engine.num_waiting() or any(s.in_prefill for s in engine.scheduler.running):
        engine.step()
    prof = cProfile.Profile()
    if "-p" in sys.argv:
        prof.enable()
    t0, steps = time.perf_counter(), int(os.environ.get("STEPS", 100))
    for _ in range(steps):
        engine.step()
    prof.disable()
    print(f"batch {batch}, {kind} outputs{' (async)' if '--async' in sys.argv else ''}"
          f"{' (no prefix cache)' if '--no-cache' in sys.argv else ''}: "
          f"{(time.perf_counter() - t0) / steps * 1e3:.3f} ms of engine host work per decode step "
          f"({engine.counters['steps_launched_ahead']} steps launched ahead)")
    if "-p" in sys.argv:
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
