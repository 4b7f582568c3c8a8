"""The MoE WS GEMM's cluster-multicast protocol (kernels_cu/moe_gemm_wg.cu MC) in its CPU model,
tests/gpu/sim_ws_protocol.py: random schedules of two CTAs' producers and consumer warps run clean, and an injected
protocol bug (each CTA expecting only its own half of a multicast stage) is caught, so the model's checks can fail."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _sim():
    path = Path(__file__).resolve().parents[1] / "gpu" / "sim_ws_protocol.py"
    spec = importlib.util.spec_from_file_location("sim_ws_protocol", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_random_schedules_run_clean():
    sim = _sim()
    for seed in range(25):
        sim.run_once(7_000_000 + seed, None)  # raises sim.Violation on a deadlock, a torn stage, a tile twice ...


@pytest.mark.parametrize("mutation", ["mc_half_expect", "ghost_bytes"])
def test_an_injected_bug_is_caught(mutation):
    sim = _sim()
    caught = 0
    for seed in range(20):
        try:
            sim.run_once(8_000_000 + seed, mutation)
        except sim.Violation:
            caught += 1
    assert caught > 0, f"{mutation}: no schedule of 20 violated a check"
