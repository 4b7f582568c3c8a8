"""tests/helpers/full_model.decode_full_batch (the device scripts' graph replays repeat its last launch) on the
NumPy backend: its last launch is a decode step of every sequence, also when the prompts enter over several
chunked steps, and it leaves nothing behind."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.engine import assert_no_leaks, make_llm
from helpers.full_model import decode_full_batch


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_last_launch_is_a_full_decode_batch(tiny_dir, async_scheduling):
    # 6 prompts of 40 tokens at 96-token steps: they enter over three steps, so a run to completion would end on
    # steps of 4 and 2 sequences
    llm = make_llm(tiny_dir, max_num_seqs=6, max_num_batched_tokens=96, max_model_len=128,
                   async_scheduling=async_scheduling)
    engine = llm.llm_engine
    launches = []
    runner = engine.runner
    for name in ("launch", "execute"):
        inner = getattr(runner, name, None)
        if inner is not None:
            def spy(batch, *a, _inner=inner, **k):
                launches.append((batch.num_seqs, bool(np.all(batch.seq_lens == 1))))
                return _inner(batch, *a, **k)
            setattr(runner, name, spy)
    steps = decode_full_batch(engine, 6, 40, seed=3)
    assert steps >= 4, steps  # three prompt steps at least, then the full decode step
    assert launches[-1] == (6, True), launches
    assert launches[0][1] is False and any(n < 6 for n, _ in launches), launches  # chunked entry happened
    assert not engine.has_pending_step() and not engine.has_unfinished_requests()
    assert_no_leaks(llm)


def test_refuses_what_does_not_fit(tiny_dir):
    engine = make_llm(tiny_dir, max_num_seqs=4, max_num_batched_tokens=96, max_model_len=64).llm_engine
    with pytest.raises(ValueError, match="decode_full_batch: 8 x"):
        decode_full_batch(engine, 8, 16)
    with pytest.raises(ValueError, match="max_model_len 64"):
        decode_full_batch(engine, 2, 60)
