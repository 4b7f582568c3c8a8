"""Every `KDA_RT_*` environment variable: typed, with a default and a one-line doc."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

__all__ = ["READ_AT_START", "cache_dir", "arch_override", "api_key", "log_stats_interval", "gc_threshold", "pdl",
           "skinny", "wgmma", "unknown_variables"]

# switches the CUDA runner reads once, when it starts (an A/B that flips them on a running engine times one setting
# twice: tests/gpu/bench_ab.py and trace_decode.py refuse them)
READ_AT_START = ("KDA_RT_SHARED_GRAPH_WS", "KDA_RT_SKIP_PAD", "KDA_RT_GPU_SAMPLING_EXTRAS")


@functools.cache
def _known() -> frozenset[str] | None:
    """Every variable this module reads: the KDA_RT_* names its source spells (each is read by name, here only);
    None where the source is not shipped (a frozen or bytecode-only install: then nothing is called unknown)."""
    try:
        source = Path(__file__).read_text(encoding="utf-8")
    except OSError:
        return None
    return frozenset(re.findall(r"KDA_RT_[A-Z0-9_]*[A-Z0-9]", source))


def unknown_variables(environ: dict[str, str] | None = None) -> list[str]:
    """KDA_RT_* variables set but read nowhere (a misspelt switch changes nothing, silently: vLLM warns about its
    own the same way).  KDA_RT_TEST_* belong to the tests."""
    environ, known = os.environ if environ is None else environ, _known()
    if known is None:
        return []
    return sorted(k for k in environ if k.startswith("KDA_RT_") and k not in known and not k.startswith("KDA_RT_TEST_"))


def cache_dir() -> Path:
    """KDA_RT_CACHE_DIR: where compiled kernels (cubins + msgpack manifest) live. Default ~/.cache/kda_rt."""
    return Path(os.environ.get("KDA_RT_CACHE_DIR") or Path.home() / ".cache" / "kda_rt")


def arch_override() -> str | None:
    """KDA_RT_ARCH: compile for this arch (e.g. sm_90a) instead of the device's; for compile-only checks."""
    return os.environ.get("KDA_RT_ARCH") or None


def api_key() -> str | None:
    """KDA_RT_API_KEY (else vLLM's VLLM_API_KEY): default for `python -m kda_rt.serve --api-key` (require
    'Authorization: Bearer KEY')."""
    return os.environ.get("KDA_RT_API_KEY") or os.environ.get("VLLM_API_KEY") or None


def log_stats_interval() -> float:
    """KDA_RT_LOG_STATS_INTERVAL: seconds between the server's throughput log lines while busy (default 10; 0 = off)."""
    value = os.environ.get("KDA_RT_LOG_STATS_INTERVAL") or "10"
    try:
        return max(0.0, float(value))
    except ValueError:
        raise ValueError(f"KDA_RT_LOG_STATS_INTERVAL must be a number of seconds, got {value!r}") from None


def server_dev_mode() -> bool:
    """KDA_RT_SERVER_DEV_MODE (else vLLM's VLLM_SERVER_DEV_MODE): 1 adds the server's development endpoints
    (`POST /reset_prefix_cache`, as vLLM's dev mode has it); default 0.  Read when the app is built."""
    name = "KDA_RT_SERVER_DEV_MODE" if os.environ.get("KDA_RT_SERVER_DEV_MODE") else "VLLM_SERVER_DEV_MODE"
    return _on_off(name, "0")


def responses_store() -> bool:
    """KDA_RT_ENABLE_RESPONSES_API_STORE (else vLLM's VLLM_ENABLE_RESPONSES_API_STORE): 1 keeps Responses API
    responses for previous_response_id and GET /v1/responses/{id}, as the server's --enable-responses-store; default 0."""
    name = ("KDA_RT_ENABLE_RESPONSES_API_STORE" if os.environ.get("KDA_RT_ENABLE_RESPONSES_API_STORE")
            else "VLLM_ENABLE_RESPONSES_API_STORE")
    return _on_off(name, "0")


def gc_threshold() -> int:
    """KDA_RT_GC_THRESHOLD: the engine raises Python's generation-0 collection threshold to this many
    allocations (default 10000; Python's own is 700; 0 = leave the process's setting alone).  Each
    step allocates a few objects per sequence, and every young collection re-examines the live ones:
    at 256 sequences the engine's host work per decode step drops from ~3.1 to ~1.9 ms (CPU harness
    tests/engine/host_overhead.py, 800 steps)."""
    return _non_negative_int("KDA_RT_GC_THRESHOLD", 10000)


def _non_negative_int(name: str, default: int, low: int = 0, high: int | None = None) -> int:
    """An integer >= low (and <= high when given; unset or empty: the default); anything else is refused."""
    value = os.environ.get(name) or str(default)
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if n < low:
        raise ValueError(f"{name} must be >= {low}, got {n}")
    if high is not None and n > high:
        raise ValueError(f"{name} must be <= {high}, got {n}")
    return n


def _on_off(name: str, default: str = "1") -> bool:
    """A 0 / 1 switch (unset or empty: the default, on unless given "0"); any other value is refused."""
    value = os.environ.get(name) or default
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def async_prefill() -> bool:
    """KDA_RT_ASYNC_PREFILL: with async scheduling, 1 launches the step after a prefill or mixed step ahead too
    (prompt chunks, admissions: docs/engine_notes.md), and the step after grammar rows with its sampler held back
    until their tokens are accepted; 0 (the default) only a steady decode step (every running sequence decoding,
    nothing waiting, no grammar row).  Measured in the fifty-eighth session (H200, 27 layers,
    tests/gpu/engine56_check.sh): 1 made the seed prefill's TTFT max slower (bf16 0.850 s against 0.812, fp8 0.670
    against 0.609) and a 100 x 2048 / 128 run faster (6.59 s against 6.95): kept off while prefill is the target
    it misses.  Read every step."""
    return _on_off("KDA_RT_ASYNC_PREFILL", "0")


def async_waiting() -> bool:
    """KDA_RT_ASYNC_WAITING: with async scheduling and KDA_RT_ASYNC_PREFILL=0, 1 (the default) launches the step after
    a decode step ahead also while requests wait (preempted ones, or more than max_num_seqs): every scheduled row a
    sampled decode, every running sequence among them, none ending by length, no grammar row, the pages for one more
    token free, so the step launched ahead preempts nobody; and none preempted by the decode step's schedule (which
    skips admission) nor added to the queue or aborted from it since, so it admits nobody either (seats and pages
    free only at a finish, after which the next step is not launched ahead; an arrival between steps used to be
    admitted by a prompt chunk launched ahead).  A serving load past its memory runs many such steps
    (256 x 8192 / 1024 on an H100 in fp8: 945 of its 1,969 decode steps, by the engine with a fixed-token runner),
    each paying the host's postprocess and schedule before its launch when 0.  Measured (sixty-second session, H100
    80GB, fp8, 27 layers, `tests/gpu/bench_ab.py --env KDA_RT_ASYNC_WAITING --values 1,0 --rounds 1 --prompts 0
    --decode 256:8192:1024 --quantization fp8`, one round): decode step 14.31 ms against 16.24, elapsed 71.42 s against
    75.74 (-5.7%), TTFT max 57.43 s against 61.39.  Read every step."""
    return _on_off("KDA_RT_ASYNC_WAITING", "1")


