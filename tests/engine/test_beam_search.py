"""`LLM.beam_search` (vLLM's offline beam search) on the NumPy backend: the beams equal a reference search that
scores whole sequences with `LLM.score` (no engine requests, no prefix cache), each step's requests resume from the
prefix cache, EOS ends a beam (unless ignore_eos), the ranking's length penalty, and bad parameters named."""

from __future__ import annotations

import numpy as np
import pytest

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


def reference(llm, prompt: list[int], width: int, steps: int, eos: frozenset, penalty: float = 1.0):
    """Beam search written the plain way: every candidate's next-token distribution from scoring its whole sequence
    (`LLM.score`: one forward over all its positions), the top 2 x width tokens of each beam a step."""
    beams, done = [(list(prompt), 0.0)], []
    key = lambda b: beam_score(b[0], b[1], eos, penalty)  # noqa: E731
    for _ in range(steps):
        grown = []
        for tokens, cum in beams:
            lp = log_softmax(llm.score(tokens)[-1])
            for t in np.argsort(-lp, kind="stable")[: 2 * width]:
                (done if int(t) in eos else grown).append((tokens + [int(t)], cum + float(lp[t])))
        beams = sorted(grown, key=key, reverse=True)[:width]
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
            assert b.cum_logprob == pytest.approx(sum(float(lp[t]) for lp, t in zip(b.logprobs, b.tokens[len(prompt):],
                                                                                 strict=True)))
            assert b.text == llm.get_tokenizer().decode(b.tokens[len(prompt):])
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
    """A candidate ending in an EOS id is finished ("stop", its text without the EOS) and ranked with the beams;
    ignore_eos makes it an ordinary token."""
    prompt = [9, 8, 7, 6, 5, 4, 3]
    lp = log_softmax(llm.score(prompt)[-1])
    first, second = (int(t) for t in np.argsort(-lp)[:2])
    monkeypatch.setattr(llm.llm_engine, "eos_token_ids", frozenset({first}))
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=3))[0].sequences
    ended = [b for b in out if b.finish_reason == "stop"]
    want = reference(llm, prompt, 2, 3, frozenset({first}))
    assert [b.tokens for b in out] == [w[0] for w in want]
    assert ended and all(b.tokens[-1] == first and len(b.tokens) == len(prompt) + 1 for b in ended)
    assert all(b.text == "" for b in ended)  # (its one generated token is the EOS)
    free = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))[0].sequences
    assert all(b.finish_reason == "length" and len(b.tokens) == len(prompt) + 3 for b in free)
    assert free[0].tokens[len(prompt)] in (first, second)


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
    apart = llm.beam_search(prompts, params, concurrency_limit=1)
    assert [[b.tokens for b in o.sequences] for o in together] == [[b.tokens for b in o.sequences] for o in apart]
    ids = llm.get_tokenizer().encode("hello there", allow_special=True)
    assert together[0].sequences[0].tokens[: len(ids)] == ids
