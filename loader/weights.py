"""Checkpoint names and shapes, and the checked loader of a Kimi Linear safetensors directory.

`expected_tensors(config)` is the single list of hub tensor names (spec §2) with their shapes and
a kind; the random-checkpoint writer and `load_checkpoint` both use it.  `load_checkpoint` reads a
single `model.safetensors` or the shards named by `model.safetensors.index.json`, maps the one
spelling transformers' `save_pretrained` writes differently (the dense layer-0 MLP under
`block_sparse_moe.` instead of `mlp.`) back to hub names, and rejects missing, unexpected,
mis-shaped or mis-typed tensors with a `CheckpointError` naming the file and the tensor.

Letters: D hidden, V vocab, H KDA heads, K KDA head dim, P = H*K, W conv width, E experts,
I dense MLP width, M expert width, S shared experts.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import TYPE_CHECKING

import numpy as np

from .config import DENSE, KDA
from .safetensors_mmap import DTYPES, CheckpointError, read_safetensors

if TYPE_CHECKING:
    from .config import ModelConfig

__all__ = [
    "A_LOG", "CONV", "DT_BIAS", "EMBEDDING", "INDEX_FILE", "MATMUL", "MATMUL_KINDS", "NORM", "ROUTER_BIAS",
    "SINGLE_FILE", "expected_tensors", "load_checkpoint",
]

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# tensor kinds: the first two are large and stay memory-mapped in their stored dtype; the rest are
# small and come back as float32
EMBEDDING, MATMUL = "embedding", "matmul"
NORM, CONV, A_LOG, DT_BIAS, ROUTER_BIAS = "norm", "conv", "a_log", "dt_bias", "router_bias"
MATMUL_KINDS = (EMBEDDING, MATMUL)
_MATMUL_DTYPES = tuple(DTYPES[c] for c in ("BF16", "F16", "F32"))
_FLOAT_DTYPES = tuple(DTYPES[c] for c in ("BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2"))

Shape = tuple[int, ...]


def expected_tensors(config: ModelConfig) -> dict[str, tuple[Shape, str]]:
    """Hub checkpoint name -> (shape, kind) for every tensor the model needs, in a stable order."""
    D = config.hidden_size
    out: dict[str, tuple[Shape, str]] = {"model.embed_tokens.weight": ((config.vocab_size, D), EMBEDDING)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ((D,), NORM)
        a = p + "self_attn."
        if config.layer_types[i] == KDA:
            kda = config.kda
            H, K, W = kda.num_heads, kda.head_dim, kda.conv_kernel_size
            P = H * K
            for x in "qkv":
                out[a + f"{x}_proj.weight"] = ((P, D), MATMUL)
            for x in "qkv":
                out[a + f"{x}_conv1d.weight"] = ((P, 1, W), CONV)
            out[a + "A_log"] = ((1, 1, H, 1), A_LOG)
            out[a + "f_a_proj.weight"] = ((K, D), MATMUL)
            out[a + "f_b_proj.weight"] = ((P, K), MATMUL)
            out[a + "dt_bias"] = ((P,), DT_BIAS)
            out[a + "b_proj.weight"] = ((H, D), MATMUL)
            out[a + "g_a_proj.weight"] = ((K, D), MATMUL)
            out[a + "g_b_proj.weight"] = ((P, K), MATMUL)
            out[a + "o_norm.weight"] = ((K,), NORM)
            out[a + "o_proj.weight"] = ((D, P), MATMUL)
        else:
            mla = config.mla
            Hm, R = mla.num_heads, mla.kv_lora_rank
            out[a + "q_proj.weight"] = ((Hm * mla.qk_head_dim, D), MATMUL)
            out[a + "kv_a_proj_with_mqa.weight"] = ((R + mla.qk_rope_head_dim, D), MATMUL)
            out[a + "kv_a_layernorm.weight"] = ((R,), NORM)
            out[a + "kv_b_proj.weight"] = ((Hm * (mla.qk_nope_head_dim + mla.v_head_dim), R), MATMUL)
            out[a + "o_proj.weight"] = ((D, Hm * mla.v_head_dim), MATMUL)
        out[p + "post_attention_layernorm.weight"] = ((D,), NORM)
        if config.mlp_types[i] == DENSE:
            _add_mlp(out, p + "mlp.", D, config.intermediate_size)
        else:
            moe = config.moe
            E, M = moe.num_experts, moe.intermediate_size
            m = p + "block_sparse_moe."
            out[m + "gate.weight"] = ((E, D), MATMUL)
            out[m + "gate.e_score_correction_bias"] = ((E,), ROUTER_BIAS)
            for e in range(E):
                out[m + f"experts.{e}.w1.weight"] = ((M, D), MATMUL)
                out[m + f"experts.{e}.w2.weight"] = ((D, M), MATMUL)
                out[m + f"experts.{e}.w3.weight"] = ((M, D), MATMUL)
            if moe.num_shared_experts:
                _add_mlp(out, m + "shared_experts.", D, M * moe.num_shared_experts)
    out["model.norm.weight"] = ((D,), NORM)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = ((config.vocab_size, D), MATMUL)
    return out


def _add_mlp(out: dict[str, tuple[Shape, str]], prefix: str, D: int, width: int) -> None:
    out[prefix + "gate_proj.weight"] = ((width, D), MATMUL)
    out[prefix + "up_proj.weight"] = ((width, D), MATMUL)
    out[prefix + "down_proj.weight"] = ((D, width), MATMUL)


# ---------------------------------------------------------------------------------------------
# reading files


def _read_files(model_dir: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors of the directory under their stored names, and name -> file it came from."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    single_path = os.path.join(model_dir, SINGLE_FILE)
    tensors: dict[str, np.ndarray] = {}
    source: dict[str, str] = {}
    if not os.path.exists(index_path):
        if not os.path.isfile(single_path):
            raise CheckpointError(f"{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
        tensors = read_safetensors(single_path)
        return tensors, dict.fromkeys(tensors, single_path)
    try:
        with open(index_path, encoding="utf-8") as fh:
            index = json.load(fh)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{index_path}: cannot read as JSON ({exc})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: 'weight_map' must be an object mapping tensor names to file names")
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        if not fname or os.path.basename(fname) != fname or fname in (".", ".."):
            raise CheckpointError(f"{index_path}: tensor '{name}' maps to {fname!r}, not a file in the directory")
        by_file.setdefault(fname, []).append(name)
    for fname, names in by_file.items():
        path = os.path.join(model_dir, fname)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: shard listed in {INDEX_FILE} (e.g. for tensor '{names[0]}') is missing")
        shard = read_safetensors(path)
        for name in names:
            if name not in shard:
                raise CheckpointError(f"{path}: tensor '{name}' is listed in {INDEX_FILE} but not in this file")
        for name in shard:
            if name not in weight_map or weight_map[name] != fname:
                raise CheckpointError(f"{path}: tensor '{name}' is in this file but {INDEX_FILE} does not map it here")
            tensors[name] = shard[name]
            source[name] = path
    return tensors, source


_TRANSFORMERS_DENSE = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")


def _to_hub_names(config: ModelConfig, tensors: dict[str, np.ndarray], source: dict[str, str]) -> None:
    """Rename, in place, transformers' save_pretrained spelling of the dense MLP to the hub one."""
    for name in list(tensors):
        m = _TRANSFORMERS_DENSE.match(name)
        layer = int(m.group(1)) if m else -1
        if not m or layer >= config.num_hidden_layers or config.mlp_types[layer] != DENSE:
            continue
        hub = f"model.layers.{layer}.mlp.{m.group(2)}"
        if hub in tensors:
            raise CheckpointError(f"{source[name]}: tensor '{name}' and '{hub}' ({source[hub]}) are the same weight")
        tensors[hub] = tensors.pop(name)
        source[hub] = source.pop(name)