def async_ending() -> bool:
    """KDA_RT_ASYNC_ENDING: with async scheduling and KDA_RT_ASYNC_PREFILL=0, 1 (the default) launches the step after a
    steady decode step ahead also where that step's token ends a sequence by length (max_tokens, max_model_len) and
    nothing waits: the sequence is retired (no row; its seat, slot and pages free, as after the synchronous engine's
    postprocess), as KDA_RT_ASYNC_PREFILL=1 does; with requests waiting its room would admit one (a prompt chunk
    launched ahead), so that step still waits for the host.  0: every such step waits for the host.  Requests that
    end by length at different steps (prompts admitted over several prefill steps: 128 of the serving workload's
    1,023 decode steps, 4 of the seed run's; any serving mix of max_tokens) each paid the host's postprocess and
    schedule before the next launch.  Read every step."""
    return _on_off("KDA_RT_ASYNC_ENDING", "1")


def async_grammar() -> bool:
    """KDA_RT_ASYNC_GRAMMAR: with async scheduling and KDA_RT_ASYNC_PREFILL=0, 1 (the default since the sixty-fourth
    session) lets a decode step after one with grammar (structured-output) rows go ahead with its sampler held back
    until their tokens are accepted and their next masks made (runner.sample), as KDA_RT_ASYNC_PREFILL=1 does; 0: any
    grammar row in a step makes the next one wait for the host, so one structured-output request among many costs
    every decode step the host's postprocess and schedule.  Measured (H100 80GB, fp8, 27 layers, one regex request
    in 32: `PYTHONPATH=$PWD:/tmp/extra python tests/gpu/bench_ab.py --env KDA_RT_ASYNC_GRAMMAR --values 1,0 --rounds 2
    --prompts 0 --decode 128:2048:256 --structured-every 32 --quantization fp8`): decode step 16.84 ms against 19.12
    (medians of two rounds), elapsed 7.35 s against 7.72.  The held-back sampler is GPU-tested
    (tests/engine/test_structured_outputs.py, its cuda cases).  Read every step."""
    return _on_off("KDA_RT_ASYNC_GRAMMAR", "1")


def gpu_sampling_extras() -> bool:
    """KDA_RT_GPU_SAMPLING_EXTRAS: 1 has the CUDA runner sample on the GPU the rows it used to copy back to the host
    sampler: repetition / presence / frequency penalties and logit_bias from per-sequence token counts and biases
    kept on the device (sampler/penalties.py; the sampling kernel's HAS_PENALTIES / HAS_BIAS forms), min_tokens and
    bad_words bans and allowed_token_ids as bitmasks beside the grammar's (SamplingBatch.device_masks; HAS_MASK).
    The host sampler (the NumPy reference) takes ~3 ms a sampled top-p row of V = 163840 when its mass is peaked,
    ~26 ms when flat, on one core of the development machine, and no step goes ahead of a host row; with this on,
    such rows also allow async scheduling (bad_words' rows only when their outputs are on the host).  Default 1
    since the fifty-eighth session (H200, 27-layer bf16, 32 x 512 / 16 with temperature 0.8, top_p 0.95 and
    frequency_penalty 0.5: decode step 9.32 ms against 921 ms with 0; tests/gpu/gpu_penalties_bench.sh); 0 sends
    those rows to the host sampler again.  Read when the runner starts."""
    return _on_off("KDA_RT_GPU_SAMPLING_EXTRAS", "1")


def pdl() -> bool:
    """KDA_RT_PDL: 0 captures the decode graphs with plain kernel launches instead of programmatic
    dependent launches (kda_rt/cuda/ops/pdl.py, sm_90+); default 1.  Read when a graph is captured."""
    return _on_off("KDA_RT_PDL")


def skinny() -> bool:
    """KDA_RT_SKINNY: 0 sends the narrow dense projections of decode batches (up to 8 rows, 4096 outputs)
    to cuBLAS instead of kernels_cu/skinny_gemm.cu; default 1.  Read at each call (a CUDA graph keeps the
    kernels it captured)."""
    return _on_off("KDA_RT_SKINNY")


def wgmma() -> bool:
    """KDA_RT_WGMMA: 0 turns the Hopper warpgroup-MMA prefill kernels off (moe_gemm_wg.cu, mla_prefill_wg.cu),
    so the portable mma.sync ones run instead; default 1 (they run wherever the arch is sm_90a).  Read at
    each call."""
    return _on_off("KDA_RT_WGMMA")


def fused_norm() -> bool:
    """KDA_RT_FUSED_NORM: 0 runs a small step's MoE combine, the residual add and the next RMSNorm as two
    kernels (moe_combine, rmsnorm) instead of one (moe_combine_norm); default 1.  Read at each forward."""
    return _on_off("KDA_RT_FUSED_NORM")


def fused_norm_max_t(default: int) -> int:
    """KDA_RT_FUSED_NORM_MAX_T (bench switch): the largest step whose MoE combine carries the next RMSNorm
    (moe_combine_norm: one block a token), instead of the measured default (ops/moe_align.FUSED_NORM_MAX_T).
    Read at each forward."""
    return _non_negative_int("KDA_RT_FUSED_NORM_MAX_T", default)


def early_weights() -> bool:
    """KDA_RT_EARLY_WEIGHTS: 0 makes the MoE down GEMM of small decode batches (moe_gemm_tc.cu) wait for the
    gate/up kernel before it copies anything, instead of copying its first weight steps while gate/up still
    runs (EARLY_B; it matters under programmatic dependent launch, i.e. in decode graphs); default 1.  Read
    when a kernel is picked (a CUDA graph keeps the kernels it captured)."""
    return _on_off("KDA_RT_EARLY_WEIGHTS")


def fused_moe() -> bool:
    """KDA_RT_FUSED_MOE: 0 runs a decode step's two MoE expert GEMMs (16-row tiles) as two launches
    (moe_grouped_gemm_tc) instead of one that streams both GEMMs' tiles (moe_decode_fused in
    kernels_cu/moe_gemm_tc.cu); default 1.  Read at each MoE call (a CUDA graph keeps what it captured)."""
    return _on_off("KDA_RT_FUSED_MOE")


def moe_gemv() -> bool:
    """KDA_RT_MOE_GEMV: 0 runs a one-token step's MoE gate/up projection on the tiled grouped GEMM
    (moe_gemm_tc.cu) instead of the GEMV spread evenly over the SMs (kernels_cu/moe_gemv.cu); default 1.
    Read at each MoE call (a CUDA graph keeps what it captured)."""
    return _on_off("KDA_RT_MOE_GEMV")


def gemv_routed() -> bool:
    """KDA_RT_GEMV_ROUTED: 0 makes a one-token step's MoE gate/up GEMV wait for the whole routing kernel and read
    its plan, instead of selecting the token's experts itself from the routing kernel's logits as soon as they are
    stored (kernels_cu/moe_gemv.cu ROUTED); default 1.  Read at each MoE call (a CUDA graph keeps what it captured)."""
    return _on_off("KDA_RT_GEMV_ROUTED")


def down_gemv() -> bool:
    """KDA_RT_DOWN_GEMV: 0 sends a one-token step's MoE down projection to the tiled grouped GEMM (moe_gemm_tc.cu)
    instead of moe_gemv_down (kernels_cu/moe_gemv.cu DOWN: units spread over every warp, each warp's first weight
    rows copied into its shared-memory ring before the programmatic-launch wait); default 1.  Read at each MoE call
    (a CUDA graph keeps what it captured)."""
    return _on_off("KDA_RT_DOWN_GEMV")


def moe_decode_ws() -> bool:
    """KDA_RT_MOE_DECODE_WS: 0 runs moe_decode_fused (the batch 2-64 decode MoE kernel) in its plain form, every warp
    copying and computing with a CTA-wide barrier a k step, instead of the producer-warp form (kernels_cu/moe_gemm_tc.cu
    DEC_WS: one warp fills mbarrier-guarded stages by tensor-map copies; sm_90+ with 128-byte k steps, elsewhere the
    plain form); default 1 (H200: 2-4% faster, tests/gpu/decode_ws_check.sh).  The outputs are the same bits either
    way.  Read when the kernel variant is chosen (a CUDA graph keeps what it captured)."""
    return _on_off("KDA_RT_MOE_DECODE_WS")


