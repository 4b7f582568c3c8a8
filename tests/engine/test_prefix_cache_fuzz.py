"""A seeded fuzz of prefix caching through the engine: requests sharing starts cut at and around page boundaries (one
token before and after, a prompt that is another's prefix, another's plus a token, a chat's next turn after its
answer), arriving over the steps, some aborted, some stopped by a token of their answer, with `n` > 1, seeded
sampling, logit_bias and penalties, priorities, `cache_salt`, `reset_prefix_cache` and `score()` mid-run, injected
launch and collect failures, on tiny token budgets, page pools and snapshot counts, synchronous and async scheduling
(the KDA_RT_ASYNC_* switches drawn too); a few seeds with a page hash that collides for half of all prefixes.

Every finished request equals the uncached engine's (tokens, finish and stop reasons exactly; logprobs to 1e-9: a
prefix computed in other chunks rounds differently in the last float64 bits); after every step every page has
exactly its holders and each snapshot slot is an entry's or free; once the workload ends no seat, state slot or
page is held by a sequence.  Each workload runs twice on one engine (the second meets the first's entries).  It
catches an end entry keyed without the token a step launched ahead folded in, a partial page not copied on a hit
and a lookup that trusts the page hash.  Tiny checkpoint, NumPy backend, float64; under 60 s in all."""

from __future__ import annotations

import random

import numpy as np
import pytest

from helpers.engine import make_llm
from kda_rt import SamplingParams
from kda_rt.engine import batch, scheduler
from kda_rt.engine.prefix_cache import PrefixCache

_ENV = ("KDA_RT_ASYNC_PREFILL", "KDA_RT_ASYNC_WAITING", "KDA_RT_ASYNC_ENDING", "KDA_RT_ASYNC_GRAMMAR",
        "KDA_RT_PROMPT_SNAPSHOTS")


def _key(completion) -> tuple:
    return (completion.token_ids, completion.finish_reason, completion.stop_reason,
            [{t: round(float(v), 9) for t, v in lp.items()} for lp in completion.logprobs or ()])


