"""Launcher for kernels_cu/sampling.cu: penalties -> greedy or temperature/top-k/min-p/top-p -> draw,
all on the device (no host sync, no allocation once the outputs are given, graph-capturable).  A row
is split over a thread-block cluster of CLUSTER CTAs on sm_90+ (one CTA per row elsewhere and for
small vocabularies); tokens, thresholds and draws do not depend on the split.

Letters: B rows, V vocabulary, N top logprobs.  The draw is argmax p_i / E_i with E_i ~ Exp(1) from
Philox-4x32-10 keyed by (seed, step) and the token index, so a row's token depends only on its seed,
step and logits.  sampler/reference.py is the NumPy oracle and draws the very same Philox uniforms."""

from __future__ import annotations

import functools

import numpy as np

from kda_rt.cuda.ops.check import expect, i32
from kda_rt.cuda.ops.compile import get_kernel

__all__ = ["sample", "sample_config", "sample_defines", "update_counts", "mark_prompt_tokens", "MAX_TOP_LOGPROBS",
           "precompile"]

MAX_TOP_LOGPROBS = 32
CLUSTER = 8  # CTAs per row on sm_90+ (the portable cluster limit): 20480 tokens each at V = 163840
_MIN_SPLIT_V = 16384  # smaller rows: one CTA per row
_MAX_CACHE_BYTES = 200 * 1024  # a slice of x larger than this is reread from global memory ...
_STATIC_SMEM_BYTES = 24 * 1024   # ... and so is one that leaves less than this under the device's opt-in limit


@functools.cache
def _device(device_id: int) -> tuple[int, int, int]:
    """(compute capability as 90 / 100 / ..., SM count, the most shared memory a block can opt into)."""
    import cupy

    dev = cupy.cuda.Device(device_id)
    attrs = dev.attributes
    optin = attrs.get("MaxSharedMemoryPerBlockOptin")
    if optin is None:  # 97 = cudaDevAttrMaxSharedMemoryPerBlockOptin
        optin = cupy.cuda.runtime.deviceGetAttribute(97, device_id)
    return int(dev.compute_capability), int(attrs["MultiProcessorCount"]), int(optin)