def down_warps(default: int) -> int:
    """KDA_RT_DOWN_WARPS: warps per CTA of moe_gemv_down (one CTA an SM); default by weight format
    (ops/moe_gemv.down_shape).  Read at each MoE call (a CUDA graph keeps what it captured)."""
    return _non_negative_int("KDA_RT_DOWN_WARPS", default, low=1, high=32)


def down_stages(default: int) -> int:
    """KDA_RT_DOWN_STAGES: units (two weight rows each) in each warp's shared-memory ring in moe_gemv_down, the first
    of them copied before the programmatic-launch wait; default by weight format (ops/moe_gemv.down_shape)."""
    return _non_negative_int("KDA_RT_DOWN_STAGES", default, low=1, high=64)


def gemv_warps(default: int) -> int:
    """KDA_RT_GEMV_WARPS: warps per CTA of the one-token MoE gate/up GEMV (moe_gemv_gate_up; the routed variant adds
    one, and needs 3 or more); default by weight format (ops/moe_gemv.gate_up_config).  Read at each MoE call."""
    return _non_negative_int("KDA_RT_GEMV_WARPS", default, low=3, high=31)


def mla_fp8() -> bool:
    """KDA_RT_MLA_FP8: 1 runs the MLA prefill attention (expanded form) on e4m3 products (mla_prefill_fp8.cu: queries,
    keys and values quantized per round with fp32 scales, the probabilities as e4m3 too; sm_90a, KDA_RT_WGMMA on),
    for long prompts, whose attention FLOPs grow with the square of the length.  Lossy beyond the bf16 path (see
    tests/kernels/test_mla_prefill.py for the measured error), like FlashAttention-3's FP8 attention; off by default
    (0), also for quantization="fp8", whose attention stays bf16 as vLLM's does.  Where it cannot run, the model logs
    a warning once and keeps the bf16 attention.  Read at each prefill step."""
    return _on_off("KDA_RT_MLA_FP8", "0")


def fp8_prefill() -> bool:
    """KDA_RT_FP8_PREFILL: 1 (default) runs the prefill MoE GEMMs of e4m3 expert stacks (quantization="fp8", the
    wgmma kernels, sm_90a) on e4m3 products, as vLLM's fp8 runs its GEMMs: x and h quantized a row at a time
    (ops/quant.quantize_activations_e4m3) and multiplied as e4m3 (moe_gemm_wg.cu WFMT = 2); the seed prefill's TTFT
    max 0.987 -> 0.736 s (H200, 2026-12-02, tests/gpu/bench_ab.py --quantization fp8).  0: bf16 sources times the
    weights widened to bf16 (WFMT = 1), the weights' rounding alone.  Only steps whose MoE GEMMs take 128-row tiles
    on wgmma (prefill steps of ~1.4K tokens or more on the 48B shape) multiply in FP8; smaller steps and decode
    keep bf16 activations, so a token's numerics depend on the step it runs in (as batch composition moves them in
    vLLM without batch invariance).  Read at each MoE call, and by moe_workspace_bytes, which sizes the room for the
    codes."""
    return _on_off("KDA_RT_FP8_PREFILL", "1")


def fp8_dense() -> bool:
    """KDA_RT_FP8_DENSE: 1 (default) gives quantization="fp8" models e4m3 copies of the large dense projections (KDA
    q|k|v and o_proj, MLA q|kv_a and o_proj, the dense layer's MLP; ~1 GB on the 48B shape, made at upload beside the
    bf16 weights, which decode keeps using) and runs them on e4m3 products in prefill steps of
    ops/dense_w8a8.MIN_TOKENS tokens or more, as vLLM's fp8 runs every linear layer: x's rows quantized (by the
    RMSNorm before, or ops/quant.quantize_activations_e4m3), one scale a weight row.  The copies need sm_90a and
    KDA_RT_WGMMA on at upload (each prefill forward reads KDA_RT_WGMMA again); KDA_RT_FP8_PREFILL and
    KDA_RT_NORM_E4M3 (the experts' products) do not touch them.  0 at upload: no copies; 0 later: the copies stay
    unused (bench A/B).  Read at upload and at each prefill forward."""
    return _on_off("KDA_RT_FP8_DENSE", "1")


def fp8_decode_gemv() -> bool:
    """KDA_RT_FP8_DECODE_GEMV: 1 (the default) has a quantization="fp8" model with the e4m3 dense copies
    (KDA_RT_FP8_DENSE) run its one-sequence decode steps' dense projections (KDA q|k|v|f_a|g_a|b and o_proj, MLA q|kv_a
    and o_proj, the dense layer's gate|up) as e4m3 GEMVs (gemv_dense, moe_gemv.cu WFMT = 1: bf16 x, e4m3 weight rows
    times their fp32 scale, fp32 sums), half the bytes of the bf16 weights they read otherwise (on the 48B shape ~2.0 GB
    of bf16 rows a step, so ~1.0 GB less: ~0.23 ms at 4.3 TB/s against the fp8 batch-1 step's 1.86 ms; lm_head stays
    bf16).  At upload it quantizes KDA's whole q|k|v|f_a|g_a|b (the prefill copy of q|k|v then a view of its rows: the
    same codes) and the projections without a prefill copy; read at upload and at each decode forward (a CUDA graph
    keeps what it captured), so an A/B in one process (tests/gpu/bench_ab.py) starts with it 1 and flips what the
    forward reads.  Needs the dense e4m3 copies (sm_90a with KDA_RT_WGMMA and KDA_RT_FP8_DENSE on; else bf16, with a
    warning at upload if set to 1); KDA's q|k|v|f_a|g_a|b only in its one-GEMM form (KDA_RT_FUSED_KDA_PROJ on); the
    dense layer's down (K 9216 > 5120) stays bf16.  `bench`'s batch-1 floor then counts those rows (kda_rt/floors.py
    e4m3_gemv_savings: 0.98 GB less on the 48B shape).  Measured (H200, 27-layer 48B shape, 2026-12-04, bench_ab.py as
    tests/gpu/fp8_decode_gemv_check.sh runs it, --rounds 3): the fp8 batch-1 replay 1.827 -> 1.638 ms (-10.4%).  0:
    those projections read their bf16 weights."""
    return _on_off("KDA_RT_FP8_DECODE_GEMV", "1")


def fp8_decode_gemv_max_t() -> int:
    """KDA_RT_FP8_DECODE_GEMV_MAX_T: decode steps of up to this many rows (1 to 4, ops/gemv.MAX_ROWS; a decode graph's
    rows, padding included: 3 sequences replay the 4-row graph of the default sizes) take KDA_RT_FP8_DECODE_GEMV's
    e4m3 GEMVs, one launch a projection for all of their rows (moe_gemv.cu MROWS: each weight pair widened once for
    every row, each row's sums bit for bit a one-row launch's); larger steps read the bf16 weights through cuBLAS.
    Default 2, measured (H100 80GB, 27-layer 48B shape in fp8, 2026-12-05, tests/gpu/bench_ab.py --quantization fp8
    --env KDA_RT_FP8_DECODE_GEMV_MAX_T --prompts 0 --rounds 2, replay step medians): 2 rows 2.999 ms (1) -> 2.844 ms
    (2) / 2.835 ms (4); 3 rows 3.383 ms (2) against 3.416 ms (3); 4 rows 3.463 ms (1, 2) against 3.740 ms (4): at 2 rows
    the ~1 GB of bf16 rows a step does not read outweighs the GEMV's doubled FMAs, at 3-4 rows no longer; 1 row 1.92
    ms either way.  Read at each decode forward and by the precompile (a CUDA graph keeps what it captured)."""
    return _non_negative_int("KDA_RT_FP8_DECODE_GEMV_MAX_T", 2, low=1, high=4)


