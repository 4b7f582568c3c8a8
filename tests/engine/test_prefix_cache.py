"""Prefix caching (`enable_prefix_caching`): a request that resumes after a cached prefix (the KDA state copied from
a snapshot slot, the MLA pages shared or copied) gets the tokens it gets without the cache, through shared system
prompts, chat turns, preemption, eviction, aborts, failed steps and async scheduling; pages and slots are never
lost.  Tiny checkpoint, NumPy backend, float64 so that where a prompt's chunks end cannot flip an argmax."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.engine import assert_no_leaks, greedy, make_llm, mixed_prompts
from kda_rt import SamplingParams
from kda_rt.engine import EngineConfig
from kda_rt.engine.allocator import IdPool
from kda_rt.engine.pools import plan_pools
from kda_rt.engine.prefix_cache import PrefixCache

KW = dict(max_num_seqs=4, max_model_len=256, block_size=16)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


def _key(out):
    """What must be equal: every sample's tokens, finish and its logprobs (rounded: a prefix computed in other chunks
    rounds differently in the last float64 bits)."""
    return [(o.token_ids, o.finish_reason, o.stop_reason,
             [{t: round(float(v), 9) for t, v in lp.items()} for lp in o.logprobs or ()]) for o in out.outputs]


def _no_leaks(llm) -> None:
    """Every page and slot back once the cache lets go of its entries (and the resumed count true before)."""
    cache = llm.llm_engine.scheduler.cache
    assert cache._num_resumed == sum(e.resumed for e in cache._lru) <= cache._max_resumed
    cache.clear()
    assert_no_leaks(llm)


def _fail_launches(runner, every: int) -> None:
    """Every `every`-th launch of `runner` raises after the runner ran it (its forward done); `del runner.launch`
    undoes it."""
    inner, calls = runner.launch, [0]

    def flaky(*a, **k):
        out = inner(*a, **k)
        calls[0] += 1
        if calls[0] % every == 0:
            raise RuntimeError("injected failure after launch")
        return out

    runner.launch = flaky


def _step(eng, finals: dict) -> int:
    """One step of `eng`, its finished outputs into `finals`; 1 if it raised the injected failure, else 0."""
    try:
        finals.update({o.request_id: o for o in eng.step() if o.finished})
    except RuntimeError as exc:
        assert "injected" in str(exc)
        return 1
    return 0


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return make_llm(tiny_dir, enable_prefix_caching=False, **KW)


# -- the cache alone ---------------------------------------------------------------------------


def test_longest_prefix_shared_pages_and_their_holders():
    pages = IdPool(12, "page")
    cache = PrefixCache(4, [100, 101], pages)
    seq_pages = pages.allocate(3)  # a sequence of 10 tokens: pages 0, 1, 2 (the last one half full)
    toks = list(range(10, 20))
    a = cache.insert(toks[:6], slot=7, pages=seq_pages)  # a junction after 6 tokens: pages 0 and 1
    assert a is not None and a.pages == seq_pages[:2] and cache.take_ops() == [("slot", [7], [100])]
    assert cache.insert(toks[:6], slot=7, pages=seq_pages) is None  # already cached
    cache.release(seq_pages)  # the sequence ends without an entry of its own: page 2 free, 0 and 1 the entry's
    assert pages.num_free == 10 and cache.reclaimable == 2
    assert cache.lookup(toks, limit=9) is a and cache.lookup(toks[:5], limit=4) is None
    assert cache.lookup(toks[:3] + [99] + toks[4:], limit=9) is None  # (a token differs inside the prefix)
    new = []
    got = cache.restore(a, slot=3, new_page=lambda: new.append(pages.allocate(1)[0]) or new[-1])
    assert got == [seq_pages[0], new[0]]
    assert cache.take_ops() == [("slot", [100], [3]), ("page", [seq_pages[1]], [new[0]])]
    assert cache.reclaimable == 1  # (page 0 is the new sequence's too now)
    b = cache.insert(toks[:9], slot=3, pages=got + pages.allocate(1))  # longer, shares page 0 with `a`
    assert cache.lookup(toks, limit=9) is b and cache.lookup(toks, limit=8) is a
    cache.release(got + [b.pages[-1]])
    assert pages.num_free == 8 and cache.reclaimable == 4  # a's pages 0, 1 and b's 0, 3 (the copy), 4
    cache.reclaim(9)  # b goes first (a was looked up last): its pages 3 and 4 free; page 0 stays a's
    assert cache.num_entries == 1 and pages.num_free == 10 and cache.reclaimable == 2
    cache.reclaim(12)
    assert cache.num_entries == 0 and pages.num_free == 12 and cache.reclaimable == 0


def test_snapshots_are_reused_least_recently_used_first():
    pages = IdPool(8, "page")
    cache = PrefixCache(4, [50], pages)
    first = cache.insert([1, 2, 3, 4], slot=0, pages=pages.allocate(1))
    second = cache.insert([5, 6, 7, 8], slot=1, pages=pages.allocate(1))  # one snapshot slot: `first` goes
    assert second.snapshot == first.snapshot == 50 and cache.num_entries == 1
    assert cache.lookup([1, 2, 3, 4, 9], limit=4) is None and cache.lookup([5, 6, 7, 8, 9], limit=4) is second
    assert cache.take_ops() == [("slot", [0], [50]), ("slot", [1], [50])]  # (two calls: the second overwrites)


def test_entries_resumed_from_outlive_the_ends_that_follow():
    """A burst sharing a start ends in as many entries as there are slots: the ends evict one another, not the
    shared start they resumed from (plain LRU evicted it with the last end); page reclaims keep the same order."""
    pages = IdPool(16, "page")
    cache = PrefixCache(4, [50, 51, 52], pages)
    first = pages.allocate(1)
    shared = cache.insert([1, 2, 3, 4], slot=0, pages=first, junction=True)
    cache.release(first)
    cache.release(cache.restore(shared, slot=1, new_page=lambda: pages.allocate(1)[0]))
    ends = []
    for i in range(4):  # (each a sequence of 5 tokens that ends: its 2 pages then held by its entry alone)
        own = pages.allocate(2)
        ends.append(cache.insert([1, 2, 3, 4, 10 + i], slot=1, pages=own))
        cache.release(own)
    assert cache.lookup([1, 2, 3, 4, 9], limit=4) is shared and cache.num_entries == 3
    assert [e in cache._lru for e in ends] == [False, False, True, True]  # (the two oldest ends went)
    cache.reclaim(pages.num_free + 2)  # (the older end goes, before the shared start)
    assert shared in cache._lru and cache.num_entries == 2 and ends[3] in cache._lru
    cache.reclaim(16)
    assert cache.num_entries == 0 and pages.num_free == 16


def test_at_most_half_the_entries_count_as_resumed_and_a_chats_turn_stops_counting():
    pages = IdPool(16, "page")
    cache = PrefixCache(4, [50, 51, 52, 53], pages)  # (two may count as resumed)
    entries = [cache.insert([i, i, i, i], slot=0, pages=pages.allocate(1)) for i in range(4)]
    for e in entries[:3]:
        cache.release(cache.restore(e, slot=1, new_page=lambda: pages.allocate(1)[0]))
    assert [e.resumed for e in entries] == [False, True, True, False]  # (the first one restored no longer counts)
    assert cache._num_resumed == 2
    cache.demote(entries[1])
    cache.demote(entries[1])  # (twice: once counted)
    assert [e.resumed for e in entries] == [False, False, True, False] and cache._num_resumed == 1
    assert cache._victim() is entries[0]
    cache.evict(entries[2])
    assert cache._num_resumed == 0


def test_copy_runs_never_read_what_they_write():
    cache = PrefixCache(4, [], IdPool(1, "page"))
    cache.ops = [("slot", 1, 10), ("slot", 2, 11), ("slot", 10, 3), ("page", 5, 6), ("page", 7, 8), ("slot", 4, 12)]
    assert cache.take_ops() == [("slot", [1, 2], [10, 11]), ("slot", [10], [3]), ("page", [5, 7], [6, 8]),
                                ("slot", [4], [12])]


def test_a_junction_is_where_another_requests_prompt_parted():
    cache = PrefixCache(4, [0], IdPool(1, "page"))
    shared = list(range(100, 110))
    cache.remember(cache._chain(shared + [1, 2, 3], 3), "a")
    assert cache.junction(shared + [1, 2, 3], 0, 12, "a") == 0  # its own prompt (a recompute) is no junction
    assert cache.junction(shared + [7, 7, 7], 0, 12, "b") == 8  # parts from a's inside page 2: its start
    cache.remember(cache._chain(shared + [7, 7, 7], 3), "b")
    assert cache.junction(shared + [1, 2, 3], 0, 12, "a") == 8  # (b brought pages 0 and 1 too: a junction for a)
    assert cache.junction(shared + [7, 7, 7], 8, 12, "c") == 12  # b's whole prompt past where it resumes
    assert cache.junction(shared + [8, 8, 8], 8, 12, "d") == 0  # (parts where it resumes)


def test_entries_and_junctions_stay_within_their_salt():
    """An entry made under a cache salt is found only under that salt (same tokens, same page hashes otherwise), and
    prompts of different salts form no junction with each other."""
    pages = IdPool(12, "page")
    cache = PrefixCache(4, [100, 101, 102], pages)
    toks = list(range(10, 20))
    a = cache.insert(toks[:8], slot=7, pages=pages.allocate(2), salt="tenant-a")
    assert cache.lookup(toks, limit=9, salt="tenant-a") is a
    assert cache.lookup(toks, limit=9) is None and cache.lookup(toks, limit=9, salt="tenant-b") is None
    plain_entry = cache.insert(toks[:8], slot=8, pages=pages.allocate(2))  # the same tokens unsalted: its own entry
    assert plain_entry is not None and plain_entry is not a and cache.lookup(toks, limit=9) is plain_entry
    assert cache.insert(toks[:8], slot=9, pages=pages.allocate(2), salt="tenant-a") is None  # (already cached)
    shared = list(range(100, 110))
    cache.remember(cache._chain(shared + [1, 2, 3], 3, salt="tenant-a"), "a")
    assert cache.junction(shared + [7, 7, 7], 0, 12, "b", cache._chain(shared + [7, 7, 7], 3, salt="tenant-b")) == 0
    assert cache.junction(shared + [7, 7, 7], 0, 12, "c", cache._chain(shared + [7, 7, 7], 3)) == 0
    assert cache.junction(shared + [7, 7, 7], 0, 12, "d", cache._chain(shared + [7, 7, 7], 3, salt="tenant-a")) == 8


def test_a_salted_request_shares_only_with_its_salt(tiny_dir, plain):
    """vLLM's cache_salt in a prompt dict: a shared system prompt resumes only among requests of the same salt (an
    unsalted or otherwise salted request computes it again); every output equals the uncached engine's; a bad salt
    is refused by name and queues nothing."""
    rng = random.Random(5)
    system = _tokens(rng, 50)
    cached = make_llm(tiny_dir, enable_prefix_caching=True, prefix_cache_states=8, **KW)
    got = []
    for i, salt in enumerate(["a", "a", "a", "b", None, "b", "a"]):
        ids = system + _tokens(rng, 3 + i)
        prompt = {"prompt_token_ids": ids} if salt is None else {"prompt_token_ids": ids, "cache_salt": salt}
        out = cached.generate(prompt, greedy(4))[0]
        assert _key(out) == _key(plain.generate({"prompt_token_ids": ids}, greedy(4))[0])
        got.append(out.num_cached_tokens)
    # a: computed, parted (junction kept), resumed; b: computed (a's entry not its), None: computed; b parts from its
    # first at the junction only now (its second), a resumes again
    assert got == [0, 0, 48, 0, 0, 0, 48], got
    for bad in ("", 7):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            cached.generate({"prompt_token_ids": system, "cache_salt": bad}, greedy(2))
    _no_leaks(cached)


# -- the engine ----------------------------------------------------------------------------------


def test_a_shared_system_prompt_is_computed_twice_then_resumed(tiny_dir, plain):
    """The first request leaves nothing for the second (its state exists only at its end); the second stops its
    chunk where the two prompts part and keeps the state there; every later one resumes from it."""
    rng = random.Random(3)
    system = _tokens(rng, 50)  # 3 full pages of 16 and 2 tokens
    cached = make_llm(tiny_dir, enable_prefix_caching=True, prefix_cache_states=4, **KW)
    for i in range(5):
        prompt = {"prompt_token_ids": system + _tokens(rng, 3 + 4 * i)}
        params = greedy(6) if i % 2 else SamplingParams(temperature=0.9, seed=i, max_tokens=6, logprobs=2)
        want, got = plain.generate(prompt, params)[0], cached.generate(prompt, params)[0]
        assert _key(got) == _key(want)
        assert got.num_cached_tokens == (48 if i >= 2 else 0)
    stats = cached.stats()
    # the junction's entry and five ends in four snapshot slots: the least recently used ends went
    assert stats["prefix_cache_hits"] == 3 * 48 and stats["prefix_cache_entries"] == 4
    _no_leaks(cached)


def test_a_burst_sharing_a_start_resumes_from_it_again_after_its_ends(tiny_dir, plain):
    """32 requests sharing a start end in 32 entries (the default slots): the start they resumed from stays, so the
    same burst again resumes every request there (under plain LRU the last end evicted it: none resumed)."""
    rng = random.Random(21)
    system = _tokens(rng, 40)
    prompts = [{"prompt_token_ids": system + _tokens(rng, 6 + i % 5)} for i in range(32)]
    kw = dict(KW, max_num_seqs=32, max_num_batched_tokens=512)
    want = [_key(o) for o in make_llm(tiny_dir, enable_prefix_caching=False, **kw).generate(prompts, greedy(4))]
    cached = make_llm(tiny_dir, enable_prefix_caching=True, **kw)
    for burst in range(2):
        outs = cached.generate(prompts, greedy(4))
        assert [_key(o) for o in outs] == want
        assert sorted(o.num_cached_tokens for o in outs) == [0] * (1 - burst) + [32] * (31 + burst)
    assert cached.stats()["prefix_cache_entries"] == 32
    _no_leaks(cached)


def test_a_requests_samples_compute_their_prompt_once(tiny_dir, plain):
    """n = 4 samples of one prompt: the first stops its chunk at the prompt's last page boundary, the other three
    wait that step and resume there (each sample its own sequence: before, samples of one request formed no
    junction and each computed the whole prompt)."""
    rng = random.Random(13)
    prompt = {"prompt_token_ids": _tokens(rng, 53)}  # (3 full pages of 16, 5 tokens more)
    params = SamplingParams(n=4, temperature=0.9, seed=3, max_tokens=6, logprobs=1)
    cached = make_llm(tiny_dir, enable_prefix_caching=True, **KW)
    want = plain.generate(prompt, params)[0]
    eng = cached.llm_engine
    steps0 = eng.counters["prefill_tokens"]
    got = cached.generate(prompt, params)[0]
    assert _key(got) == _key(want)
    assert cached.stats()["prefix_cache_hits"] == 3 * 48
    assert eng.counters["prefill_tokens"] - steps0 == 53 + 3 * 5  # (the prompt once, the three samples' last 5)
    _no_leaks(cached)


def test_a_chats_earlier_turn_is_evicted_before_its_latest(tiny_dir):
    """Turn 2 resumes from turn 1's end and ends itself: turn 1's entry no longer counts as resumed, so a new entry
    evicts it, not the latest turn."""
    cached = make_llm(tiny_dir, enable_prefix_caching=True, prefix_cache_states=2, **KW)
    rng = random.Random(8)
    first = _tokens(rng, 30)
    said = cached.generate({"prompt_token_ids": first}, greedy(5))[0].outputs[0].token_ids
    second = first + said + _tokens(rng, 7)
    out = cached.generate({"prompt_token_ids": second}, greedy(5))[0]
    assert out.num_cached_tokens >= len(first) + len(said) - 1
    cached.generate({"prompt_token_ids": _tokens(rng, 20)}, greedy(3))  # (its end takes a slot: one entry goes)
    third = second + out.outputs[0].token_ids + _tokens(rng, 4)
    assert cached.generate({"prompt_token_ids": third}, greedy(3))[0].num_cached_tokens >= len(third) - 4 - 1
    _no_leaks(cached)


@pytest.mark.parametrize("mode", ["sync", "async", "async_prefill"])
def test_a_chats_next_turn_resumes_where_the_last_one_ended(tiny_dir, plain, mode, monkeypatch):
    """Turn 2 repeats turn 1's prompt and answer: it resumes after every token turn 1's state holds (its answer's
    last token too when a step launched ahead computed it before the stop was seen)."""
    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", "1" if mode == "async_prefill" else "0")
    cached = make_llm(tiny_dir, enable_prefix_caching=True, async_scheduling=mode != "sync", **KW)
    rng = random.Random(5)
    first = _tokens(rng, 37)
    answer = plain.generate({"prompt_token_ids": first}, greedy(12))[0].outputs[0].token_ids
    for stop in (None, answer[7]):  # at max_tokens, then at a stop token in the middle
        params = greedy(12, stop_token_ids=[stop] if stop is not None else None)
        one = cached.generate({"prompt_token_ids": first}, params)[0]
        assert _key(one) == _key(plain.generate({"prompt_token_ids": first}, params)[0])
        said = one.outputs[0].token_ids
        second = {"prompt_token_ids": first + said + _tokens(rng, 9)}
        got, want = cached.generate(second, greedy(8))[0], plain.generate(second, greedy(8))[0]
        assert _key(got) == _key(want)
        assert len(first) + len(said) - 1 <= got.num_cached_tokens <= len(first) + len(said)
    _no_leaks(cached)


@pytest.mark.parametrize("mode", ["sync", "async", "async_prefill"])
def test_many_requests_under_pressure_get_their_tokens(tiny_dir, mode, monkeypatch):
    """Requests sharing starts, arriving together, with a pool so small that entries are evicted and sequences
    preempted, two snapshot slots and a small token budget: every output equals the uncached engine's."""
    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", "1" if mode == "async_prefill" else "0")
    rng = random.Random(11)
    starts = [_tokens(rng, n) for n in (20, 35, 50)]
    prompts = [starts[i % 3] + _tokens(rng, rng.randint(1, 8)) for i in range(14)]
    prompts += [p + [5] for p in prompts[:3]]  # (a prompt that is another's plus one token)
    params = [greedy(10 + i % 7) if i % 3 else
              SamplingParams(temperature=0.8, top_p=0.9, seed=40 + i, max_tokens=16, ignore_eos=True)
              for i in range(len(prompts))]
    kw = dict(max_num_seqs=5, max_model_len=80, block_size=16, num_blocks=7, max_num_batched_tokens=40,
              async_scheduling=mode != "sync")
    want = [_key(o) for o in make_llm(tiny_dir, enable_prefix_caching=False, **kw).generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    cached = make_llm(tiny_dir, enable_prefix_caching=True, prefix_cache_states=2, **kw)
    for _ in range(2):  # (the second round meets the first round's entries)
        outs = cached.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [_key(o) for o in outs] == want
    stats = cached.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["preemptions"] > 0, stats
    _no_leaks(cached)


def test_aborted_and_failed_requests_leave_no_entry(tiny_dir):
    cached = make_llm(tiny_dir, enable_prefix_caching=True, **KW)
    eng = cached.llm_engine
    eng.add_request("a", {"prompt_token_ids": list(range(3, 40))}, greedy(20))
    for _ in range(3):
        eng.step()
    eng.abort("a")
    while eng.has_unfinished_requests() or eng.has_pending_step():
        eng.step()
    assert eng.scheduler.cache.num_entries == 0
    _no_leaks(cached)


def test_a_failed_launch_drops_the_cache_and_loses_nothing(tiny_dir, plain):
    """A launch that raises after its forward ran: the step's sequences are recomputed and every entry goes (a slot
    the failed step wrote may have been copied); the finals equal the uncached engine's."""
    rng = random.Random(2)
    system = _tokens(rng, 40)
    prompts = [system + _tokens(rng, 5 + i) for i in range(6)]
    params = [greedy(5 + i) for i in range(6)]
    want = [_key(o) for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params)]
    cached = make_llm(tiny_dir, enable_prefix_caching=True, max_num_batched_tokens=32, **KW)
    runner, eng, finals, failed = cached.llm_engine.runner, cached.llm_engine, {}, 0
    _fail_launches(runner, 7)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, params[i], output_kind="final")
        for _ in range(3):  # (they arrive while others run: later ones meet the earlier ones' entries)
            failed += _step(eng, finals)
    while eng.has_unfinished_requests():
        failed += _step(eng, finals)
    del runner.launch
    assert failed >= 2 and [_key(finals[f"r{i}"]) for i in range(6)] == want
    _no_leaks(cached)


