"""SamplingParams: vLLM defaults, and every bad value names its parameter."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kda_rt import SamplingParams


def test_vllm_defaults():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert (p.seed, p.stop_strings, p.stop_token_ids, p.ignore_eos) == (None, (), [], False)
    assert not p.greedy and SamplingParams(temperature=0).greedy
    assert (p.skip_special_tokens, p.spaces_between_special_tokens) == (True, True)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -0.1}, "temperature"), ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"), ({"seed": "1"}, "seed"),
        ({"seed": 2**70}, "seed"), ({"stop": [""]}, "stop"), ({"stop": 5}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"n": 0}, "n"), ({"logprobs": 100}, "logprobs"),
        ({"repetition_penalty": 0}, "repetition_penalty"), ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"), ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"ignore_eos": 1}, "ignore_eos"), ({"top_k": 2**31}, "top_k"), ({"top_k": 2**70}, "top_k"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids"), ({"logit_bias": {"\u00b2": 1.0}}, "logit_bias"),
        ({"logit_bias": {"9" * 40: 1.0}}, "logit_bias"), ({"logit_bias": {2**31: 1.0}}, "logit_bias"),
        ({"n": 2**16 + 1}, r"n must be an int in \[1, MAX_N = 65536\]"), ({"n": 10**9}, "n must be"),
        ({"spaces_between_special_tokens": 1}, "spaces_between_special_tokens must be a bool"),
    ],
)
def test_bad_values_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_n_bounded():
    """n up to MAX_N is taken; past it refused at construction (was: n = 10**9 accepted, and LLM.generate then spent
    minutes building a billion sequences)."""
    from kda_rt.sampler.params import MAX_N

    assert SamplingParams(n=MAX_N).n == MAX_N


def test_stop_string_normalised():
    assert SamplingParams(stop="###").stop_strings == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop_strings == ("a", "b")


def test_int32_edges_accepted():
    """The largest top_k, token id and logit_bias key that the samplers take (int32) pass; a digit-string key is
    read as its id, as JSON sends them."""
    p = SamplingParams(top_k=2**31 - 1, stop_token_ids=[2**31 - 1], logit_bias={"2147483647": 1.0, "7": -1.0})
    assert p.logit_bias == {2**31 - 1: 1.0, 7: -1.0}


def test_huge_temperature_casts_without_overflow():
    """A temperature past float32's range (vLLM takes any non-negative value) is clipped to float32's largest as the
    batch's device array is built: sampling is uniform either way, and no 'overflow in cast' warning is raised."""
    import warnings

    from kda_rt.sampler.batch import SamplingBatch

    params = [SamplingParams(temperature=1e308), SamplingParams(temperature=0.7)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch = SamplingBatch.build(((p, 1, [1, 2], []) for p in params), [0])
    assert batch.temperature[0] == np.finfo(np.float32).max and batch.temperature[1] == np.float32(0.7)


def test_numpy_numbers_accepted_as_python_ones():
    """NumPy integers and floats are taken where ints and numbers are (vLLM takes them: a caller's max_tokens from an
    array), and the integer fields keep them as Python ints (JSON, the engine's arithmetic); NumPy bools and
    non-finite floats are still refused by name."""
    p = SamplingParams(n=np.int64(2), max_tokens=np.int32(7), min_tokens=np.uint8(1), temperature=np.float32(0.5),
                       top_k=np.int64(5), seed=np.uint64(3), logprobs=np.int8(2), stop_token_ids=[np.int64(5)],
                       logit_bias={np.int64(9): np.float16(1.5)}, allowed_token_ids=[np.int16(3), 4])
    ints = (p.n, p.max_tokens, p.min_tokens, p.top_k, p.seed, p.logprobs, *p.stop_token_ids, *p.logit_bias,
            *p.allowed_token_ids)
    assert ints == (2, 7, 1, 5, 3, 2, 5, 9, 3, 4) and all(type(i) is int for i in ints)
    assert p.temperature == 0.5 and type(p.temperature) is float and p.logit_bias == {9: 1.5}
    for bad, name in ((dict(n=np.bool_(True)), "n"), (dict(max_tokens=np.float64(3.0)), "max_tokens"),
                      (dict(temperature=np.bool_(True)), "temperature"), (dict(top_p=np.float32("nan")), "top_p"),
                      (dict(stop_token_ids=[np.bool_(False)]), "stop_token_ids")):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**bad)
