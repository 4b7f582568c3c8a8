"""`LLM.beam_search` (vLLM's offline beam search) on the NumPy backend: the beams equal a reference search that
scores whole sequences with `LLM.score` (no engine requests, no prefix cache), each step's requests resume from the
prefix cache, EOS ends a beam (unless ignore_eos), the ranking's length penalty, temperature's extra candidate, and
bad parameters named."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.engine import assert_no_leaks, make_llm
from kda_rt import BeamSearchParams
from kda_rt.beam_search import BeamSearchOutput, beam_score

KW = dict(max_num_seqs=8, max_model_len=128, block_size=16, dtype="float64")


@pytest.fixture(scope="module")
def llm():
    from kda_rt.demo import demo_path

    return make_llm(demo_path(), **KW)  # (the demo checkpoint has a tokenizer: texts and beams' text)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def reference(llm, prompt: list[int], width: int, steps: int, stops: frozenset, penalty: float = 1.0,
              eos: frozenset | None = None):
    """Beam search written the plain way: every candidate's next-token distribution from scoring its whole sequence
    (`LLM.score`: one forward over all its positions), the top 2 x width tokens of each beam a step, ranked by the
    summed logprob over the length (a final EOS id not counted) to the power `penalty`."""
    eos = stops if eos is None else eos

    def key(b):
        tokens, cum = b
        return cum / (len(tokens) - (tokens[-1] in eos)) ** penalty

    beams, done = [(list(prompt), 0.0)], []
    for _ in range(steps):
        grown = []
        for tokens, cum in beams:
            lp = log_softmax(llm.score(tokens)[-1])
            for t in np.argsort(-lp, kind="stable")[: 2 * width]:
                (done if int(t) in stops else grown).append((tokens + [int(t)], cum + float(lp[t])))
        beams = sorted(grown, key=key, reverse=True)[:width]
        if not beams:
            break
    return sorted(done + beams, key=key, reverse=True)[:width]


@pytest.mark.parametrize(("width", "steps"), [(1, 5), (3, 4)])
def test_beams_equal_a_reference_search(llm, width, steps):
    """Two prompts searched together: every returned beam's tokens, summed logprob (float64 model, logits in float32:
    1e-5 relative) and order are the reference's; width 1 is greedy decoding; the requests of each step after the
    first resumed after their parents' tokens (prefix cache hits), and nothing leaks."""
    prompts = [[5, 17, 99, 3, 250, 31, 7], list(range(40, 75))]
    hits = llm.stats()["prefix_cache_hits"]
    out = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(width, steps))
    assert len(out) == 2 and all(isinstance(o, BeamSearchOutput) for o in out)
    for prompt, o in zip(prompts, out, strict=True):
        want = reference(llm, prompt, width, steps, llm.llm_engine.eos_token_ids)
        assert [b.tokens for b in o.sequences] == [w[0] for w in want]
        np.testing.assert_allclose([b.cum_logprob for b in o.sequences], [w[1] for w in want], rtol=1e-5)
        for b in o.sequences:
            assert b.tokens[: len(prompt)] == prompt and len(b.tokens) == len(prompt) + steps
            assert b.finish_reason == "length" and len(b.logprobs) == steps
            assert all(len(lp) == 2 * width for lp in b.logprobs)  # the top 2 x width, the greedy sample among them
            assert b.cum_logprob == pytest.approx(sum(float(lp[t]) for lp, t in zip(b.logprobs, b.tokens[len(prompt):],
                                                                                 strict=True)))
            assert b.text == llm.get_tokenizer().decode(b.tokens)  # (vLLM's offline search: prompt and all)
    if width == 1:  # greedy: the engine's own greedy decoding
        from kda_rt import SamplingParams

        for prompt, o in zip(prompts, out, strict=True):
            got = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=steps,
                                                                            ignore_eos=True))[0]
            assert o.sequences[0].tokens[len(prompt):] == list(got.outputs[0].token_ids)
    # each step's requests but the first's resume after their parent's whole sequence: (steps - 1) searches of
    # width beams a prompt, most of them at least the prompt long
    assert llm.stats()["prefix_cache_hits"] - hits >= (steps - 1) * min(len(p) for p in prompts)
    assert_no_leaks(llm)