def test_score_takes_pages_the_cache_holds(tiny_dir):
    """Pages held only by entries are free to lend: score() evicts entries for them."""
    cached = make_llm(tiny_dir, enable_prefix_caching=True, max_num_seqs=2, max_model_len=64, block_size=16,
                      num_blocks=4)
    cached.generate({"prompt_token_ids": list(range(3, 50))}, greedy(10))
    stats = cached.stats()
    assert stats["pages_used"] == 0 and stats["pages_free"] == 4 and stats["pages_cached"] >= 3, stats
    want = make_llm(tiny_dir, max_num_seqs=2, max_model_len=64, block_size=16, num_blocks=4,
                    enable_prefix_caching=False).llm_engine.score(
        list(range(3, 60)))
    np.testing.assert_array_equal(cached.llm_engine.score(list(range(3, 60))), want)
    _no_leaks(cached)


def test_settings_and_the_pool_plan():
    with pytest.raises(ValueError, match="prefix_cache_states must be an int >= 1"):
        EngineConfig(enable_prefix_caching=True, prefix_cache_states=0)
    with pytest.raises(ValueError, match="enable_prefix_caching must be a bool"):
        EngineConfig(enable_prefix_caching="yes")
    from helpers.configs import tiny_config
    from kda_rt.loader.config import parse_config

    cfg = parse_config(tiny_config())
    off = plan_pools(cfg, EngineConfig(max_num_seqs=4, block_size=16, max_model_len=256, enable_prefix_caching=False),
                     itemsize=4,
                     memory_bytes=2**30, padding=True)
    on = plan_pools(cfg, EngineConfig(max_num_seqs=4, block_size=16, max_model_len=256, enable_prefix_caching=True,
                                      prefix_cache_states=3), itemsize=4, memory_bytes=2**30, padding=True)
    assert off.snapshot_slots == () and on.snapshot_slots == (5, 6, 7)  # after 4 engine slots and the padding one
    assert on.num_slots == off.num_slots + 3 and on.engine_blocks < off.engine_blocks  # (their memory: the pages')


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_mixed_mini_mixes(tiny_dir, quantization):
    """Random prompts with random shared starts in random order on the default settings: the outputs are the
    uncached engine's (a broad net behind the targeted tests above), with fp8 experts too."""
    rng = random.Random(29)
    bases = mixed_prompts(4, seed=29, lo=10, hi=60)
    prompts = [rng.choice(bases)[: rng.randint(5, 60)] + _tokens(rng, rng.randint(1, 8)) for _ in range(20)]
    params = [greedy(rng.randint(1, 6)) for _ in prompts]
    kw = dict(max_num_seqs=3, max_model_len=128, block_size=16, max_num_batched_tokens=48, quantization=quantization)
    want = [_key(o) for o in make_llm(tiny_dir, enable_prefix_caching=False, **kw).generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    cached = make_llm(tiny_dir, enable_prefix_caching=True, prefix_cache_states=3, **kw)
    got = [_key(cached.generate({"prompt_token_ids": p}, q)[0]) for p, q in zip(prompts, params, strict=True)]
    assert got == want
    assert cached.stats()["prefix_cache_hits"] > 0
    _no_leaks(cached)


# -- the scheduler with a cache, against a model that remembers tokens -------------------------------


class _TokenModel:
    """A model whose KDA state is the tuple of tokens folded into it and whose pages hold token ids: every step checks
    that each sequence's state and pages hold exactly its computed tokens (restored ones included), then computes."""

    def __init__(self, block_size: int) -> None:
        self.bs, self.state, self.pages = block_size, {}, {}

    def copy(self, runs) -> None:
        for kind, src, dst in runs:
            store = self.state if kind == "slot" else self.pages
            got = [store.get(s) for s in src]
            for d, v in zip(dst, got, strict=True):
                store[d] = dict(v) if isinstance(v, dict) else v

    def run(self, seq, n: int) -> None:
        c, bs = seq.num_computed, self.bs
        toks = seq.tokens(0, c + n)
        if c:
            assert self.state[seq.slot] == tuple(toks[:c]), (seq.request_id, c)
            assert [self.pages[seq.blocks[p // bs]][p % bs] for p in range(c)] == toks[:c], (seq.request_id, c)
        self.state[seq.slot] = tuple(toks)
        if seq.prompt_snapshot is not None:  # (the state partway, into its reserved slot)
            at, slot = seq.prompt_snapshot
            assert c < at < c + n, (seq.request_id, c, n, at)
            self.state[slot] = tuple(toks[:at])
        for p in range(c, c + n):
            self.pages.setdefault(seq.blocks[p // bs], {})[p % bs] = toks[p]


@st.composite
def _cached_workloads(draw):
    from kda_rt.engine.scheduler import SchedulerConfig

    m = draw(st.integers(1, 48))
    cfg = SchedulerConfig(max_num_seqs=draw(st.integers(1, 5)), max_num_batched_tokens=m,
                          block_size=draw(st.sampled_from([4, 8, 16])), num_blocks=draw(st.integers(6, 24)),
                          num_slots=5, prefill_tail_tokens=draw(st.sampled_from([0, min(4, m), m])),
                          snapshot_slots=tuple(range(5, 5 + draw(st.integers(1, 4)))),
                          prompt_snapshots=draw(st.booleans()), policy=draw(st.sampled_from(["fcfs", "priority"])))
    stem = draw(st.lists(st.integers(1, 3), min_size=40, max_size=40))  # (prompts share starts of it)
    events = draw(st.lists(st.tuples(
        st.lists(st.tuples(st.integers(0, 40), st.lists(st.integers(1, 3), max_size=6), st.integers(1, 12),
                           st.integers(-1, 1), st.sampled_from([None, None, "x", "y"])),
                 max_size=3),  # arrivals: (shared start, own tokens, max_tokens, priority under "priority", salt)
        st.lists(st.integers(0, 50), max_size=1),  # aborts
    ), min_size=1, max_size=20))
    return cfg, stem, events, draw(st.sampled_from([2, 3, 8]))


@settings(max_examples=150, deadline=None)
@given(_cached_workloads())
def test_scheduler_with_a_cache_keeps_every_state_and_page_true(workload):
    """Random arrivals sharing starts, aborts, preemption and eviction, prompt snapshots (every 2, 3 or 8 tokens of a
    chunk here) or none: each step's sequences find exactly their computed tokens in their (restored) state and pages;
    pages are held by exactly their holders; every snapshot slot is an entry's, reserved or free; nothing leaks."""
    from kda_rt.engine import scheduler

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler, "SNAPSHOT_ALIGN", workload[3])
        _scheduler_workload(*workload[:3])


def _scheduler_workload(cfg, stem, events) -> None:
    from kda_rt.engine.scheduler import Scheduler
    from kda_rt.engine.sequence import Sequence, SequenceStatus

    sched, model = Scheduler(cfg), _TokenModel(cfg.block_size)
    cache, live, ids = sched.cache, [], iter(range(10_000))

    def step():
        out = sched.schedule()
        model.copy(cache.take_ops())
        for seq, n in out.scheduled:
            model.run(seq, n)
        sched.commit(out)
        for seq, _ in out.scheduled:
            cache.confirm(seq.kept)  # (the engine's part: the step's rows were read, none in error)
            if seq.num_computed == seq.num_tokens:
                seq.output_token_ids.append(1 + seq.num_tokens % 3)
                if len(seq.output_token_ids) >= seq.max_tokens:
                    sched.finish(seq, keep=seq.num_computed)
        holders: dict[int, int] = {}
        for s in sched.running:
            assert s.resumed_from is None or s.resumed_from.salt == s.cache_salt  # (a salt shares with itself only)
            assert len(s.blocks) == sched.pages_for(s.num_computed)
            for p in s.blocks:
                holders[p] = holders.get(p, 0) + 1
        for e in cache._lru:
            assert len(e.pages) == sched.pages_for(len(e.tokens))
            for p in e.pages:
                holders[p] = holders.get(p, 0) + 1
        assert set(holders) == sched.pages.used_ids()
        assert all(cache._holders.get(p, 1) == h for p, h in holders.items())
        only = {p for e in cache._lru for p in e.pages} - {p for s in sched.running for p in s.blocks}
        assert cache.reclaimable == len(only)
        assert cache._num_resumed == sum(e.resumed for e in cache._lru) <= cache._max_resumed
        reserved = [s.prompt_snapshot[1] for s in sched.running if s.prompt_snapshot is not None]
        assert sorted(cache._free_snapshots + [e.snapshot for e in cache._lru] + reserved) == list(cfg.snapshot_slots)
        return out.scheduled

    for arrivals, aborts in events:
        for shared, own, max_tokens, priority, salt in arrivals:
            rid = f"q{next(ids)}"
            seq = Sequence(rid, 0, stem[:shared] + own or [1], SamplingParams(max_tokens=max_tokens), seed=0,
                           max_tokens=max_tokens, arrival=int(rid[1:]),
                           priority=priority if cfg.policy == "priority" else 0, cache_salt=salt)
            if sched.pages_for(seq.max_positions) > cfg.num_blocks:
                continue
            sched.add(seq)
            live.append(seq)
        for k in aborts:
            live = [s for s in live if not s.finished]
            if live:
                sched.finish(live[k % len(live)])
        assert step() or not sched.has_unfinished()
    for _ in range(10_000):
        if not sched.has_unfinished():
            break
        assert step()
    assert all(s.status is SequenceStatus.FINISHED for s in live)
    cache.clear()
    assert sched.pages.num_used == 0 and sched.slots.num_used == 0


@pytest.mark.parametrize("ahead_prefill", ["0", "1"])
def test_a_failed_launch_after_a_stop_keeps_no_state(tiny_dir, plain, ahead_prefill, monkeypatch):
    """A step launched ahead whose launch raises after its forward ran may have folded one more token into a sequence
    that the step before it stopped: that sequence's state is not kept (its key would miss the token).  Next turns of
    every request, on the same engine, equal the uncached engine's."""
    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", ahead_prefill)
    rng = random.Random(41)
    prompts = [_tokens(rng, 30 + 3 * i) for i in range(8)]
    answers = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], greedy(12))]
    params = [greedy(12, stop_token_ids=[a[3 + i % 5]]) for i, a in enumerate(answers)]
    cached = make_llm(tiny_dir, enable_prefix_caching=True, **KW)
    runner, eng, finals = cached.llm_engine.runner, cached.llm_engine, {}
    _fail_launches(runner, 3)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, params[i], output_kind="final")
    while eng.has_unfinished_requests():
        _step(eng, finals)
    del runner.launch
    said = [finals[f"r{i}"].outputs[0].token_ids for i in range(8)]
    assert said == [plain.generate({"prompt_token_ids": p}, q)[0].outputs[0].token_ids
                    for p, q in zip(prompts, params, strict=True)]
    second = [{"prompt_token_ids": p + s + _tokens(rng, 5)} for p, s in zip(prompts, said, strict=True)]
    got = cached.generate(second, greedy(6))
    assert [_key(o) for o in got] == [_key(o) for o in plain.generate(second, greedy(6))]
    _no_leaks(cached)


def test_reset_prefix_cache(tiny_dir, plain):
    """LLM / AsyncLLM.reset_prefix_cache (vLLM's names) drop every entry; later requests compute everything again."""
    import asyncio

    from kda_rt.async_llm import AsyncLLM

    cached = make_llm(tiny_dir, enable_prefix_caching=True, **KW)
    prompt = list(range(3, 60))
    first = cached.generate({"prompt_token_ids": prompt}, greedy(4))[0].outputs[0].token_ids
    turn = {"prompt_token_ids": prompt + first + [9, 9]}
    assert cached.stats()["prefix_cache_entries"] == 1
    assert cached.reset_prefix_cache() is True and cached.stats()["prefix_cache_entries"] == 0
    out = cached.generate(turn, greedy(4))[0]
    assert out.num_cached_tokens == 0 and _key(out) == _key(plain.generate(turn, greedy(4))[0])
    assert asyncio.run(AsyncLLM(cached).reset_prefix_cache()) is True
    assert cached.stats()["prefix_cache_entries"] == 0 and plain.reset_prefix_cache() is True
    cached.generate({"prompt_token_ids": prompt}, greedy(4))  # (seen before the reset: forgotten, so no junction)
    assert cached.stats()["prefix_cache_entries"] == 1 and cached.stats()["prefix_cache_hits"] == 0
    _no_leaks(cached)


@pytest.mark.parametrize("ahead", [False, True])
def test_a_row_that_errors_keeps_no_state(tiny_dir, ahead, monkeypatch):
    """A row whose forward went non-finite finishes with an error, and no state of its sequence stays cached, also one
    kept before its result was known (retired for its length by a step launched ahead): the next request with the
    same start computes it again and gets the tokens the uncached engine gives."""
    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", "1")
    kw = dict(max_num_seqs=2, max_model_len=128, block_size=16, async_scheduling=ahead)
    llm = make_llm(tiny_dir, enable_prefix_caching=True, **kw)
    runner, first = llm.llm_engine.runner, [True]
    inner = runner.launch

    def launch(batch, sampling, **k):  # the first forward overflows: its state and its logits are non-finite
        out = inner(batch, sampling, **k)
        if first[0]:
            first[0] = False
            runner.kda_pool.recurrent[:, int(batch.state_slots[0])] = np.nan
            out.errors[0], out.token_ids[0] = "non-finite logits", None
        return out

    runner.launch = launch
    prompt = list(range(3, 43))
    a = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1))[0]
    assert a.outputs[0].finish_reason == "error" and llm.stats()["prefix_cache_entries"] == 0
    again = {"prompt_token_ids": prompt + [7]}
    b = llm.generate(again, greedy(3))[0]
    assert b.num_cached_tokens == 0 and _key(b) == _key(make_llm(tiny_dir, enable_prefix_caching=False, **kw).generate(again,
                                                                                                    greedy(3))[0])
    del runner.launch
    _no_leaks(llm)


