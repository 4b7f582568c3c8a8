"""kernels_cu/kda_prefill.cu against the float64 NumPy KDA (kda_rt.reference.kda_core) on the same
bf16-rounded inputs: conv -> SiLU -> bf16 -> l2norm -> gate -> beta -> recurrence -> bf16(o) -> gated norm.

Every case draws fresh random inputs and poisons `out` with NaN before the call (helpers.kda_kernel).
Gates: "normal" (|g| ~ 1), "near_zero" (g ~ -1e-9: no decay at all), "extreme" (g in -160 .. -4800
per token), "mixed" (channels of -20, 0, 300 dt_bias with exp(A_log) up to 16), "bursty" (normal,
plus random tokens whose gate is -100 .. -800: chunks where some 16-row sub-blocks take the
tensor-core path and others the fp32 path (row scans, or per element), and long prefix sums next to small differences).

Tolerances (the kernel's tensor-core operands are bf16, as fla's chunk_kda; accumulation and the
carried state are fp32):
  out: RMS(out - ref) / RMS(ref) <= 1e-2 over the whole batch and over every 2048-token window of
  the long case.  y is bf16 (2^-9 relative rounding) and is computed from O rounded to bf16 twice
  over (O itself, and the bf16 operands W, U, qg, kd, A_qk, V_new, S behind it, each a 2^-9 relative
  rounding that averages down over the 64..128-long dot products).
  state: RMS over each slot <= 6e-3 relative: the state sums kd^T V_new over all chunks with kd and
  V_new rounded to bf16 (random 2^-9 errors per term, fla's rounding); decay keeps it from drifting.
Measured on the H200 (every case here): out 3.4e-3 .. 4.7e-3, state 2.7e-3 .. 4.4e-3 (worst: near_zero,
no decay, and the 72-sequence bursty case); along the 32K sequence every 2048-token window stays at
3.5e-3 .. 3.6e-3 (no drift).
  conv state: exact (a copy of bf16 inputs); slots not in the batch: untouched.
Letters: T tokens, B sequences, H heads, K = V = 128, P = H*K, W = 4, S slots.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from helpers.gpu import BF16, bf16_round, inline_module, poison_shared_memory, to_np
from helpers.kda_kernel import check, make_inputs, reference, run_op, upload

pytestmark = pytest.mark.gpu

OUT_TOL, STATE_TOL, WINDOW = 1e-2, 6e-3, 2048

CASES = [  # (lengths, H, gates, state columns per CTA or None for the launcher's choice)
    ([1, 3, 64, 65, 200], 4, "normal", None),
    ([1, 3, 64, 65, 200], 4, "mixed", None),
    ([200, 65, 3], 8, "extreme", None),
    ([130, 1], 8, "near_zero", None),
    ([130], 32, "normal", None),
    ([31, 1, 33, 97, 1, 128, 300], 4, "bursty", None),
    ([1, 3, 64, 65, 200], 4, "normal", 32),
    ([257, 1, 100], 4, "bursty", 64),
    ([257, 1, 100], 4, "mixed", 128),
    ([2048] * 32, 2, "normal", None),  # many sequences: chunk ids, grid and slots at scale
    ([1, 63, 64, 65, 130, 7] * 12, 2, "bursty", None),  # > 32 sequences: the chunk search takes 2 steps
]


def _inputs(lengths, num_heads, gates, seed, fresh=None):
    rng = np.random.default_rng(seed)
    inp = make_inputs(rng, lengths, num_heads, "normal" if gates == "bursty" else gates,
                      num_slots=max(8, len(lengths) + 4), fresh=fresh)
    if gates == "bursty":  # ~3% of tokens: f + 300 on every channel -> g ~ -exp(A_log) * 300
        rows = rng.random(inp["f"].shape[0]) < 0.03
        inp["f"][rows] = bf16_round(inp["f"][rows] + 300.0)
    return inp


def check_prefill(out, dev, ref, inp, tag, windows=False):
    """Compare out / pools with the reference at the prefill bounds; per window along T if asked."""
    return check(out, dev, ref, inp, tag, out_tol=OUT_TOL, state_tol=STATE_TOL, windows=WINDOW if windows else 0)


def _run(lengths, num_heads, gates, columns, seed, windows=False, fresh=None):
    from kda_rt.cuda.ops.kda_prefill import kda_prefill

    inp = _inputs(lengths, num_heads, gates, seed, fresh)
    dev = upload(inp)
    op = functools.partial(kda_prefill, state_columns=columns) if columns else kda_prefill
    out = run_op(op, dev, num_heads)  # out is poisoned with NaN before the call
    tag = f"prefill {len(lengths)} seqs ({sum(lengths)} tok) H{num_heads} {gates} vb={columns or 'auto'}"
    return check_prefill(out, dev, reference(inp, num_heads), inp, tag, windows)


def _case_id(c):
    lengths = c[0] if len(c[0]) <= 8 else [f"{len(c[0])}seqs{sum(c[0])}tok"]
    return f"L{'-'.join(map(str, lengths))}-H{c[1]}-{c[2]}" + (f"-vb{c[3]}" if c[3] else "")


@pytest.mark.parametrize("lengths, num_heads, gates, columns", CASES, ids=[_case_id(c) for c in CASES])
def test_kda_prefill(lengths, num_heads, gates, columns):
    _run(lengths, num_heads, gates, columns, seed=sum(lengths) * num_heads + len(gates))


def test_kda_prefill_long():
    """One 32K-token sequence with a nonzero initial state: errors per 2048-token window show drift."""
    _run([32768], 2, "normal", None, seed=32768, windows=True, fresh=[False])
    _run([32768 - 5, 5], 2, "bursty", None, seed=32769, windows=True, fresh=[False, True])


@pytest.mark.parametrize("lengths, num_heads, gates", [([1, 3, 64, 65, 200], 4, "bursty"), ([130, 70], 32, "normal"),
                                                     ([40, 9], 1, "normal"), ([40, 9], 3, "mixed"),
                                                     ([33, 2], 64, "normal")])
def test_kda_prefill_e4m3_out(lengths, num_heads, gates):
    """e4m3_out (kda_prefill_norm_e4m3, one token a block of 16 threads a head; 1 and 3 heads leave a half warp, 64 a
    1024-thread block): out bit for bit as without it (same inputs, same state), and the codes and scales bit for bit
    what quantize_activations_e4m3 makes from out, both into buffers poisoned alike; with one token whose gates are all
    -inf (y = 0: scale 1, zero codes) and one with a NaN gate (a NaN scale, its codes left as they were)."""
    import cupy

    from kda_rt.cuda.ops.compile import arch_number, device_arch
    from kda_rt.cuda.ops.kda_prefill import kda_prefill
    from kda_rt.cuda.ops.quant import quantize_activations_e4m3

    if arch_number(device_arch()) < 89:
        pytest.skip("e4m3 codes need sm_89+")
    inp = _inputs(lengths, num_heads, gates, seed=7 * sum(lengths) + num_heads)
    inp["gate"][1] = -np.inf  # token 1: every head's output gated to 0
    inp["gate"][-1, 5] = np.nan  # the last token: a NaN in one head
    dev, dev2 = upload(inp), upload(inp)  # (two copies of the pools: each call updates its own)
    T, P = dev["f"].shape
    plain = run_op(kda_prefill, dev, num_heads)
    poisoned = lambda: (cupy.full((T, P), 0x7F, dtype=np.uint8), cupy.full(T, -1.0, dtype=np.float32))  # noqa: E731
    q, qs = poisoned()
    out = run_op(kda_prefill, dev2, num_heads, e4m3_out=(q, qs))
    assert cupy.array_equal(out.view(cupy.uint16), plain.view(cupy.uint16)), "e4m3_out changed out"
    want_q, want_s = poisoned()
    quantize_activations_e4m3(out, out=want_q, scale_out=want_s)
    assert float(want_s[1]) == 1.0 and not bool(want_q[1].any()), "token 1 is not a zero row (test setup)"
    assert bool(cupy.isnan(want_s[-1])), "the last token's row is finite (test setup)"
    assert cupy.array_equal(qs, want_s, equal_nan=True), "scales differ from quantize_activations_e4m3's"
    assert cupy.array_equal(q, want_q), f"{int((q != want_q).sum())} codes differ from quantize_activations_e4m3's"


@pytest.mark.parametrize("lengths, num_heads, gates, columns", [([31, 1, 33, 97, 1, 128, 300], 4, "bursty", 32),
                                                              ([700, 2, 129], 8, "mixed", 64),
                                                              ([1, 64, 65], 3, "extreme", 16)])
def test_kda_prefill_state_prefetch(lengths, num_heads, gates, columns):
    """kda_prefill_state's prefetch depths (STATE_PF 0: one buffer a tile; 1: A_qk and kd a chunk ahead; 2: every tile
    a chunk ahead) against the reference, with a nonzero initial state on some sequences, and bit for bit equal to one
    another (the same products in the same order: a wrong buffer or chunk index, a tile read before it landed or
    overwritten while read shows as a difference from depth 0; depth 0 itself, whose barriers moved too, is held to
    the reference's bound)."""
    import cupy

    from kda_rt.cuda.ops.kda_prefill import kda_prefill

    fresh = [i % 2 == 0 for i in range(len(lengths))]
    inp = _inputs(lengths, num_heads, gates, seed=11 * sum(lengths) + num_heads, fresh=fresh)
    ref = reference(inp, num_heads)
    outs, recs = [], []
    for pf in (0, 1, 2):
        dev = upload(inp)
        out = run_op(functools.partial(kda_prefill, state_columns=columns, state_prefetch=pf), dev, num_heads)
        check_prefill(out, dev, ref, inp, f"prefetch {pf} {len(lengths)} seqs H{num_heads} {gates} vb={columns}")
        outs.append(out.view(cupy.uint16)), recs.append(dev["rec_pool"])
    for pf in (1, 2):
        assert cupy.array_equal(outs[pf], outs[0]), f"prefetch {pf}: out differs from prefetch 0's"
        assert cupy.array_equal(recs[pf], recs[0]), f"prefetch {pf}: the final state differs from prefetch 0's"


@pytest.mark.parametrize("lengths, num_heads, gates", [([31, 1, 33, 97, 1, 128, 300], 4, "bursty"),
                                                     ([200, 65, 3], 8, "extreme"), ([130, 1], 8, "near_zero"),
                                                     ([1, 3, 64, 65, 200], 4, "mixed"), ([4096], 4, "normal")])
def test_kda_prefill_intra_variants(monkeypatch, lengths, num_heads, gates):
    """The intra kernel's variants, each alone on top of the build with all of them off (the build before
    2026-12-02): KDA_RT_KDA_CONV_ONE_ROUND (the conv + SiLU outputs rounded to bf16 once, by their store),
    KDA_RT_KDA_SCALE_UNROLL (phase (c) unrolled, each thread's column pair fixed), KDA_RT_KDA_ROW_NORM_SPREAD (row
    norms on warps 0-7, gate bookkeeping on warps 12-15), KDA_RT_KDA_CONV_PAIRS (phase (a) two channels a
    thread), KDA_RT_KDA_BETA_EARLY (beta loaded before the copies), KDA_RT_KDA_COPY_ROWS (the copies issued row by
    row), KDA_RT_KDA_EARLY_LOOKUP (the next tile's lookup at the entry), KDA_RT_KDA_G_BALANCE (phase (g) two row
    blocks a warp), KDA_RT_KDA_G_STAGED (W, U stored in 16-byte pieces) and KDA_RT_KDA_PAD_FIXUP (rows past the end
    zeroed after phase (a), not selected value by value): bit for bit what the all-off build gives; the bit-identical
    variants that apply on top of another, each bit for bit that other alone: KDA_RT_KDA_ROW_SCATTER ((b)'s row sums
    by a reduce-scatter) on ROW_NORM_SPREAD, KDA_RT_KDA_LOOKUP_BOUNDS (the search returns the bounds, the slot-free
    copies first) on EARLY_LOOKUP + COPY_ROWS, KDA_RT_KDA_T_ROWS = 1 and 4 (rows a thread in T's products) on
    T_HALVES (T_ROWS 2, the default), PAD_FIXUP on the one-channel GATE_FAST and GATE_POLY builds (its fix-up in
    place of their selects); KDA_RT_KDA_GATE_FAST (the gate's softplus branch-free, without log1pf),
    KDA_RT_KDA_EXP2_FTZ (per-element exponentials without subnormal results), KDA_RT_KDA_T_HALVES (T's off-diagonal
    blocks by halves, fp32 sums in another order), KDA_RT_KDA_SILU_FAST (conv + SiLU by the hardware reciprocal
    alone), KDA_RT_KDA_GATE_POLY (the gate's softplus by one exponential and a polynomial), KDA_RT_KDA_E_SCAN
    (unsafe diagonal halves by row scans): against the reference at the prefill bounds.  Also "default" (no switch
    set), "default-bit" (CONV_PAIRS, BETA_EARLY, COPY_ROWS, EARLY_LOOKUP, G_BALANCE, G_STAGED, ROW_SCATTER, PAD_FIXUP,
    LOOKUP_BOUNDS off and T_ROWS 1 in it: bit for bit the default) and "default-PAD_FIXUP" (PAD_FIXUP on the default
    build, two channels a thread: bit for bit without it).  Every gate kind, fresh and continuing sequences (the
    conv-state slot read), lengths 1-4096; every SM's shared memory poisoned before each build."""
    import cupy

    from kda_rt.cuda.ops.kda_prefill import kda_prefill

    fresh = [i % 2 == 0 for i in range(len(lengths))]
    inp = _inputs(lengths, num_heads, gates, seed=17 * sum(lengths) + num_heads, fresh=fresh)
    ref = reference(inp, num_heads)
    outs, recs = {}, {}
    bitwise = ("KDA_RT_KDA_CONV_ONE_ROUND", "KDA_RT_KDA_SCALE_UNROLL", "KDA_RT_KDA_ROW_NORM_SPREAD",
               "KDA_RT_KDA_CONV_PAIRS", "KDA_RT_KDA_BETA_EARLY", "KDA_RT_KDA_COPY_ROWS", "KDA_RT_KDA_EARLY_LOOKUP",
               "KDA_RT_KDA_G_BALANCE", "KDA_RT_KDA_G_STAGED", "KDA_RT_KDA_PAD_FIXUP")
    bounded = ("KDA_RT_KDA_GATE_FAST", "KDA_RT_KDA_EXP2_FTZ", "KDA_RT_KDA_T_HALVES", "KDA_RT_KDA_SILU_FAST",
               "KDA_RT_KDA_GATE_POLY", "KDA_RT_KDA_E_SCAN")
    stacked = ("KDA_RT_KDA_ROW_SCATTER", "KDA_RT_KDA_LOOKUP_BOUNDS")
    switches = (*bitwise, *bounded, *stacked, "KDA_RT_KDA_T_ROWS")
    off = dict.fromkeys((*bitwise, *bounded, *stacked), "0")  # T_ROWS unset: 2, applies with T_HALVES only
    lookup_base = {"KDA_RT_KDA_EARLY_LOOKUP": "1", "KDA_RT_KDA_COPY_ROWS": "1"}
    on_top = {  # run: (its switches over all-off, the run it must equal bit for bit)
        "ROW_SCATTER": ({"KDA_RT_KDA_ROW_NORM_SPREAD": "1", "KDA_RT_KDA_ROW_SCATTER": "1"}, "KDA_RT_KDA_ROW_NORM_SPREAD"),
        "LOOKUP_BOUNDS": ({**lookup_base, "KDA_RT_KDA_LOOKUP_BOUNDS": "1"}, "lookup-base"),
        "T_ROWS=1": ({"KDA_RT_KDA_T_HALVES": "1", "KDA_RT_KDA_T_ROWS": "1"}, "KDA_RT_KDA_T_HALVES"),
        "T_ROWS=4": ({"KDA_RT_KDA_T_HALVES": "1", "KDA_RT_KDA_T_ROWS": "4"}, "KDA_RT_KDA_T_HALVES"),
        "GATE_FAST+PAD_FIXUP": ({"KDA_RT_KDA_GATE_FAST": "1", "KDA_RT_KDA_PAD_FIXUP": "1"}, "KDA_RT_KDA_GATE_FAST"),
        "GATE_POLY+PAD_FIXUP": ({"KDA_RT_KDA_GATE_POLY": "1", "KDA_RT_KDA_PAD_FIXUP": "1"}, "KDA_RT_KDA_GATE_POLY")}
    runs = {"none": off, **{name: {**off, name: "1"} for name in (*bitwise, *bounded)},
            "lookup-base": {**off, **lookup_base}, **{run: {**off, **env} for run, (env, _) in on_top.items()},
            "default": {}, "default-PAD_FIXUP": {"KDA_RT_KDA_PAD_FIXUP": "0"},
            "default-bit": {"KDA_RT_KDA_CONV_PAIRS": "0", "KDA_RT_KDA_BETA_EARLY": "0", "KDA_RT_KDA_COPY_ROWS": "0",
                            "KDA_RT_KDA_EARLY_LOOKUP": "0", "KDA_RT_KDA_G_BALANCE": "0", "KDA_RT_KDA_G_STAGED": "0",
                            "KDA_RT_KDA_ROW_SCATTER": "0", "KDA_RT_KDA_PAD_FIXUP": "0",
                            "KDA_RT_KDA_LOOKUP_BOUNDS": "0", "KDA_RT_KDA_T_ROWS": "1"}}
    for run, env in runs.items():
        for name in switches:
            if name in env:
                monkeypatch.setenv(name, env[name])
            else:
                monkeypatch.delenv(name, raising=False)
        dev = upload(inp)
        poison_shared_memory()  # no build may pass on what the one before left in shared memory
        out = run_op(kda_prefill, dev, num_heads)
        check_prefill(out, dev, ref, inp, f"variants {run} {len(lengths)} seqs H{num_heads} {gates}")
        outs[run], recs[run] = out.view(cupy.uint16), dev["rec_pool"]
    pairs = [(name, "none") for name in bitwise] + [(run, base) for run, (_, base) in on_top.items()]
    for run, base in [*pairs, ("default-bit", "default"), ("default-PAD_FIXUP", "default")]:  # bit-identical
        assert cupy.array_equal(outs[run], outs[base]), f"{run}: out differs from the {base} build's"
        assert cupy.array_equal(recs[run], recs[base]), f"{run}: the final state differs from the {base} build's"

LOOKUP_SRC = r"""
#define HEAD_DIM 128
#define CONV_W 4
#define CHUNK 64
#define VB 64
#define INTRA_THREADS 512
#include "kda_prefill.cu"
// one warp a pair of chunk ids (all lanes active, as in the kernel): EARLY_LOOKUP's lockstep search, two calls of
// the single one and LOOKUP_BOUNDS's search with the sequences' bounds (out: [2 n] ids, then [2 n][2] bounds)
extern "C" __global__ void lookup_pairs(const int* cu, int num_seqs, const int* cids, int n, int* pair_out,
                                        int* single_out, int* bounds_seq, int* bounds_out) {
    const int w = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if (w >= n) return;  // warp-uniform
    int s1, s2, u1, u2, b1[2], b2[2];
    sequence_of_chunk_pair(cu, num_seqs, cids[2 * w], cids[2 * w + 1], s1, s2);
    const int t1 = sequence_of_chunk(cu, num_seqs, cids[2 * w]), t2 = sequence_of_chunk(cu, num_seqs, cids[2 * w + 1]);
    sequence_bounds_of_chunk_pair(cu, num_seqs, cids[2 * w], cids[2 * w + 1], u1, u2, b1, b2);
    if ((threadIdx.x & 31) == 0) {
        pair_out[2 * w] = s1, pair_out[2 * w + 1] = s2, single_out[2 * w] = t1, single_out[2 * w + 1] = t2;
        bounds_seq[2 * w] = u1, bounds_seq[2 * w + 1] = u2;
        bounds_out[4 * w] = b1[0], bounds_out[4 * w + 1] = b1[1], bounds_out[4 * w + 2] = b2[0], bounds_out[4 * w + 3] = b2[1];
    }
}
"""


def test_kda_sequence_of_chunk_pair():
    """kda_prefill.cu's sequence_of_chunk_pair (EARLY_LOOKUP: the tile's own sequence and the next tile's, for its L2
    prefetch, searched in lockstep) against NumPy (the last sequence whose first chunk id, b + cu_seqlens[b] // 64, is
    <= the id) and against two calls of sequence_of_chunk, for 1-1025 sequences (one to three 32-way steps, the two
    searches finishing on different steps), lengths 0-300 (empty sequences among them) and random pairs of ids
    over every chunk id; sequence_bounds_of_chunk_pair (LOOKUP_BOUNDS) the same sequences and each one's
    cu_seqlens[seq], cu_seqlens[seq + 1].  The model's tests reach only small batches, where the search is one step
    or none."""
    import cupy

    mod = inline_module(LOOKUP_SRC)
    fn = mod.get_function("lookup_pairs")
    rng = np.random.default_rng(5)
    for num_seqs in (1, 2, 31, 32, 33, 100, 1000, 1025):
        lens = rng.integers(0, 301, num_seqs)
        lens[rng.random(num_seqs) < 0.1] = 0
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        chunks = num_seqs + int(cu[-1]) // 64
        base = np.arange(num_seqs) + cu[:-1] // 64
        ids = np.concatenate([np.repeat(np.arange(chunks), 2), rng.integers(0, chunks, 2 * chunks)]).astype(np.int32)
        ids[1:2 * chunks:2] = rng.permutation(chunks)  # every id in both places, paired with another
        n = ids.size // 2
        want = np.searchsorted(base, ids, side="right") - 1
        pair, single = cupy.full(2 * n, -7, dtype=np.int32), cupy.full(2 * n, -7, dtype=np.int32)
        bseq, bounds = cupy.full(2 * n, -7, dtype=np.int32), cupy.full(4 * n, -7, dtype=np.int32)
        fn(((n * 32 + 127) // 128,), (128,), (cupy.asarray(cu), np.int32(num_seqs), cupy.asarray(ids), np.int32(n),
                                              pair, single, bseq, bounds))
        np.testing.assert_array_equal(single.get(), want, err_msg=f"sequence_of_chunk, {num_seqs} sequences")
        np.testing.assert_array_equal(pair.get(), want, err_msg=f"sequence_of_chunk_pair, {num_seqs} sequences")
        np.testing.assert_array_equal(bseq.get(), want, err_msg=f"sequence_bounds_of_chunk_pair, {num_seqs} sequences")
        np.testing.assert_array_equal(bounds.get().reshape(-1, 2), np.stack([cu[want], cu[want + 1]], axis=1),
                                      err_msg=f"sequence_bounds_of_chunk_pair's bounds, {num_seqs} sequences")


SOFTPLUS_SRC = r"""
#include "kda_common.cuh"
extern "C" __global__ void softplus_all(const float* z, float* fast, float* approx, float* poly, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) fast[i] = kda_softplus_fast(z[i], 0.f), approx[i] = kda_softplus_approx(z[i], 0.f),
               poly[i] = kda_softplus_poly(z[i], 0.f);
}
"""


def test_kda_softplus_fast():
    """kda_common.cuh's kda_softplus_fast (GATE_FAST's gate) and kda_softplus_poly (GATE_POLY's) on 2M points of z in
    [-80, 30] plus the switch points (x = e^z = 1/8, z = 20 and the float after it, which must come back as itself;
    z = 0 and the smallest |z|, where poly's two terms meet) and NaN / +-inf, against float64 softplus.  Bound a point:
    2e-6 relative (fast's formula given x: <= ~1.5e-6, poly's <= 3.4e-7, kda_common.cuh) plus 2 |z| 2^-24 (the
    rounding of ex2's argument and ex2.approx's own ~2^-22, which kda_softplus_approx, the default build's, has too:
    held to the same bound here).  A wrong series or polynomial coefficient costs >= ~1e-4 relative and fails."""
    import cupy

    mod = inline_module(SOFTPLUS_SRC)
    sweep = np.linspace(-80.0, 30.0, 2_000_001, dtype=np.float32)
    edges = np.float32([0.0, 1e-30, -1e-30, np.log(0.125), np.nextafter(np.float32(np.log(0.125)), np.float32(1)),
                        20.0, np.nextafter(np.float32(20.0), np.float32(21)), np.nan, -np.inf, np.inf])
    z = np.concatenate([sweep, edges])
    dz = cupy.asarray(z)
    fast, approx, poly = (cupy.full(z.size, -7.0, dtype=np.float32) for _ in range(3))
    n = z.size
    mod.get_function("softplus_all")(((n + 255) // 256,), (256,), (dz, fast, approx, poly, np.int32(n)))
    fast, approx, poly = fast.get(), approx.get(), poly.get()
    z64 = z.astype(np.float64)
    with np.errstate(invalid="ignore"):
        ref = np.where(z64 > 20, z64, np.logaddexp(0.0, z64))
    fin = np.isfinite(z)
    bound = 2e-6 + 2 * np.abs(z64[fin]) * 2.0**-24
    for name, got in (("fast", fast), ("approx", approx), ("poly", poly)):
        rel = np.abs(got[fin] - ref[fin]) / ref[fin]
        worst = int(np.argmax(rel / bound))
        print(f"kda_softplus_{name}: max rel {rel.max():.3e} (z = {z[fin][worst]:.4f}, its bound {bound[worst]:.2e})")
        assert (rel <= bound).all(), f"kda_softplus_{name}: relative error {rel[worst]:.3e} > {bound[worst]:.3e} at " \
                                     f"z = {z[fin][worst]!r}"
        assert np.isnan(got[-3]) and got[-2] == 0.0 and got[-1] == np.inf, f"kda_softplus_{name}: NaN / -inf / +inf"
        assert got[-4] == z[-4], f"kda_softplus_{name}: z just above 20 is not z itself"


if __name__ == "__main__":
    for case in CASES:
        test_kda_prefill(*case)
    test_kda_prefill_long()


@pytest.mark.parametrize("lengths, num_heads, gates, cuts, columns", [
    ([200, 65, 3, 130, 1000], 4, "bursty", [128, 64, 0, 64, 960], 32),
    ([300, 70], 8, "mixed", [256, 0], 64),
    ([2048, 2048, 129], 2, "extreme", [64, 1984, 128], None),
])
def test_kda_prefill_snapshot(lengths, num_heads, gates, cuts, columns):
    """`snapshot` (the prefix cache's prompt snapshots): sequence b's state after its first cuts[b] tokens also goes to
    a free slot (poisoned before: NaN states, 0x7FFF conv entries).  Outputs and the batch's slots bit for bit a run
    without it (same inputs); each snapshot slot bit for bit the end state of a run on those first tokens alone (same
    state width: the same chunks, the same arithmetic), its conv history equal to the float64 reference's of those
    tokens; other slots untouched.  Malformed snapshot arrays are refused by name."""
    import cupy

    from kda_rt.cuda.ops.kda_prefill import kda_prefill

    inp = _inputs(lengths, num_heads, gates, seed=sum(lengths) + sum(cuts))
    free = [s for s in range(inp["rec_pool"].shape[0]) if s not in set(inp["state_slots"].tolist())]
    snap_slots = [free.pop() if c else 0 for c in cuts]
    for b, c in enumerate(cuts):
        if c:
            inp["rec_pool"][snap_slots[b]] = np.nan
    dev, plain_dev = upload(inp), upload(inp)
    bits = lambda a: a.view(cupy.uint16) if a.dtype == BF16 else a.view(cupy.uint32)  # noqa: E731
    for b, c in enumerate(cuts):
        if c:
            bits(dev["conv_pool"][snap_slots[b]])[...] = 0x7FFF
    op = functools.partial(kda_prefill, state_columns=columns) if columns else kda_prefill
    snap = cupy.asarray(np.array([[c, s] for c, s in zip(cuts, snap_slots, strict=True)], dtype=np.int32))
    out = run_op(op, dev, num_heads, snapshot=snap)
    plain = run_op(op, plain_dev, num_heads)
    assert cupy.array_equal(bits(out), bits(plain)), "the snapshot changed out"
    for s in inp["state_slots"].tolist():
        for pool in ("conv_pool", "rec_pool"):
            assert cupy.array_equal(bits(dev[pool][s]), bits(plain_dev[pool][s])), f"the snapshot changed slot {s}"
    # the first cuts[b] tokens alone (the snapshotting sequences, same fresh / continuing starts and states)
    keep = [b for b, c in enumerate(cuts) if c]
    cu = inp["cu_seqlens"]
    rows = np.concatenate([np.arange(cu[b], cu[b] + cuts[b]) for b in keep])
    part = dict(inp, cu_seqlens=np.concatenate([[0], np.cumsum([cuts[b] for b in keep])]).astype(np.int32),
                context_lens=inp["context_lens"][keep], state_slots=inp["state_slots"][keep])
    for name in ("qkv", "f", "b", "gate"):
        part[name] = inp[name][rows]
    part_dev = upload(part)
    run_op(op, part_dev, num_heads)
    _, ref_conv, _ = reference(part, num_heads)
    for i, b in enumerate(keep):
        s, alone = snap_slots[b], int(part["state_slots"][i])
        assert cupy.array_equal(bits(dev["rec_pool"][s]), bits(part_dev["rec_pool"][alone])), \
            f"sequence {b}: the snapshot after {cuts[b]} tokens is not the end state of those tokens alone"
        assert np.array_equal(to_np(dev["conv_pool"][s]), ref_conv[alone]), f"sequence {b}: snapshot conv history"
    used = set(inp["state_slots"].tolist()) | {snap_slots[b] for b in keep}
    for s in set(range(inp["rec_pool"].shape[0])) - used:
        assert cupy.array_equal(bits(dev["rec_pool"][s]), bits(plain_dev["rec_pool"][s])), f"slot {s} changed"
        assert cupy.array_equal(bits(dev["conv_pool"][s]), bits(plain_dev["conv_pool"][s])), f"slot {s} changed"
    with pytest.raises(ValueError, match="snapshot must be a contiguous"):
        run_op(op, dev, num_heads, snapshot=snap[:-1])
    with pytest.raises(ValueError, match="snapshot must be a contiguous"):
        run_op(op, dev, num_heads, snapshot=snap.astype(np.int64))
