"""Every request shape users send, on the CUDA backend, against the NumPy oracle (issue 8).

Prompts around the prefill budget B (1, B-1, B, B+1, 3B+7 tokens) and one of 32,768 tokens; steps
where decodes share the batch with prefill chunks of other sequences; preemption under a tiny
page pool; the engine-level invariances of tests/engine (staggered arrivals, chunk budgets
1/2/5/16/33, streaming = non-streaming).

The check (`assert_matches_oracle`): the oracle (NumPy backend, dtype="bfloat16", same
fixed-routing checkpoint) scores prompt + the CUDA tokens in one prefill, so every CUDA token is
compared with the oracle's logits at the very same context.  Each token must be the oracle's
argmax up to bf16 noise (3 x the 2e-2 relative per-position error that test_cuda_model.py bounds,
as an absolute margin on the logit), and its logprob must agree with the oracle's within the same
margin.  With fixed routing there are no router near-ties, so a wrong cache, state slot, chunk
boundary or page table shows up as a logits error far above the margin.  The fraction of tokens
that equal the oracle's argmax exactly is printed.
"""

from __future__ import annotations

import numpy as np
import pytest

from kda_rt import LLM, SamplingParams

pytestmark = pytest.mark.gpu

TOL = 2e-2  # per-position relative error bound of the CUDA backend (tests/gpu/test_cuda_model.py)
B = 64  # prefill token budget of the boundary tests
VOCAB = 768  # ordinary (non-special) ids of the demo vocabulary


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from kda_rt.demo import demo_path
    from kda_rt.demo.make_demo import DEMO_CONFIG
    from kda_rt.random_checkpoint import write_random_checkpoint

    cfg = dict(DEMO_CONFIG, model_max_length=65536)
    return str(write_random_checkpoint(cfg, tmp_path_factory.mktemp("shapes"), seed=5, tokenizer_dir=demo_path(),
                                       fixed_routing=True))


@pytest.fixture(scope="module")
def oracle(ckpt):
    return LLM(ckpt, backend="numpy", dtype="bfloat16", max_num_seqs=1, max_model_len=40000,
               max_num_batched_tokens=40000, enable_prefix_caching=False)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, **kw)


def prompt_of(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


def assert_matches_oracle(oracle: LLM, prompt: list[int], out, label: str) -> float:
    """Teacher-forced check of one CUDA completion; returns the exact-argmax fraction."""
    tokens = out.token_ids
    assert out.finish_reason == "length", f"{label}: finished with {out.finish_reason}"
    logits = oracle.score(prompt + tokens[:-1])[len(prompt) - 1:].astype(np.float64)
    exact = 0
    for i, tok in enumerate(tokens):
        row = logits[i]
        noise = 3 * TOL * np.sqrt(np.mean(row**2))
        lz = row.max() + np.log(np.exp(row - row.max()).sum())
        assert row[tok] >= row.max() - noise, (
            f"{label}: step {i} token {tok} has oracle logit {row[tok]:.4f}, argmax {int(row.argmax())} has "
            f"{row.max():.4f} (margin {noise:.4f})")
        if out.logprobs is not None:
            assert abs(out.logprobs[i][tok] - (row[tok] - lz)) <= noise + 0.02, f"{label}: step {i} logprob"
        exact += int(tok == int(row.argmax()))
    return exact / len(tokens)


def run_all(llm: LLM, prompts: list[list[int]], params) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0] for o in outs]


def no_leaks(llm: LLM) -> None:
    s = llm.stats()
    assert s["running"] == s["waiting"] == s["slots_used"] == s["pages_used"] == 0, s


class Recorder:
    """Wraps the CUDA runner and keeps each step's ForwardBatch."""

    def __init__(self, inner) -> None:
        self.inner, self.batches = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, batch, sampling):
        self.batches.append(batch)
        return self.inner.execute(batch, sampling)

    def launch(self, batch, sampling, **kw):
        self.batches.append(batch)
        return self.inner.launch(batch, sampling, **kw)


