"""The weight schema (`loader/schema.py`): every tensor of `expected_tensors(config)` is held by
exactly one field of `read_weights` (no leftovers, nothing missing), and the CUDA upload
(`kda_rt/cuda/weights.py`, run here with NumPy standing in for CuPy) copies every tensor exactly
once into the fused device layouts, for dense-only, MLA, MoE with / without shared experts and
tied configs."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import types
from collections import Counter

import numpy as np
import pytest

from helpers.configs import tiny_config
from kda_rt.loader.config import parse_config
from kda_rt.loader.schema import KDAWeights, Stack, expected_tensors, read_weights


def _lac(kinds: str) -> dict:
    return {"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4,
            "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "k"],
            "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "m"]}


CONFIGS = {
    "dense-only-kda": dict(num_hidden_layers=2, linear_attn_config=_lac("kk"), first_k_dense_replace=2),
    "mla-moe-shared": {},
    "mla-moe-noshared-tied": dict(num_shared_experts=0, tie_word_embeddings=True),
    "all-moe-2shared": dict(num_hidden_layers=3, linear_attn_config=_lac("kmk"), first_k_dense_replace=0,
                            num_shared_experts=2),
}


def _tensors(config) -> dict[str, np.ndarray]:
    """A distinct float32 array per expected tensor (values: a per-tensor offset + position)."""
    return {name: (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) * 1e-3 + i)
            for i, (name, (shape, _)) in enumerate(expected_tensors(config).items())}


def _leaves(obj) -> list[np.ndarray]:
    """Every array held by a field of the schema tree."""
    if isinstance(obj, np.ndarray):
        return [obj]
    if dataclasses.is_dataclass(obj):
        return [a for f in dataclasses.fields(obj) for a in _leaves(getattr(obj, f.name))]
    if isinstance(obj, list | tuple):
        return [a for x in obj for a in _leaves(x)]
    assert obj is None, f"unexpected {type(obj).__name__} in the schema"
    return []


@pytest.mark.parametrize("name", list(CONFIGS))
def test_schema_consumes_every_tensor_once(name):
    config = parse_config(tiny_config(**CONFIGS[name]))
    tensors = _tensors(config)
    weights = read_weights(config, tensors)
    held = Counter(id(a) for a in _leaves(weights))
    names = {id(a): n for n, a in tensors.items()}
    assert sorted(n for i, n in names.items() if held[i] != 1) == [], "tensors not held exactly once"
    assert set(held) <= set(names), "the schema holds arrays that are not checkpoint tensors"
    assert weights.output is (tensors["model.embed_tokens.weight"] if config.tie_word_embeddings
                              else tensors["lm_head.weight"])


def test_schema_reports_missing_and_misshaped():
    config = parse_config(tiny_config())
    tensors = _tensors(config)
    del tensors["model.layers.2.self_attn.kv_b_proj.weight"]
    with pytest.raises(KeyError, match="kv_b_proj"):
        read_weights(config, tensors)
    tensors = _tensors(config)
    tensors["model.norm.weight"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="model.norm.weight"):
        read_weights(config, tensors)


def test_stack_rows():
    a, b = np.zeros((2, 5)), np.ones((3, 5))
    assert Stack.rows(a, b).shape == (5, 5)
    fields = dict.fromkeys(f.name for f in dataclasses.fields(KDAWeights))
    w = KDAWeights(**(fields | {f"{x}_conv1d": np.zeros((4, 1, 3)) for x in "qkv"}))
    assert w.conv_taps.shape == (12, 3) and all(p.shape == (4, 3) for p in w.conv_taps.parts)


# ---------------------------------------------------------------------------------------------
# the CUDA upload with NumPy in place of CuPy


class _FakeUploader:
    """Records the host source of every copy; device arrays are NumPy arrays."""

    def __init__(self):
        self.sources: list[np.ndarray] = []
        self.bytes_uploaded = 0
        self.stream = contextlib.nullcontext()  # work queued "on the uploader's stream" runs now

    def copy(self, dst, src):
        src = np.asarray(src)
        assert dst.shape == src.shape and dst.flags.c_contiguous
        dst[...] = src.astype(dst.dtype)
        self.sources.append(src)
        self.bytes_uploaded += dst.nbytes

    def new(self, src, dtype=None):
        dst = np.empty(src.shape, dtype=dtype or src.dtype)
        self.copy(dst, src)
        return dst

    def finish(self):
        pass


def _root(a: np.ndarray) -> np.ndarray:
    while a.base is not None and isinstance(a.base, np.ndarray):
        a = a.base
    return a


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cuda_upload_copies_every_tensor_once(name, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(empty=np.empty))
    import kda_rt.cuda.weights as cw
    from kda_rt.cuda.ops.check import BF16

    uploader = _FakeUploader()
    monkeypatch.setattr(cw, "Uploader", lambda: uploader)
    config = parse_config(tiny_config(**CONFIGS[name]))
    tensors = _tensors(config)
    dev = cw.upload_weights(config, tensors, progress=False)

    copied = Counter(id(_root(s)) for s in uploader.sources)
    names = {id(a): n for n, a in tensors.items()}
    assert sorted(n for i, n in names.items() if copied[i] != 1) == [], "tensors not uploaded exactly once"
    assert set(copied) <= set(names)

    def bf16(*parts):
        return np.concatenate(parts).astype(BF16)

    def same(got, want):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))

    t = tensors
    assert dev.lm_head is dev.embed if config.tie_word_embeddings else dev.lm_head is not dev.embed
    for i, L in enumerate(dev.layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + ("mlp." if config.mlp_types[i] == "dense" else "block_sparse_moe.")
        assert L.kind == config.layer_types[i] and L.mlp_kind == config.mlp_types[i]
        same(L.in_norm, t[p + "input_layernorm.weight"].astype(BF16))
        if L.kind == "kda":
            k = L.mixer
            same(k.qkv, bf16(*(t[a + f"{x}_proj.weight"] for x in "qkv")))
            same(k.fgb, bf16(t[a + "f_a_proj.weight"], t[a + "g_a_proj.weight"], t[a + "b_proj.weight"]))
            same(k.conv_w, np.concatenate([t[a + f"{x}_conv1d.weight"][:, 0, :] for x in "qkv"]))
            same(k.A_log, t[a + "A_log"].reshape(-1))
            assert (k.rank_f, k.rank_g) == (config.kda.head_dim, config.kda.head_dim)
        else:
            same(L.mixer.q_kva, bf16(t[a + "q_proj.weight"], t[a + "kv_a_proj_with_mqa.weight"]))
        if L.mlp_kind == "dense":
            same(L.mlp.gate_up, bf16(t[m + "gate_proj.weight"], t[m + "up_proj.weight"]))
        else:
            E = config.moe.num_experts
            same(L.mlp.router, t[m + "gate.weight"])
            # the router's three-bf16 split (derived on the device, not uploaded) adds up to it exactly
            parts = np.asarray(L.mlp.router_split, dtype=np.float32).reshape(3, E, -1)
            assert np.array_equal((parts[0] + parts[1]) + parts[2], np.asarray(t[m + "gate.weight"], np.float32))
            w13 = [bf16(t[m + f"experts.{e}.w1.weight"], t[m + f"experts.{e}.w3.weight"]) for e in range(E)]
            w2 = [t[m + f"experts.{e}.w2.weight"].astype(BF16) for e in range(E)]
            # one shared expert of the experts' width rides as expert E of the stacks; wider ones stay apart
            assert L.mlp.shared_in_stack == (config.moe.num_shared_experts == 1)
            if L.mlp.shared_in_stack:
                w13.append(bf16(t[m + "shared_experts.gate_proj.weight"], t[m + "shared_experts.up_proj.weight"]))
                w2.append(t[m + "shared_experts.down_proj.weight"].astype(BF16))
                same(L.mlp.shared.gate_up, w13[E])
                same(L.mlp.shared.down, w2[E])
            same(L.mlp.w13, np.stack(w13))
            same(L.mlp.w2, np.stack(w2))
            assert (L.mlp.shared is None) == (config.moe.num_shared_experts == 0)