def test_eos_ends_a_beam(llm, monkeypatch):
    """A candidate ending in an EOS id is finished ("stop", stop_reason as generate reports it: None for the
    tokenizer's EOS, else the id) and ranked with the beams, its length without the EOS, under a length penalty too;
    ignore_eos makes it an ordinary token (its length still counted as vLLM's); where every candidate ends, the
    search stops early."""
    prompt = [9, 8, 7, 6, 5, 4, 3]
    lp = log_softmax(llm.score(prompt)[-1])
    first, second, third = (int(t) for t in np.argsort(-lp)[:3])
    eng = llm.llm_engine
    monkeypatch.setattr(eng, "eos_token_ids", frozenset({first, third}))
    monkeypatch.setattr(eng.postprocessor, "quiet_eos_ids", frozenset({first}))
    for penalty in (1.0, 0.5, 2.0):
        out = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=penalty))
        want = reference(llm, prompt, 2, 3, frozenset({first, third}), penalty)
        seqs = out[0].sequences
        assert [b.tokens for b in seqs] == [w[0] for w in want], penalty
        np.testing.assert_allclose([b.cum_logprob for b in seqs], [w[1] for w in want], rtol=1e-5)
        for b in seqs:
            if b.tokens[-1] in (first, third) and len(b.tokens) == len(prompt) + 1:
                assert b.finish_reason == "stop" and b.stop_reason == (None if b.tokens[-1] == first else third)
    assert any(b.finish_reason == "stop" for b in llm.beam_search([prompt], BeamSearchParams(2, 3))[0].sequences)
    free = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))[0].sequences
    want = reference(llm, prompt, 2, 3, frozenset(), eos=frozenset({first, third}))
    assert [b.tokens for b in free] == [w[0] for w in want]
    assert all(b.finish_reason == "length" and len(b.tokens) == len(prompt) + 3 for b in free)
    # width 1: its two candidates both EOS ids -> the search ends after one step, with the better of them
    monkeypatch.setattr(eng, "eos_token_ids", frozenset({first, second}))
    (only,) = llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=5))[0].sequences
    assert only.tokens == prompt + [first] and only.finish_reason == "stop" and len(only.logprobs) == 1


def test_temperature_samples_a_candidate_more(llm):
    """temperature > 0: each step's sampled token is a candidate beside the top 2 x width (vLLM's behaviour), with
    its logprob of the model's distribution (before temperature): on the demo's flat distributions some step lists
    2 x width + 1 tokens."""
    prompt = [21, 22, 23, 24, 25]
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=4, temperature=1.5))[0].sequences
    sizes = {len(lp) for b in out for lp in b.logprobs}
    assert sizes <= {4, 5} and 5 in sizes, sizes
    lp0 = log_softmax(llm.score(prompt)[-1])
    for b in out:
        first = b.logprobs[0]
        for t, v in first.items():
            assert float(v) == pytest.approx(lp0[t], rel=1e-5)


def test_length_penalty_ranks_by_length():
    """vLLM's score: cum_logprob / len ** length_penalty, a final EOS not counted in len."""
    eos = frozenset({2})
    assert beam_score([1, 5, 6, 7], -2.0, eos, 1.0) == pytest.approx(-0.5)
    assert beam_score([1, 5, 6, 2], -2.0, eos, 1.0) == pytest.approx(-2.0 / 3)
    assert beam_score([1, 5, 6, 7], -2.0, eos, 0.0) == pytest.approx(-2.0)
    assert beam_score([1, 5, 6, 7], -2.0, eos, 2.0) == pytest.approx(-2.0 / 16)
    # a longer sequence with a lower sum can rank first under a larger penalty
    short, long_ = ([1, 5], -1.0), ([1, 5, 6, 7, 8, 9], -2.0)
    assert beam_score(*short, eos, 0.0) > beam_score(*long_, eos, 0.0)
    assert beam_score(*short, eos, 1.0) < beam_score(*long_, eos, 1.0)