@pytest.mark.parametrize("length", [1, B - 1, B, B + 1, 3 * B + 7])
def test_prompt_lengths_around_the_budget(ckpt, oracle, length):
    gpu = LLM(ckpt, backend="cuda", max_num_seqs=4, max_model_len=1024, num_blocks=80, max_num_batched_tokens=B)
    prompt = prompt_of(length, seed=length)
    out = run_all(gpu, [prompt], greedy(12))[0]
    frac = assert_matches_oracle(oracle, prompt, out, f"{length} tokens, budget {B}")
    print(f"prompt {length} (budget {B}): {frac:.0%} exact oracle argmax")
    no_leaks(gpu)


def test_boundary_prompts_together_share_steps(ckpt, oracle):
    """All boundary lengths at once under budget B: decodes of short prompts ride along with the
    continuing prefill chunks of long ones."""
    gpu = LLM(ckpt, backend="cuda", max_num_seqs=8, max_model_len=1024, num_blocks=160, max_num_batched_tokens=B)
    rec = gpu.llm_engine.runner = Recorder(gpu.llm_engine.runner)
    prompts = [prompt_of(n, seed=100 + n) for n in (1, B - 1, B, B + 1, 3 * B + 7)]
    outs = run_all(gpu, prompts, greedy(16))
    mixed = [b for b in rec.batches if (b.seq_lens == 1).any() and (b.seq_lens > 1).any()]
    mid = [b for b in rec.batches if b.logits_indices.size < b.num_seqs]
    assert mixed and mid, "expected steps mixing decodes with prefill chunks, and chunks without logits"
    for p, o in zip(prompts, outs, strict=True):
        assert_matches_oracle(oracle, p, o, f"together, {len(p)} tokens")
    no_leaks(gpu)


def test_32k_prompt(ckpt, oracle):
    gpu = LLM(ckpt, backend="cuda", max_num_seqs=2, max_model_len=33000, num_blocks=1100)
    prompt = prompt_of(32768, seed=7)
    out = run_all(gpu, [prompt], greedy(8))[0]
    frac = assert_matches_oracle(oracle, prompt, out, "32768 tokens")
    print(f"32K prompt: {frac:.0%} exact oracle argmax, tokens {out.token_ids}")
    no_leaks(gpu)


def test_staggered_arrivals_mixed_steps(ckpt, oracle):
    """Requests join while others decode (engine-level, budget 16): every step after the first mixes."""
    gpu = LLM(ckpt, backend="cuda", max_num_seqs=6, max_model_len=512, num_blocks=64, max_num_batched_tokens=16)
    engine = gpu.llm_engine
    prompts = [prompt_of(n, seed=200 + n) for n in (5, 40, 17, 3, 90, 33)]
    done = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, greedy(10 + 2 * i))
        for _ in range(3):
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0]
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0]
    assert sorted(done) == [f"r{i}" for i in range(len(prompts))]
    for i, p in enumerate(prompts):
        assert len(done[f"r{i}"].token_ids) == 10 + 2 * i
        assert_matches_oracle(oracle, p, done[f"r{i}"], f"staggered r{i}")
    no_leaks(gpu)


@pytest.mark.parametrize("budget", [1, 2, 5, 16, 33])
def test_chunk_budgets(ckpt, oracle, budget):
    gpu = LLM(ckpt, backend="cuda", max_num_seqs=1, max_model_len=256, num_blocks=8, max_num_batched_tokens=budget)
    prompt = prompt_of(45, seed=3)
    out = run_all(gpu, [prompt], greedy(6))[0]
    assert_matches_oracle(oracle, prompt, out, f"budget {budget}")
    no_leaks(gpu)


def test_preemption_tiny_pool(ckpt, oracle):
    """6 pages of 16 tokens: one request fits alone, several never do; recompute after preemption."""
    gpu = LLM(ckpt, backend="cuda", max_num_seqs=6, max_model_len=96, block_size=16, num_blocks=6,
              max_num_batched_tokens=32)
    prompts = [prompt_of(n, seed=300 + n) for n in (2, 30, 11, 40, 7, 25, 19, 36)]
    params = [greedy(12 + (i % 4) * 4) for i in range(len(prompts))]
    outs = run_all(gpu, prompts, params)
    assert gpu.stats()["preemptions"] > 0, "the pool was meant to be too small to avoid preemption"
    for p, prm, o in zip(prompts, params, outs, strict=True):
        assert len(o.token_ids) == prm.max_tokens
        assert_matches_oracle(oracle, p, o, f"preemption, {len(p)} tokens")
    no_leaks(gpu)


