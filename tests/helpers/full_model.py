"""The full Kimi-Linear-48B-A3B shape with random weights (router bias std 0.05) on the CUDA backend,
for the device scripts in tests/gpu/ (one model load each, its time on stderr); and a run that leaves a full
decode batch as the last launch (the inputs a captured decode graph's replays then repeat)."""

from __future__ import annotations

import sys
import time


def full_engine(layers: int = 27, exact_graphs=(), tokenizer=None, **engine_config):
    """(ModelConfig, LLMEngine) of the 48B preset cut to `layers` layers; `engine_config` are EngineConfig
    fields (gpu_memory_utilization defaults to 0.85); `tokenizer`: the engine's (structured outputs need one).  exact_graphs: decode batch sizes that get a graph of exactly
    their rows besides the default sizes up to max_num_seqs (else a batch between two sizes replays the next one up,
    padding rows and all)."""
    from kda_rt.bench import random_weights
    from kda_rt.demo.presets import PRESETS
    from kda_rt.engine.config import EngineConfig
    from kda_rt.llm import build_engine
    from kda_rt.loader.config import parse_config

    if exact_graphs:
        seqs = engine_config["max_num_seqs"]
        engine_config["cuda_graph_sizes"] = sorted(set(EngineConfig().graph_sizes(seqs)) | set(exact_graphs))
    cfg = parse_config(PRESETS["kimi-linear-48b-a3b"](layers), source="preset")
    t0 = time.perf_counter()
    engine = build_engine(cfg, random_weights(cfg, 0, router_bias_std=0.05),
                          EngineConfig(**{"gpu_memory_utilization": 0.85, **engine_config}), tokenizer=tokenizer)
    print(f"load {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return cfg, engine


def decode_full_batch(engine, batch: int, input_len: int, seed: int = 7) -> int:
    """Run `batch` random prompts of `input_len` tokens until one step decodes all of them, then abort them: the
    engine's last launch (and so the inputs that the `batch`-row decode graph's replays repeat) is a decode step
    of `batch` live sequences.  A run to completion ends on partial steps instead: prompts that entered a step later
    finish a step later (32 x 2048 prompts at 16384-token steps: the 32-row graph last ran 24 sequences and 8
    padding rows).  Returns the steps taken."""
    import numpy as np

    from kda_rt.sampler.params import SamplingParams

    cfg = engine.config
    prefill_steps = -(-batch * input_len // cfg.max_num_batched_tokens)
    max_tokens = prefill_steps + 8  # still decoding when the last prompt is in
    if batch > cfg.max_num_seqs or input_len + max_tokens > cfg.max_model_len:
        raise ValueError(f"decode_full_batch: {batch} x ({input_len} + {max_tokens}) tokens do not fit "
                         f"max_num_seqs {cfg.max_num_seqs} / max_model_len {cfg.max_model_len}")
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"full-batch-{seed}-{i}" for i in range(batch)]
    sched = engine.scheduler
    try:
        for rid in ids:
            engine.add_request(rid, {"prompt_token_ids": rng.integers(0, engine.model_config.vocab_size,
                                                                      input_len).tolist()}, params)
        for step in range(1, max_tokens + prefill_steps + 1):
            before = engine.counters["prefill_tokens"]
            engine.step()
            if engine.counters["prefill_tokens"] == before and len(sched.running) == batch and not sched.waiting:
                return step
        raise RuntimeError(f"decode_full_batch: no step decoded all {batch} sequences")
    finally:
        engine.abort_request(ids)
        while engine.has_unfinished_requests() or engine.has_pending_step():  # (a step launched ahead: collected)
            engine.step()


def time_replays(runner, graph, chunks: int = 5, per_chunk: int = 20) -> tuple[float, dict[int, float]]:
    """ms a replay of `graph` (a runner's _Graph: the median over `chunks` chunks of `per_chunk` replays, after 3
    warm-up replays, CUDA events) and the experts its timed replays touch a MoE layer (runner.experts_touched):
    counted over the timed replays themselves, since repeating one step's tokens at one position drifts its routing
    to fewer experts than its first replays touch (fifty-first session, batch 32: 70.8 experts a MoE layer in the
    first three replays, 66.3 over the timed ones, tests/gpu/replay_routing.py), and the floor printed beside a time
    is that of the experts counted."""
    import statistics

    import cupy

    times = []
    with runner.stream:
        for _ in range(3):
            graph.graph.launch(runner.stream)
        runner.experts_touched(reset=True)
        for _ in range(chunks):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(runner.stream)
            for _ in range(per_chunk):
                graph.graph.launch(runner.stream)
            end.record(runner.stream)
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) / per_chunk)
        touched = runner.experts_touched(reset=True)
    return statistics.median(times), touched