@settings(max_examples=300, deadline=None)
@given(a=st.tuples(st.integers(1, 60), st.floats(-80, 0)), b=st.tuples(st.integers(1, 60), st.floats(-80, 0)),
       penalty=st.floats(-8, 8))
def test_the_ranking_key_orders_as_the_score(a, b, penalty):
    """The search ranks by a log-space key (exact where the score leaves a float's range); where the score is a
    plain float, the key orders two beams as the score does."""
    from kda_rt.beam_search import _rank_key

    (la, ca), (lb, cb) = a, b
    ta, tb = list(range(la)), list(range(lb))
    sa, sb = beam_score(ta, ca, frozenset(), penalty), beam_score(tb, cb, frozenset(), penalty)
    if abs(sa - sb) > 1e-9 * max(abs(sa), abs(sb), 1e-300):
        assert (sa > sb) == (_rank_key(ta, ca, frozenset(), penalty) > _rank_key(tb, cb, frozenset(), penalty))


@pytest.mark.parametrize("penalty", [400, -400, 1000])
def test_extreme_length_penalties_rank_without_error(llm, penalty):
    """A length penalty whose power leaves a float's range (len ** 400 overflows, len ** -400 is 0) still ranks: the
    score gives its limit, and the search's beams are in the order of the exact score (rational arithmetic: the
    summed logprob over len ** penalty as a fraction)."""
    from fractions import Fraction

    assert beam_score(list(range(50)), -3.0, frozenset(), float(penalty)) in (0.0, -0.0, float("-inf"))
    eos = llm.llm_engine.eos_token_ids
    params = BeamSearchParams(beam_width=4, max_tokens=6, length_penalty=float(penalty))
    (out,) = llm.beam_search([{"prompt_token_ids": [5, 6, 7]}], params)

    def exact(b):
        length = len(b.tokens) - (1 if b.tokens[-1] in eos else 0)
        return Fraction(b.cum_logprob) / Fraction(length) ** penalty

    assert len(out.sequences) == 4
    scores = [exact(b) for b in out.sequences]
    assert scores == sorted(scores, reverse=True)


def test_beam_text_leaves_out_ids_past_the_tokenizer():
    """A checkpoint whose embedding has more rows than its tokenizer has tokens: a beam's text leaves the unknown ids
    out (as generate's does) instead of failing."""
    from kda_rt.beam_search import BeamSearchSequence, generated

    class Tok:
        vocab_size = 10

        def decode(self, ids):
            assert all(i < 10 for i in ids)
            return ",".join(map(str, ids))

    beam = BeamSearchSequence([1, 2, 3, 11, 4, 12], finish_reason="length")
    assert generated(beam, 2, Tok(), BeamSearchParams(beam_width=1, max_tokens=4)) == ([3, 11, 4, 12], "3,4")