def test_streaming_equals_non_streaming(ckpt):
    """Same steps, same kernels: the streamed deltas concatenate to exactly the non-streamed tokens."""
    gpu = LLM(ckpt, backend="cuda", max_num_seqs=4, max_model_len=512, num_blocks=40, max_num_batched_tokens=32)
    prompts = [prompt_of(n, seed=400 + n) for n in (3, 50, 21)]
    plain = [o.token_ids for o in run_all(gpu, prompts, greedy(14))]
    got: dict[str, list[int]] = {}
    for delta in gpu.generate([{"prompt_token_ids": p} for p in prompts], greedy(14), stream=True):
        got.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
    assert [got[k] for k in sorted(got, key=int)] == plain
    no_leaks(gpu)


def test_default_max_model_len_is_the_models(ckpt):
    # (a quarter of the GPU still holds 65,536 tokens of this model's pages many times over; the default 0.9 would
    # take the memory of the other pytest processes of device_run.sh's XDIST run)
    gpu = LLM(ckpt, backend="cuda", max_num_seqs=2, gpu_memory_utilization=0.25)
    assert gpu.engine_config.max_model_len == 65536
    with pytest.raises(ValueError, match="exceeds the model's limit 65536"):
        LLM(ckpt, backend="cuda", max_model_len=70000)


def test_async_scheduling_same_outputs(ckpt, oracle, monkeypatch):
    """Steps launched ahead (the default: decode steps, and the prompts' chunked prefill steps beside decodes whose
    ids are fed on the device) on the GPU.  (1) Requests that all start together and run to the same length see
    batches of the same sequences either way (in the ahead engine the rows that take the previous step's ids
    lead): tokens and logprobs equal the synchronous engine's bit for bit.  (2) Stop-token finishes in the middle of a batch, seeded sampling, a late
    arrival and an abort between steps: a launched-ahead step fixes its batch before an arrival, so the
    batches differ from the synchronous engine's; every greedy row is checked against the oracle instead
    (a stale or misplaced input id would show as tokens the oracle does not predict)."""
    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", "1")  # (default 0 until this test has run on a GPU)
    kw = dict(backend="cuda", max_num_seqs=8, max_model_len=1024, num_blocks=160, max_num_batched_tokens=B)
    sync, ahead = LLM(ckpt, async_scheduling=False, **kw), LLM(ckpt, **kw)
    prompts = [prompt_of(n, seed=300 + n) for n in (5, 17, 40, 63, 64, 90, 130)]
    params = [greedy(20) if i % 2 else SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=20,
                                                      ignore_eos=True, logprobs=3) for i in range(len(prompts))]
    launched = ahead.llm_engine.counters["steps_launched_ahead"]
    calls, inner = [], ahead.llm_engine.runner.launch

    def spy(batch, sampling, **kw):
        calls.append((int(batch.seq_lens.max()), len(kw.get("ids_from_last", ()))))
        return inner(batch, sampling, **kw)

    ahead.llm_engine.runner.launch = spy
    try:
        want, got = run_all(sync, prompts, params), run_all(ahead, prompts, params)
    finally:
        del ahead.llm_engine.runner.launch
    assert ahead.llm_engine.counters["steps_launched_ahead"] - launched == len(calls) - 1  # all but the first
    assert any(longest > 1 and fed for longest, fed in calls), calls  # a prefill chunk beside device-fed decodes
    for w, g in zip(want, got, strict=True):
        assert (g.token_ids, g.logprobs) == (w.token_ids, w.logprobs)

    stops = [greedy(24, stop_token_ids=[w.token_ids[5]]) if w.logprobs is not None and i % 2 else greedy(12 + 2 * i)
             for i, w in enumerate(want)]
    eng, finals = ahead.llm_engine, {}
    for i, (p, sp) in enumerate(zip(prompts[:-1], stops[:-1], strict=True)):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, sp, output_kind="final")
    for step in range(400):
        if step == 8:
            eng.add_request("late", {"prompt_token_ids": prompts[-1]}, stops[-1], output_kind="final")
        if step == 11:
            eng.abort("r4")
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
        if step > 11 and not eng.has_unfinished_requests():
            break
    no_leaks(ahead)
    assert set(finals) == {"r0", "r1", "r2", "r3", "r5", "late"}
    assert any(o.finish_reason == "stop" for o in finals.values())
    for rid, out in finals.items():
        prompt = prompts[-1] if rid == "late" else prompts[int(rid[1:])]
        if out.finish_reason == "stop":  # the stop token is the last one; the oracle check wants "length"
            assert out.token_ids[-1] in stops[int(rid[1:])].stop_token_ids
            out = type("Done", (), {"token_ids": out.token_ids, "logprobs": out.logprobs, "finish_reason": "length"})
        assert_matches_oracle(oracle, prompt, out, f"async, {rid}")


