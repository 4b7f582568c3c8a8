"""The full Kimi-Linear-48B-A3B shape with random weights (router bias std 0.05) on the CUDA backend,
for the device scripts in tests/gpu/ (one model load each, its time on stderr)."""

from __future__ import annotations

import sys
import time


def full_engine(layers: int = 27, **engine_config):
    """(ModelConfig, LLMEngine) of the 48B preset cut to `layers` layers; `engine_config` are EngineConfig
    fields (gpu_memory_utilization defaults to 0.85)."""
    from kda_rt.bench import random_weights
    from kda_rt.demo.presets import PRESETS
    from kda_rt.engine.config import EngineConfig
    from kda_rt.llm import build_engine
    from kda_rt.loader.config import parse_config

    cfg = parse_config(PRESETS["kimi-linear-48b-a3b"](layers), source="preset")
    t0 = time.perf_counter()
    engine = build_engine(cfg, random_weights(cfg, 0, router_bias_std=0.05),
                          EngineConfig(**{"gpu_memory_utilization": 0.85, **engine_config}))
    print(f"load {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return cfg, engine
