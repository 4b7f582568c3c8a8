"""`write_random_checkpoint` / `python -m kda_rt.random_checkpoint`: the directories it writes load
with `load_config` + `load_checkpoint`, for several configs, single-file and sharded."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from helpers.configs import tiny_config
from kda_rt.loader.config import load_config
from kda_rt.loader.safetensors_mmap import read_safetensors_metadata
from kda_rt.loader.weights import INDEX_FILE, SINGLE_FILE, expected_tensors, load_checkpoint
from kda_rt.random_checkpoint import main, write_random_checkpoint

CONFIGS = {
    "tiny": (tiny_config(), 1),
    "tiny-3-shards": (tiny_config(), 3),
    "tied-no-shared-2-groups": (tiny_config(tie_word_embeddings=True, num_shared_experts=0, num_expert_group=2,
                                            topk_group=2, num_experts_per_token=4), 2),
    "all-kda-dense": (tiny_config(num_hidden_layers=2, first_k_dense_replace=2,
                                  linear_attn_config={"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 3,
                                                      "kda_layers": [1, 2], "full_attn_layers": []}), 1),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_written_directory_loads(tmp_path, case):
    raw, shards = CONFIGS[case]
    d = write_random_checkpoint(raw, tmp_path / "ckpt", num_shards=shards, seed=1)
    assert json.loads((d / "config.json").read_text()) == raw
    cfg = load_config(d)
    weights = load_checkpoint(d, cfg, progress=False)
    assert list(weights) == list(expected_tensors(cfg))
    if shards == 1:
        assert (d / SINGLE_FILE).exists() and not (d / INDEX_FILE).exists()
        assert read_safetensors_metadata(d / SINGLE_FILE) == {"format": "pt"}
    else:
        index = json.loads((d / INDEX_FILE).read_text())
        files = sorted(set(index["weight_map"].values()))
        assert files == [f"model-{k:05d}-of-{shards:05d}.safetensors" for k in range(1, shards + 1)]
        assert not (d / SINGLE_FILE).exists()


def test_values_depend_on_seed_not_shards(tmp_path):
    raw = tiny_config()
    one = load_checkpoint(write_random_checkpoint(raw, tmp_path / "a", seed=5), load_config(tmp_path / "a"))
    many = load_checkpoint(write_random_checkpoint(raw, tmp_path / "b", seed=5, num_shards=5), load_config(tmp_path / "b"))
    other = load_checkpoint(write_random_checkpoint(raw, tmp_path / "c", seed=6), load_config(tmp_path / "c"))
    name = "model.layers.1.self_attn.q_proj.weight"
    for key in one:
        assert np.array_equal(one[key].view(np.uint8), many[key].view(np.uint8)), key
    assert not np.array_equal(one[name].view(np.uint8), other[name].view(np.uint8))


def test_scales_and_dtypes(tmp_path):
    d = write_random_checkpoint(tiny_config(intermediate_size=1024, hidden_size=256), tmp_path, seed=0)
    w = load_checkpoint(d, load_config(d))
    down = w["model.layers.0.mlp.down_proj.weight"].astype(np.float32)  # fan_in 1024
    assert w["model.layers.0.mlp.down_proj.weight"].dtype == ml_dtypes.bfloat16
    assert abs(down.std() * np.sqrt(1024) - 1) < 0.05
    bias = w["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"]
    assert 0.1 < bias.std() < 0.6
    a_log = w["model.layers.0.self_attn.A_log"]
    assert np.all((a_log >= 0) & (a_log <= np.log(16)))
    norm = w["model.layers.0.input_layernorm.weight"]
    assert abs(norm.mean() - 1) < 0.05 and 0.05 < norm.std() < 0.2
    from kda_rt.loader.safetensors_mmap import read_safetensors

    stored = read_safetensors(d / SINGLE_FILE)
    for name in ("model.layers.0.self_attn.A_log", "model.layers.0.self_attn.dt_bias",
                 "model.layers.1.block_sparse_moe.gate.e_score_correction_bias"):
        assert stored[name].dtype == np.float32, name
    assert stored["model.layers.0.self_attn.q_conv1d.weight"].dtype == ml_dtypes.bfloat16


def test_float32_dtype_and_stale_shards_removed(tmp_path):
    write_random_checkpoint(tiny_config(), tmp_path, num_shards=3)
    d = write_random_checkpoint(tiny_config(), tmp_path, dtype="float32")
    assert sorted(p.name for p in d.iterdir()) == ["config.json", SINGLE_FILE]
    w = load_checkpoint(d, load_config(d))
    assert w["lm_head.weight"].dtype == np.float32


def test_tokenizer_copy(tmp_path):
    src = tmp_path / "tok"
    src.mkdir()
    (src / "tiktoken.model").write_text("abc 0\n")
    (src / "tokenizer_config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"not copied")
    d = write_random_checkpoint(tiny_config(), tmp_path / "out", tokenizer_dir=src)
    assert (d / "tiktoken.model").read_text() == "abc 0\n"
    assert (d / "tokenizer_config.json").exists()
    load_checkpoint(d, load_config(d))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        write_random_checkpoint(tiny_config(), tmp_path / "out2", tokenizer_dir=empty)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        write_random_checkpoint(tiny_config(), tmp_path, dtype="int8")
    with pytest.raises(ValueError, match="num_shards"):
        write_random_checkpoint(tiny_config(), tmp_path, num_shards=0)


def test_cli(tmp_path, capsys):
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(tiny_config()))
    main(["--config", str(cfg_path), "--out", str(tmp_path / "cli"), "--seed", "2", "--shards", "2"])
    assert str(tmp_path / "cli") in capsys.readouterr().out
    d = tmp_path / "cli"
    assert (d / INDEX_FILE).exists()
    load_checkpoint(d, load_config(d))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))


@pytest.mark.parametrize(("content", "needle"), [
    (None, "--config '{path}': not found"), ("{oops", "--config '{path}':1:2: not valid JSON"),
    ('{"model_type": "llama"}', "write_random_checkpoint(config): unsupported model_type 'llama'"),
], ids=["missing", "malformed", "bad-field"])
def test_cli_names_a_bad_config(tmp_path, capsys, content, needle):
    """python -m kda_rt.random_checkpoint with a bad --config: one `error:` line naming it, exit status 2 (was a
    traceback)."""
    from kda_rt.random_checkpoint import main

    path = tmp_path / "c.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "error: " + needle.format(path=path) in err, err


@pytest.mark.parametrize(("argv", "needle"), [
    (["--seed", "-1"], "--seed must be >= 0"), (["--shards", "0"], "--shards must be >= 1, got 0"),
    (["--router-bias-std", "nan"], "--router-bias-std must be a finite number >= 0, got nan"),
    (["--router-bias-std", "inf"], "--router-bias-std must be a finite number >= 0, got inf"),
    (["--router-bias-std", "-1"], "--router-bias-std must be a finite number >= 0, got -1.0"),
    (["--tokenizer-from", "{file}"], "--tokenizer-from '{file}': not a directory"),
    (["--tokenizer-from", "{tmp}/nope"], "--tokenizer-from '{tmp}/nope': no such directory"),
    (["--out", "{file}"], "--out '{file}': cannot create the directory (File exists)"),
    (["--out", "{file}/sub"], "--out '{file}/sub': cannot create the directory (Not a directory)"),
], ids=["seed-negative", "shards-zero", "bias-nan", "bias-inf", "bias-negative", "tokenizer-file", "tokenizer-missing",
        "out-file", "out-under-file"])
def test_cli_bad_flags_named(tmp_path, capsys, argv, needle):
    """Refused by flag, one `error:` line and exit status 2, nothing written (was: --seed -1 "expected non-negative
    integer"; --router-bias-std nan or inf wrote NaN or inf biases and exited 0; a file as --tokenizer-from or --out a
    NotADirectoryError / FileExistsError traceback, after the weights were written)."""
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(tiny_config()))
    file = tmp_path / "afile"
    file.write_text("x")
    argv = [a.format(file=file, tmp=tmp_path) for a in argv]
    out = [] if "--out" in argv else ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(cfg_path), *out, *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "error: " + needle.format(file=file, tmp=tmp_path) in err, err
    assert not (tmp_path / "out").exists()