def kda_norm_e4m3() -> bool:
    """KDA_RT_KDA_NORM_E4M3: 1 has the KDA prefill's gated norm write its output's e4m3 codes too where o_proj runs
    on e4m3 products (kda_prefill.cu kda_prefill_norm_e4m3, with KDA_RT_FP8_DENSE), so o_proj's source is not read
    again to quantize it (the default: the seed prefill's TTFT max 0.6702 -> 0.664 s in fp8, H200, 2026-12-02,
    tests/gpu/bench_ab.py --quantization fp8 --env KDA_RT_KDA_NORM_E4M3 --values 0,1 --rounds 3); 0:
    ops/quant.quantize_activations_e4m3 quantizes it.  The same codes either way.  Read at each prefill forward."""
    return _on_off("KDA_RT_KDA_NORM_E4M3", "1")


def norm_e4m3() -> bool:
    """KDA_RT_NORM_E4M3: 1 (default) has the RMSNorm before an fp8 MoE block write x's e4m3 codes too where the block's
    gate/up GEMM takes e4m3 sources (rmsnorm.cu E4M3_OUT, moe_forward x_codes=), so x is not read again to quantize
    it; 0: the MoE quantizes x itself (ops/quant.quantize_activations_e4m3).  The same codes either way.  Read at
    each forward."""
    return _on_off("KDA_RT_NORM_E4M3")


def dense_gemv() -> bool:
    """KDA_RT_DENSE_GEMV: 0 sends one-row projections of 4-256 MB of bf16 weights (batch-1 q|k|v|f_a|g_a|b, MLA
    q|kv_a, a dense MLP's gate|up) to cuBLAS instead of gemv_dense (kernels_cu/moe_gemv.cu DENSE, its first weight
    rows loaded before the programmatic-launch wait); default 1.  Read at each gemm.linear call (a CUDA graph keeps
    what it captured).  The e4m3 GEMVs of KDA_RT_FP8_DECODE_GEMV do not read it."""
    return _on_off("KDA_RT_DENSE_GEMV")


def dense_gemv_max_t() -> int:
    """KDA_RT_DENSE_GEMV_MAX_T (bench switch, prepared 2026-12-04; its tests passed on the GPU in the
    fifty-eighth session, not yet timed): gemm.linear sends projections of
    2 to this many rows (up to 4, ops/gemv.MAX_ROWS) that gemv_dense serves at one row (KDA q|k|v|f_a|g_a|b, MLA
    q|kv_a, the dense layer's gate|up: 4-256 MB of bf16 weights, K <= 2560) to it too, one launch for all rows (each
    weight pair widened once; each row's sums bit for bit a one-row launch's), instead of cuBLAS (the wide q|k|v at
    ~74% of copy bandwidth in the batch-32 trace); default 1 (one row only, the measured form).  Read at each
    gemm.linear call and by the precompile (a CUDA graph keeps what it captured)."""
    return _non_negative_int("KDA_RT_DENSE_GEMV_MAX_T", 1, low=1, high=4)


def dense_gemv_pre(default: int) -> int:
    """KDA_RT_DENSE_GEMV_PRE (bench switch): how many units (row pairs) each warp of gemv_dense loads before its
    programmatic-launch wait, 0, 1 or 2 (kernels_cu/moe_gemv.cu DENSE_PRE), instead of the measured default
    (ops/gemv.PRE_UNITS).  Read when the kernel is picked (a CUDA graph keeps what it captured)."""
    n = _non_negative_int("KDA_RT_DENSE_GEMV_PRE", default)
    if n > 2:
        raise ValueError(f"KDA_RT_DENSE_GEMV_PRE must be 0, 1 or 2, got {n}")
    return n


def kda_early_state() -> bool:
    """KDA_RT_KDA_EARLY_STATE: 0 makes the KDA decode kernel wait for the kernel before it (programmatic launch)
    before any load, instead of loading its weights and the slots' recurrent state first (kernels_cu/kda_decode.cu
    EARLY_STATE); default 1.  Read when the kernel is picked (a CUDA graph keeps what it captured)."""
    return _on_off("KDA_RT_KDA_EARLY_STATE")


def skip_pad() -> int:
    """KDA_RT_SKIP_PAD: 2 (the default) and 1 have a decode graph's padding rows skip the work nobody reads: the
    CUDA runner gives them the slot -1, which the KDA decode kernel treats as a fresh state stored nowhere
    (kernels_cu/kda_decode.cu SKIP_PAD: no conv-history or state stores, 2 MiB a padding row a KDA layer at 32
    heads), and uploads the live row count, with which the MoE bucketing plans the live tokens' pairs alone and the
    combine writes zeros for the others (kernels_cu/moe_bucket.cuh LIVE_PAIRS / LIVE_TOKENS: identical padding rows
    all route to the same 8 experts, tiles of them more); the live rows' outputs and states bit for bit the same.
    Measured (H200, 27-layer 48B shape, 2026-12-04, tests/gpu/graph_pad_check.py): 96 rows on the 128-row graph
    +4.0% over the 96-row graph with 0, -0.3% with 1; 160 on 256 +14.7% with 0, +4.2% with 1.  2: also the KDA decode
    kernel's padding CTAs write zeros and leave (kda_decode.cu SKIP_PAD = 2): 160 on 256 17.505 ms with 1, 16.959 with
    2 (the exact 160-row graph 16.80 / 16.79; graph_pad_check.py --batches 160, one process a value, 2026-12-04), so
    padding costs ~1% there.
    0: padding rows run on the padding slot like live rows (the form before).  Read once when the runner starts (its
    uploads and its kernels agree on it)."""
    value = os.environ.get("KDA_RT_SKIP_PAD") or "2"
    if value not in ("0", "1", "2"):
        raise ValueError(f"KDA_RT_SKIP_PAD must be 0, 1 or 2, got {value!r}")
    return int(value)


def kda_smem_state(default: int) -> int:
    """KDA_RT_KDA_SMEM_STATE: how the one-CTA-per-head KDA decode kernel (batches above 4, sm_90+) moves each head's
    recurrent state (kernels_cu/kda_decode.cu SMEM_STATE; every form gives the same outputs and pools bit for bit):
    0 into registers and out by stores, two CTAs an SM; 1 into shared memory by bulk copies, three CTAs an SM; 2 (a
    bench form, measured slower than 1 at every batch) back out by bulk copies too; 3 (a bench form, 25-38% slower)
    a persistent CTA an SM that walks its heads with the next ones' copies in flight (three state buffers).  Unset:
    `default`, the launcher's
    measured choice by batch (ops/kda_decode.py SMEM_STATE_MIN_SEQS).  Read when the kernel is picked (a CUDA graph
    keeps what it captured)."""
    value = os.environ.get("KDA_RT_KDA_SMEM_STATE") or str(default)
    if value not in ("0", "1", "2", "3"):
        raise ValueError(f"KDA_RT_KDA_SMEM_STATE must be 0, 1, 2 or 3, got {value!r}")
    return int(value)


def kda_persist_ctas() -> int:
    """KDA_RT_KDA_PERSIST_CTAS (tests and benches): the persistent KDA decode form's grid (KDA_RT_KDA_SMEM_STATE=3),
    at most the number of heads to run; 0 (the default) one CTA an SM.  Read at each launch."""
    return _non_negative_int("KDA_RT_KDA_PERSIST_CTAS", 0)


