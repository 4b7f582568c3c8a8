"""`expected_tensors` and `load_checkpoint`: names/shapes vs config, single and sharded files,
index errors, missing/unexpected/mis-shaped/mis-typed tensors, and the transformers layout."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest

from helpers.configs import tiny_config
from kda_rt.loader.config import parse_config
from kda_rt.loader.safetensors_mmap import CheckpointError, read_safetensors, save_safetensors
from kda_rt.loader.weights import INDEX_FILE, MATMUL_KINDS, SINGLE_FILE, expected_tensors, load_checkpoint
from kda_rt.random_checkpoint import write_random_checkpoint


def test_expected_tensors_tiny():
    cfg = parse_config(tiny_config())
    exp = expected_tensors(cfg)
    # per spec §2: 3 global + per layer 2 norms; KDA 15, MLA 5; dense 3; MoE 2 + 3*E + 3 shared
    assert len(exp) == 3 + 4 * 2 + 3 * 15 + 5 + 3 + 3 * (2 + 3 * 8 + 3)
    assert exp["model.layers.0.mlp.gate_proj.weight"] == ((128, 64), "matmul")
    assert exp["model.layers.0.self_attn.q_conv1d.weight"][0] == (64, 1, 4)
    assert exp["model.layers.0.self_attn.A_log"][0] == (1, 1, 2, 1)
    assert exp["model.layers.2.self_attn.q_proj.weight"][0] == (2 * 24, 64)
    assert exp["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"][0] == (40, 64)
    assert exp["model.layers.2.self_attn.kv_b_proj.weight"][0] == (2 * 32, 32)
    assert exp["model.layers.3.block_sparse_moe.experts.7.w2.weight"][0] == (64, 32)
    assert exp["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"] == ((8,), "router_bias")
    assert "model.layers.0.block_sparse_moe.gate.weight" not in exp


def test_expected_tensors_tied_and_no_shared():
    exp = expected_tensors(parse_config(tiny_config(tie_word_embeddings=True, num_shared_experts=0)))
    assert "lm_head.weight" not in exp
    assert not any("shared_experts" in n for n in exp)


@pytest.mark.parametrize("num_shards", [1, 4], ids=["single", "4-shards"])
def test_load_returns_views_and_fp32_small(tmp_path, num_shards):
    cfg_dict = tiny_config()
    d = write_random_checkpoint(cfg_dict, tmp_path, num_shards=num_shards, seed=3)
    cfg = parse_config(cfg_dict)
    w = load_checkpoint(d, cfg, progress=False)
    exp = expected_tensors(cfg)
    assert list(w) == list(exp)
    for name, (shape, kind) in exp.items():
        assert w[name].shape == shape
        if kind in MATMUL_KINDS:
            assert w[name].dtype == ml_dtypes.bfloat16 and not w[name].flags.owndata, name
        else:
            assert w[name].dtype == np.float32, name


def _single(tmp_path, edit=None):
    """Write the tiny checkpoint, then rewrite model.safetensors with `edit(tensors)` applied."""
    cfg = parse_config(tiny_config())
    d = write_random_checkpoint(tiny_config(), tmp_path)
    tensors = {k: np.array(v) for k, v in read_safetensors(d / SINGLE_FILE).items()}
    if edit is not None:
        edit(tensors)
        save_safetensors(d / SINGLE_FILE, tensors)
    return d, cfg


def _check_error(d, cfg, *needles):
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(d, cfg, progress=False)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_missing_tensor(tmp_path):
    d, cfg = _single(tmp_path, lambda t: t.pop("model.layers.1.self_attn.dt_bias"))
    _check_error(d, cfg, str(d), "missing", "model.layers.1.self_attn.dt_bias")


def test_unexpected_tensor(tmp_path):
    d, cfg = _single(tmp_path, lambda t: t.update({"model.layers.0.self_attn.rotary.inv_freq": np.ones(4, np.float32)}))
    _check_error(d, cfg, "unexpected", "model.layers.0.self_attn.rotary.inv_freq", str(d / SINGLE_FILE))


def test_wrong_shape(tmp_path):
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    d, cfg = _single(tmp_path, lambda t: t.update({name: t[name][:, :16]}))
    _check_error(d, cfg, str(d / SINGLE_FILE), name, "shape")


def test_wrong_dtype_matmul(tmp_path):
    name = "model.layers.0.self_attn.o_proj.weight"
    d, cfg = _single(tmp_path, lambda t: t.update({name: t[name].astype(np.float64)}))
    _check_error(d, cfg, str(d / SINGLE_FILE), name, "float64")


def test_wrong_dtype_small(tmp_path):
    name = "model.layers.0.self_attn.A_log"
    d, cfg = _single(tmp_path, lambda t: t.update({name: t[name].astype(np.int32)}))
    _check_error(d, cfg, str(d / SINGLE_FILE), name, "int32")


def _set(name, index, value):
    def edit(t):
        a = t[name].copy()
        a[index] = value
        t[name] = a
    return edit


@pytest.mark.parametrize(("name", "index", "value", "needle"), [
    ("model.layers.0.self_attn.A_log", (0, 0, 1, 0), np.nan, "non-finite"),
    ("model.layers.0.self_attn.A_log", (0, 0, 1, 0), 100.0, "over 30"),  # exp overflows float32: NaN gates, then
    ("model.layers.0.self_attn.A_log", (0, 0, 1, 0), 31.0, "over 30"),   # LinAlgError in every request
    ("model.layers.0.self_attn.dt_bias", (5,), np.inf, "non-finite"),
    ("model.layers.1.block_sparse_moe.gate.e_score_correction_bias", (0,), np.nan, "non-finite"),
    ("model.layers.1.block_sparse_moe.gate.weight", (0, 0), np.nan, "non-finite"),  # argsort hid the expert
    ("model.norm.weight", (3,), -np.inf, "non-finite"),
])
def test_bad_values_in_small_tensors_and_routers(tmp_path, name, index, value, needle):
    """A NaN or inf in a small tensor or a router, or an A_log whose exp() is no decay rate, is a load error naming
    the tensor and the index (these gave a LinAlgError in every request, which killed a server's engine, or
    silently never routed to an expert)."""
    d, cfg = _single(tmp_path, _set(name, index, value))
    _check_error(d, cfg, name, needle, str(list(index)))


def test_a_log_at_the_bound_loads(tmp_path):
    name = "model.layers.0.self_attn.A_log"
    d, cfg = _single(tmp_path, _set(name, (0, 0, 1, 0), 30.0))
    assert load_checkpoint(d, cfg, progress=False)[name][0, 0, 1, 0] == 30.0


def test_small_tensors_any_float_dtype(tmp_path):
    name = "model.layers.1.block_sparse_moe.gate.e_score_correction_bias"
    d, cfg = _single(tmp_path, lambda t: t.update({name: t[name].astype(ml_dtypes.bfloat16)}))
    got = load_checkpoint(d, cfg, progress=False)[name]
    assert got.dtype == np.float32 and np.any(got != 0)


def test_empty_directory(tmp_path):
    _check_error(tmp_path, parse_config(tiny_config()), str(tmp_path), SINGLE_FILE)


def _spoil(path, how):
    """Replace `path` with a broken link, a directory or a FIFO."""
    path.unlink(missing_ok=True)
    {"link": lambda: path.symlink_to(path.parent / "blobs" / path.name), "dir": path.mkdir,
     "fifo": lambda: os.mkfifo(path)}[how]()


_SPOILED = {"link": "a broken link (to a missing file)", "dir": "a directory, not a file", "fifo": "not a regular file"}


@pytest.mark.parametrize("how", list(_SPOILED))
@pytest.mark.parametrize("name", [SINGLE_FILE, INDEX_FILE])
def test_checkpoint_file_not_a_file_is_named(tmp_path, name, how):
    """model.safetensors or the index that is a broken link, a directory or not a regular file is named, with what is
    wrong with it (was: "neither model.safetensors nor model.safetensors.index.json found")."""
    d, cfg = _single(tmp_path) if name == SINGLE_FILE else _sharded(tmp_path)[:2]
    _spoil(d / name, how)
    _check_error(d, cfg, f"{d / name}: {_SPOILED[how]}")


# ---------------------------------------------------------------------------------------------
# sharded directories


def _sharded(tmp_path):
    d = write_random_checkpoint(tiny_config(), tmp_path, num_shards=3)
    return d, parse_config(tiny_config()), json.loads((d / INDEX_FILE).read_text())


@pytest.mark.parametrize("text", ["{not json", "[1]", '{"weight_map": [1]}', '{"weight_map": {"a": 3}}'])
def test_index_malformed(tmp_path, text):
    d, cfg, _ = _sharded(tmp_path)
    (d / INDEX_FILE).write_text(text)
    _check_error(d, cfg, str(d / INDEX_FILE))


def test_index_path_escape(tmp_path):
    d, cfg, index = _sharded(tmp_path)
    index["weight_map"]["model.norm.weight"] = "../evil.safetensors"
    (d / INDEX_FILE).write_text(json.dumps(index))
    _check_error(d, cfg, str(d / INDEX_FILE), "model.norm.weight")


def test_index_shard_missing(tmp_path):
    d, cfg, _ = _sharded(tmp_path)
    (d / "model-00002-of-00003.safetensors").unlink()
    _check_error(d, cfg, "model-00002-of-00003.safetensors", "missing")


def test_single_file_wins_over_the_index_with_a_warning(tmp_path, caplog):
    """With both model.safetensors and the index, model.safetensors is read, as transformers' from_pretrained does,
    and the index is named in a warning (was: the index, silently)."""
    d, cfg, _ = _sharded(tmp_path / "sharded")
    single, _ = _single(tmp_path / "single", lambda t: t.update({"model.norm.weight": np.full_like(t["model.norm.weight"], 3)}))
    (d / SINGLE_FILE).write_bytes((single / SINGLE_FILE).read_bytes())
    with caplog.at_level("WARNING"):
        got = load_checkpoint(d, cfg, progress=False)
    assert np.all(got["model.norm.weight"] == 3)
    assert f"{d / INDEX_FILE}: ignored" in caplog.text and str(d / SINGLE_FILE) in caplog.text


@pytest.mark.parametrize("how", list(_SPOILED))
def test_index_shard_not_a_file_is_named(tmp_path, how):
    """(was: a shard that is a directory or a FIFO reported as "missing")"""
    d, cfg, _ = _sharded(tmp_path)
    _spoil(d / "model-00002-of-00003.safetensors", how)
    _check_error(d, cfg, "model-00002-of-00003.safetensors", f"is {_SPOILED[how]}")


def test_index_names_wrong_file(tmp_path):
    d, cfg, index = _sharded(tmp_path)
    name = next(n for n, f in index["weight_map"].items() if f.startswith("model-00001"))
    index["weight_map"][name] = "model-00003-of-00003.safetensors"
    (d / INDEX_FILE).write_text(json.dumps(index))
    _check_error(d, cfg, name, "model-0000")


def test_index_lists_absent_tensor(tmp_path):
    d, cfg, index = _sharded(tmp_path)
    index["weight_map"]["model.extra.weight"] = "model-00001-of-00003.safetensors"
    (d / INDEX_FILE).write_text(json.dumps(index))
    _check_error(d, cfg, "model-00001-of-00003.safetensors", "model.extra.weight")


# ---------------------------------------------------------------------------------------------
# transformers save_pretrained layout


def test_transformers_dense_spelling_is_renamed(tmp_path):
    def rename(t):
        for proj in ("gate", "up", "down"):
            t[f"model.layers.0.block_sparse_moe.{proj}_proj.weight"] = t.pop(f"model.layers.0.mlp.{proj}_proj.weight")

    d, cfg = _single(tmp_path, rename)
    w = load_checkpoint(d, cfg, progress=False)
    assert "model.layers.0.mlp.up_proj.weight" in w


def test_both_dense_spellings_is_an_error(tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    d, cfg = _single(tmp_path, lambda t: t.update({"model.layers.0.block_sparse_moe.up_proj.weight": t[name]}))
    _check_error(d, cfg, "model.layers.0.block_sparse_moe.up_proj.weight", name)


@pytest.mark.parity
@pytest.mark.parametrize("shard_size", [None, "100KB"], ids=["single", "sharded"])
def test_transformers_save_pretrained_round_trip(tmp_path, shard_size):
    """transformers -> save_pretrained -> our loader -> our writer (hub layout) -> transformers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from kda_rt.loader.config import load_config

    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**tiny_config()))
    with torch.no_grad():  # make the zero/one-initialised tensors distinguishable
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model = model.to(torch.bfloat16)
    saved = tmp_path / "saved"
    model.save_pretrained(saved, **({} if shard_size is None else {"max_shard_size": shard_size}))
    assert (saved / (SINGLE_FILE if shard_size is None else INDEX_FILE)).exists()

    cfg = load_config(saved)
    weights = load_checkpoint(saved, cfg, progress=False)
    assert "model.layers.0.mlp.gate_proj.weight" in weights

    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "config.json").write_text((saved / "config.json").read_text())
    save_safetensors(hub / SINGLE_FILE, weights, {"format": "pt"})
    again, info = transformers.KimiLinearForCausalLM.from_pretrained(hub, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    want = model.state_dict()
    for name, value in again.state_dict().items():
        assert torch.equal(value.float(), want[name].float()), name


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
