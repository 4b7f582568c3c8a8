"""Limits fail clearly without disturbing other requests; stats; pool sizing; the bench CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys

import numpy as np
import pytest

from helpers.configs import tiny_config
from helpers.engine import assert_no_leaks, greedy, make_llm
from kda_rt.bench import random_weights
from kda_rt.demo import demo_path
from kda_rt.engine import EngineConfig
from kda_rt.engine.config import default_max_num_seqs
from kda_rt.engine.pools import fit_max_num_seqs, kv_bytes_per_block, plan_pools, state_bytes_per_slot
from kda_rt.loader.config import parse_config
from kda_rt.loader.weights import expected_tensors


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return make_llm(tiny_dir, max_num_seqs=2, max_model_len=64, block_size=16)


def test_bad_requests_leave_others_running(llm):
    engine = llm.llm_engine
    engine.add_request("good", {"prompt_token_ids": [5, 6, 7]}, greedy(5))
    engine.step()
    bad = [
        ({"prompt_token_ids": [5] * 50}, greedy(20), r"prompt \(50 tokens\) \+ max_tokens \(20\) = 70 exceeds max_model_len 64"),
        ({"prompt_token_ids": [5] * 64}, greedy(1), r"prompt has 64 tokens; max_model_len is 64"),
        ({"prompt_token_ids": []}, greedy(1), "empty"),
        ({"prompt_token_ids": [5, 512]}, greedy(1), r"512 is outside the vocabulary \[0, 512\)"),
        ({"prompt_token_ids": [-1]}, greedy(1), "outside the vocabulary"),
        ({"prompt_token_ids": [True]}, greedy(1), r"must be ints; item 0 is True \(bool\)"),
        ({"prompt_token_ids": [5, True, 6]}, greedy(1), r"item 1 is True \(bool\)"),  # (numpy would make it 1)
        ({"prompt_token_ids": [5, 2**70]}, greedy(1), r"id 1180591620717411303424 is outside"),  # past int64
        ({"prompt_token_ids": [5, 6.0]}, greedy(1), r"item 1 is 6.0 \(float\)"),
        ({"prompt_token_ids": [[5, 6]]}, greedy(1), r"item 0 is \[5, 6\] \(list\)"),  # (was: "id [5, 6] is outside")
        ({"prompt_token_ids": [5, -3, 7]}, greedy(1), r"id -3 is outside"),
        ({"prompt_token_ids": [5]}, greedy(1, stop_token_ids=[7, 512]), r"stop_token_ids holds 512, outside the "
         r"vocabulary \[0, 512\)"),
        ("text prompt", greedy(1), "no tokenizer"),
        ({"prompt_token_ids": [5]}, greedy(1), "already in use"),
    ]
    for i, (prompt, params, match) in enumerate(bad):
        with pytest.raises(ValueError, match=match):
            engine.add_request("good" if match == "already in use" else f"bad{i}", prompt, params)
    assert set(engine.requests) == {"good"}
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(llm)


def test_prompt_ids_fast_path_keeps_the_values(llm):
    """Lists of Python ints are range-checked in one NumPy pass (a 2048-token prompt: ~0.1 ms instead of ~0.5);
    other item types (numpy integers) take the per-item pass; both give Python ints of the same values."""
    engine = llm.llm_engine
    ids = list(np.random.default_rng(1).integers(0, 512, 300))
    text, got = engine.prompt_ids([int(i) for i in ids])
    assert text is None and got == [int(i) for i in ids] and all(type(i) is int for i in got)
    _, got_np = engine.prompt_ids(np.asarray(ids, dtype=np.int32))
    assert got_np == got and all(type(i) is int for i in got_np)
    _, edge = engine.prompt_ids([0, 511])
    assert edge == [0, 511]


def test_generate_all_or_nothing_and_max_tokens_none(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [5] * 70}], greedy(4))
    assert_no_leaks(llm)
    out = llm.generate({"prompt_token_ids": [5] * 10}, greedy(None))[0].outputs[0]
    assert len(out.token_ids) == 54 and out.finish_reason == "length"  # up to max_model_len


@pytest.mark.parametrize("kw,match", [
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"block_size": 8}, "block_size"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"), ({"num_blocks": 0}, "num_blocks"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"), ({"max_model_len": 0}, "max_model_len"),
    ({"prefill_tail_tokens": -1}, "prefill_tail_tokens must be an int >= 0"),
    ({"prefill_tail_tokens": 1.5}, "prefill_tail_tokens must be an int >= 0"),
    ({"cuda_graph_sizes": []}, "cuda_graph_sizes must be a non-empty list of ints >= 1, got \\[\\]"),
    ({"cuda_graph_sizes": "8"}, "cuda_graph_sizes must be a non-empty list"),
    ({"cuda_graph_sizes": 8}, "cuda_graph_sizes must be a non-empty list"),
    ({"cuda_graph_sizes": [8, 0]}, "cuda_graph_sizes entries must be ints >= 1, got 0 in \\[8, 0\\]"),
    ({"cuda_graph_sizes": [True]}, "cuda_graph_sizes entries must be ints >= 1, got True"),
    ({"cuda_graph_sizes": [2.0]}, "cuda_graph_sizes entries must be ints >= 1, got 2.0"),
])
def test_engine_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_cuda_graph_sizes():
    """EngineConfig.cuda_graph_sizes, as vLLM's --cuda-graph-sizes: unset, the powers of two and 1.5 x the powers of
    two from 6 below max_num_seqs, and max_num_seqs (less than a third of any batch's rows padding); one value N, 1, 2, 4 and the multiples of 8 up to N; several, those (sorted, once each); sizes
    above max_num_seqs left out.  A list (from the server's msgpack settings) becomes a tuple; the flag takes one
    or more values on every entry point's command line."""
    import argparse

    assert EngineConfig().graph_sizes(1024) == [1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512,
                                                768, 1024]
    assert EngineConfig().graph_sizes(48) == [1, 2, 4, 6, 8, 12, 16, 24, 32, 48]
    assert EngineConfig().graph_sizes(100) == [1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100]
    assert EngineConfig().graph_sizes(5) == [1, 2, 4, 5] and EngineConfig().graph_sizes(1) == [1]
    sizes = EngineConfig().graph_sizes(1024)
    assert all(3 * (g - b) < g for b in range(1, 1025) for g in [next(s for s in sizes if s >= b)])  # (padding share)
    one = EngineConfig(cuda_graph_sizes=[256])
    assert one.cuda_graph_sizes == (256,) and one.graph_sizes(1024) == [1, 2, 4, *range(8, 257, 8)]
    assert one.graph_sizes(100) == [1, 2, 4, *range(8, 97, 8)]
    assert EngineConfig(cuda_graph_sizes=(3,)).graph_sizes(64) == [1, 2]
    assert EngineConfig(cuda_graph_sizes=[160, 1, 32, 160, 2000]).graph_sizes(1024) == [1, 32, 160]
    assert EngineConfig(cuda_graph_sizes=[2000]).graph_sizes(16) == [1, 2, 4, 8, 16]
    assert EngineConfig(cuda_graph_sizes=[2000, 3000]).graph_sizes(16) == []  # (every batch eager)
    import msgpack

    sent = msgpack.unpackb(msgpack.packb(EngineConfig(cuda_graph_sizes=[1, 96]).to_dict()))  # (the server's settings)
    assert sent["cuda_graph_sizes"] == [1, 96] and EngineConfig(**sent).cuda_graph_sizes == (1, 96)
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert EngineConfig.from_cli_args(parser.parse_args(["--cuda-graph-sizes", "1", "2", "160"])).cuda_graph_sizes == (
        1, 2, 160)
    assert EngineConfig.from_cli_args(parser.parse_args([])).cuda_graph_sizes is None


def test_bench_reports_the_decode_graphs_padding_share():
    """bench's "decode_graph_padding": padding rows over all rows its run replayed on decode graphs (the CUDA runner's
    graph_rows, live and padding, read before and after the run); absent without graphs (the NumPy runner,
    --enforce-eager) or without a graph replay in the run."""
    from kda_rt.bench import _padding_share

    assert _padding_share([10, 2], [40, 12]) == {"decode_graph_padding": 0.25}
    assert _padding_share([10, 2], [10, 2]) == {} and _padding_share([], []) == {}


def test_bench_sampling_flag(tiny_dir):
    """bench --sampling: every request samples with those settings (penalised rows included, the CUDA runner's
    KDA_RT_GPU_SAMPLING_EXTRAS path on the GPU); a bad key or value is an error naming the flag."""
    from kda_rt.bench import parse_sampling, run_bench

    assert parse_sampling("") == {}
    assert parse_sampling("temperature=0.8, top_k=40,frequency_penalty=0.5,seed=3") == {
        "temperature": 0.8, "top_k": 40, "frequency_penalty": 0.5, "seed": 3}
    for bad, match in (("foo=1", "'foo=1' is not KEY=VALUE"), ("top_p", "'top_p' is not KEY=VALUE"),
                       ("top_k=x", "top_k takes a number"), ("top_p=2", "--sampling: top_p must be <= 1.0")):
        with pytest.raises(ValueError, match=match):
            parse_sampling(bad)
    engine = make_llm(tiny_dir, max_num_seqs=2, max_model_len=64).llm_engine
    seen = []
    execute = engine.runner.execute
    engine.runner.execute = lambda batch, sampling: seen.append(sampling.params) or execute(batch, sampling)
    report = run_bench(engine, 2, 8, 3, sampling=parse_sampling("temperature=0.7,presence_penalty=0.5"))
    assert report["num_steps"] >= 3 and seen
    assert all(p.temperature == 0.7 and p.presence_penalty == 0.5 and p.ignore_eos for ps in seen for p in ps)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_bench_counts_steps_launched_ahead(tiny_dir, async_scheduling):
    """bench's steps_launched_ahead: the run's steps queued before the previous one's tokens reached the host (all
    the steady decode steps with async scheduling, none without)."""
    from kda_rt.bench import run_bench

    engine = make_llm(tiny_dir, max_num_seqs=2, max_model_len=64, async_scheduling=async_scheduling).llm_engine
    report = run_bench(engine, 2, 8, 6)
    if async_scheduling:
        assert 0 < report["steps_launched_ahead"] < report["num_steps"]
    else:
        assert report["steps_launched_ahead"] == 0


def test_bench_random_range_ratio(tiny_dir, capsys):
    """bench --random-range-ratio R: each request's input and output lengths drawn (seeded) from [L(1 - R), L(1 + R)],
    the runs' token counts and rates from those lengths, every request ending at its own drawn max_tokens; the
    prefill floor of the drawn prompts and no decode floor (the batch shrinks); R = 0 draws nothing (the prompts of
    runs before the flag); R outside [0, 1) or a --prefix-len reaching the shortest prompt is refused by name."""
    from kda_rt.bench import floors, length_range, main, run_bench

    assert length_range(100, 0.5) == (50, 150) and length_range(1, 0.9) == (1, 1)
    engine = make_llm(tiny_dir, max_num_seqs=8, max_model_len=128).llm_engine
    prompts, ends = [], []
    add, fin = engine.add_request, engine.scheduler.finish
    engine.add_request = lambda rid, prompt, params, **k: (prompts.append(prompt["prompt_token_ids"]),
                                                           add(rid, prompt, params, **k))[1]
    engine.scheduler.finish = lambda seq, *a, **k: (ends.append(len(seq.output_token_ids)), fin(seq, *a, **k))[1]
    report = run_bench(engine, 8, 40, 20, seed=3, prefix_len=10, range_ratio=0.5)
    lens = report.pop("_prompt_lens")
    assert lens == [len(p) for p in prompts] and all(20 <= n <= 60 for n in lens) and len(set(lens)) > 2
    assert all(p[:10] == prompts[0][:10] for p in prompts)
    assert report["input_tokens"] == sum(lens) and report["output_tokens"] == sum(ends)
    assert all(10 <= n <= 30 for n in ends) and len(set(ends)) > 2
    assert report["output_tok_s"] == pytest.approx(sum(ends) / report["elapsed_s"])
    again = run_bench(engine, 8, 40, 20, seed=3, prefix_len=10, range_ratio=0.5)
    assert again["_prompt_lens"] == lens  # (seeded)
    fl = floors(engine.model_config, (8, 40, 20), report, None, prompt_lens=lens)
    assert fl["decode_floor_ms"] is None and fl["decode_ratio"] is None and fl["prefill_floor_s"] > 0
    assert fl["prefill_floor_s"] != floors(engine.model_config, (8, 40, 20), report, None)["prefill_floor_s"]
    prompts.clear()
    plain = run_bench(engine, 3, 12, 2, seed=3)
    assert "input_tokens" not in plain and [len(p) for p in prompts] == [12] * 3
    for argv, match in ((["--random-range-ratio", "1"], "--random-range-ratio must be >= 0 and below 1"),
                        (["--random-range-ratio", "nan"], "--random-range-ratio must be"),
                        (["--random-range-ratio", "0.5", "--prefix-len", "20"], "--prefix-len must be")):
        with pytest.raises(SystemExit):
            main(["--model", str(tiny_dir), "--input-len", "40", *argv])
        assert match in capsys.readouterr().err


def test_bench_structured_every(capsys):
    """bench --structured-every N: requests 0, N, 2N, ... carry --structured-regex (structured-output rows among
    free ones) and their texts match it, the others are unconstrained; a model without a tokenizer needs --tokenizer
    (refused by name otherwise), and N < 0 is refused."""
    import re

    pytest.importorskip("llguidance")
    from kda_rt.bench import main, run_bench
    from kda_rt.demo import demo_path

    engine = make_llm(demo_path(), max_num_seqs=5, max_model_len=128).llm_engine
    added, texts = {}, {}
    add, step = engine.add_request, engine.step
    engine.add_request = lambda rid, prompt, params, **k: (added.__setitem__(rid, params), add(rid, prompt, params, **k))[1]

    def spy_step():
        outs = step()
        for o in outs:
            texts[o.request_id] = texts.get(o.request_id, "") + o.outputs[0].text
        return outs

    engine.step = spy_step
    run_bench(engine, 5, 12, 16, seed=2, structured=(2, "[a-z]+( [a-z]+)*"))
    constrained = sorted(r for r, p in added.items() if p.structured_outputs is not None)
    assert constrained == ["bench-0", "bench-2", "bench-4"]
    assert all(re.fullmatch("[a-z]+( [a-z]+)*", texts[r]) for r in constrained), texts
    assert not all(re.fullmatch("[a-z ]*", texts[r]) for r in ("bench-1", "bench-3")), texts  # (free rows are not)
    for argv, match in ((["--config", "kimi-linear-48b-a3b", "--random-weights", "--structured-every", "2"],
                         "--structured-every needs a tokenizer"),
                        (["--model", str(demo_path()), "--structured-every", "-1"], "--structured-every must be >= 0")):
        with pytest.raises(SystemExit):
            main(argv)
        assert match in capsys.readouterr().err


@pytest.mark.parametrize("entry", ["kda_rt.generate", "kda_rt.bench", "kda_rt.server.__main__"])
def test_cuda_graph_sizes_flag_on_every_entry_point(entry):
    """--cuda-graph-sizes takes one or more sizes on generate, bench and the server (nargs="+"); a bad size is an
    argparse error naming the flag."""
    import importlib

    parser = importlib.import_module(entry).build_parser()
    base = ["--config", "kimi-linear-48b-a3b"] if entry == "kda_rt.bench" else []  # (bench: a model is required)
    assert parser.parse_args([*base, "--cuda-graph-sizes", "1", "5"]).cuda_graph_sizes == [1, 5]
    assert parser.parse_args(base).cuda_graph_sizes is None
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--cuda-graph-sizes", "x"])


@pytest.mark.parametrize("memory_gib,name,expected", [
    (141, "NVIDIA H200", 16384), (80, "NVIDIA H100 80GB HBM3", 16384), (192, "NVIDIA B200", 16384),
    (80, "NVIDIA A100-SXM4-80GB", 8192), (48, "NVIDIA L40S", 8192), (69.9, "NVIDIA H100 NVL", 8192),
    (None, "", 8192),
])
def test_offline_batched_tokens_rule(memory_gib, name, expected):
    """vLLM's offline default: 16384 new tokens a step on GPUs of 70+ GiB but the A100, else (and on CPU) 8192."""
    from kda_rt.engine.config import offline_batched_tokens

    memory = None if memory_gib is None else int(memory_gib * 2**30)
    assert offline_batched_tokens(memory, name) == expected


def test_batched_tokens_defaults(tiny_dir):
    """Unset, max_num_batched_tokens is resolved when the engine is built (NumPy: 8192); given, it is kept;
    the server's flag defaults to 8192 (its streams feel every long step)."""
    from kda_rt.server.__main__ import build_parser

    assert EngineConfig().max_num_batched_tokens is None
    assert make_llm(tiny_dir, backend="numpy").llm_engine.config.max_num_batched_tokens == 8192
    assert make_llm(tiny_dir, backend="numpy", max_num_batched_tokens=96).llm_engine.config.max_num_batched_tokens == 96
    assert build_parser().parse_args([]).max_num_batched_tokens == 8192


def test_backend_errors(tiny_dir):
    from kda_rt.engine.runner import cuda_unavailable_reason

    if cuda_unavailable_reason() is not None:  # CPU machines: a clear reason, not a crash later
        with pytest.raises(RuntimeError, match="backend='cuda' is unavailable"):
            make_llm(tiny_dir, backend="cuda")
    with pytest.raises(ValueError, match="dtype"):
        make_llm(tiny_dir, dtype="float16")


@pytest.mark.parametrize(("optin", "ok"), [(232448, True), (166912, False), (101376, False)],
                         ids=["sm_90", "sm_80-A100", "sm_89"])
def test_backend_needs_the_kda_kernels_shared_memory(optin, ok):
    """A GPU whose blocks may opt in to less shared memory than the largest kernel's (kda_prefill_intra, 221,616
    bytes) is refused with the numbers (backend='auto' then runs NumPy), instead of failing at its first prefill."""
    from kda_rt.engine.runner import smem_shortfall

    reason = smem_shortfall(optin)
    if ok:
        assert reason is None
    else:
        assert reason is not None and f"use {optin} bytes" in reason and "needs 221616" in reason


def test_stats_counters(llm):
    before = llm.stats()
    llm.generate([{"prompt_token_ids": [9] * 7}, {"prompt_token_ids": [8] * 3}], greedy(4))
    after = llm.stats()
    for key in ("running", "waiting", "preemptions", "pages_used", "pages_free", "slots_used", "slots_free",
                "tokens_processed", "prefill_tokens", "generated_tokens", "steps", "requests_finished"):
        assert key in after
    assert after["generated_tokens"] - before["generated_tokens"] == 8
    assert after["prefill_tokens"] - before["prefill_tokens"] == 10
    assert after["tokens_processed"] - before["tokens_processed"] == 10 + 2 * 3  # last token never computed
    assert after["pages_free"] == llm.llm_engine.scheduler.config.num_blocks and after["slots_free"] == 2


def test_step_token_bins(llm):
    """Each step's tokens (its prefill tokens plus the tokens it sampled) binned at vLLM's iteration_tokens_total
    bounds, which /metrics shows (was: no per-step count at all, only totals)."""
    from kda_rt.engine.llm_engine import STEP_TOKEN_BOUNDS

    before = llm.stats()
    llm.generate([{"prompt_token_ids": [9] * 7}, {"prompt_token_ids": [8] * 3}], greedy(4))
    after = llm.stats()
    bins = [a - b for a, b in zip(after["step_token_bins"], before["step_token_bins"], strict=True)]
    assert len(bins) == len(STEP_TOKEN_BOUNDS) + 1 == 14
    # step 1: both prompts (10 tokens) and their first tokens (2) = 12, in (8, 16]; then three decode steps of 2
    # tokens, in (1, 8]
    expected = [0] * 14
    expected[STEP_TOKEN_BOUNDS.index(16)], expected[STEP_TOKEN_BOUNDS.index(8)] = 1, 3
    assert bins == expected
    assert sum(bins) == after["steps"] - before["steps"]
    after["step_token_bins"][0] += 1  # a copy: a caller's snapshot never moves with the engine
    assert llm.stats()["step_token_bins"] != after["step_token_bins"]


def test_pool_plan_numpy():
    """NumPy backend: every engine slot can reach max_model_len; num_blocks overrides; no padding."""
    cfg = parse_config(tiny_config())
    big = 2**40
    plan = plan_pools(cfg, EngineConfig(max_num_seqs=4, max_model_len=256, block_size=16, enable_prefix_caching=False),
                      itemsize=4, memory_bytes=big, cap_to_sequences=True)
    assert (plan.engine_slots, plan.engine_blocks, plan.max_model_len) == (4, 4 * 16, 256)
    assert (plan.num_slots, plan.num_blocks, plan.pad_slot, plan.pad_page) == (4, 64, None, None)
    plan = plan_pools(cfg, EngineConfig(num_blocks=7, block_size=16, max_model_len=100), itemsize=4, memory_bytes=big,
                      cap_to_sequences=True)
    assert (plan.engine_slots, plan.engine_blocks) == (16, 7)
    # prefix caching (the default) adds prefix_cache_states (32) snapshot slots after the engine's, no pages
    plan = plan_pools(cfg, EngineConfig(max_num_seqs=4, max_model_len=256, block_size=16), itemsize=4,
                      memory_bytes=big, cap_to_sequences=True)
    assert (plan.engine_slots, plan.num_slots, plan.num_blocks) == (4, 36, 64)
    assert plan.snapshot_slots == tuple(range(4, 36))


def test_num_blocks_over_the_memory_budget_named(tiny_dir):
    """An explicit num_blocks beyond what the memory budget holds is refused naming it, its bytes and the most pages
    that fit (was: NumPy's "Unable to allocate 144. PiB for an array", or "Maximum allowed dimension exceeded",
    with no setting named); up to that count it is taken as given."""
    cfg = parse_config(tiny_config())
    page = kv_bytes_per_block(cfg, 16, 4)
    memory = 2**30
    engine = EngineConfig(max_num_seqs=4, max_model_len=64, block_size=16, gpu_memory_utilization=1.0,
                          enable_prefix_caching=False)
    most = (memory - 4 * state_bytes_per_slot(cfg, 4)) // page
    fits = plan_pools(cfg, dataclasses.replace(engine, num_blocks=most), itemsize=4, memory_bytes=memory)
    assert fits.engine_blocks == most
    with pytest.raises(ValueError, match=rf"num_blocks {most + 1} does not fit: .* holds at most {most} pages"):
        plan_pools(cfg, dataclasses.replace(engine, num_blocks=most + 1), itemsize=4, memory_bytes=memory)
    for huge in (2**40, 10**30):
        with pytest.raises(ValueError, match=rf"num_blocks {huge} does not fit"):
            make_llm(tiny_dir, max_model_len=64, block_size=16, num_blocks=huge)


def test_pool_plan_device_budget():
    """CUDA backend: pages fill what gpu_memory_utilization leaves after weights, state and padding."""
    cfg = parse_config(tiny_config())
    page, slot = kv_bytes_per_block(cfg, 16, 2), state_bytes_per_slot(cfg, 2, 4)
    assert page == 1 * 16 * (32 + 8) * 2  # one MLA layer, kv_lora_rank + rope dim per token
    device = 10 * 2**20
    for caching, snapshots in ((False, 0), (True, 32)):  # prefix caching's states: more slots, fewer pages
        plan = plan_pools(cfg, EngineConfig(max_num_seqs=4, max_model_len=256, block_size=16,
                                            enable_prefix_caching=caching), itemsize=2,
                          state_itemsize=4, memory_bytes=device, weight_bytes=2**20, padding=True)
        used = 2**20 + plan.num_slots * slot + plan.num_blocks * page
        assert plan.num_slots == 5 + snapshots and plan.pad_slot == 4 and plan.pad_page == plan.engine_blocks
        assert plan.snapshot_slots == tuple(range(5, 5 + snapshots))
        assert used == 2**20 + plan.bytes and used <= 0.9 * device < used + page


def test_default_max_num_seqs():
    """vLLM's default (1024 on a GPU of 70+ GiB that is not an A100, else 256), capped so the state slots take at
    most half the memory after the weights: as many as fit there, a multiple of 16 past 16; NumPy 16."""
    assert default_max_num_seqs(141 * 10**9, "NVIDIA H200") == 1024
    assert default_max_num_seqs(80 * 2**30, "NVIDIA A100-SXM4-80GB") == 256
    assert default_max_num_seqs(48 * 2**30, "NVIDIA L40S") == 256 and default_max_num_seqs(None) == 256
    mb = 2**20
    assert fit_max_num_seqs(1024, 42 * mb, 100 * 2**30) == 1024  # 42 GiB of slots in 100 GiB
    # the 48B shape in bf16 on an H200: ~34 GiB after the weights, 42 MiB a slot: 414 fit in half, 400 taken
    assert fit_max_num_seqs(1024, 42 * mb, 34 * 2**30) == 400
    assert fit_max_num_seqs(256, 42 * mb, 420 * mb) == 5  # under 16: as many as fit
    assert fit_max_num_seqs(256, 42 * mb, 10 * mb) == 1  # never 0 (plan_pools then names what does not fit)
    assert fit_max_num_seqs(256, 0, 0) == 256  # no KDA layer: slots cost nothing
    cfg = parse_config(tiny_config())
    slot, page = state_bytes_per_slot(cfg, 2, 4), kv_bytes_per_block(cfg, 16, 2)
    off = dict(enable_prefix_caching=False)  # (the engine's own slots alone)
    roomy = plan_pools(cfg, EngineConfig(block_size=16, **off), itemsize=2, state_itemsize=4, memory_bytes=2**30,
                       padding=True, default_seqs=1024)
    assert roomy.engine_slots == 1024 and roomy.num_slots == 1025
    memory = 2**20 + 2 * 100 * slot  # ~100 slots fit in half of what the weights leave
    tight = plan_pools(cfg, EngineConfig(block_size=16, gpu_memory_utilization=1.0, **off), itemsize=2,
                       state_itemsize=4, memory_bytes=memory, weight_bytes=2**20, padding=True, default_seqs=1024)
    room = memory - 2**20 - slot - page
    assert tight.engine_slots == (room // 2 // slot) // 16 * 16 and tight.engine_slots * slot <= room // 2
    explicit = plan_pools(cfg, EngineConfig(block_size=16, max_num_seqs=40, gpu_memory_utilization=1.0, **off),
                          itemsize=2, state_itemsize=4, memory_bytes=memory, weight_bytes=2**20, padding=True,
                          default_seqs=1024)
    assert explicit.engine_slots == 40  # a given value is kept (its pages are what is left)
    with pytest.raises(ValueError, match="max_num_seqs must be an int >= 1"):
        EngineConfig(max_num_seqs=0)


def test_llm_resolves_max_num_seqs(tiny_dir):
    """An unset max_num_seqs is resolved when the engine is built (NumPy: 16), and the scheduler and the
    engine's config carry the resolved number."""
    llm = make_llm(tiny_dir, max_model_len=64, block_size=16, max_num_seqs=None)
    assert llm.engine_config.max_num_seqs == 16 == llm.llm_engine.scheduler.config.max_num_seqs
    assert llm.llm_engine.runner.plan.engine_slots == 16
    from kda_rt.engine.llm_engine import LLMEngine

    unresolved = dataclasses.replace(llm.engine_config, max_num_seqs=None)
    with pytest.raises(ValueError, match="resolved max_model_len, max_num_batched_tokens and max_num_seqs"):
        LLMEngine(llm.model_config, llm.llm_engine.runner, None, unresolved, num_slots=16, num_blocks=4)


def test_max_model_len_resolution(caplog):
    """vLLM's rule: default to the model's limit when one sequence of it fits, else the largest length
    that fits (one log line); an explicit value that does not fit names both numbers."""
    cfg = parse_config(tiny_config(model_max_length=4096))
    page = kv_bytes_per_block(cfg, 16, 2)
    roomy = dict(itemsize=2, memory_bytes=2**30, padding=True)
    assert plan_pools(cfg, EngineConfig(block_size=16), **roomy).max_model_len == 4096
    tight = dict(itemsize=2, memory_bytes=(100 + 1) * page, padding=True)  # ~100 pages after the padding page
    eng = EngineConfig(block_size=16, max_num_seqs=1, gpu_memory_utilization=1.0, enable_prefix_caching=False)
    with caplog.at_level("WARNING", logger="kda_rt.engine.pools"):
        plan = plan_pools(cfg, eng, **tight)
    assert plan.max_model_len == plan.engine_blocks * 16 < 4096
    assert [r for r in caplog.records if "max_model_len" in r.getMessage()], "one log line says why"
    with pytest.raises(ValueError, match=r"max_model_len 4096 does not fit.*holds \d+ tokens"):
        plan_pools(cfg, dataclasses.replace(eng, max_model_len=4096), **tight)
    with pytest.raises(ValueError, match="max_model_len 5000 exceeds the model's limit 4096"):
        plan_pools(cfg, EngineConfig(block_size=16, max_model_len=5000), **roomy)
    with pytest.raises(ValueError, match="no room for KV pages"):
        plan_pools(cfg, eng, itemsize=2, memory_bytes=10, padding=True)


def test_llm_default_max_model_len_is_the_models(tiny_dir):
    llm = make_llm(tiny_dir, max_num_seqs=2, block_size=16)
    assert llm.engine_config.max_model_len == llm.model_config.max_model_len


@pytest.mark.slow
def test_random_weights_full_shape_share_host_memory():
    """The 48B preset (cut to 5 layers here: 16 GB logical) builds with one host array per shape and
    kind, routers drawn per layer (issue 12: the full model without holding 98 GB on the host)."""
    from kda_rt.demo.presets import kimi_linear_48b_a3b
    from kda_rt.loader.weights import expected_tensors

    cfg = parse_config(kimi_linear_48b_a3b(5))
    assert cfg.mla_layer_ids == (3, 4) and cfg.kda_layer_ids == (0, 1, 2)
    weights = random_weights(cfg, seed=1)
    expected = expected_tensors(cfg)
    assert list(weights) == list(expected)
    assert all(weights[n].shape == shape for n, (shape, _) in expected.items())
    host = {id(a): a.nbytes for a in weights.values()}
    logical = sum(a.nbytes for a in weights.values())
    assert sum(host.values()) < 0.2 * logical, (sum(host.values()), logical)
    routers = [weights[n] for n in weights if n.endswith("block_sparse_moe.gate.weight")]
    biases = [weights[n] for n in weights if n.endswith("e_score_correction_bias")]
    assert len(routers) == 4 and len({id(r) for r in routers}) == 4 and len({id(b) for b in biases}) == 4
    assert 0.02 < float(np.std(biases[0])) < 0.1  # router bias std 0.05: routing follows the data


def test_random_weights_match_checkpoint_layout():
    cfg = parse_config(tiny_config())
    weights = random_weights(cfg, seed=1)
    expected = expected_tensors(cfg)
    assert list(weights) == list(expected)
    assert all(weights[n].shape == shape for n, (shape, _) in expected.items())


@pytest.mark.parametrize("source", ["demo", "config"])
def test_bench_cli(tmp_path, source):
    if source == "demo":
        args = ["--model", str(demo_path())]
    else:
        (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
        args = ["--config", str(tmp_path / "config.json"), "--random-weights", "--num-blocks", "6", "--block-size", "16"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDA_RT_")} | {"KDA_RT_MLA_FP8": "0"}
    res = subprocess.run([sys.executable, "-m", "kda_rt.bench", *args, "--batch", "2", "--input-len", "64",
                          "--output-len", "8", "--backend", "numpy"], capture_output=True, text=True, timeout=120,
                         env=env)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert report["backend"] == "numpy" and report["args"]["batch"] == 2
    assert report["env"] == {"KDA_RT_MLA_FP8": "0"}, report["env"]  # the switches a row ran with
    for key in ("total_tok_s", "output_tok_s", "ttft_s_mean", "tpot_s_mean", "decode_step_s_mean", "peak_memory_bytes"):
        assert report[key] > 0, key
    # the floor's bytes over the step: the rate the step moved them at (any GPU; the floor is at the H200's rate)
    assert report["decode_tb_s"] == pytest.approx(report["decode_floor_gb"] / 1e3 / report["decode_step_s_mean"])
    assert report["decode_ratio"] == pytest.approx(report["decode_step_s_mean"] * 1e3 / report["decode_floor_ms"])


def test_bench_cli_num_layers_needs_a_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    res = subprocess.run([sys.executable, "-m", "kda_rt.bench", "--config", str(tmp_path / "config.json"),
                          "--random-weights", "--num-layers", "2", "--backend", "numpy"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "--num-layers works with a preset" in res.stderr


def test_bench_cli_num_iters_reports_medians():
    """--num-iters 3: each number the median over the three timed runs, the runs' own reports under "iters", with
    the garbage collections each run saw; --num-iters-warmup 0 is --no-warmup."""
    res = subprocess.run([sys.executable, "-m", "kda_rt.bench", "--model", str(demo_path()), "--batch", "2",
                          "--input-len", "16", "--output-len", "4", "--backend", "numpy", "--num-iters", "3",
                          "--num-iters-warmup", "0"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout.strip().splitlines()[-1])
    runs = report["iters"]
    assert len(runs) == 3 and report["args"]["num_iters_warmup"] == 0
    for key in ("elapsed_s", "ttft_s_max", "gc_s", "gc_collections", "num_steps"):
        assert report[key] == statistics.median(r[key] for r in runs), key
    assert all(r["gc_collections"] >= 0 and r["gc_s"] >= 0 for r in runs)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--config", "kimi-linear-48b-a3b", "--random-weights", "--num-iters", "0"], "--num-iters must be >= 1"),
    (["--config", "kimi-linear-48b-a3b", "--random-weights", "--num-iters-warmup", "-1"], "--num-iters-warmup >= 0"),
    (["--config", "kimi-linear-48b-a3b", "--random-weights", "--num-layers", "0"], "--num-layers must be >= 1"),
    (["--model", "/nonexistent", "--num-layers", "2"], "works with a preset --config only"),
    (["--config", "kimi-linear-48b-a3b", "--random-weights", "--router-bias-std", "nan"], "--router-bias-std"),
    (["--config", "kimi-linear-48b-a3b", "--random-weights", "--router-bias-std", "-1"], "--router-bias-std"),
    (["--config", "kimi-linear-48b-a3b", "--random-weights", "--seed", "-1"], "--seed must be >= 0"),
    (["--model", str(demo_path()), "--seed", "-1"], "--seed must be >= 0"),
    (["--model", str(demo_path()), "--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
])
def test_bench_cli_bad_flags_named(capsys, argv, needle):
    """Refused before anything is built (was: --num-layers 0 became 27 layers and failed on host memory, --num-layers
    with --model was ignored, a NaN bias std printed NaN into the JSON line, --seed -1 "expected non-negative
    integer" with no flag named, --max-num-seqs 0 silently the largest batch)."""
    from kda_rt.bench import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_bench_cli_config_needs_random_weights(tmp_path):
    res = subprocess.run([sys.executable, "-m", "kda_rt.bench", "--config", "c.json"], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert res.returncode == 2 and "--random-weights" in res.stderr


def test_profile_decodes_every_prompt_once_all_are_prefilled(tiny_dir):
    """bench --profile's decode step runs the whole batch: the prompts still decode after the last
    one's prefill (the early ones do not run out of tokens while later ones prefill), nothing launched
    ahead falls into the timed window, and the requests are aborted afterwards.  (NumPy backend: the
    CUDA-event tables are empty here, the engine flow is what is checked.)"""
    from kda_rt.bench import profile_steps

    llm = make_llm(tiny_dir, max_num_seqs=6, max_model_len=256, block_size=16, max_num_batched_tokens=64)
    engine = llm.llm_engine
    steps = engine.counters["steps"]
    out = profile_steps(engine, batch=6, input_len=40, seed=3)
    assert out["decode"]["batch"] == 6
    assert engine.counters["steps"] - steps >= 5  # 240 prompt tokens at 64 per step, then the decode
    assert not engine.has_pending_step()
    assert_no_leaks(llm)


def test_prefill_tail_tokens_over_the_budget_refused_at_engine_build(tiny_dir):
    """A tail larger than the step budget (a step of up to twice the budget) is refused when the engine is built,
    naming both settings; the default follows the budget (budget // 64)."""
    with pytest.raises(ValueError, match=r"prefill_tail_tokens \(65\) must be at most max_num_batched_tokens \(64\)"):
        make_llm(tiny_dir, max_model_len=96, block_size=16, max_num_batched_tokens=64, prefill_tail_tokens=65)
    llm = make_llm(tiny_dir, max_model_len=96, block_size=16, max_num_batched_tokens=640)
    assert llm.llm_engine.scheduler.config.prefill_tail_tokens == 10


def test_weights_that_cannot_fit_the_gpu_are_refused_before_the_upload():
    """The CUDA runner checks the weights' device bytes against the GPU's free memory before uploading anything: the
    48B shape in bf16 (98.3 GB, as the H200 runs it) does not fit an 80 GB H100, the error names both, the free
    memory and what fp8 needs; fp8 (51.1 GB) fits; on a 40 GB card neither does."""
    from kda_rt.demo.presets import kimi_linear_48b_a3b
    from kda_rt.engine.pools import check_weights_fit

    cfg = parse_config(kimi_linear_48b_a3b())
    h200, h100 = dict(free_bytes=140 * 10**9, total_bytes=141 * 10**9), dict(free_bytes=84 * 10**9,
                                                                             total_bytes=85 * 10**9)
    assert check_weights_fit(cfg, None, device="NVIDIA H200", **h200) == pytest.approx(98.28e9, rel=1e-3)
    fp8 = check_weights_fit(cfg, "fp8", device="NVIDIA H100 80GB HBM3", **h100)
    assert fp8 == pytest.approx(51.10e9, rel=1e-3)
    with pytest.raises(ValueError, match=r"the weights need 91\.5 GiB on the GPU \(bf16\) but NVIDIA H100 80GB HBM3 has "
                                         r"78\.2 GiB free of 79\.2 GiB; with quantization=\"fp8\" .* they need "
                                         r"47\.6 GiB$"):
        check_weights_fit(cfg, None, device="NVIDIA H100 80GB HBM3", **h100)
    with pytest.raises(ValueError, match=r"\(fp8 experts\) but NVIDIA L40S has 37\.3 GiB free"):
        check_weights_fit(cfg, "fp8", free_bytes=40 * 10**9, total_bytes=48 * 10**9, device="NVIDIA L40S")
    with pytest.raises(ValueError, match="47.6 GiB, still too many"):
        check_weights_fit(cfg, None, free_bytes=40 * 10**9, total_bytes=48 * 10**9, device="NVIDIA L40S")
    # a tiny model: its bytes (bf16 matmuls, fp32 small tensors), far under any GPU
    tiny = parse_config(tiny_config())
    assert 0 < check_weights_fit(tiny, None, device="x", free_bytes=2**30, total_bytes=2**30) < 2**24


def test_prefix_cache_states_fit_a_share_of_the_pages(caplog):
    """Prefix caching (on by default) never costs the engine its sequences: max_num_seqs's default is the same with
    it and without; its states take at most 1/8 (SNAPSHOT_SHARE) of the pages' memory, fewer than
    prefix_cache_states where 32 do not fit there (one warning), none where not one does; with num_blocks given,
    what the pages leave."""
    from kda_rt.engine.pools import SNAPSHOT_SHARE

    cfg = parse_config(tiny_config())
    slot, page = state_bytes_per_slot(cfg, 2, 4), kv_bytes_per_block(cfg, 16, 2)
    kw = dict(itemsize=2, state_itemsize=4, weight_bytes=2**20, padding=True, default_seqs=16)

    def plans(memory, **settings):
        eng = EngineConfig(block_size=16, gpu_memory_utilization=1.0, **settings)
        return (plan_pools(cfg, dataclasses.replace(eng, enable_prefix_caching=False), memory_bytes=memory, **kw),
                plan_pools(cfg, eng, memory_bytes=memory, **kw))

    roomy_off, roomy = plans(2**30)
    assert len(roomy.snapshot_slots) == 32 and roomy.engine_slots == roomy_off.engine_slots == 16
    roomy_budget = 2**30 - 2**20 - (slot + page) - 16 * slot
    assert (roomy_off.engine_blocks, roomy.engine_blocks) == (roomy_budget // page, (roomy_budget - 32 * slot) // page)
    # pages' memory for ~40 states: 1/8 of it holds 5 (the default max_num_seqs the same either way)
    memory = 2**20 + (slot + page) + 60 * slot
    with caplog.at_level("WARNING", logger="kda_rt.engine.pools"):
        off, on = plans(memory)
    seqs = off.engine_slots
    budget = memory - 2**20 - (slot + page) - seqs * slot
    assert on.engine_slots == seqs == 16 and 40 <= budget // slot < 48
    assert len(on.snapshot_slots) == budget // SNAPSHOT_SHARE // slot == 5
    assert on.engine_blocks == (budget - 5 * slot) // page >= off.engine_blocks * (SNAPSHOT_SHARE - 1) // SNAPSHOT_SHARE
    assert [r.getMessage() for r in caplog.records if "prefix caching" in r.getMessage()] == [
        f"prefix caching keeps 5 KDA states, not prefix_cache_states 32: they may take 1/{SNAPSHOT_SHARE} of the KV "
        f"pages' {budget / 2**30:.2f} GiB"]
    # under one state's worth in the share: no snapshot slot (the engine then runs without the cache)
    off, on = plans(2**20 + (slot + page) + 23 * slot, max_num_seqs=16)
    assert on.snapshot_slots == () and on.engine_blocks == off.engine_blocks > 0 and on.engine_slots == 16
    # num_blocks given: the states take what the pages leave
    off, on = plans(memory, num_blocks=10)
    assert len(on.snapshot_slots) == min(32, (budget - 10 * page) // slot) and on.engine_blocks == 10