def kda_conv_one_round() -> bool:
    """KDA_RT_KDA_CONV_ONE_ROUND: 1 rounds the KDA prefill's conv + SiLU outputs to bf16 once, by their store
    (kernels_cu/kda_prefill.cu CONV_ONE_ROUND: the same bits, one conversion an element fewer); default 1 (0: the
    build before 2026-12-02).  Read at each prefill."""
    return _on_off("KDA_RT_KDA_CONV_ONE_ROUND")


def kda_gate_fast() -> bool:
    """KDA_RT_KDA_GATE_FAST: 1 computes the KDA prefill's gate softplus without log1pf and without a branch
    (kernels_cu/kda_common.cuh kda_softplus_fast: <= ~1.5e-6 relative beyond what kda_softplus_approx has, the
    rounding of ex2's argument, ~|z| 2^-24); default 1 (0: the build before 2026-12-02).
    Read at each prefill."""
    return _on_off("KDA_RT_KDA_GATE_FAST")


def kda_scale_unroll() -> bool:
    """KDA_RT_KDA_SCALE_UNROLL: 1 builds the KDA prefill intra kernel's scaled-tile phase unrolled, each thread's
    column pair fixed (kernels_cu/kda_prefill.cu SCALE_UNROLL: the same bits, fewer instructions); default 1 (0: the
    build before 2026-12-02).  Read at each prefill."""
    return _on_off("KDA_RT_KDA_SCALE_UNROLL")


def kda_row_norm_spread() -> bool:
    """KDA_RT_KDA_ROW_NORM_SPREAD: 1 builds the KDA prefill intra kernel's row norms on warps 0-7 (eight rows each,
    finished side by side) and its gate bookkeeping on warps 12-15 (kernels_cu/kda_prefill.cu ROW_NORM_SPREAD: the
    same bits); default 1 (0: the build before 2026-12-02).
    Read at each prefill."""
    return _on_off("KDA_RT_KDA_ROW_NORM_SPREAD")


def kda_conv_pairs() -> bool:
    """KDA_RT_KDA_CONV_PAIRS: 1 builds the KDA prefill intra kernel's conv + SiLU + gate phase with two adjacent
    channels a thread (kernels_cu/kda_prefill.cu CONV_PAIRS: 4-byte loads and stores, one packed conversion a row;
    the same bits); default 1 (0: the build before 2026-12-03).  Read at each prefill."""
    return _on_off("KDA_RT_KDA_CONV_PAIRS")


def kda_beta_early() -> bool:
    """KDA_RT_KDA_BETA_EARLY: 1 builds the KDA prefill intra kernel with each row's beta loaded before the tile's
    copies are issued (kernels_cu/kda_prefill.cu BETA_EARLY: the same bits); default 1 (0: the build before
    2026-12-03).  Read at each prefill."""
    return _on_off("KDA_RT_KDA_BETA_EARLY")


def kda_copy_rows() -> bool:
    """KDA_RT_KDA_COPY_ROWS: 1 builds the KDA prefill intra kernel's raw q, k, v, f copies with each thread on one
    column piece of every 32nd row (kernels_cu/kda_prefill.cu COPY_ROWS: the same copies, less index arithmetic);
    default 1 (0: the build before 2026-12-03).  Read at each prefill."""
    return _on_off("KDA_RT_KDA_COPY_ROWS")


def kda_early_lookup() -> bool:
    """KDA_RT_KDA_EARLY_LOOKUP: 1 builds the KDA prefill intra kernel with the next tile's sequence lookup (for its L2
    prefetch) and the head's A_log at the entry, beside the tile's own lookup (kernels_cu/kda_prefill.cu
    EARLY_LOOKUP: the same bits); default 1 (0: the build before 2026-12-03).  Read at each prefill."""
    return _on_off("KDA_RT_KDA_EARLY_LOOKUP")


def kda_row_scatter() -> bool:
    """KDA_RT_KDA_ROW_SCATTER: 1 builds the KDA prefill intra kernel's row sums (phase (b)) by a reduce-scatter over the
    lanes, 27 shuffles a warp instead of 120 (kernels_cu/kda_prefill.cu ROW_SCATTER: the same bits); default 1 (0: the
    build without it, as before the thirty-seventh session, 2026-12-03).  Read at each prefill."""
    return _on_off("KDA_RT_KDA_ROW_SCATTER")


def kda_silu_fast() -> bool:
    """KDA_RT_KDA_SILU_FAST: 1 builds the KDA prefill intra kernel's conv + SiLU with the hardware reciprocal alone
    (kernels_cu/kda_prefill.cu SILU_FAST: within ~2 ulp before the bf16 rounding, not the same bits); default 1 (0:
    the build without it, as before the thirty-seventh session, 2026-12-03).  Read at each prefill."""
    return _on_off("KDA_RT_KDA_SILU_FAST")


def kda_gate_poly() -> bool:
    """KDA_RT_KDA_GATE_POLY: 1 builds the KDA prefill intra kernel's gate softplus with one exponential and a polynomial
    (kernels_cu/kda_common.cuh kda_softplus_poly: within kda_softplus_fast's bound, not the same bits); default 1 (0:
    kda_softplus_fast, as before 2026-12-03).  Read at each prefill."""
    return _on_off("KDA_RT_KDA_GATE_POLY")


def kda_pad_fixup() -> bool:
    """KDA_RT_KDA_PAD_FIXUP: 1 builds the KDA prefill intra kernel's phase (a) without the per-value selects of rows past
    a sequence's end, zeroing those rows after (kernels_cu/kda_prefill.cu PAD_FIXUP: the same bits); default 1 (0: the
    build without it).  Read at each prefill."""
    return _on_off("KDA_RT_KDA_PAD_FIXUP")


def kda_e_scan() -> bool:
    """KDA_RT_KDA_E_SCAN: 1 builds the KDA prefill intra kernel's per-element path of unsafe diagonal sub-blocks as
    row scans, the decay carried from row to row by one exponential a row and channel (kernels_cu/kda_prefill.cu
    E_SCAN: products in another order, not the same bits); default 1 (0: per element, as before 2026-12-03).  Read at
    each prefill."""
    return _on_off("KDA_RT_KDA_E_SCAN")


def kda_lookup_bounds() -> bool:
    """KDA_RT_KDA_LOOKUP_BOUNDS: 1 builds the KDA prefill intra kernel with the sequence search returning the
    sequence's bounds and the copies that cannot read the conv-state slot issued first (kernels_cu/kda_prefill.cu
    LOOKUP_BOUNDS, applies with EARLY_LOOKUP and COPY_ROWS: the same bits); default 1 (0: without).  Read at each
    prefill."""
    return _on_off("KDA_RT_KDA_LOOKUP_BOUNDS")


def kda_t_rows() -> int:
    """KDA_RT_KDA_T_ROWS: 1, 2 or 4 rows a thread in the KDA prefill intra kernel's off-diagonal T products
    (kernels_cu/kda_prefill.cu T_ROWS, applies with T_HALVES: the same bits); default 2 (measured fastest of the
    three, 2026-12-03).  Read at each prefill."""
    n = _non_negative_int("KDA_RT_KDA_T_ROWS", 2, 1, 4)
    if n == 3:
        raise ValueError("KDA_RT_KDA_T_ROWS must be 1, 2 or 4, got 3")
    return n


def kda_g_staged() -> bool:
    """KDA_RT_KDA_G_STAGED: 1 builds the KDA prefill intra kernel's W, U stores staged in shared memory and written in
    16-byte pieces (kernels_cu/kda_prefill.cu G_STAGED: the same bits); default 1 (0: the build without it, as
    before the thirty-seventh session, 2026-12-03).  Read at each prefill."""
    return _on_off("KDA_RT_KDA_G_STAGED")


