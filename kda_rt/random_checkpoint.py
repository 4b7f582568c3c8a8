"""Write a random-weight Kimi Linear checkpoint in the exact hub layout (spec §2).

    python -m kda_rt.random_checkpoint --config cfg.json --out DIR [--seed N] [--shards N]
                                       [--tokenizer-from DIR]

Names and shapes come from `kda_rt.loader.weights.expected_tensors`, so whatever this writes,
`load_checkpoint` accepts.  Scales keep activations O(1) through many layers (z ~ N(0, 1)):
matmul weights z/sqrt(fan_in), embeddings z, norm weights 1 + 0.1·z, conv weights 0.5·z,
A_log = log U(1, 16), dt_bias z, router correction bias 0.3·z (non-zero, so a loader that drops
it changes routing).  A_log, dt_bias and the correction bias are stored fp32; all
other tensors in `dtype`.  Values depend on the seed only, not on the number of shards.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from kda_rt.loader.config import parse_config
from kda_rt.loader.jsonfile import read_json
from kda_rt.loader.safetensors_mmap import save_safetensors
from kda_rt.loader.weights import (
    A_LOG,
    CONV,
    DT_BIAS,
    EMBEDDING,
    INDEX_FILE,
    NORM,
    ROUTER_BIAS,
    SINGLE_FILE,
    expected_tensors,
)

if TYPE_CHECKING:
    from kda_rt.loader.config import ModelConfig

__all__ = ["TOKENIZER_PATTERNS", "random_tensor", "random_weights", "write_random_checkpoint"]

_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
_FP32_KINDS = (A_LOG, DT_BIAS, ROUTER_BIAS)
TOKENIZER_PATTERNS = (
    "tokenizer*.json", "tiktoken.model", "*.tiktoken", "special_tokens_map.json", "added_tokens.json",
    "chat_template*", "tokenization_*.py", "vocab.*", "merges.txt", "generation_config.json",
)
_STALE_PATTERNS = (SINGLE_FILE, INDEX_FILE, "model-*-of-*.safetensors")


def random_tensor(rng: np.random.Generator, shape: tuple[int, ...], kind: str, *,
                  router_bias_std: float = 0.3, fixed_routing: bool = False) -> np.ndarray:
    """float32 values for one tensor of the given kind (see the module docstring for the scales)."""
    if kind == EMBEDDING:
        return rng.standard_normal(shape, dtype=np.float32)
    if kind == NORM:
        return 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    if kind == CONV:
        return 0.5 * rng.standard_normal(shape, dtype=np.float32)
    if kind == A_LOG:
        return np.log(rng.uniform(1.0, 16.0, size=shape)).astype(np.float32)
    if kind == DT_BIAS:
        return rng.standard_normal(shape, dtype=np.float32)
    if kind == ROUTER_BIAS:
        if fixed_routing:  # biases 2 apart (sigmoid scores span < 1): selection never depends on the input
            return (2.0 * rng.permutation(shape[-1])).astype(np.float32).reshape(shape)
        return np.float32(router_bias_std) * rng.standard_normal(shape, dtype=np.float32)
    return rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-1]))  # matmul [out, in]


def random_weights(config: ModelConfig, seed: int = 0, *, router_bias_std: float = 0.05,
                   share: bool | None = None) -> dict[str, np.ndarray]:
    """Hub name -> random tensor for every weight of `config`, as `load_checkpoint` would return
    them: embeddings and matmuls in the config's dtype (bf16 by default), small tensors float32.

    `share` (default: when the weights exceed 4 GiB): tensors of the same shape, kind and dtype are
    one array on the host (views of it), so the full 48B shape costs ~2 GB of host memory and a few
    seconds; the device still gets a separate copy of each, so the bytes every step moves are
    unchanged.  Router weights and correction biases are always drawn per layer, so routing
    follows the data (biases of std `router_bias_std`, small as in a trained model)."""
    from kda_rt.loader.weights import MATMUL_KINDS, ROUTER

    stored = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}.get(config.dtype, np.float32)
    rng = np.random.default_rng(seed)
    tensors = expected_tensors(config)
    dtype_of = {name: stored if kind in MATMUL_KINDS else np.float32 for name, (_, kind) in tensors.items()}
    if share is None:
        nbytes = sum(int(np.prod(shape)) * np.dtype(dtype_of[n]).itemsize for n, (shape, _) in tensors.items())
        share = nbytes > 4 * 2**30
    cache: dict[tuple, np.ndarray] = {}
    out = {}
    for name, (shape, kind) in tensors.items():
        key = (tuple(shape), kind, np.dtype(dtype_of[name]).str)
        per_layer = kind in (ROUTER, ROUTER_BIAS)
        if share and not per_layer and key in cache:
            out[name] = cache[key]
            continue
        value = random_tensor(rng, shape, kind, router_bias_std=router_bias_std).astype(dtype_of[name])
        if share and not per_layer:
            cache[key] = value
        out[name] = value
    return out


def _shard_plan(sizes: list[int], num_shards: int) -> list[int]:
    """Shard index per tensor: contiguous groups of roughly equal bytes, none empty."""
    total = sum(sizes)
    plan, shard, in_shard, done = [], 0, 0, 0
    for i, size in enumerate(sizes):
        unopened = num_shards - 1 - shard
        if in_shard and unopened and (done >= total * (shard + 1) / num_shards or len(sizes) - i == unopened):
            shard, in_shard = shard + 1, 0
        plan.append(shard)
        in_shard += 1
        done += size
    return plan


def write_random_checkpoint(
    config: dict[str, Any],
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    num_shards: int = 1,
    dtype: str = "bfloat16",
    tokenizer_dir: str | os.PathLike[str] | None = None,
    router_bias_std: float = 0.3,
    fixed_routing: bool = False,
) -> Path:
    """Write `config.json` (the dict verbatim) and random weights to `out_dir`; returns its path."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    model_config = parse_config(config, source="write_random_checkpoint(config)")
    expected = expected_tensors(model_config)
    if not 1 <= num_shards <= len(expected):
        raise ValueError(f"num_shards must be in 1..{len(expected)}, got {num_shards}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():  # never mix shards of two runs
        if old.is_file() and any(fnmatch.fnmatch(old.name, p) for p in _STALE_PATTERNS):
            old.unlink()
    with open(out / "config.json", "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
        fh.write("\n")

    names = list(expected)
    stored = {n: np.dtype(np.float32 if expected[n][1] in _FP32_KINDS else _DTYPES[dtype]) for n in names}
    sizes = [int(np.prod(expected[n][0])) * stored[n].itemsize for n in names]
    plan = _shard_plan(sizes, num_shards)
    files = [SINGLE_FILE] if num_shards == 1 else [
        f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors" for k in range(num_shards)
    ]
    rng = np.random.default_rng(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, np.ndarray] = {}
    for i, name in enumerate(names):
        shape, kind = expected[name]
        shard[name] = random_tensor(rng, shape, kind, router_bias_std=router_bias_std, fixed_routing=fixed_routing).astype(stored[name])
        weight_map[name] = files[plan[i]]
        if i == len(names) - 1 or plan[i + 1] != plan[i]:
            save_safetensors(out / files[plan[i]], shard, {"format": "pt"})
            shard = {}
    if num_shards > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        with open(out / INDEX_FILE, "w", encoding="utf-8") as fh:
            json.dump(index, fh, indent=2)
            fh.write("\n")
    if tokenizer_dir is not None:
        _copy_tokenizer(Path(tokenizer_dir), out)
    return out


def _copy_tokenizer(src: Path, out: Path) -> None:
    found = [p for p in sorted(src.iterdir()) if p.is_file() and any(fnmatch.fnmatch(p.name, t) for t in TOKENIZER_PATTERNS)]
    if not found:
        raise FileNotFoundError(f"{src}: no tokenizer files (looked for {', '.join(TOKENIZER_PATTERNS)})")
    for path in found:
        if path.resolve() != (out / path.name).resolve():
            shutil.copyfile(path, out / path.name)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kda_rt.random_checkpoint", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="config.json to copy (hub layout)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    ap.add_argument("--tokenizer-from", default=None, help="directory to copy tokenizer files from")
    ap.add_argument("--router-bias-std", type=float, default=0.3, help="std of e_score_correction_bias")
    ap.add_argument("--fixed-routing", action="store_true",
                    help="correction biases 2 apart, so expert selection never depends on the input (no router "
                         "near-ties: for tight backend-vs-backend comparisons)")
    args = ap.parse_args(argv)
    # each refused by name before anything is written (was: --seed -1 "expected non-negative integer", NaN or inf
    # router biases written with exit status 0, a file as --out or --tokenizer-from a traceback)
    if args.seed < 0:
        ap.error(f"--seed must be >= 0 (NumPy's generator takes no negative seed), got {args.seed}")
    if args.shards < 1:
        ap.error(f"--shards must be >= 1, got {args.shards}")
    if not 0.0 <= args.router_bias_std < math.inf:  # (NaN fails too)
        ap.error(f"--router-bias-std must be a finite number >= 0, got {args.router_bias_std}")
    if args.tokenizer_from is not None and not os.path.isdir(args.tokenizer_from):
        ap.error(f"--tokenizer-from {args.tokenizer_from!r}: "
                 f"{'not a directory' if os.path.exists(args.tokenizer_from) else 'no such directory'}")
    try:  # a bad --config or tokenizer directory: one line naming it, exit status 2 (not a traceback)
        config = read_json(args.config, label=f"--config {args.config!r}")
        try:
            os.makedirs(args.out, exist_ok=True)
        except OSError as exc:
            ap.error(f"--out {args.out!r}: cannot create the directory ({exc.strerror})")
        out = write_random_checkpoint(
            config, args.out, seed=args.seed, num_shards=args.shards, dtype=args.dtype,
            tokenizer_dir=args.tokenizer_from, router_bias_std=args.router_bias_std, fixed_routing=args.fixed_routing,
        )
    except (ValueError, OSError) as exc:  # ConfigError is a ValueError
        ap.error(str(exc))
    print(out)


if __name__ == "__main__":
    main()