def _listing(names: list[str], source: dict[str, str] | None = None) -> str:
    shown = [f"'{n}'" + (f" ({source[n]})" if source else "") for n in names[:5]]
    return ", ".join(shown) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


# ---------------------------------------------------------------------------------------------


def load_checkpoint(
    model_dir: str | os.PathLike[str],
    config: ModelConfig,
    *,
    progress: bool | None = None,
) -> dict[str, np.ndarray]:
    """Load and check every tensor of a checkpoint directory against `config`.

    Returns hub name -> array in `expected_tensors` order.  Embedding and matmul weights are the
    read-only memory-mapped views in their stored dtype (bf16 / f16 / f32, nothing copied); the
    small tensors (norms, conv, A_log, dt_bias, router bias) are float32 copies.  `progress` shows
    a tqdm bar; None shows it for checkpoints over 1 GiB.
    """
    model_dir = os.fspath(model_dir)
    tensors, source = _read_files(model_dir)
    _to_hub_names(config, tensors, source)
    expected = expected_tensors(config)
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"{model_dir}: unexpected tensors for this config: {_listing(unexpected, source)}")
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensors: {_listing(missing)}")

    total = sum(t.nbytes for t in tensors.values())
    show = total > (1 << 30) if progress is None else progress
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"checking {os.path.basename(model_dir) or model_dir}")
    out: dict[str, np.ndarray] = {}
    try:
        for name, (shape, kind) in expected.items():
            arr = tensors[name]
            where = f"{source[name]}: tensor '{name}'"
            if arr.shape != shape:
                raise CheckpointError(f"{where}: shape {list(arr.shape)} but the config implies {list(shape)}")
            if kind in MATMUL_KINDS:
                if arr.dtype not in _MATMUL_DTYPES:
                    raise CheckpointError(f"{where}: dtype {arr.dtype} for a {kind} weight (want bf16, f16 or f32)")
                out[name] = arr
            else:
                if arr.dtype not in _FLOAT_DTYPES:
                    raise CheckpointError(f"{where}: dtype {arr.dtype} for a {kind} tensor (want a float type)")
                out[name] = arr.astype(np.float32)
            if bar is not None:
                bar.update(arr.nbytes)
    finally:
        if bar is not None:
            bar.close()
    return out