def kda_g_balance() -> bool:
    """KDA_RT_KDA_G_BALANCE: 1 builds the KDA prefill intra kernel's W, U products with each warp on two row blocks of
    the lower-triangular T (kernels_cu/kda_prefill.cu G_BALANCE: 5 k steps a warp instead of 1-4 of twice the width;
    the same bits); default 1 (0: the build without it, as before the thirty-seventh session, 2026-12-03).  Read at
    each prefill."""
    return _on_off("KDA_RT_KDA_G_BALANCE")


def kda_t_halves() -> bool:
    """KDA_RT_KDA_T_HALVES: 1 builds the KDA prefill intra kernel's off-diagonal T blocks by halves (T_10 and T_32,
    then the lower-left 32 x 32 block) with T diag(beta) written by each stage, 5 barriers instead of 8
    (kernels_cu/kda_prefill.cu T_HALVES: fp32 sums in another order, not bit-identical); default 1 (0: the build
    before 2026-12-03).  Read at each prefill."""
    return _on_off("KDA_RT_KDA_T_HALVES")


def kda_exp2_ftz() -> bool:
    """KDA_RT_KDA_EXP2_FTZ: 1 builds the KDA prefill intra kernel's per-element exponentials from ex2.approx.ftz alone
    (kernels_cu/kda_prefill.cu EXP2_FTZ: the same bits down to 2^-126, 0 below it); default 1 (0: the build before
    2026-12-02).  Read at each prefill."""
    return _on_off("KDA_RT_KDA_EXP2_FTZ")


def kda_state_hints(default: int) -> int:
    """KDA_RT_KDA_STATE_HINTS (bench switch): the cache hints of the KDA decode kernel's recurrent-state loads and
    stores (kernels_cu/kda_decode.cu STATE_HINTS: 0 plain, 1 loads without L1 allocation and streaming stores, 2 the
    loads only, 3 the stores only) instead of the launcher's choice by batch (ops/kda_decode.state_hints).  Read when
    the kernel is picked (a CUDA graph keeps what it captured)."""
    if not os.environ.get("KDA_RT_KDA_STATE_HINTS"):
        return default
    n = _non_negative_int("KDA_RT_KDA_STATE_HINTS", default)
    if n > 3:
        raise ValueError(f"KDA_RT_KDA_STATE_HINTS must be 0, 1, 2 or 3, got {n}")
    return n


def gemv_signal_overlap() -> bool:
    """KDA_RT_GEMV_SIGNAL_OVERLAP: 0 makes thread 0 of each routed one-token GEMV CTA take the CTA's count right
    after the routing kernel's signal and the x staging wait for the selection, instead of a second warp counting
    and the others staging x while warp 0 selects (kernels_cu/moe_gemv.cu SIGNAL_OVERLAP); default 1.  Read when
    the kernel variant is chosen (a CUDA graph keeps what it captured)."""
    return _on_off("KDA_RT_GEMV_SIGNAL_OVERLAP")


def gemv_shared_first() -> bool:
    """KDA_RT_GEMV_SHARED_FIRST: 0 keeps the shared expert's units in the routed one-token GEMV's order (the last
    tile), instead of first in every warp with the first one's weight rows loaded before the routing kernel's
    signal (kernels_cu/moe_gemv.cu SHARED_FIRST); default 1.  Read when the kernel variant is chosen (a CUDA graph
    keeps what it captured)."""
    return _on_off("KDA_RT_GEMV_SHARED_FIRST")


def fused_route() -> bool:
    """KDA_RT_FUSED_ROUTE: 0 routes a decode step's tokens with three kernels (router logits, select,
    moe_bucket) instead of one (moe_route_fused in kernels_cu/moe_route.cu); default 1.  Read at each MoE
    call (a CUDA graph keeps what it captured)."""
    return _on_off("KDA_RT_FUSED_ROUTE")


def w8a8_tile() -> tuple[int, int] | None:
    """KDA_RT_W8A8_TILE (bench switch): BNxSTAGES, the tile of the prefill GEMMs on e4m3 sources and weights
    (kernels_cu/moe_gemm_wg.cu WFMT = 2: the MoE's, and the dense projections' of fp8 models, ops/dense_w8a8), e.g.
    128x3 (two CTAs an SM); unset: the launcher's choice.  Read at each launch; a tile that does not fit the GEMM
    is refused there (and a dense projection it does not fit at upload gets no e4m3 copy)."""
    value = os.environ.get("KDA_RT_W8A8_TILE") or ""
    if not value:
        return None
    try:
        bn, stages = (int(v) for v in value.lower().split("x"))
    except ValueError:
        raise ValueError(f"KDA_RT_W8A8_TILE must be BNxSTAGES (e.g. 128x3), got {value!r}") from None
    return bn, stages


def moe_b_tma() -> bool:
    """KDA_RT_MOE_B_TMA: 1 copies the weight rows of the prefill MoE GEMMs on wgmma (and of fp8 models' dense prefill
    projections, ops/dense_w8a8.py, which run on the same kernel) by tensor-map copies (TMA, one thread a stage)
    instead of cp.async pieces over the block (kernels_cu/moe_gemm_wg.cu B_TMA: the same bits; bf16 weights, and e4m3
    weights with e4m3 sources; e4m3 weights with bf16 sources keep cp.async); default 0: measured no faster (H200,
    2026-12-03).  The plain kernel's switch only: the warp-specialized form (KDA_RT_MOE_WS, by default for e4m3
    sources) always copies the weights so.  Read when the kernel variant is chosen."""
    return _on_off("KDA_RT_MOE_B_TMA", "0")


def moe_a_tma() -> bool:
    """KDA_RT_MOE_A_TMA: 1 (with KDA_RT_MOE_B_TMA=1) copies the source rows of the prefill down GEMM on wgmma (h,
    contiguous in expert order; also fp8 models' dense prefill projections, one expert over an identity plan) by a
    tensor-map copy too, so a stage has no cp.async (kernels_cu/moe_gemm_wg.cu A_TMA: the same bits; gate/up's rows
    are a gather and keep cp.async); default 0: measured no faster (H200, 2026-12-03).  The plain kernel's switch
    only: the warp-specialized form (KDA_RT_MOE_WS) copies the down GEMM's rows so wherever a 128-row box fits the
    source's allocation.  Read when the kernel variant is chosen."""
    return _on_off("KDA_RT_MOE_A_TMA", "0")


def moe_ws() -> bool | None:
    """KDA_RT_MOE_WS: the prefill MoE GEMMs on wgmma (and fp8 models' dense prefill projections, which run on the same
    kernel) in their persistent, warp-specialized form: one CTA an SM claiming (tile, feature block) items, a producer
    warpgroup filling the stages by tensor-map copies (and the gathered rows by cp.async) on mbarriers, the consumers
    freeing each stage as its products finish (kernels_cu/moe_gemm_wg.cu WS: the same bits).  1: wherever it can be
    built (bf16 weights, and e4m3 weights with e4m3 sources); 0: never; unset: for e4m3 sources only (fp8 models'
    prefill), where it measured faster (H200, 2026-12-03, forty-second session: w8a8 GEMMs -3.5 to -7% but one +5.5%,
    the fp8 seed prefill -1.1%; bf16 +3 to +12% a GEMM, the model within noise).  Read when the kernel variant is
    chosen."""
    value = os.environ.get("KDA_RT_MOE_WS")
    return None if not value else _on_off("KDA_RT_MOE_WS")