def test_gpu_sampling_extras_equal_the_host_sampler(ckpt, monkeypatch):
    """KDA_RT_GPU_SAMPLING_EXTRAS=1: rows with repetition / presence / frequency penalties sampled on the GPU from the
    runner's per-sequence token counts (sampler/penalties.py), logit_bias rows from its bias rows, and rows with
    min_tokens bans or allowed_token_ids through the kernel's masks (SamplingBatch.device_masks), give the host
    sampler's greedy tokens bit for bit and
    its logprobs within float32 rounding (synchronous steps: the same batches, so the same logits); the penalties
    change the tokens; with async scheduling the penalised steps are launched ahead (the device counts the token the
    host has not seen yet; finishes by length only (min_tokens covers every token, so no stop id ends a request), so
    the batches are the synchronous engine's) and the tokens are
    again the same.  12 sequences, 8 at a time, rows for 2 at first: the counts' arrays grow and rows are reused."""
    import cupy

    from kda_rt.sampler.penalties import PenaltyRows
    from kda_rt.sampler.sampling import update_counts

    kw = dict(backend="cuda", max_num_seqs=8, max_model_len=1024, num_blocks=160, max_num_batched_tokens=B)
    prompts = [prompt_of(n, seed=700 + n) for n in (5, 17, 40, 63, 90, 130, 7, 25, 50, 70, 33, 12)]
    kinds = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.8), dict(presence_penalty=1.5),
             dict(repetition_penalty=0.9, frequency_penalty=0.4, presence_penalty=0.3), {}, dict(frequency_penalty=2.0),
             dict(min_tokens=0, stop_token_ids=list(range(3, 40))), dict(allowed_token_ids=list(range(100, 400))),
             dict(allowed_token_ids=list(range(3, 300)), min_tokens=0, stop_token_ids=[7, 8], presence_penalty=1.0),
             dict(logit_bias={t: -5.0 for t in range(3, 60)}, frequency_penalty=0.5),
             dict(logit_bias={t: 4.0 for t in range(200, 230)})]  # (a bias without a penalty)
    params = [greedy(n, **{**kind, "min_tokens": n} if "min_tokens" in kind else kind)  # (bans on every token)
              for n, kind in ((16 + 4 * (i % 3), kinds[i % len(kinds)]) for i in range(len(prompts)))]
    monkeypatch.setenv("KDA_RT_GPU_SAMPLING_EXTRAS", "0")
    host = LLM(ckpt, async_scheduling=False, **kw)
    want = run_all(host, prompts, params)
    plain = run_all(host, prompts, [greedy(p.max_tokens) for p in params])
    assert sum(w.token_ids != p.token_ids for w, p in zip(want, plain, strict=True)) >= 6, "the settings changed nothing"
    assert all(100 <= t < 400 for t in want[7].token_ids) and not set(want[6].token_ids) & set(range(3, 40))
    monkeypatch.setenv("KDA_RT_GPU_SAMPLING_EXTRAS", "1")
    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", "1")
    for ahead in (False, True):
        dev = LLM(ckpt, async_scheduling=ahead, **kw)
        runner = dev.llm_engine.runner
        assert runner.device_extras
        # rows for 2 sequences at first, so the 12 sequences grow the arrays on the device (and reuse rows)
        runner.penalty_rows = PenaltyRows(runner.config.vocab_size, cupy, lambda c, ids, rows, r=runner: update_counts(
            c, ids, rows=rows, stream=r.stream), first_capacity=2)
        launched = dev.llm_engine.counters["steps_launched_ahead"]
        got = run_all(dev, prompts, params)
        assert runner.penalty_rows.capacity >= 4
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            assert g.token_ids == w.token_ids, f"row {i} (async {ahead})"
            for lw, lg in zip(w.logprobs, g.logprobs, strict=True):
                assert lg.keys() == lw.keys() and all(abs(lg[t] - lw[t]) <= 1e-4 for t in lw), f"row {i} logprobs"
        assert (dev.llm_engine.counters["steps_launched_ahead"] - launched > 10) == ahead
        no_leaks(dev)
        del dev