def test_a_state_retired_ahead_is_not_resumed_before_its_row_is_read(tiny_dir, plain, monkeypatch):
    """A sequence retired for its length by a step launched ahead keeps its state before that step's row is read; a
    request admitted into the seat it frees, in the same schedule, must not resume from it: the row goes non-finite
    here, so that state is too (before: B resumed after 42 tokens and ended with an error instead of its tokens)."""
    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", "1")
    llm = make_llm(tiny_dir, enable_prefix_caching=True, max_num_seqs=1, max_model_len=128, block_size=16)
    prompt = list(range(3, 43))
    said = plain.generate({"prompt_token_ids": prompt}, greedy(3))[0].outputs[0].token_ids
    turn = {"prompt_token_ids": prompt + list(said[:2]) + [7, 8]}  # (A's retired state holds prompt + said[:2])
    runner, eng = llm.llm_engine.runner, llm.llm_engine
    inner = runner.launch

    def launch(batch, sampling, **k):  # A's last step (its third token) overflows
        out = inner(batch, sampling, **k)
        if int(batch.context_lens[0]) == len(prompt) + 1 and batch.num_tokens == 1 and sampling.num_rows:
            runner.kda_pool.recurrent[:, int(batch.state_slots[0])] = np.nan
            out.errors[0], out.token_ids[0] = "non-finite logits", None
        return out

    runner.launch = launch
    eng.add_request("a", {"prompt_token_ids": prompt}, greedy(3), output_kind="final")
    eng.add_request("b", turn, greedy(3), output_kind="final")
    finals = {}
    while eng.has_unfinished_requests() or eng.has_pending_step():
        finals.update({o.request_id: o for o in eng.step()})
    del runner.launch
    assert finals["a"].outputs[0].finish_reason == "error"
    assert finals["b"].num_cached_tokens < len(prompt) + 2
    assert _key(finals["b"]) == _key(plain.generate(turn, greedy(3))[0])
    _no_leaks(llm)