def sample_config(B: int, V: int, cluster: int | None = None, threads: int | None = None) -> tuple[int, int, int, bool]:
    """(CLUSTER, THREADS, MIN_BLOCKS, CACHE_X) for B rows of V logits.  CLUSTER CTAs per row on sm_90+
    when V >= 16384; 1024 threads while the B * CLUSTER CTAs fit on the SMs at one per SM, else 512
    (two per SM: B = 32 is one wave).  `cluster` / `threads` force a variant (tests); every variant
    gives the same tokens (log-sum-exp merge order aside)."""
    import cupy

    cc, num_sms, smem_optin = _device(cupy.cuda.Device().id)
    if cluster is None:
        cluster = CLUSTER if cc >= 90 and V >= _MIN_SPLIT_V else 1
    if not 1 <= cluster <= 8 or (cluster > 1 and cc < 90):
        raise ValueError(f"cluster must be 1..8 (> 1 needs sm_90+), got {cluster} on compute capability {cc}")
    if threads is None:
        threads = (1024 if B * cluster <= num_sms else 512) if cluster > 1 else (1024 if V > 16384 else 256)
    if threads not in (256, 512, 1024):
        raise ValueError(f"threads must be 256, 512 or 1024, got {threads}")
    slice_ = (-(-V // cluster) + 3) // 4 * 4
    # the slice must fit beside the static shared memory (~17 KB) under this device's limit: 227 KB on
    # Hopper, 163 KB on A100, 99 KB on sm_86 / sm_89
    min_blocks = 2 if threads == 512 else 1
    cache = slice_ * 4 <= min(_MAX_CACHE_BYTES, smem_optin - _STATIC_SMEM_BYTES)
    return cluster, threads, min_blocks, cache


def sample_defines(B: int, V: int, *, vec: bool, penalties: bool, mask: bool, logprob: bool, num_logprobs: int,
                   cluster: int | None = None, threads: int | None = None, bias: bool = False) -> tuple[dict, int, int, int]:
    """(compile-time constants of sample_rows, CLUSTER, THREADS, dynamic shared memory bytes)."""
    cluster, threads, min_blocks, cache = sample_config(B, V, cluster, threads)
    smem = (-(-V // cluster) + 3) // 4 * 16 if cache else 0  # the CTA's slice of x, fp32
    defines = dict(V=V, THREADS=threads, MIN_BLOCKS=min_blocks, CLUSTER=cluster, CACHE_X=cache,
                   VEC=vec and V % 4 == 0, HAS_PENALTIES=penalties, HAS_BIAS=bias, HAS_MASK=mask, WRITE_LOGPROB=logprob,
                   NUM_TOP=num_logprobs)
    return defines, cluster, threads, smem


def precompile(V: int, max_rows: int, extras: bool = False) -> int:
    """Compile (or load from the disk cache) the sample_rows variants that plain requests use, for any
    batch of 1..max_rows rows of V logits: each thread count sample_config picks in that range, with
    and without the sampled token's logprob (and with `extras`, the runner's KDA_RT_GPU_SAMPLING_EXTRAS, those
    with penalties and with masks too, and update_counts).  The runner calls it at start, so no request waits for
    NVRTC (a variant takes ~1.5 s to compile); grammar masks (without `extras`), logit_bias (HAS_BIAS) and top
    logprobs compile on first use.  Returns the number of variants."""
    seen = set()
    if extras:
        get_kernel("sampling.cu", "update_counts", V=V)
    flags = (False, True) if extras else (False,)
    for B in sorted({1, max(1, max_rows)}):
        for logprob, pen, mask in [(lp, pen, mask) for lp in (False, True) for pen in flags for mask in flags]:
            defines, _, _, smem = sample_defines(B, V, vec=V % 4 == 0, penalties=pen, mask=mask, logprob=logprob,
                                                 num_logprobs=0)
            key = tuple(sorted(defines.items()))
            if key not in seen:
                seen.add(key)
                get_kernel("sampling.cu", "sample_rows", max_dynamic_smem=smem, **defines)
    return len(seen)


def sample(logits, temperature, top_k, top_p, min_p, seeds, steps, *, penalties=None, allowed=None, out_ids=None,
           out_logprobs=None, num_logprobs: int = 0, out_top_ids=None, out_top_logprobs=None, out_flags=None,
           stream=None, cluster: int | None = None, threads: int | None = None):
    """logits [B, V] f32; temperature, top_p, min_p [B] f32; top_k [B] i32 (0: off); seeds [B] u64;
    steps [B] i32.  penalties: None or (counts [B, V] i32 of output tokens, prompt_mask [B, V] u8,
    repetition, presence, frequency [B] f32[, rows[, bias]]): with `rows` ([B] i32) row b reads counts / prompt_mask
    row rows[b] of [R, V] ones (the runner's per-sequence rows, sampler/penalties.py), and with `bias` ([R, V] f32:
    a request's logit_bias, 0 elsewhere) adds that row of it before the penalties.  Writes out_logprobs [B] f32
    (log-softmax of the penalised, untempered logits at the sampled token) when given, and with num_logprobs = N > 0
    the N most likely tokens into out_top_ids [B, N] i32 / out_top_logprobs [B, N] f32 (both required).  allowed:
    None or [B, ceil(V / 32)] int32 bitmask of allowed tokens (a grammar's; with the runner's
    KDA_RT_GPU_SAMPLING_EXTRAS also bans and allowed_token_ids; a row with every bit set is unconstrained).
    out_flags [B] i32 (optional): 0, or 1 when a raw logit is not finite, 3 when only a penalised one is (an
    overflow), 2 when the mask allows no token: the CUDA runner reports flags 1 and 3 as the reference's errors and
    samples flag 2 rows on the host (sampler/reference.py), which reports the error.  `cluster` / `threads` force a kernel
    variant (see sample_config).  Returns ids [B] i32."""
    import cupy

    B, V = expect(logits, "logits", ndim=2, dtype=np.float32)
    for name, arr, dtype in (("temperature", temperature, np.float32), ("top_k", top_k, np.int32),
                             ("top_p", top_p, np.float32), ("min_p", min_p, np.float32),
                             ("seeds", seeds, np.uint64), ("steps", steps, np.int32)):
        expect(arr, name, shape=(B,), dtype=dtype)
    pen_rows = bias = np.uint64(0)  # (null: row b reads counts row b; no bias)
    if penalties is not None:
        if len(penalties) not in (5, 6, 7):
            raise ValueError("penalties: (counts, prompt_mask, repetition, presence, frequency[, rows[, bias]])")
        counts, prompt_mask, repetition, presence, frequency = penalties[:5]
        R = B
        if len(penalties) >= 6:
            pen_rows = penalties[5]
            expect(pen_rows, "penalties.rows", shape=(B,), dtype=np.int32)
            R = counts.shape[0]
        if len(penalties) == 7:
            bias = penalties[6]
            expect(bias, "penalties.bias", shape=(R, V), dtype=np.float32)
        expect(counts, "penalties.counts", shape=(R, V), dtype=np.int32)
        expect(prompt_mask, "penalties.prompt_mask", shape=(R, V), dtype=np.uint8)
        for name, arr in (("repetition", repetition), ("presence", presence), ("frequency", frequency)):
            expect(arr, f"penalties.{name}", shape=(B,), dtype=np.float32)
    else:
        counts = prompt_mask = repetition = presence = frequency = logits  # never read (HAS_PENALTIES=0)
    if allowed is not None:
        expect(allowed, "allowed", shape=(B, (V + 31) // 32), dtype=np.int32)
    if out_flags is not None:
        expect(out_flags, "out_flags", shape=(B,), dtype=np.int32)
    out_ids = cupy.empty((B,), dtype=np.int32) if out_ids is None else out_ids
    expect(out_ids, "out_ids", shape=(B,), dtype=np.int32)
    if out_logprobs is not None:
        expect(out_logprobs, "out_logprobs", shape=(B,), dtype=np.float32)
    if not isinstance(num_logprobs, int) or not 0 <= num_logprobs <= min(MAX_TOP_LOGPROBS, V):
        raise ValueError(f"num_logprobs must be an int in [0, {min(MAX_TOP_LOGPROBS, V)}], got {num_logprobs!r}")
    if num_logprobs:
        if out_top_ids is None or out_top_logprobs is None:
            raise ValueError("num_logprobs > 0 needs out_top_ids [B, N] int32 and out_top_logprobs [B, N] float32")
        expect(out_top_ids, "out_top_ids", shape=(B, num_logprobs), dtype=np.int32)
        expect(out_top_logprobs, "out_top_logprobs", shape=(B, num_logprobs), dtype=np.float32)
    defines, cluster, threads, smem = sample_defines(
        B, V, vec=logits.data.ptr % 16 == 0, penalties=penalties is not None, mask=allowed is not None,
        logprob=out_logprobs is not None, num_logprobs=num_logprobs, cluster=cluster, threads=threads,
        bias=penalties is not None and len(penalties) == 7)
    kernel = get_kernel("sampling.cu", "sample_rows", max_dynamic_smem=smem, **defines)
    if B:
        unused = out_ids  # placeholder pointer for outputs the specialisation never writes
        kernel((B * cluster,), (threads,), (logits, temperature, top_k, top_p, min_p, seeds, steps, counts,
                                            prompt_mask, repetition, presence, frequency, pen_rows, bias, out_ids,
                                            unused if out_logprobs is None else out_logprobs,
                                            out_top_ids if num_logprobs else unused,
                                            out_top_logprobs if num_logprobs else unused,
                                            allowed if allowed is not None else unused,
                                            out_flags if out_flags is not None else np.uint64(0), i32(B)),
               shared_mem=smem, stream=stream)
    return out_ids


def update_counts(counts, ids, *, rows=None, stream=None) -> None:
    """counts[r, ids[b]] += 1 for each row b, r = rows[b] (default b; r < 0 and ids outside [0, V) are skipped).
    counts [R, V] i32, ids [B] i32, rows [B] i32 (without rows R = B)."""
    R, V = expect(counts, "counts", ndim=2, dtype=np.int32)
    (B,) = expect(ids, "ids", ndim=1, dtype=np.int32)
    if rows is None:
        if B != R:
            raise ValueError(f"update_counts: {B} ids for {R} count rows (give rows to map them)")
    else:
        expect(rows, "rows", shape=(B,), dtype=np.int32)
    if B:
        get_kernel("sampling.cu", "update_counts", V=V)(((B + 255) // 256,), (256,),
                                                        (counts, ids, np.uint64(0) if rows is None else rows, i32(B)),
                                                        stream=stream)


def mark_prompt_tokens(prompt_mask, row: int, token_ids, *, stream=None) -> None:
    """prompt_mask[row, token_ids] = 1 (ids outside [0, V) skipped); clear the row first when reusing it.
    prompt_mask [B, V] u8, token_ids [L] i32."""
    B, V = expect(prompt_mask, "prompt_mask", ndim=2, dtype=np.uint8)
    (L,) = expect(token_ids, "token_ids", ndim=1, dtype=np.int32)
    if not 0 <= row < B:
        raise ValueError(f"row must be in [0, {B}), got {row!r}")
    if L:
        get_kernel("sampling.cu", "mark_prompt_tokens", V=V)(((L + 255) // 256,), (256,),
                                                             (prompt_mask, token_ids, i32(row), i32(L)), stream=stream)