def test_prefix_cache_copies_move_whole_slots_and_pages(ckpt):
    """copy_slots / copy_pages: the destination rows of every KDA and MLA pool equal the (random) source rows, queued
    in order behind one another (a snapshot read back after it is overwritten), and no other row moves."""
    import cupy

    gpu = LLM(ckpt, backend="cuda", max_num_seqs=4, max_model_len=512, num_blocks=16, enable_prefix_caching=True,
              prefix_cache_states=3, enforce_eager=True)  # (a small pool: every row of it is filled below)
    runner = gpu.llm_engine.runner
    assert runner.plan.snapshot_slots == (5, 6, 7)
    pools = [a.view(cupy.uint8) for pair in runner.kda_pools.values() for a in pair]  # (bytes: no NaN compares)
    pools += [a.view(cupy.uint8) for a in runner.mla_pools.values()]
    cupy.random.seed(3)
    for a in pools:  # (random bytes in every row)
        a[...] = cupy.random.randint(0, 256, size=a.shape).astype(cupy.uint8)
    before = [a.copy() for a in pools]
    runner.copy_slots([0, 2], [5, 6])
    runner.copy_slots([5], [1])  # (reads the snapshot written just before)
    runner.copy_pages([3], [9])
    runner.stream.synchronize()
    num_kda = 2 * len(runner.kda_pools)
    for i, (a, b) in enumerate(zip(pools, before, strict=True)):
        want = b.copy()
        if i < num_kda:
            want[5], want[6], want[1] = b[0], b[2], b[0]
        else:
            want[9] = b[3]
        assert bool((a == want).all())


def test_prefix_cache_resumes_match_the_oracle(ckpt, oracle):
    """A shared system prompt and a chat's second turn on the CUDA backend with prefix caching: the requests that
    resume from a restored state and shared or copied pages (num_cached_tokens says where) give the oracle's tokens,
    alone and while others run."""
    gpu = LLM(ckpt, backend="cuda", max_num_seqs=8, max_model_len=2048, num_blocks=120, max_num_batched_tokens=B,
              enable_prefix_caching=True, prefix_cache_states=4)
    system = prompt_of(150, seed=90)  # two full pages of 64 and 22 tokens
    for i in range(4):
        prompt = system + prompt_of(5 + 3 * i, seed=91 + i)
        out = gpu.generate({"prompt_token_ids": prompt}, greedy(10))[0]
        # (a budget of B = 64: request 0's chunks are 0-64, 64-128 and 128-155, none longer than 64 tokens, so it keeps
        # no prompt snapshot; request 1 stops at the junction, 128, and keeps the state there for the next ones)
        assert out.num_cached_tokens == (128 if i >= 2 else 0)
        assert_matches_oracle(oracle, prompt, out.outputs[0], f"system prompt, request {i}")
    first = prompt_of(70, seed=95)
    said = gpu.generate({"prompt_token_ids": first}, greedy(12))[0].outputs[0].token_ids
    second = first + said + prompt_of(9, seed=96)
    out = gpu.generate({"prompt_token_ids": second}, greedy(10))[0]
    assert out.num_cached_tokens >= len(first) + len(said) - 1
    assert_matches_oracle(oracle, second, out.outputs[0], "second turn")
    prompts = [system + prompt_of(4 + i, seed=100 + i) for i in range(12)] + [second + [5]]
    outs = run_all(gpu, prompts, greedy(12))
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        assert_matches_oracle(oracle, p, o, f"together, request {i}")
    gpu.llm_engine.scheduler.cache.clear()
    no_leaks(gpu)