def moe_multicast() -> bool:
    """KDA_RT_MOE_MC: 1 runs the warp-specialized MoE prefill GEMMs (KDA_RT_MOE_WS) in clusters of two CTAs that take
    an expert's two consecutive tiles and copy half of the weight rows each into both CTAs' stages (tensor-map
    multicast: a third fewer bytes from L2 a stage; kernels_cu/moe_gemm_wg.cu MC: the same bits); default 0: measured
    slower than WS alone (H200, 2026-12-03: +1 to +15% a GEMM against the plain kernel, WS -7 to +4%; the seed
    prefill within noise of the plain kernel).  Read when the kernel variant is chosen."""
    return _on_off("KDA_RT_MOE_MC", "0")


def tma_l2_promotion() -> str:
    """KDA_RT_TMA_L2_PROMOTION: how far L2 widens each tensor-map copy's fetches (ops/tma.py: cuTensorMapEncodeTiled's
    L2 promotion): none, 64, 128 or 256 (bytes; default 256).  A bench switch: the MoE prefill GEMMs' weight rows are
    128 bytes a k step, and a 256-byte promotion fetches the next step's too (H200, 2026-12-03: the WS form moves 37%
    more over the fabric between L2's partitions at 256 than at 128 or none, in the same time; the fp8 seed prefill
    0.6159 s at 256, 0.6158 at 128).  Read when a tensor map is made (maps are kept by value)."""
    value = os.environ.get("KDA_RT_TMA_L2_PROMOTION", "256")
    if value not in ("none", "64", "128", "256"):
        raise ValueError(f"KDA_RT_TMA_L2_PROMOTION must be none, 64, 128 or 256, got {value!r}")
    return value


def moe_half_skip() -> bool:
    """KDA_RT_MOE_HALF_SKIP: 0 makes a warpgroup of the prefill MoE GEMMs on wgmma whose 64 rows all lie past its
    tile's end multiply zeros instead of skipping its products (kernels_cu/moe_gemm_wg.cu HALF_SKIP); default 1.
    Read when the kernel variant is chosen."""
    return _on_off("KDA_RT_MOE_HALF_SKIP")


def route_norm() -> bool:
    """KDA_RT_ROUTE_NORM: 0 keeps the residual add and RMSNorm between a small decode step's mixer and its MoE
    block as their own kernel (rmsnorm.cu) instead of inside the fused routing kernel (moe_route_fused with
    ROUTE_NORM); default 1.  Read at each forward (a CUDA graph keeps what it captured)."""
    return _on_off("KDA_RT_ROUTE_NORM")


def route_norm_max_t(default: int) -> int:
    """KDA_RT_ROUTE_NORM_MAX_T (bench switch): the largest step whose residual add and RMSNorm before the MoE
    block ride in the routing kernel, instead of the measured default (cuda/moe.ROUTE_NORM_MAX_T).  Read at each
    forward and by the precompile (a CUDA graph keeps what it captured)."""
    return _non_negative_int("KDA_RT_ROUTE_NORM_MAX_T", default)


def moe_min_avg_rows(default: int) -> int:
    """KDA_RT_MOE_MIN_AVG_ROWS (bench switch): the average rows a touched expert from which a step's MoE GEMMs take
    64-row tiles instead of the 16-row decode tiles (and moe_decode_fused), instead of the measured default
    (ops/moe_gemm_tc.MIN_AVG_ROWS, MIN_AVG_ROWS_E4M3 for e4m3 stacks); at least 1.  Read at each forward (a CUDA
    graph keeps what it captured)."""
    return _non_negative_int("KDA_RT_MOE_MIN_AVG_ROWS", default, low=1)


def moe_fused32() -> str:
    """KDA_RT_MOE_FUSED32 (bench switch): which steps take 32-row tiles (on moe_decode_fused where it runs).  "e4m3"
    (the default): e4m3 stacks from MIN_AVG_ROWS_E4M3 to 48 rows an expert on average (decode batches of ~514-1370
    tokens of the 48B shape) where KDA_RT_MOE_FUSED64 leaves them on the 64-row tiles that widen e4m3 to bf16 (by
    default it takes them to moe_decode_fused's 64-row tiles instead); "auto": also bf16 stacks from MIN_AVG_ROWS to
    FUSED32_BF16_MAX_AVG (batches of ~115-157 tokens), instead of the 64-row fused tiles (the default until the
    fifty-fifth session measured those faster: moe_gemm_tc.py FUSED32_BF16_MAX_AVG's note); "1":
    every step of 4 to 48 rows an expert in both formats (the 16-row tiles of e4m3 stacks below MIN_AVG_ROWS_E4M3
    too); "0": none (the 64-row tiles).  Read at each forward and by the precompile (a CUDA graph keeps what it
    captured)."""
    value = os.environ.get("KDA_RT_MOE_FUSED32") or "e4m3"
    if value not in ("auto", "e4m3", "1", "0"):
        raise ValueError(f"KDA_RT_MOE_FUSED32 must be auto, e4m3, 1 or 0, got {value!r}")
    return value


def moe_fused64() -> str:
    """KDA_RT_MOE_FUSED64 (bench switch): which steps that take 64-row MoE tiles run moe_decode_fused on them
    (kernels_cu/moe_gemm_tc.cu DEC_WS with BM = 64) instead of two moe_grouped_gemm_tc launches.  "auto" (the default)
    or "1": both formats (e4m3 stacks from MIN_AVG_ROWS_E4M3 to 48 rows an expert, in place of the 32-row fused tiles:
    moe_gemm_tc.py FUSED64_E4M3; bf16 decode batches of ~115-1370 tokens of the 48B shape, 4-48 rows an expert:
    FUSED64_BF16); "e4m3": e4m3 stacks alone (the fifty-second session's default); "0": none.  Read at each forward and
    by the precompile (a CUDA graph keeps what it captured)."""
    value = os.environ.get("KDA_RT_MOE_FUSED64") or "auto"
    if value not in ("auto", "e4m3", "1", "0"):
        raise ValueError(f"KDA_RT_MOE_FUSED64 must be auto, e4m3, 1 or 0, got {value!r}")
    return value


def mla_store_fold() -> bool:
    """KDA_RT_MLA_STORE_FOLD: 0 writes a decode step's MLA latent rows with their own kernel (mla_store.cu) instead
    of inside the mla_absorb_q launch of steps of up to 8 tokens (kernels_cu/mla_attn.cu); default 1.  Read at each
    forward (a CUDA graph keeps what it captured)."""
    return _on_off("KDA_RT_MLA_STORE_FOLD")


def mla_min_tiles(default: int) -> int:
    """KDA_RT_MLA_MIN_TILES (bench switch): the fewest 64-position tiles one split of the MLA decode attention
    reads (kernels_cu/mla_attn.cu MIN_TILES), instead of the measured default (ops/mla_attn._MIN_TILES); at least
    1.  Read when the kernel is picked and its splits counted (a CUDA graph keeps what it captured)."""
    return _non_negative_int("KDA_RT_MLA_MIN_TILES", default, low=1)


def moe_dec_a_async() -> bool:
    """KDA_RT_MOE_DEC_A_ASYNC (bench switch): 1 (the default) has moe_decode_fused's producer warp copy the A rows by
    cp.async from all its lanes, completing on the stage's mbarrier (kernels_cu/moe_gemm_tc.cu DEC_A_ASYNC); 0: one
    bulk copy a row; the same outputs bit for bit (moe_gemm_tc.py FUSED64_BF16 has the measurements).  Read when the
    kernel variant is chosen (a CUDA graph keeps what it captured)."""
    return _on_off("KDA_RT_MOE_DEC_A_ASYNC")