def test_steady_decode_steps_go_ahead_when_entries_hold_the_free_pages(tiny_dir, monkeypatch):
    """A steady decode step that needs a new page is launched ahead as without the cache when only entries hold the
    pages it needs (eviction gives them)."""
    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", "0")
    ahead = []
    for cache in (False, True):
        llm = make_llm(tiny_dir, max_num_seqs=2, max_model_len=128, block_size=16, num_blocks=8,
                       enable_prefix_caching=cache, prefix_cache_states=8)
        for i in range(6):  # each leaves an entry of 2 pages
            llm.generate({"prompt_token_ids": [100 + i] * 20}, greedy(4))
        before = llm.stats()["steps_launched_ahead"]
        llm.generate({"prompt_token_ids": list(range(3, 12))}, greedy(100))
        ahead.append(llm.stats()["steps_launched_ahead"] - before)
    assert ahead[1] == ahead[0] > 90, ahead


@pytest.mark.parametrize("ahead_prefill", ["0", "1"])
def test_an_error_in_a_dropped_step_ahead_keeps_no_state(tiny_dir, plain, ahead_prefill, monkeypatch):
    """The last request stops; the step launched ahead, which computed its stop token, goes non-finite and is dropped
    (every row finished): its errors are still read, and the state kept with its row is dropped, so the next turn
    is computed afresh and equals the uncached engine's."""
    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", ahead_prefill)
    prompt = list(range(3, 43))
    answer = plain.generate({"prompt_token_ids": prompt}, greedy(8))[0].outputs[0].token_ids
    k = next(i for i in range(2, 8) if answer[i] not in answer[:i])
    llm = make_llm(tiny_dir, enable_prefix_caching=True, **KW)
    runner, poisoned = llm.llm_engine.runner, []
    inner = runner.launch

    def launch(batch, sampling, **kw):  # the forward of the stop token overflows
        out = inner(batch, sampling, **kw)
        if not poisoned and int(batch.context_lens[0]) == len(prompt) + k:
            poisoned.append(kw)
            runner.kda_pool.recurrent[:, int(batch.state_slots[0])] = np.nan
            if sampling.num_rows:
                out.errors[0], out.token_ids[0] = "non-finite logits", None
        return out

    runner.launch = launch
    said = llm.generate({"prompt_token_ids": prompt}, greedy(8, stop_token_ids=[answer[k]]))[0].outputs[0]
    del runner.launch
    assert said.finish_reason == "stop" and poisoned and poisoned[0].get("ids_from_last")  # (the step ahead)
    turn = {"prompt_token_ids": prompt + list(said.token_ids) + [7, 8]}
    got = llm.generate(turn, greedy(3))[0]
    assert got.num_cached_tokens == 0 and _key(got) == _key(plain.generate(turn, greedy(3))[0])
    _no_leaks(llm)


