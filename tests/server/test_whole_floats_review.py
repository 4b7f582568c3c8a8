"""protocol._decode_whole_floats (review): a body with many whole-number floats in a list of integers decodes in a
bounded number of passes (was: one full re-decode a float, quadratic: 8,000 token ids as floats held the event loop
for ~6 s, 32,000 for minutes); fractions stay 400s naming their element."""

from __future__ import annotations

import msgspec
import pytest

from kda_rt.server import protocol


def _count_typed_decodes(monkeypatch) -> list[int]:
    calls = [0]
    real = msgspec.json.decode

    def counting(*args, **kwargs):
        if "type" in kwargs:
            calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(msgspec.json, "decode", counting)
    return calls


def test_a_list_of_whole_floats_decodes_in_few_passes(monkeypatch):
    ids = [float(i) for i in range(2000)]
    calls = _count_typed_decodes(monkeypatch)
    req, _ = protocol.decode_body(msgspec.json.encode({"tokens": ids}), protocol.DetokenizeRequest)
    assert req.tokens == list(range(2000)) and all(type(t) is int for t in req.tokens)
    assert calls[0] <= 4, calls[0]  # (was 2001)
    calls[0] = 0
    body = {"prompt": "x", "n": 2.0, "allowed_token_ids": ids[:500], "stop_token_ids": ids[:300], "seed": 3e0}
    req, _ = protocol.decode_body(msgspec.json.encode(body), protocol.CompletionRequest)
    assert (req.n, req.seed, req.allowed_token_ids, req.stop_token_ids) == (2, 3, list(range(500)), list(range(300)))
    assert calls[0] <= 8, calls[0]  # (was 803)


def test_a_fraction_among_whole_floats_stays_a_400_naming_it():
    body = {"prompt": "x", "stop_token_ids": [1.0, 2, 3.5, 4.0]}
    with pytest.raises(protocol.InvalidRequest, match=r"stop_token_ids\[2\]"):
        protocol.decode_body(msgspec.json.encode(body), protocol.CompletionRequest)