@pytest.mark.parametrize("budget", [4096, 100])
def test_the_same_prompt_again_resumes_from_its_prompt_snapshot(ckpt, oracle, budget, monkeypatch):
    """Prompt snapshots on the CUDA backend (kda_prefill_state writes the state 64 tokens apart from the chunk's start
    into a reserved slot during the step): the same 300-token prompt sent again resumes at 256 (one chunk) or at 264
    (a budget of 100: chunks 0-100, 100-200, 200-300; a partial page of 64 copied), and a longer one that starts with
    it too; every token the oracle's, and the entry's conv history and state those of a prefill of its tokens alone
    in the chunks the request computed them in (other chunks round the KDA outputs otherwise, and so every later
    layer's input) within bf16 noise: 2e-2 of the largest conv entry, 1e-2 RMS of the state (the reference's steps
    have fewer rows, so cuBLAS may tile the projections otherwise; whether they are equal bit for bit is printed;
    tests/kernels/test_kda_prefill.py::test_kda_prefill_snapshot checks the kernel bit for bit on equal inputs)."""
    from kda_rt.cuda.runner import CudaRunner

    monkeypatch.setenv("KDA_RT_PROMPT_SNAPSHOTS", "1")
    monkeypatch.setattr(CudaRunner, "writes_snapshots", True)  # (off by default until this test has passed on a GPU)
    gpu = LLM(ckpt, backend="cuda", max_num_seqs=4, max_model_len=1024, num_blocks=60, max_num_batched_tokens=budget,
              prefill_tail_tokens=0, enable_prefix_caching=True, prefix_cache_states=4)
    prompt, at = prompt_of(300, seed=150), (256 if budget == 4096 else 264)
    for i in range(2):
        out = gpu.generate({"prompt_token_ids": prompt}, greedy(10))[0]
        assert out.num_cached_tokens == (at if i else 0), (i, out.num_cached_tokens)
        assert_matches_oracle(oracle, prompt, out.outputs[0], f"budget {budget}, request {i}")
    cache = gpu.llm_engine.scheduler.cache
    snap = next(e for e in cache._lru if e.prompt)
    assert len(snap.tokens) == at
    runner = gpu.llm_engine.runner
    slot = gpu.llm_engine.scheduler.slots.allocate()[0]  # (a prefill of the entry's tokens alone into a free slot)
    pages = gpu.llm_engine.scheduler.allocate_pages(-(-at // 64))
    from kda_rt.engine.batch import ForwardBatch

    # (the entry's tokens in the chunks the request computed them in: 0-256, or 0-100, 100-200 and 200-264, so every
    # KDA layer's input, and so the conv history of the layers after the first, is the one the snapshot saw)
    cuts = [0, at] if budget == 4096 else [0, 100, 200, at]
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        runner.score(ForwardBatch.build([list(snap.tokens[a:b])], [a], [slot], [pages], all_logits=True))
    for layer, (conv, rec) in runner.kda_pools.items():
        u16 = conv.view(np.uint16)  # (bf16 by its bits)
        same = bool((u16[snap.snapshot] == u16[slot]).all())
        got, want = conv[snap.snapshot].astype(np.float64), conv[slot].astype(np.float64)
        conv_err = float(abs(got - want).max() / abs(want).max())
        got, want = rec[snap.snapshot].astype(np.float64), rec[slot].astype(np.float64)
        err = float(((got - want) ** 2).mean() ** 0.5 / (want**2).mean() ** 0.5)
        print(f"budget {budget}, layer {layer}: conv history {'bit for bit' if same else f'max rel {conv_err:.2e}'}, "
              f"state rms rel {err:.2e}")
        assert conv_err <= 2e-2 and err <= 1e-2, f"layer {layer}: conv max rel {conv_err:.2e}, state rms {err:.2e}"
    gpu.llm_engine.scheduler.slots.release([slot])
    gpu.llm_engine.scheduler.pages.release(pages)
    longer = prompt + prompt_of(20, seed=151)
    out = gpu.generate({"prompt_token_ids": longer}, greedy(10))[0]
    assert out.num_cached_tokens >= at
    assert_matches_oracle(oracle, longer, out.outputs[0], f"budget {budget}, longer")
    cache.clear()
    no_leaks(gpu)


def test_prefix_cache_samples_share_their_prompt(ckpt, oracle):
    """n = 3 samples of one prompt with prefix caching: the first computes the prompt up to its last page boundary
    and keeps the state there, the other two resume from it (one snapshot into two slots in one gather): every
    sample's tokens are the oracle's."""
    gpu = LLM(ckpt, backend="cuda", max_num_seqs=4, max_model_len=1024, num_blocks=40, max_num_batched_tokens=B,
              enable_prefix_caching=True, prefix_cache_states=2)
    prompt = prompt_of(150, seed=140)  # (the junction at 128)
    out = gpu.generate({"prompt_token_ids": prompt}, greedy(8, n=3))[0]
    assert gpu.stats()["prefix_cache_hits"] == 2 * 128
    for i, o in enumerate(out.outputs):
        assert_matches_oracle(oracle, prompt, o, f"sample {i}")
    gpu.llm_engine.scheduler.cache.clear()
    no_leaks(gpu)


def test_priority_and_cache_salts_under_a_tiny_pool(ckpt, oracle):
    """The sixtieth session's engine changes on the CUDA backend: priority scheduling (preemption takes the least
    urgent; a preempted request goes back to its place in the queue), requests in two cache salts sharing starts (they
    resume only within their salt), metrics stamps: every token still the oracle's, no leaks."""
    gpu = LLM(ckpt, backend="cuda", max_num_seqs=6, max_model_len=160, block_size=16, num_blocks=10,
              max_num_batched_tokens=B, enable_prefix_caching=True, prefix_cache_states=3,
              scheduling_policy="priority")
    starts = [prompt_of(n, seed=210 + n) for n in (20, 35)]
    prompts = [starts[i % 2] + prompt_of(3 + i, seed=220 + i) for i in range(10)]
    given = [{"prompt_token_ids": p, "cache_salt": "ab"[i % 3 % 2]} for i, p in enumerate(prompts)]
    outs = gpu.generate(given, greedy(12), priority=[(i * 7) % 5 - 2 for i in range(len(prompts))])
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        assert_matches_oracle(oracle, p, o.outputs[0], f"priority + salts, request {i}")
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    s = gpu.stats()
    print(f"priority + salts: {s['prefix_cache_hits']} tokens resumed, {s['preemptions']} preemptions")
    assert s["preemptions"] > 0, s
    no_leaks(gpu)


def test_prefix_cache_under_a_tiny_pool(ckpt, oracle):
    """Entries evicted for pages, sequences preempted, async steps ahead: every token still the oracle's.  (Pages of
    16 and three snapshot slots: with pages of 64, 9 of them and two slots the requests' ends evict each junction
    before a request that shares it is admitted: nothing is resumed, as on the NumPy backend.)"""
    gpu = LLM(ckpt, backend="cuda", max_num_seqs=6, max_model_len=160, block_size=16, num_blocks=10,
              max_num_batched_tokens=B, enable_prefix_caching=True, prefix_cache_states=3)
    starts = [prompt_of(n, seed=110 + n) for n in (20, 35, 50)]
    prompts = [starts[i % 3] + prompt_of(3 + i, seed=120 + i) for i in range(12)]
    for _ in range(2):
        outs = run_all(gpu, prompts, greedy(12))
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
            assert_matches_oracle(oracle, p, o, f"tiny pool, request {i}")
    s = gpu.stats()
    print(f"tiny pool: {s['prefix_cache_hits']} tokens resumed, {s['preemptions']} preemptions")
    assert s["prefix_cache_hits"] > 0 and s["preemptions"] > 0, s


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_prefix_cache_equals_the_same_chunks_bit_for_bit(ckpt, quantization):
    """A request resumed at a junction runs the chunks the uncached engine runs when its budget ends the first chunk
    there: the tokens and logprobs are equal bit for bit (the restored state and pages are the computed ones), also
    with fp8 experts (prefix caching is on by default for both)."""
    if quantization == "fp8":
        from kda_rt.cuda.ops.compile import arch_number, device_arch

        if arch_number(device_arch()) < 89:
            pytest.skip("e4m3 weights need sm_89 or newer")
    kw = dict(backend="cuda", max_num_seqs=2, max_model_len=1024, max_num_batched_tokens=128, prefill_tail_tokens=0,
              quantization=quantization)
    system = prompt_of(140, seed=130)  # the junction at 128
    prompts = [system + prompt_of(20 + i, seed=131 + i) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    plain = LLM(ckpt, enable_prefix_caching=False, **kw)
    want = [plain.generate({"prompt_token_ids": p}, params)[0].outputs[0] for p in prompts]
    del plain
    cached = LLM(ckpt, enable_prefix_caching=True, **kw)
    got = [cached.generate({"prompt_token_ids": p}, params)[0] for p in prompts]
    assert got[2].num_cached_tokens == 128
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.token_ids and g.outputs[0].logprobs == w.logprobs


def test_prompt_logprobs_reduced_on_the_gpu(ckpt, monkeypatch):
    """`SamplingParams(prompt_logprobs=N)` on the CUDA runner reduces the prompt's logits on the GPU
    (`score_logprobs`: the final hidden rows projected by lm_head SCORE_ROWS at a time, each chunk reduced by
    sampler/prompt_logprobs.py with CuPy; only logprob, rank and top N come back).  The chunks' logits are captured
    in the same prefill (a second one need not repeat it bit for bit) and reduced again by the NumPy path: logprobs
    and top logprobs within 1e-12 (the GPU's float64 sums in another order), the same ranks, top ids that hold
    those logprobs.  A 300-token prompt at 128 rows a chunk (1024 by default: three chunks, the last one short), the
    targets the prompt's next tokens; against a second prefill's `LLM.score` logits within bf16 noise (the same
    model); `LLM.prompt_logprobs`'s dicts built from the rows; a one-token prompt has none."""
    import kda_rt.cuda.runner as runner_mod
    import kda_rt.sampler.prompt_logprobs as pl

    monkeypatch.setattr(runner_mod, "SCORE_ROWS", 128)
    chunks = []
    real = pl.prompt_logprob_rows

    def spy(logits, targets, num, xp=np):
        got = real(logits, targets, num, xp=xp)
        if xp is not np:
            chunks.append((logits.get(), xp.asnumpy(xp.asarray(targets)), got))
        return got

    monkeypatch.setattr(pl, "prompt_logprob_rows", spy)
    gpu = LLM(ckpt, backend="cuda", max_num_seqs=2, max_model_len=1024, num_blocks=40)
    assert gpu.prompt_logprobs({"prompt_token_ids": [5]}, 3) == ([None], [None])
    ids, num = prompt_of(300, 41), 4
    rows = gpu.llm_engine.prompt_logprob_rows(ids, num)
    assert [c[0].shape[0] for c in chunks] == [128, 128, 43]
    np.testing.assert_array_equal(np.concatenate([c[1] for c in chunks]), ids[1:])
    for logits, targets, got in chunks:
        want = real(logits, targets, num)
        np.testing.assert_allclose(got.logprob, want.logprob, rtol=0, atol=1e-12)
        np.testing.assert_array_equal(got.rank, want.rank)
        np.testing.assert_allclose(got.top_logprobs, want.top_logprobs, rtol=0, atol=1e-12)
        lp = logits.astype(np.float64) - logits.max(-1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
        np.testing.assert_allclose(np.take_along_axis(lp, got.top_ids, -1), got.top_logprobs, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(rows.logprob, np.concatenate([c[2].logprob for c in chunks]))
    again = gpu.score(ids).astype(np.float64)[:-1]  # (a second prefill: the same model, bf16 noise apart)
    np.testing.assert_allclose(np.concatenate([c[0] for c in chunks]), again, rtol=0,
                               atol=TOL * 3 * float(np.abs(again).max()))
    dicts, ranks = gpu.prompt_logprobs({"prompt_token_ids": ids}, num)
    assert dicts[0] is None and ranks[0] is None and len(dicts) == len(ids) == len(ranks)
    assert all(ids[i] in dicts[i] and num <= len(dicts[i]) <= num + 1 for i in range(1, len(ids)))