@pytest.mark.parametrize("every", [2, 3, 5])
def test_failed_collects_with_stops_lose_no_output(tiny_dir, plain, every, monkeypatch):
    """Requests that stop in the middle, one at a time (each one's last step launched ahead is dropped, and with the
    cache collected for its errors), with every `every`-th collect raising: every request's final comes, equal to the
    uncached engine's."""
    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", "1")
    rng = random.Random(every)
    prompts = [_tokens(rng, 20 + 2 * i) for i in range(6)]
    answers = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], greedy(10))]
    params = [greedy(10, stop_token_ids=[a[2 + i % 4]]) for i, a in enumerate(answers)]
    want = [_key(plain.generate({"prompt_token_ids": p}, q)[0]) for p, q in zip(prompts, params, strict=True)]
    llm = make_llm(tiny_dir, enable_prefix_caching=True, max_num_seqs=1, max_model_len=96, block_size=16)
    eng, runner, calls = llm.llm_engine, llm.llm_engine.runner, [0]
    inner = runner.collect

    def collect(h):
        out = inner(h)
        calls[0] += 1
        if calls[0] % every == 0:
            raise RuntimeError("injected failure after collect")
        return out

    runner.collect = collect
    finals, failed = {}, 0
    for i, (p, q) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, q, output_kind="final")
    while eng.has_unfinished_requests():
        failed += _step(eng, finals)
    del runner.collect
    assert failed >= 2 and [_key(finals[f"r{i}"]) for i in range(6)] == want
    _no_leaks(llm)