@pytest.mark.parametrize(("kw", "needle"), [
    (dict(beam_width=0, max_tokens=4), "beam_width must be an int in \\[1, 10\\]"),
    (dict(beam_width=11, max_tokens=4), "beam_width must be an int in \\[1, 10\\]"),
    (dict(beam_width=True, max_tokens=4), "beam_width must be an int"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be an int >= 1"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature must be >= 0"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty must be a finite number"),
    (dict(beam_width=2, max_tokens=4, ignore_eos=1), "ignore_eos must be a bool"),
])
def test_bad_params_named(kw, needle):
    with pytest.raises(ValueError, match=needle):
        BeamSearchParams(**kw)


def test_bad_calls_named(llm):
    with pytest.raises(TypeError, match="prompts must be a list of prompts .* got set"):
        llm.beam_search({"a", "b"}, BeamSearchParams(2, 3))
    with pytest.raises(TypeError, match="params must be a BeamSearchParams"):
        llm.beam_search([[5, 6]], {"beam_width": 2, "max_tokens": 3})
    with pytest.raises(ValueError, match=r"prompt 1: 126 tokens \+ max_tokens 4 exceed max_model_len 128"):
        llm.beam_search([[5, 6], [7] * 126], BeamSearchParams(2, 4))
    with pytest.raises(ValueError, match="concurrency_limit must be an int >= 1"):
        llm.beam_search([[5, 6]], BeamSearchParams(2, 3), concurrency_limit=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.beam_search([[5, 10**6]], BeamSearchParams(2, 3))
    assert_no_leaks(llm)


def test_concurrency_limit_and_text_prompts(llm):
    """Prompts searched a group at a time give what they give together; a text prompt is tokenized as generate
    does."""
    prompts = ["hello there", {"prompt_token_ids": [11, 12, 13, 14]}, [70, 71, 72]]
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    together = llm.beam_search(prompts, params)
    flat = llm.beam_search([70, 71, 72], params)  # a flat list of ids is one prompt, as generate reads it
    assert len(flat) == 1 and [b.tokens for b in flat[0].sequences] == [b.tokens for b in together[2].sequences]
    apart = llm.beam_search(prompts, params, concurrency_limit=1)
    assert [[b.tokens for b in o.sequences] for o in together] == [[b.tokens for b in o.sequences] for o in apart]
    ids = llm.get_tokenizer().encode("hello there", allow_special=True)
    assert together[0].sequences[0].tokens[: len(ids)] == ids


def test_async_beam_search_is_the_offline_one(llm, monkeypatch):
    """AsyncLLM.beam_search (vLLM's EngineClient form): one finished RequestOutput whose outputs are the offline
    search's beams, best first, with the generated ids, their text (a final EOS left out unless
    include_stop_str_in_output), cumulative_logprob and logprobs; while another request runs beside it."""
    import asyncio

    from kda_rt import SamplingParams
    from kda_rt.async_llm import AsyncLLM

    prompt = [9, 8, 7, 6, 5, 4, 3]
    lp = log_softmax(llm.score(prompt)[-1])
    first = int(np.argmax(lp))
    monkeypatch.setattr(llm.llm_engine, "eos_token_ids", frozenset({first}))  # (one beam ends at once)
    params = BeamSearchParams(beam_width=3, max_tokens=4)
    want = llm.beam_search([prompt], params)[0].sequences
    engine = AsyncLLM(llm)

    async def main(params):
        async def other():
            return [o async for o in engine.generate([50, 51, 52], SamplingParams(temperature=0, max_tokens=6,
                                                                                  ignore_eos=True))]
        beams, side = await asyncio.gather(_collect(engine.beam_search(prompt, "b1", params)), other())
        return beams, side

    async def _collect(gen):
        return [o async for o in gen]

    (out,), side = asyncio.run(main(params))
    assert out.finished and out.request_id == "b1" and out.prompt_token_ids == prompt and side[-1].finished
    tok = llm.get_tokenizer()
    assert [prompt + list(c.token_ids) for c in out.outputs] == [b.tokens for b in want]
    for i, (c, b) in enumerate(zip(out.outputs, want, strict=True)):
        assert c.index == i and c.cumulative_logprob == pytest.approx(b.cum_logprob) and c.logprobs == b.logprobs
        assert c.finish_reason == b.finish_reason
        shown = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids
        assert c.text == tok.decode(shown)
    assert any(c.finish_reason == "stop" for c in out.outputs)
    (kept,), _ = asyncio.run(main(BeamSearchParams(beam_width=3, max_tokens=4, include_stop_str_in_output=True)))
    stopped = [c for c in kept.outputs if c.finish_reason == "stop"]
    assert stopped and all(c.text == tok.decode(c.token_ids) for c in stopped)
    assert_no_leaks(llm)