def moe_dec_reverse() -> bool:
    """KDA_RT_MOE_DEC_REVERSE (bench switch): 1 (the default) has moe_decode_fused take each GEMM's items in reverse
    tile order, the shared expert's full tiles first (kernels_cu/moe_gemm_tc.cu DEC_REVERSE); 0: in plan order; the
    same outputs bit for bit.  Read when the kernel variant is chosen (a CUDA graph keeps what it captured)."""
    return _on_off("KDA_RT_MOE_DEC_REVERSE")


def shared_graph_ws() -> bool:
    """KDA_RT_SHARED_GRAPH_WS: 1 (the default) gives every decode graph views of one shared workspace, sized by the
    largest graph (captured first), so the graphs cost the memory of the largest alone, whatever cuda_graph_sizes
    captures (kda_rt/cuda/workspace.py); 0: a workspace each (with the default graph sizes ~3.5x the largest graph's
    bytes in all: the page pool does not reserve them, so a large max_num_seqs may then not fit, a MemoryError at
    start naming the graph).  Read when the runner starts."""
    return _on_off("KDA_RT_SHARED_GRAPH_WS")


def mla_wave_splits() -> bool:
    """KDA_RT_MLA_WAVE_SPLITS (bench switch; measured mixed in the fifty-third session, +0.7 / -1.1%, left off): 1
    launches the MLA decode attention of more tokens than SMs with the split count that fills the waves best
    (ops/mla_attn.launch_splits) instead of one split a token (ceil(T / SMs) waves of whole contexts); default 0.  Read
    when a launch is made (a CUDA graph keeps what it captured)."""
    return _on_off("KDA_RT_MLA_WAVE_SPLITS", default="0")


def fused_kda_projection() -> bool:
    """KDA_RT_FUSED_KDA_PROJ: 0 runs a KDA layer's decode projections of x as two GEMMs (q|k|v, f_a|g_a|b)
    instead of one over their stacked weights (kda_rt/cuda/model.py); default 1.  Read at each call (a CUDA
    graph keeps what it captured)."""
    return _on_off("KDA_RT_FUSED_KDA_PROJ")


def skinny_staged() -> bool:
    """KDA_RT_SKINNY_STAGED: 0 keeps the projections of up to 8 rows whose weights fit one CTA per SM in
    shared memory (o_proj) on the streaming skinny_gemm instead of skinny_gemm_staged, which copies them
    before the programmatic-launch wait (kernels_cu/skinny_gemm.cu; sm_90+); default 1.  Read at each call
    (a CUDA graph keeps what it captured)."""
    return _staged_value() != "0"


def skinny_staged_bulk() -> bool:
    """KDA_RT_SKINNY_STAGED=2: skinny_gemm_staged copies each weight row with one bulk copy (cp.async.bulk)
    instead of 16-byte cp.async pieces (bench A/B)."""
    return _staged_value() == "2"


def _staged_value() -> str:
    value = os.environ.get("KDA_RT_SKINNY_STAGED") or "1"
    if value not in ("0", "1", "2"):
        raise ValueError(f"KDA_RT_SKINNY_STAGED must be 0, 1 or 2, got {value!r}")
    return value


def smem_carveout() -> int | None:
    """KDA_RT_SMEM_CARVEOUT (a bench switch): the preferred shared-memory carveout (percent of the unified L1 /
    shared memory, or -1: the driver's choice) given to every kernels_cu/ kernel; unset: none is set.  The
    driver sizes an SM's shared memory for each kernel's own occupancy and changes it only on an idle SM, so a
    kernel launched early (programmatic launch) that needs more than is left waits for the kernel before to
    leave; a carveout that differs between neighbours makes SMs drain between them (H200: 100 for every
    kernel, or for kda_decode_step and mla_expand_out alone, made batch-1 decode steps slower)."""
    value = os.environ.get("KDA_RT_SMEM_CARVEOUT") or ""
    if not value:
        return None
    if value.lstrip("-").isdigit() and -1 <= int(value) <= 100:
        return int(value)
    raise ValueError(f"KDA_RT_SMEM_CARVEOUT must be -1 or 0 to 100, got {value!r}")


def skinny_wide() -> bool:
    """KDA_RT_SKINNY_WIDE: 0 keeps the narrow dense projections of 9 to 32 rows (decode batches) on cuBLAS
    instead of skinny_gemm_cl (kernels_cu/skinny_gemm.cu; sm_90+); default 1.  Read at each call (a CUDA
    graph keeps what it captured)."""
    return _on_off("KDA_RT_SKINNY_WIDE")


def skinny_ws() -> bool:
    """KDA_RT_SKINNY_WS: 0 runs the 9-32-row projections on skinny_gemm_cl (every warp loads its weight rows into
    registers) instead of skinny_gemm_ws, where one producer warp streams the weights and x by tensor-map copies through
    a ring in shared memory (kernels_cu/skinny_gemm.cu; sm_90 to sm_11x, k slices of whole 128-wide steps); default 1
    (H200, traced at batch 32: 31-32 us a decode step less, 0.35%).  Read at each call (a CUDA graph keeps what it
    captured)."""
    return _on_off("KDA_RT_SKINNY_WS")


def skinny_ws_min_k() -> int:
    """KDA_RT_SKINNY_WS_MIN_K (a bench switch): skinny_gemm_ws only for projections of at least this K (the rest on
    skinny_gemm_cl); default 0 (every K).  Read at each call."""
    return _non_negative_int("KDA_RT_SKINNY_WS_MIN_K", 0)


def mla_early_weights() -> bool:
    """KDA_RT_MLA_EARLY_WEIGHTS (a bench switch): 1 builds the small-step MLA up-projections (mla_absorb_q,
    mla_expand_out) so that they load their kv_b rows before the programmatic-launch wait (kernels_cu/mla_attn.cu
    EARLY_W); default 1 (measured -0.6% at batch 1: docs/PERFORMANCE.md, twenty-third session).  Read at each
    call (a CUDA graph keeps what it captured)."""
    return _on_off("KDA_RT_MLA_EARLY_WEIGHTS", default="1")


def chain_probe() -> int:
    """KDA_RT_CHAIN_PROBE (a bench switch, tests/gpu/probe_route_chain.py): N > 0 builds the fused routing kernel
    and the routed gate/up GEMV with CHAIN_PROBE=N, which stamp %globaltimer at the links of a one-token MoE step
    into N rows of their modules (kernels_cu/common.cuh); 0 (default): the runtime's kernels.  Read when a kernel
    variant is built."""
    return _non_negative_int("KDA_RT_CHAIN_PROBE", 0)


def pdl_dep() -> bool:
    """KDA_RT_PDL_DEP: 0 builds the kernels that load weights into registers before their programmatic-launch wait
    (moe_route_fused, skinny_gemm_cl) with the plain wait, which ptxas issues before those loads
    (kernels_cu/common.cuh KDA_PDL_WAIT_AFTER); default 1.  Read when a kernel variant is built."""
    return _on_off("KDA_RT_PDL_DEP")


def prompt_snapshots() -> bool:
    """KDA_RT_PROMPT_SNAPSHOTS: with prefix caching, 1 (the default) keeps the KDA state at the last 64-token chunk
    end of a prompt's final prefill chunk as an entry (the kernels write it during the step: no copy, no extra step),
    so the same prompt sent again (a regenerate, a retry, another sample later) resumes there and computes at most 64
    tokens; 0: only junctions and request ends are kept (the same prompt again computed in full, the third time
    resumed).  Only runners that write ForwardBatch.snapshot (`writes_snapshots`: the NumPy runner; the CUDA runner
    once its kernel path has passed its GPU tests) make them.  Read every step."""
    return _on_off("KDA_RT_PROMPT_SNAPSHOTS", "1")