@pytest.mark.parametrize("mode", ["sync", "async_prefill"])
def test_a_burst_with_one_system_prompt_computes_it_once(tiny_dir, plain, mode, monkeypatch):
    """Eight requests with one 48-token start arrive together: the first stops its chunk at 48 and keeps the state,
    the others wait that step and resume there (the start is computed once, as SGLang's in-batch prefix sharing
    does); outputs equal the uncached engine's."""
    monkeypatch.setenv("KDA_RT_ASYNC_PREFILL", "1" if mode == "async_prefill" else "0")
    rng = random.Random(17)
    system = _tokens(rng, 48)
    prompts = [system + _tokens(rng, 5 + i) for i in range(8)]
    kw = dict(max_num_seqs=8, max_model_len=128, block_size=16, max_num_batched_tokens=256,
              async_scheduling=mode != "sync")
    want = [_key(o) for o in make_llm(tiny_dir, enable_prefix_caching=False, **kw).generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(4))]
    llm = make_llm(tiny_dir, enable_prefix_caching=True, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(4))
    assert [_key(o) for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [0] + [48] * 7
    assert llm.stats()["prefill_tokens"] == sum(len(p) for p in prompts) - 7 * 48
    _no_leaks(llm)


@pytest.mark.parametrize("snapshots", ["1", "0"])
def test_the_same_prompt_again_resumes_inside_its_last_chunk(tiny_dir, plain, snapshots, monkeypatch):
    """Prompt snapshots (KDA_RT_PROMPT_SNAPSHOTS=1, the default): the model writes the state at the last 64-token
    chunk end of a prompt's final chunk into a snapshot slot during that step, so the same prompt sent again (a
    regenerate) resumes there, and so does a longer prompt that starts with it.  Without them the second request
    computes the prompt in full (stopping at the junction with the first), and the third resumes from that junction."""
    monkeypatch.setenv("KDA_RT_PROMPT_SNAPSHOTS", snapshots)
    prompt = {"prompt_token_ids": _tokens(random.Random(11), 150)}  # chunk ends at 64 and 128; pages of 16
    cached = make_llm(tiny_dir, enable_prefix_caching=True, **KW)
    got = []
    for i in range(3):
        params = SamplingParams(temperature=0.8, seed=i, max_tokens=5, logprobs=2)
        out = cached.generate(prompt, params)[0]
        assert _key(out) == _key(plain.generate(prompt, params)[0])
        got.append(out.num_cached_tokens)
    assert got == ([0, 128, 144] if snapshots == "1" else [0, 0, 144])
    longer = {"prompt_token_ids": prompt["prompt_token_ids"] + [9, 8, 7]}
    out = cached.generate(longer, greedy(4))[0]
    assert _key(out) == _key(plain.generate(longer, greedy(4))[0]) and out.num_cached_tokens == 144
    _no_leaks(cached)


def test_a_prompt_snapshot_after_chunks_of_a_small_budget(tiny_dir, monkeypatch):
    """A prompt whose final chunk starts off the 64-token grid (a budget of 100 tokens: chunks 0-100 and 100-180) keeps
    its state 64 tokens into that chunk, at 164: a partial page, which the request that resumes there copies."""
    monkeypatch.setenv("KDA_RT_PROMPT_SNAPSHOTS", "1")
    kw = dict(KW, max_num_batched_tokens=100, prefill_tail_tokens=0)
    prompt = {"prompt_token_ids": _tokens(random.Random(12), 180)}
    want = make_llm(tiny_dir, enable_prefix_caching=False, **kw).generate(prompt, greedy(6, logprobs=2))[0]
    cached = make_llm(tiny_dir, enable_prefix_caching=True, **kw)
    first = cached.generate(prompt, greedy(6, logprobs=2))[0]
    second = cached.generate(prompt, greedy(6, logprobs=2))[0]
    assert _key(first) == _key(second) == _key(want)
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 164)
    entries = cached.llm_engine.scheduler.cache._lru
    assert [len(e.tokens) for e in entries if e.prompt] == [164]
    _no_leaks(cached)