def _workload(seed: int) -> tuple[dict, dict, list[dict], set[int], set[int], tuple[int, int]]:
    """(engine settings, environment, requests, steps that reset the cache, steps that score a prompt, (every how
    many launches, collects) an injected failure comes, 0: none)."""
    rng = random.Random(seed)
    bs = rng.choice([16, 16, 32])
    cfg = dict(max_num_seqs=rng.choice([1, 2, 3, 5]), max_model_len=rng.choice([64, 80, 128]), block_size=bs,
               num_blocks=rng.choice([None, 6, 8, 12]), max_num_batched_tokens=rng.choice([1, 2, 5, 16, 17, 40, 128]),
               async_scheduling=rng.random() < 0.6, prefix_cache_states=rng.choice([1, 2, 3, 8, 8]),
               scheduling_policy=rng.choice(["fcfs", "fcfs", "priority"]), prefill_tail_tokens=rng.choice([None, 0, 3]))
    if cfg["num_blocks"] is not None:  # (at least one sequence of max_model_len fits)
        cfg["num_blocks"] = max(cfg["num_blocks"], -(-cfg["max_model_len"] // bs))
    if (cfg["prefill_tail_tokens"] or 0) > cfg["max_num_batched_tokens"]:
        cfg["prefill_tail_tokens"] = 0
    env = {name: rng.choice(["0", "1"]) for name in _ENV}
    limit = cfg["max_model_len"]
    stems = [[rng.randrange(3, 512) for _ in range(70)] for _ in range(3)]
    reqs: list[dict] = []
    for _ in range(rng.randint(4, 14)):
        max_tokens, kind = rng.randint(1, 8), rng.random()
        if kind < 0.45:  # a shared start cut at or next to a page boundary, maybe with tokens of its own
            cut = rng.choice([bs - 1, bs, bs + 1, 2 * bs - 1, 2 * bs, 2 * bs + 1, 47, 48, 49, rng.randint(1, 70)])
            prompt = rng.choice(stems)[:cut] + [rng.randrange(3, 512) for _ in range(rng.choice([0, 0, 1, 2, 5]))]
        elif kind < 0.75 and reqs:  # a chat's next turn: an earlier request's prompt and answer, and more
            prompt = ("turn", rng.randrange(len(reqs)), [rng.randrange(3, 512) for _ in range(rng.randint(0, 18))])
        elif kind < 0.85 and any(isinstance(r["prompt"], list) for r in reqs):  # another's prefix, or it and one more
            other = rng.choice([r["prompt"] for r in reqs if isinstance(r["prompt"], list)])
            prompt = other[: rng.randint(1, len(other))] if rng.random() < 0.5 else other + [rng.randrange(3, 512)]
        else:
            prompt = [rng.randrange(3, 512) for _ in range(rng.randint(1, 70))]
        if isinstance(prompt, list):
            prompt = prompt[: limit - max_tokens] or [5]
        if rng.random() < 0.5:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                    logprobs=rng.choice([None, 2]))
        else:
            params = SamplingParams(temperature=0.9, top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(1000),
                                    max_tokens=max_tokens, ignore_eos=rng.random() < 0.7, n=rng.choice([1, 1, 2, 3]),
                                    logprobs=rng.choice([None, 1]))
        if rng.random() < 0.15:
            params.stop_token_ids = [rng.randrange(3, 512) for _ in range(20)]
        if rng.random() < 0.1:
            params.logit_bias = {rng.randrange(3, 512): 5.0}
        if rng.random() < 0.1:
            params.repetition_penalty, params.min_tokens = 1.2, min(max_tokens, 2)
        at = rng.randint(0, 12) if isinstance(prompt, list) else reqs[prompt[1]]["at"] + rng.randint(4, 24)
        reqs.append(dict(prompt=prompt, params=params, at=at, stop_at=rng.randint(0, 7) if rng.random() < 0.4 else None,
                         abort=rng.randint(0, 6) if rng.random() < 0.12 else None,
                         priority=rng.randint(-1, 1) if cfg["scheduling_policy"] == "priority" else 0,
                         salt=rng.choice([None, None, None, "a", "b"])))
    resets = {rng.randint(0, 15) for _ in range(rng.choice([0, 0, 1, 2]))}
    scores = {rng.randint(0, 15) for _ in range(rng.choice([0, 0, 1, 3]))}
    return cfg, env, reqs, resets, scores, (rng.choice([0, 0, 0, 4, 7]), rng.choice([0, 0, 0, 5]))


def _inject_failures(runner, every_launch: int, every_collect: int) -> None:
    """A few launches (after the forward ran) and collects raise: the engine recomputes their sequences."""
    calls = {"launch": 0, "collect": 0}
    for name, every in (("launch", every_launch), ("collect", every_collect)):
        if not every:
            continue
        inner = getattr(runner, name)

        def flaky(*a, _inner=inner, _name=name, _every=every, **k):
            out = _inner(*a, **k)
            calls[_name] += 1
            if calls[_name] in (_every, 3 * _every, 5 * _every):
                raise RuntimeError("injected failure")
            return out

        setattr(runner, name, flaky)


def _check_holders(llm) -> None:
    """Every page held by exactly its holders (running sequences and entries), the pages only entries hold counted as
    reclaimable, every snapshot slot an entry's, reserved by a sequence for its prompt snapshot, or free, the resumed
    count true."""
    eng = llm.llm_engine
    sched, cache = eng.scheduler, eng.scheduler.cache
    holders: dict[int, int] = {}
    for page in [p for s in sched.running for p in s.blocks] + [p for e in cache._lru for p in e.pages]:
        holders[page] = holders.get(page, 0) + 1
    assert set(holders) == sched.pages.used_ids()
    assert all(cache._holders.get(p, 1) == h for p, h in holders.items())
    only = {p for e in cache._lru for p in e.pages} - {p for s in sched.running for p in s.blocks}
    assert cache.reclaimable == len(only)
    reserved = [s.prompt_snapshot[1] for s in sched.running if s.prompt_snapshot is not None]
    assert sorted(cache._free_snapshots + [e.snapshot for e in cache._lru] + reserved) == \
        sorted(sched.config.snapshot_slots)
    assert cache._num_resumed == sum(e.resumed for e in cache._lru) <= cache._max_resumed


def _colliding_chain(self, tokens, num_pages, chain=None, salt=None):
    """`PrefixCache._chain` with one bit a page: half of all prefixes collide (a lookup, an insert and a junction must
    never trust a hash alone)."""
    out = [int(salt is not None)] if chain is None else chain
    for j in range(len(out) - 1, num_pages):
        out.append((out[-1] + sum(tokens[j * self.block_size:(j + 1) * self.block_size])) % 2)
    return out


@pytest.mark.parametrize("seed, colliding", [(s, False) for s in range(20)] + [(s, True) for s in range(20, 26)])
def test_cached_runs_equal_uncached_ones_and_hold_nothing_after(tiny_dir, seed, colliding, monkeypatch):
    cfg, env, reqs, resets, scores, (every_launch, every_collect) = _workload(seed)
    if colliding:
        monkeypatch.setattr(PrefixCache, "_chain", _colliding_chain)
    # prompt snapshots every 16 tokens of a chunk (the kernels' 64 outgrows these prompts; the NumPy model keeps a
    # state anywhere): most prompts make one
    monkeypatch.setattr(scheduler, "SNAPSHOT_ALIGN", 16)
    monkeypatch.setattr(batch, "SNAPSHOT_ALIGN", 16)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    plain = make_llm(tiny_dir, enable_prefix_caching=False, **{k: v for k, v in cfg.items()
                                                                if k != "prefix_cache_states"})
    cached = make_llm(tiny_dir, enable_prefix_caching=True, **cfg)
    want, answers = {}, {}
    for i, r in enumerate(reqs):
        if isinstance(r["prompt"], tuple):  # (a turn after request j: its prompt, its first answer, more)
            _, j, more = r["prompt"]
            r["prompt"] = (reqs[j]["prompt"] + list(answers[j]) + more)[: cfg["max_model_len"] - r["params"].max_tokens]
        out = plain.generate({"prompt_token_ids": r["prompt"]}, r["params"])[0]
        if r["stop_at"] is not None:  # (stopped by a token of its answer: its last step launched ahead computed it)
            said = out.outputs[0].token_ids
            r["params"].stop_token_ids = [said[min(r["stop_at"], len(said) - 1)]]
            out = plain.generate({"prompt_token_ids": r["prompt"]}, r["params"])[0]
        answers[i], want[f"r{i}"] = out.outputs[0].token_ids, [_key(o) for o in out.outputs]
    eng = cached.llm_engine
    _inject_failures(eng.runner, every_launch, every_collect)
    for _ in range(2):  # (the second round meets the first one's entries)
        finals, step = {}, 0
        while step <= max(r["at"] for r in reqs) or eng.has_unfinished_requests() or eng.has_pending_step():
            for i, r in enumerate(reqs):
                if r["at"] == step:
                    prompt = {"prompt_token_ids": r["prompt"], **({"cache_salt": r["salt"]} if r["salt"] else {})}
                    eng.add_request(f"r{i}", prompt, r["params"], output_kind="final", priority=r["priority"])
                if r["abort"] is not None and r["at"] + r["abort"] == step:
                    eng.abort(f"r{i}")
            if step in resets:
                cached.reset_prefix_cache()
            if step in scores:
                ids = reqs[step % len(reqs)]["prompt"]
                try:
                    got = eng.score(ids)
                except RuntimeError as exc:  # (no room while requests run, or an injected collect failure)
                    assert "score() needs" in str(exc) or "injected" in str(exc), exc
                else:
                    np.testing.assert_array_equal(got, plain.llm_engine.score(ids))
            try:
                finals.update({o.request_id: o for o in eng.step() if o.finished})
            except RuntimeError as exc:
                assert "injected" in str(exc)
            _check_holders(cached)
            step += 1
            assert step < 3000, "no progress"
        for i, r in enumerate(reqs):
            if r["abort"] is None:
                assert [_key(o) for o in finals[f"r{i}"].outputs] == want[f"r{i}"], (seed, i, r)
        stats = cached.stats()
        assert stats["running"] == stats["waiting"] == stats["slots_used"] == stats["pages_used"] == 0, stats
    _check_holders(cached)
    cached.llm_engine.scheduler.cache.clear()
    assert eng.scheduler.pages.num_used == 0 and eng.scheduler.slots.num_used == 0
