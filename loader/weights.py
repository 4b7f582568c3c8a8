"""The checked loader of a Kimi Linear safetensors directory.

`load_checkpoint` reads a single `model.safetensors` or the shards named by `model.safetensors.index.json`
(with both there, `model.safetensors`, as transformers does, and a warning), maps the one spelling
transformers' `save_pretrained` writes differently (the dense layer-0 MLP under `block_sparse_moe.` instead of
`mlp.`) back to hub names, and checks every tensor against `expected_tensors(config)` (the weight schema,
`loader/schema.py`, the one place checkpoint names are spelled), rejecting missing, unexpected, mis-shaped or
mis-typed tensors, and non-finite small tensors or routers (or an A_log past A_LOG_MAX), with a
`CheckpointError` naming the file and the tensor.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import numpy as np

from .jsonfile import read_json
from .safetensors_mmap import DTYPES, CheckpointError, read_safetensors
from .schema import (  # re-exported
    A_LOG,
    CONV,
    DT_BIAS,
    EMBEDDING,
    MATMUL,
    MATMUL_KINDS,
    NORM,
    ROUTER,
    ROUTER_BIAS,
    expected_tensors,
    transformers_to_hub,
)

if TYPE_CHECKING:
    from .config import ModelConfig

__all__ = [
    "A_LOG", "CONV", "DT_BIAS", "EMBEDDING", "INDEX_FILE", "MATMUL", "MATMUL_KINDS", "NORM", "ROUTER", "ROUTER_BIAS",
    "SINGLE_FILE", "expected_tensors", "load_checkpoint",
]

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_MATMUL_DTYPES = tuple(DTYPES[c] for c in ("BF16", "F16", "F32"))
_FLOAT_DTYPES = tuple(DTYPES[c] for c in ("BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2"))
# exp(A_log) is a KDA head's decay rate (1 .. 16 at fla's initialisation); past e^30 every token's gate already
# clears the state, and far past it (e^88.7) float32 overflows: the gates become -inf or NaN
A_LOG_MAX = 30.0


# ---------------------------------------------------------------------------------------------
# reading files


def _not_a_file(path: str) -> str | None:
    """What keeps `path` from being read as a regular file (a link to one is fine), or None."""
    if os.path.isfile(path):
        return None
    if os.path.islink(path) and not os.path.exists(path):
        return "a broken link (to a missing file)"
    if os.path.isdir(path):
        return "a directory, not a file"
    return "not a regular file" if os.path.lexists(path) else "missing"


def _read_files(model_dir: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors of the directory under their stored names, and name -> file it came from."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    single_path = os.path.join(model_dir, SINGLE_FILE)
    tensors: dict[str, np.ndarray] = {}
    source: dict[str, str] = {}
    for path in (single_path, index_path):
        problem = _not_a_file(path)
        if problem not in (None, "missing"):
            raise CheckpointError(f"{path}: {problem}")
    if os.path.isfile(single_path):  # read first when both are there, as transformers' from_pretrained does
        if os.path.exists(index_path):
            logger.warning("%s: ignored, and the shards it names: %s is read instead (as transformers does)",
                           index_path, single_path)
        tensors = read_safetensors(single_path)
        return tensors, dict.fromkeys(tensors, single_path)
    if not os.path.exists(index_path):
        raise CheckpointError(f"{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    index = read_json(index_path, CheckpointError, want_object=False)  # a non-object: no 'weight_map', named below
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
        problem = _not_a_file(path)
        if problem is not None:
            raise CheckpointError(f"{path}: shard listed in {INDEX_FILE} (e.g. for tensor '{names[0]}') is {problem}")
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


def _to_hub_names(config: ModelConfig, tensors: dict[str, np.ndarray], source: dict[str, str]) -> None:
    """Rename, in place, transformers' save_pretrained spelling of the dense MLP to the hub one."""
    for name in list(tensors):
        hub = transformers_to_hub(config, name)
        if hub is None:
            continue
        if hub in tensors:
            raise CheckpointError(f"{source[name]}: tensor '{name}' and '{hub}' ({source[hub]}) are the same weight")
        tensors[hub] = tensors.pop(name)
        source[hub] = source.pop(name)


def _check_values(where: str, values: np.ndarray, kind: str) -> np.ndarray:
    """The small tensors and the routers (a few MB in all, read whole): finite, and A_log within A_LOG_MAX.  Matmul
    weights are not read here (a NaN there makes the logits non-finite, which the engine reports per request)."""
    bad = ~np.isfinite(values)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise CheckpointError(f"{where}: {int(bad.sum())} non-finite value(s) (NaN, inf, or past float32's range), the "
                              f"first {values[at]} at index {list(at)}")
    if kind == A_LOG and values.max() > A_LOG_MAX:
        at = tuple(int(i) for i in np.argwhere(values > A_LOG_MAX)[0])
        raise CheckpointError(f"{where}: A_log {values[at]:.4g} at index {list(at)} is over {A_LOG_MAX:g} (exp(A_log) "
                              f"is a head's decay rate, 1 to 16 at initialisation; e^{A_LOG_MAX:g} already clears the "
                              "state every token)")
    return values


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
                if kind == ROUTER:  # (NaN there hides an expert from the top-k: read it, a few MB)
                    _check_values(where, arr.astype(np.float32), kind)
            else:
                if arr.dtype not in _FLOAT_DTYPES:
                    raise CheckpointError(f"{where}: dtype {arr.dtype} for a {kind} tensor (want a float type)")
                out[name] = _check_values(where, arr.astype(np.float32), kind)
            if bar is not None:
                bar.update(arr.nbytes)
    finally:
        if bar is not None:
            bar.close()
    return out
