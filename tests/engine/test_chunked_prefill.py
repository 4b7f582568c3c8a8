"""Chunked prefill: any token budget gives the logits of one full prefill, and the flat batch
carries exactly the metadata the kernels read."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.engine import assert_no_leaks, greedy, make_llm, mixed_prompts
from kda_rt.engine.batch import ForwardBatch


class RecordingRunner:
    """Records every batch and logits block of a NumPy runner's forward (patched on the instance)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.batches: list[ForwardBatch] = []
        self.logits: list[np.ndarray] = []
        self._forward = runner.forward
        runner.forward = self.forward

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        out = self._forward(batch)
        self.batches.append(batch)
        self.logits.append(out)
        return out

    def close(self) -> None:
        del self.runner.forward


def sampled_logits(llm, prompt: list[int], n: int) -> tuple[np.ndarray, RecordingRunner]:
    """[n, V] logits each generated token was sampled from (one request alone)."""
    rec = RecordingRunner(llm.llm_engine.runner)
    try:
        out = llm.generate({"prompt_token_ids": prompt}, greedy(n))[0]
    finally:
        rec.close()
    rows = np.concatenate([x for x in rec.logits if x.shape[0]], axis=0)
    assert rows.shape[0] == n and len(out.outputs[0].token_ids) == n
    return rows, rec


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-6), ("float32", 2e-5)], ids=["f64", "f32"])
def test_chunk_budgets_match_full_prefill(tiny_dir, dtype, tol):
    prompt = mixed_prompts(1, seed=3, lo=45, hi=45)[0]
    full_llm = make_llm(tiny_dir, dtype=dtype, max_model_len=96, block_size=16, max_num_seqs=1)
    full, rec = sampled_logits(full_llm, prompt, 6)
    assert rec.batches[0].num_tokens == 45  # one prefill
    np.testing.assert_allclose(full[0], full_llm.score(prompt)[-1], rtol=0, atol=tol)
    for budget in (1, 2, 5, 16, 33):
        llm = make_llm(tiny_dir, dtype=dtype, max_model_len=96, block_size=16, max_num_seqs=1,
                       max_num_batched_tokens=budget)
        got, rec = sampled_logits(llm, prompt, 6)
        assert len(rec.batches) == -(-45 // budget) + 5
        assert all(b.logits_indices.size == 0 for b in rec.batches[: -(-45 // budget) - 1])  # mid-prompt chunks
        err = np.abs(got - full).max()
        assert err <= tol, f"budget {budget}: max abs logits error {err:.3g} > {tol}"
        assert_no_leaks(llm)


def test_flat_batch_metadata(tiny_dir):
    """A mixed step: one decode, one prefill chunk that ends its prompt, one mid-prompt chunk (synchronous steps: with
    async scheduling the step after the first is launched before b and c arrive, and they join the one after)."""
    llm = make_llm(tiny_dir, max_model_len=96, block_size=16, max_num_seqs=3, max_num_batched_tokens=40,
                   async_scheduling=False)
    engine = llm.llm_engine
    rec = RecordingRunner(engine.runner)
    engine.add_request("a", {"prompt_token_ids": list(range(10, 30))}, greedy(4))  # 20 tokens
    engine.step()  # a: whole prompt
    engine.add_request("b", {"prompt_token_ids": list(range(40, 50))}, greedy(4))  # 10 tokens
    engine.add_request("c", {"prompt_token_ids": list(range(60, 100))}, greedy(4))  # 40 tokens
    engine.step()  # a decodes (1), b whole (10), c first 29 tokens
    b = rec.batches[-1]
    a_seq = engine.requests["a"][1][0]
    assert b.cu_seqlens.tolist() == [0, 1, 11, 40]
    assert b.context_lens.tolist() == [20, 0, 0]
    assert b.input_ids[:2].tolist() == [a_seq.output_token_ids[0], 40]
    assert b.input_ids[11:14].tolist() == [60, 61, 62]
    assert b.is_prefill.tolist() == [False, True, True]
    assert b.logits_indices.tolist() == [0, 10]  # c is mid-prompt: no row
    assert rec.logits[-1].shape == (2, llm.model_config.vocab_size)
    assert len(set(b.state_slots.tolist())) == 3
    tables = [set(row[row >= 0].tolist()) for row in b.block_tables]
    assert [len(t) for t in tables] == [2, 1, 2] and not (tables[0] & tables[1] or tables[1] & tables[2])
    engine.step()  # c: last 11 tokens, context 29
    b = rec.batches[-1]
    assert b.context_lens.tolist()[-1] == 29 and b.seq_lens.tolist()[-1] == 11
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(llm)


def test_prefill_tail_tokens_finish_prompts_a_step_sooner(tiny_dir):
    """Four 32-token prompts under a 64-token budget: the first two prompts' decodes take 2 tokens of the second
    step, so without a tail the last prompt's final 2 tokens wait for a third step; with prefill_tail_tokens
    (default budget // 64, here 1: too small; 8 given) the second step takes them, the run has one step fewer,
    every step stays within budget + tail, and the greedy tokens are the same (float64)."""
    prompts = mixed_prompts(4, seed=9, lo=32, hi=32)
    runs = {}
    for tail in (None, 0, 8):
        llm = make_llm(tiny_dir, max_model_len=96, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                       **({} if tail is None else {"prefill_tail_tokens": tail}))
        assert llm.llm_engine.scheduler.config.prefill_tail_tokens == (1 if tail is None else tail)
        rec = RecordingRunner(llm.llm_engine.runner)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(3))
        finally:
            rec.close()
        sizes = [b.num_tokens for b in rec.batches]
        assert max(sizes) <= 64 + (tail or 0), sizes
        runs[tail] = ([o.outputs[0].token_ids for o in outs], sizes)
        assert_no_leaks(llm)
    assert runs[None][1] == runs[0][1]
    assert len(runs[8][1]) == len(runs[0][1]) - 1, (runs[0][1], runs[8][1])
    assert runs[8][0] == runs[0][0]
