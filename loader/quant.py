"""FP8 (e4m3) weights with one fp32 scale per output row (per channel): the weight format that the GEMV kernels take
besides bf16 (kernels_cu/moe_gemv.cu WFMT = 1: ops/gemv.gemv_dense and ops/moe_gemv.moe_gemv_gate_up with `scale`).

    w[n, k] ≈ float(q[n, k]) · scale[n],   scale[n] = max_k |w[n, k]| / 448   (448: e4m3's largest finite value)

so each row uses e4m3's whole range and the rounding error of an entry is at most half an e4m3 ulp of its scaled
value (2^-4 relative for normal values).  A row of zeros gets scale 1 (every q 0), and so does a row whose largest
entry is below 448 x fp32's smallest normal (~5e-36: its scale would be an fp32 subnormal, losing the row's range;
such a row is zero to any use).  e4m3 here is the "fn" variant (no infinities, one NaN pattern), the one
checkpoints store as safetensors F8_E4M3."""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["E4M3", "E4M3_MAX", "dequantize_rows", "expert_weight_names", "quantize_experts", "quantize_rows"]

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448.0


def quantize_rows(w: np.ndarray, name: str = "weight", reciprocal: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] (any float dtype) -> (q [N, K] e4m3, scale [N] fp32) as above.  A non-finite entry is refused with
    the tensor's name and the entry's row and column (it would make its whole row's scale, and every product, NaN).
    reciprocal: the activations' rule (the prefill GEMMs' e4m3 sources, quant.cu's activation kernels and
    rmsnorm.cu E4M3_OUT): q = e4m3(w · (1 / scale)) with the reciprocal rounded once in fp32, as vLLM's dynamic
    per-token quantization multiplies by its inverted scale, instead of one quotient an element (weights, at
    load); the same scale, and a code moves only where w / scale lies within an ulp of a rounding tie."""
    w = np.asarray(w)
    if w.ndim != 2 or not (w.dtype.kind == "f" or w.dtype == np.dtype(ml_dtypes.bfloat16)):
        raise ValueError(f"quantize_rows: {name} must be a 2-D float array, got shape {w.shape} dtype {w.dtype}")
    with np.errstate(over="ignore"):  # (a float64 entry past float32's range becomes inf: refused below)
        w32 = w.astype(np.float32)
    bad = ~np.isfinite(w32)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        v = float(w[r, c])
        what = "a non-finite entry" if not np.isfinite(v) else "an entry outside float32's range"
        raise ValueError(f"quantize_rows: {name} has {what} ({v}) at row {r}, column {c}")
    amax = np.abs(w32).max(axis=1) if w32.shape[1] else np.zeros(w32.shape[0], np.float32)
    tiny = E4M3_MAX * float(np.finfo(np.float32).tiny)  # below it the scale would be subnormal
    scale = np.where(amax >= tiny, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    w32[amax < tiny] = 0.0  # (zero to any use: see above)
    # the division's rounding can put |w / scale| a hair above 448; clip so that it rounds to 448, not to NaN
    scaled = w32 * (np.float32(1) / scale)[:, None] if reciprocal else w32 / scale[:, None]
    q = np.clip(scaled, -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return q, scale


def dequantize_rows(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32 q · scale (per row), the values the kernels multiply."""
    if q.dtype != E4M3 or q.ndim != 2 or scale.shape != (q.shape[0],):
        raise ValueError(f"dequantize_rows: needs q [N, K] e4m3 and scale [N], got {q.dtype} {q.shape} and "
                         f"{scale.dtype} {scale.shape}")
    return q.astype(np.float32) * scale.astype(np.float32)[:, None]


def expert_weight_names(config) -> list[str]:
    """The checkpoint names of the weights `EngineConfig.quantization = "fp8"` stores in e4m3: every routed expert's
    w1, w3, w2 and, when the MoE has one shared expert (of the experts' width: the CUDA backend computes it in the
    experts' stacks), its gate, up and down projections.  Row-wise e4m3 per these [rows, K] matrices is the same as
    per the CUDA stacks' rows (w1 | w3 stacked by rows, w2 as it is)."""
    if config.moe is None:
        return []
    names = []
    for i, kind in enumerate(config.mlp_types):
        if kind != "moe":
            continue
        base = f"model.layers.{i}.block_sparse_moe."
        names += [f"{base}experts.{e}.{w}.weight" for e in range(config.moe.num_experts) for w in ("w1", "w3", "w2")]
        if config.moe.num_shared_experts == 1:
            names += [f"{base}shared_experts.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")]
    return names


def quantize_experts(config, raw):
    """The checkpoint `raw` (name -> array) with each weight of expert_weight_names replaced by its e4m3 values,
    dequantized (float32 q · scale, quantize_rows per row): what the NumPy backend runs for an fp8 model, the values the
    CUDA backend's e4m3 kernels multiply (ops/quant.quantize_rows_e4m3 gives the same codes and scales from the bf16
    values it uploads, so the weights are rounded to bf16 first here too).  Other entries are passed through as they
    are."""
    bf16 = np.dtype(ml_dtypes.bfloat16)
    out = dict(raw)
    for name in expert_weight_names(config):
        if name not in out:
            raise ValueError(f"quantize_experts: the checkpoint has no {name}")
        w = np.asarray(out[name])
        q, scale = quantize_rows(w if w.dtype == bf16 else w.astype(bf16), name)
        out[name] = dequantize_rows(q, scale)
    return out