def test_prompt_snapshots_reserve_slots_and_go_first():
    """`reserve` hands out a free snapshot slot, else evicts the least recently used entry no request resumed from
    (prompt snapshots before the others, also newer ones), else none; a reserved slot becomes a prompt entry without
    a copy, and one whose prefix is cached already goes back."""
    pages = IdPool(32, "page")
    cache = PrefixCache(4, [10, 11, 12, 13], pages)

    def entry(tokens, reserved=None):
        return cache.insert(tokens, 0, pages.allocate(-(-len(tokens) // 4)), reserved=reserved)

    end, older = entry([1, 2, 3, 4, 5]), entry([7, 7, 7, 7, 7, 7])  # copies of slot 0 into free snapshots
    snap = entry([1, 2, 3, 4], reserved=cache.reserve())
    assert snap.prompt and [op[2] for op in cache.ops] == [end.snapshot, older.snapshot]  # (no copy of its own)
    free = cache.reserve()
    assert entry([1, 2, 3, 4], reserved=free) is None  # cached already: the slot goes back
    assert cache.reserve() == free  # (held: none free now)
    assert cache.reserve() == snap.snapshot and snap not in cache._lru and older in cache._lru  # the prompt one first
    cache.unreserve(snap.snapshot)
    cache.unreserve(free)
    cache.restore(end, 1, lambda: pages.allocate(1)[0])  # `end` is resumed from now
    assert sorted([cache.reserve(), cache.reserve()]) == sorted([free, snap.snapshot])
    assert cache.reserve() == older.snapshot  # then the entry no one resumed from
    assert cache.reserve() is None and end in cache._lru  # only the resumed one is left: it stays


def test_a_prompt_snapshot_resumed_by_a_regenerate_stays_ahead_of_never_resumed_entries(monkeypatch):
    """A request that resumed from a prompt snapshot (the same prompt again) ends: the snapshot is not demoted the way
    a chat's earlier end entry is (the new end entry holds its tokens, but the same prompt a third time cannot resume
    from that longer entry), so an unrelated request's end entry evicts an entry no request resumed from, and the
    prompt sent a third time resumes from its snapshot again."""
    from kda_rt.engine import scheduler as scheduler_module
    from kda_rt.engine.scheduler import Scheduler, SchedulerConfig
    from kda_rt.engine.sequence import Sequence

    monkeypatch.setenv("KDA_RT_PROMPT_SNAPSHOTS", "1")
    monkeypatch.setattr(scheduler_module, "SNAPSHOT_ALIGN", 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, block_size=4, num_blocks=32,
                                      num_slots=2, snapshot_slots=(5, 6), prompt_snapshots=True))
    arrivals = iter(range(100))

    def run(prompt: list[int]) -> int:
        seq = Sequence("r", 0, list(prompt), SamplingParams(max_tokens=1), seed=0, max_tokens=1,
                       arrival=next(arrivals))
        sched.add(seq)
        start = None
        while seq.num_computed < seq.num_tokens:  # (a junction may stop a chunk)
            out = sched.schedule()
            start = seq.num_computed if start is None else start
            sched.commit(out)
            sched.cache.confirm(seq.kept)
        seq.output_token_ids.append(1)
        sched.finish(seq, keep=seq.num_computed)
        return start

    prompt = list(range(10, 20))
    assert run(prompt) == 0  # a prompt snapshot at 8 and the end entry at 10
    assert run(prompt) == 8  # the same prompt again resumes from the snapshot
    run([3, 3, 3])  # an unrelated request ends: its end entry needs a snapshot slot
    assert run(prompt) == 8  # the third time too


def test_pages_are_reclaimed_least_recently_used_first_prompt_snapshots_or_not():
    """For pages (not a snapshot slot) a prompt snapshot is no first victim: its pages are mostly a running request's
    or its end entry's too, so evicting it would free none and lose it; the least recently used entry goes."""
    pages = IdPool(6, "page")
    cache = PrefixCache(4, [10, 11], pages)
    older = cache.insert([1, 2, 3, 4, 5], 0, pages.allocate(2))
    snap = cache.insert([7, 7, 7, 7], 0, pages.allocate(1), reserved=cache.reserve())
    for p in older.pages + snap.pages:
        cache.release([p])  # (the sequences that made them let go: the entries alone hold them)
    assert snap.prompt and cache.reclaimable == 3 and pages.num_free == 3
    cache.reclaim(5)
    assert older not in cache._lru and snap in cache._lru and pages.num_free == 5
