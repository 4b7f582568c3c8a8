"""kernels_cu/kda_decode.cu against the float64 NumPy KDA, step by step, and against kda_prefill.

Cases: several decode steps over fresh sequences (garbage in their slots) mixed with continuing ones
and permuted slots, B = 1, 3, 5, 32, 128; normal, mixed and extreme gates; every kernel variant
(column split over a cluster of 1, 2, 4 or 8 CTAs; split > 1 needs sm_90+); the low-rank gate
projections f_b, g_b fused into the kernel (small batches, strided f_a / g_a rows); decode after prefill
equals one prefill of the same tokens (state carried in the pools); one step replayed from a captured
CUDA graph.
Tolerances as tests/kernels/test_kda_prefill.py: out RMS ratio <= 5e-3, state <= 1e-4, conv state
exact.  Letters: B sequences (one token each), H heads, K = V = 128, P = H*K, W = 4, S slots.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.gpu import BF16, bf16_round, poison, rms_rel, to_np
from helpers.kda_kernel import K, check, make_inputs, reference, run_op, upload

pytestmark = pytest.mark.gpu


def step_inputs(rng, inp, num_heads, fresh):
    """Next-token inputs for every sequence of `inp` (same weights and slots), context per `fresh`."""
    nxt = make_inputs(rng, [1] * len(inp["state_slots"]), num_heads, fresh=fresh)
    for name in ("conv_w", "A_log", "dt_bias", "o_norm_w", "state_slots"):
        nxt[name] = inp[name]
    return nxt


def sync_pools(inp, dev):
    """Host pools <- device pools (the reference continues from the kernel's state, exactly as stored)."""
    inp["conv_pool"], inp["rec_pool"] = to_np(dev["conv_pool"]), to_np(dev["rec_pool"])


CASES = [(1, 32, "normal"), (3, 4, "mixed"), (5, 4, "normal"), (5, 4, "mixed"), (8, 32, "extreme"),
         (32, 8, "extreme"), (128, 4, "mixed")]
# (split, threads): every entry of kda_rt.cuda.ops.kda_decode._VARIANTS (None = the launcher's choice,
# covered by the prefill and graph tests below).  Step 0 has fresh (even) and continuing (odd)
# sequences, steps 1 and 2 continue them all (B = 1: fresh, then continuing).
VARIANTS = [(1, 256), (2, 128), (2, 256), (4, 128), (8, 128)]


def variant_kw(variant):
    """kda_decode keywords of a variant; skips split > 1 on GPUs without thread-block clusters."""
    import cupy

    if variant is None:
        return {}
    if variant[0] > 1 and int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("column split needs thread-block clusters (sm_90+)")
    return {"split": variant[0], "threads": variant[1]}


def vid(variant):
    return "auto" if variant is None else f"split{variant[0]}x{variant[1]}"


def _next_step(rng, inp, dev, num_heads, names):
    """The inputs of the next decode step of every sequence, with the device pools synced to them and the
    named inputs uploaded again; returns the new host inputs."""
    nxt = step_inputs(rng, inp, num_heads, [False] * len(inp["context_lens"]))
    sync_pools(nxt, dev)
    for name in names:
        dev[name] = upload({name: nxt[name]})[name]
    return nxt


@pytest.mark.parametrize("early", ["1", "0"], ids=["early-state", "wait-first"])
@pytest.mark.parametrize("variant", VARIANTS, ids=[vid(v) for v in VARIANTS])
@pytest.mark.parametrize("num_seqs, num_heads, gates", CASES, ids=[f"B{c[0]}-H{c[1]}-{c[2]}" for c in CASES])
def test_kda_decode_steps(num_seqs, num_heads, gates, variant, early, monkeypatch):
    """Both entries: the state and weights loaded before the programmatic-launch wait (KDA_RT_KDA_EARLY_STATE=1,
    the default) or after it."""
    from kda_rt.cuda.ops.kda_decode import kda_decode

    monkeypatch.setenv("KDA_RT_KDA_EARLY_STATE", early)

    kw = variant_kw(variant)
    rng = np.random.default_rng(num_seqs * num_heads)
    inp = make_inputs(rng, [1] * num_seqs, num_heads, gates, num_slots=num_seqs + 3)
    dev = upload(inp)
    for step in range(3):
        if step:
            inp = _next_step(rng, inp, dev, num_heads, ("qkv", "f", "b", "gate", "context_lens"))
        out = run_op(kda_decode, dev, num_heads, **kw)
        check(out, dev, reference(inp, num_heads), inp,
              f"decode step {step} B{num_seqs} H{num_heads} {gates} {vid(variant)}")


@pytest.mark.parametrize("num_seqs, gates", [(5, "mixed"), (160, "normal")])
def test_kda_decode_state_hints(num_seqs, gates, monkeypatch):
    """Every cache-hint variant of the state's loads and stores (kda_decode.cu STATE_HINTS 0-3, forced through
    KDA_RT_KDA_STATE_HINTS; the launcher picks 1 up to 128 sequences and 2 above) on the same inputs, two steps:
    outputs and pools bit for bit those of the plain variant (0), which is checked against the reference."""
    import cupy

    from kda_rt.cuda.ops.kda_decode import kda_decode, state_hints

    results = {}
    for hints in ("0", "1", "2", "3"):
        monkeypatch.setenv("KDA_RT_KDA_STATE_HINTS", hints)
        assert state_hints(num_seqs) == int(hints)
        rng = np.random.default_rng(num_seqs)
        inp = make_inputs(rng, [1] * num_seqs, 4, gates, num_slots=num_seqs + 2)
        dev = upload(inp)
        got = []
        for step in range(2):
            if step:
                inp = _next_step(rng, inp, dev, 4, ("qkv", "f", "b", "gate", "context_lens"))
            out = run_op(kda_decode, dev, 4)
            if hints == "0":
                check(out, dev, reference(inp, 4), inp, f"decode step {step} B{num_seqs} {gates}")
            got.append([cupy.asnumpy(a).tobytes() for a in (out, dev["rec_pool"], dev["conv_pool"])])
        results[hints] = got
    for hints in ("1", "2", "3"):
        assert results[hints] == results["0"], f"STATE_HINTS={hints}: outputs or pools differ from the plain variant"


@pytest.mark.parametrize("early", ["1", "0"], ids=["early-state", "wait-first"])
@pytest.mark.parametrize("num_seqs, num_heads, gates", [(5, 4, "mixed"), (32, 8, "extreme"), (160, 4, "normal")])
def test_kda_decode_smem_state(num_seqs, num_heads, gates, early, monkeypatch):
    """The state by bulk copies into shared memory, three CTAs an SM (kda_decode.cu SMEM_STATE, forced through
    KDA_RT_KDA_SMEM_STATE=1; =2 writes it back by bulk copies too; =3 the persistent form, one CTA an SM walking its
    heads with three state buffers, also on a grid of 3 CTAs (KDA_RT_KDA_PERSIST_CTAS=3: each CTA many heads, so
    every buffer is reused and its copies' parities wrap, fresh heads, which copy nothing, among them)) on the same
    inputs as the register form, three steps (fresh and continuing sequences in permuted slots): outputs and pools
    bit for bit the register form's (asserted first), which is checked against
    the reference with the state bound at 5e-4: on these draws one conv output of the fp32 kernel rounds to the
    other bf16 neighbour of the float64 reference's, which moves that head's state by ~2e-4 RMS (measured 1.66e-4 at
    B32-H8 step 2 and 1.96e-4 at B160-H4 step 0, H200; test_kda_decode_steps holds the kernel to 1e-4 on its own
    draws)."""
    import cupy

    from kda_rt.cuda.ops.kda_decode import SMEM_STATE_MIN_BLOCKS, decode_config, kda_decode

    if int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("SMEM_STATE needs bulk copies and mbarriers (sm_90+)")
    monkeypatch.setenv("KDA_RT_KDA_EARLY_STATE", early)
    results, ref_failure = {}, None
    for form in ("0", "1", "2", "3", "3-grid3"):
        smem = form[0]
        monkeypatch.setenv("KDA_RT_KDA_SMEM_STATE", smem)
        monkeypatch.setenv("KDA_RT_KDA_PERSIST_CTAS", "3" if form == "3-grid3" else "0")
        assert decode_config(num_seqs=num_seqs)[2] == {"0": 2, "1": SMEM_STATE_MIN_BLOCKS, "2": SMEM_STATE_MIN_BLOCKS,
                                                       "3": 1}[smem]
        rng = np.random.default_rng(7 * num_seqs + num_heads)
        inp = make_inputs(rng, [1] * num_seqs, num_heads, gates, num_slots=num_seqs + 3)
        dev = upload(inp)
        got = []
        for step in range(3):
            if step:
                inp = _next_step(rng, inp, dev, num_heads, ("qkv", "f", "b", "gate", "context_lens"))
            out = run_op(kda_decode, dev, num_heads)
            if form == "0":  # (a failure here is raised after the bit-for-bit comparison below)
                try:
                    check(out, dev, reference(inp, num_heads), inp, f"decode step {step} B{num_seqs} H{num_heads} {gates}",
                          state_tol=5e-4)
                except AssertionError as e:
                    ref_failure = ref_failure or e
            got.append([cupy.asnumpy(a).tobytes() for a in (out, dev["rec_pool"], dev["conv_pool"])])
        results[form] = got
    for form in ("1", "2", "3", "3-grid3"):
        for step, (a, b) in enumerate(zip(results[form], results["0"], strict=True)):
            for name, x, y in zip(("out", "rec_pool", "conv_pool"), a, b, strict=True):
                assert x == y, f"SMEM_STATE={form} step {step}: {name} differs from the register form's"
    if ref_failure is not None:
        raise ref_failure


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize(("num_seqs", "smem", "fused", "early"), [
    (3, "auto", False, True), (3, "auto", True, True), (6, "0", False, True), (6, "1", False, True),
    (6, "2", False, True), (40, "auto", False, True), (3, "auto", False, False), (6, "0", False, False),
    (6, "3", False, True), (40, "3", False, True), (40, "3", False, False)],
    ids=["B3-split4", "B3-split4-fused", "B6-registers", "B6-smem1", "B6-smem2", "B40-smem1", "B3-split4-late",
         "B6-registers-late", "B6-persist", "B40-persist-grid5", "B40-persist-grid5-late"])
def test_kda_decode_skip_pad(num_seqs, smem, fused, early, level, monkeypatch):
    """kda_decode(skip_pad=1 or 2) (kda_decode.cu SKIP_PAD, the runner's KDA_RT_SKIP_PAD): rows whose slot is -1
    are padding rows, a fresh state stored nowhere (2: their CTAs write zeros and leave).  Against the same step with
    those rows on a real spare slot (context 0, skip_pad off): every live output row bit for bit the same, the padding
    rows' too with 1 and zeros with 2 (poisoned before), the live slots' conv
    and recurrent state bit for bit the same, and the pools everywhere else untouched (the spare slot keeps its
    garbage, which the run without the switch overwrote).  Slot 0 is never a live slot, and the pools are views
    from the second slot of larger arrays whose first slot is a guard: a store to the slot a padding row's -1 maps
    to (0) or to slot -1 itself (the define missing) shows.  The live rows are fresh and continuing sequences in
    permuted slots, two steps; every state form: the split kernel (3 rows, also with the low-rank gates fused in),
    the register form and both shared-memory forms (6 rows, forced) and the launcher's choice at 40 rows, and the
    split and register forms with EARLY_STATE 0 ("late": the programmatic-launch wait at entry, KDA_RT_KDA_EARLY_STATE=0)."""
    import cupy

    from kda_rt.cuda.ops.kda_decode import kda_decode

    monkeypatch.setenv("KDA_RT_KDA_EARLY_STATE", "1" if early else "0")

    if int(cupy.cuda.Device().compute_capability) < 90 and (num_seqs <= 4 or smem in ("1", "2", "3")):
        pytest.skip("the split kernel and SMEM_STATE need sm_90+")
    # the persistent form (3) at 40 rows on 5 CTAs: 32 heads each, padding rows' heads (no copy) among them
    monkeypatch.setenv("KDA_RT_KDA_PERSIST_CTAS", "5" if smem == "3" and num_seqs == 40 else "0")
    if smem == "auto":
        monkeypatch.delenv("KDA_RT_KDA_SMEM_STATE", raising=False)
    else:
        monkeypatch.setenv("KDA_RT_KDA_SMEM_STATE", smem)
    H, pads, S = 4, max(1, num_seqs // 3), num_seqs + 3
    rng = np.random.default_rng(31 * num_seqs + len(smem) + fused)
    inp = make_inputs(rng, [1] * num_seqs, H, "mixed", num_slots=S)
    live = num_seqs - pads
    inp["state_slots"][:live] = rng.permutation(np.arange(1, S))[:live]  # (slot 0: never live)
    spare = int(np.setdiff1d(np.arange(1, S), inp["state_slots"][:live])[0])
    inp["context_lens"][live:] = 0
    step2 = step_inputs(rng, inp, H, [False] * live + [True] * pads)  # the live rows continue, the padding rows fresh
    low_rank = [low_rank_inputs(rng, x, H, K) for x in (inp, step2)] if fused else None
    runs = {}
    for skip in (False, True):
        step_inp = dict(inp, state_slots=inp["state_slots"].copy())
        step_inp["state_slots"][live:] = -1 if skip else spare
        dev = upload(step_inp)
        guarded = {}
        for name in ("conv_pool", "rec_pool"):  # [guard, slot 0, ..., slot S-1]: the pool is big[1:]
            big = cupy.empty((S + 1, *dev[name].shape[1:]), dtype=dev[name].dtype)
            big[0] = 7.0
            big[1:] = dev[name]
            dev[name], guarded[name] = big[1:], big
        before = {n: to_np(b) for n, b in guarded.items()}
        outs = []
        for step in range(2):
            if step:
                for name in ("qkv", "f", "b", "gate", "context_lens"):
                    dev[name] = upload({name: step2[name]})[name]
            kw = {}
            if fused:
                upload_low_rank(dev, low_rank[step], K)
                kw = {"f_b": dev["f_b"], "g_b": dev["g_b"]}
            out = cupy.empty((num_seqs, H * K), dtype=BF16)  # (dev["f"] is f_a's [B, rank] view when fused)
            poison(out)
            outs.append(to_np(run_op(kda_decode, dev, H, out=out, skip_pad=level if skip else 0, **kw)))
        runs[skip] = (outs, before, {n: to_np(b) for n, b in guarded.items()})
    (plain_out, _, plain_pools), (skip_out, before, skip_pools) = runs[False], runs[True]
    for step, (a, b) in enumerate(zip(plain_out, skip_out, strict=True)):
        assert np.all(np.isfinite(a)) and np.array_equal(a[:live], b[:live]), f"step {step}: skip_pad changed live rows"
        if level == 1:
            assert np.array_equal(a[live:], b[live:]), f"step {step}: skip_pad 1 changed the padding rows' outputs"
        else:
            assert np.all(b[live:] == 0.0), f"step {step}: skip_pad 2 left padding rows' outputs nonzero / unwritten"
    used = inp["state_slots"][:live] + 1  # (rows of the guarded arrays)
    for name in ("conv_pool", "rec_pool"):
        p, q, b0 = plain_pools[name], skip_pools[name], before[name]
        assert np.array_equal(p[used], q[used]), f"{name}: the live slots' state differs with skip_pad"
        rest = np.setdiff1d(np.arange(S + 1), used)  # (the guard, slot 0, the spare slot, the other idle ones)
        assert np.array_equal(q[rest], b0[rest]), f"{name}: skip_pad wrote a slot no live row owns"
        assert not np.array_equal(p[spare + 1], b0[spare + 1]), \
            f"{name}: the run without skip_pad left the spare slot as is (the comparison proves nothing)"


@pytest.mark.parametrize("smem", [1, 2])
def test_kda_decode_smem_state_occupancy(smem):
    """The shared-memory state forms hold three CTAs an SM (their point: 192 KB of state in flight an SM), which
    their static shared memory leaves no byte to spare for on a 228 KB SM (ops/kda_decode.py SMEM_STATE_MIN_BLOCKS):
    a byte more would silently drop them to two."""
    import cupy

    from kda_rt.cuda.ops import pdl
    from kda_rt.cuda.ops.compile import get_kernel
    from kda_rt.cuda.ops.kda_decode import _STATE_BYTES, SMEM_STATE_MIN_BLOCKS, _smem_optin, state_hints

    if int(cupy.cuda.Device().compute_capability) < 90 or _smem_optin() < 232448:
        pytest.skip("needs sm_90+ with 227 KB of shared memory a block (H100, H200, B200)")
    kernel = get_kernel("kda_decode.cu", "kda_decode_step", max_dynamic_smem=_STATE_BYTES, HEAD_DIM=K, CONV_W=4,
                        THREADS=256, SPLIT=1, MIN_BLOCKS=SMEM_STATE_MIN_BLOCKS, FUSE_FG=0, RANK_F=0, RANK_G=0,
                        EARLY_STATE=1, STATE_HINTS=state_hints(32), SMEM_STATE=smem)
    assert pdl.max_active_blocks(kernel, 256, _STATE_BYTES) == SMEM_STATE_MIN_BLOCKS


def low_rank_inputs(rng, inp, num_heads, rank):
    """f_a / g_a outputs [B, rank] and f_b / g_b [P, rank] (bf16 values); inp's f and gate <- their products
    rounded to bf16 (what the unfused path gets from cuBLAS)."""
    B, P = len(inp["state_slots"]), num_heads * K
    lr = {n: bf16_round(rng.normal(size=(B, rank))) for n in ("f_a", "g_a")}
    lr.update({n: bf16_round(rng.normal(size=(P, rank)) / np.sqrt(rank)) for n in ("f_b", "g_b")})
    inp["f"], inp["gate"] = bf16_round(lr["f_a"] @ lr["f_b"].T), bf16_round(lr["g_a"] @ lr["g_b"].T)
    return lr


def upload_low_rank(dev, lr, rank):
    """f_a | g_a into one strided buffer [B, 2 rank + 8] (as the model's f_a | g_a | b projection), f_b, g_b."""
    import cupy

    B = lr["f_a"].shape[0]
    small = np.zeros((B, 2 * rank + 8))
    small[:, :rank], small[:, rank:2 * rank] = lr["f_a"], lr["g_a"]
    small_dev = cupy.asarray(small.astype(np.float32).astype(BF16))
    dev["f"], dev["gate"] = small_dev[:, :rank], small_dev[:, rank:2 * rank]
    dev["f_b"], dev["g_b"] = (cupy.asarray(lr[n].astype(np.float32).astype(BF16)) for n in ("f_b", "g_b"))


FUSED = [(1, 32, "normal", 4), (3, 8, "mixed", 8), (16, 8, "normal", 4), (5, 4, "extreme", 8)]


@pytest.mark.parametrize("num_seqs, num_heads, gates, split", FUSED, ids=[f"B{c[0]}-H{c[1]}-{c[2]}-split{c[3]}" for c in FUSED])
def test_kda_decode_fused_low_rank(num_seqs, num_heads, gates, split):
    """f = f_a f_b^T and gate = g_a g_b^T computed inside the kernel (small-batch decode), two steps."""
    import cupy

    from kda_rt.cuda.ops.kda_decode import kda_decode

    kw = variant_kw((split, 128))
    rank = K
    rng = np.random.default_rng(11 * num_seqs + num_heads)
    inp = make_inputs(rng, [1] * num_seqs, num_heads, gates, num_slots=num_seqs + 2)
    dev = upload(inp)
    for step in range(2):
        if step:
            inp = _next_step(rng, inp, dev, num_heads, ("qkv", "b", "context_lens"))
        upload_low_rank(dev, low_rank_inputs(rng, inp, num_heads, rank), rank)
        out = cupy.empty((num_seqs, num_heads * K), dtype=BF16)
        poison(out)
        run_op(kda_decode, dev, num_heads, out=out, f_b=dev["f_b"], g_b=dev["g_b"], **kw)
        check(out, dev, reference(inp, num_heads), inp, f"fused low-rank step {step} B{num_seqs} H{num_heads} {gates}")


STRIDED = [(1, 8, True), (3, 8, True), (32, 8, False)]  # H = 8: rows of 3P + 2R + H a multiple of 8


@pytest.mark.parametrize("num_seqs, num_heads, fused", STRIDED, ids=[f"B{c[0]}-H{c[1]}-{'fused' if c[2] else 'plain'}"
                                                                     for c in STRIDED])
def test_kda_decode_reads_qkv_as_a_column_block(num_seqs, num_heads, fused):
    """qkv as the model's decode step passes it: the first 3P columns of one [B, 3P + 2R + H] GEMM output
    whose other columns are f_a | g_a | b (fused: the kernel applies f_b, g_b; plain: f and gate given and
    the f_a | g_a columns NaN, never read), against the float64 reference, two steps."""
    import cupy

    from kda_rt.cuda.ops.kda_decode import kda_decode

    rank, P = K, num_heads * K
    rng = np.random.default_rng(5 * num_seqs + num_heads)
    inp = make_inputs(rng, [1] * num_seqs, num_heads, "mixed", num_slots=num_seqs + 2)
    dev = upload(inp)
    for step in range(2):
        if step:
            inp = _next_step(rng, inp, dev, num_heads, ("f", "gate", "context_lens"))
        lr = low_rank_inputs(rng, inp, num_heads, rank) if fused else None
        host = np.full((num_seqs, 3 * P + 2 * rank + num_heads), np.nan, dtype=np.float32)  # unread columns: NaN
        host[:, :3 * P], host[:, 3 * P + 2 * rank:] = inp["qkv"], inp["b"]
        if fused:
            host[:, 3 * P:3 * P + rank], host[:, 3 * P + rank:3 * P + 2 * rank] = lr["f_a"], lr["g_a"]
        both = cupy.asarray(host.astype(BF16))
        dev["qkv"], dev["b"] = both[:, :3 * P], both[:, 3 * P + 2 * rank:]
        kw = {}
        if fused:
            dev["f"], dev["gate"] = both[:, 3 * P:3 * P + rank], both[:, 3 * P + rank:3 * P + 2 * rank]
            kw = {n: cupy.asarray(lr[n].astype(np.float32).astype(BF16)) for n in ("f_b", "g_b")}
        out = cupy.empty((num_seqs, P), dtype=BF16)
        poison(out)
        run_op(kda_decode, dev, num_heads, out=out, **kw)
        check(out, dev, reference(inp, num_heads), inp, f"strided qkv step {step} B{num_seqs} H{num_heads} fused={fused}")


def test_kda_decode_rejects_misaligned_qkv_rows():
    """A qkv view whose rows are not 16-byte aligned is refused before any launch, naming qkv."""
    import cupy

    from kda_rt.cuda.ops.kda_decode import kda_decode

    rng = np.random.default_rng(3)
    inp = make_inputs(rng, [1, 1], 2, "normal", num_slots=2)
    dev = upload(inp)
    wide = cupy.zeros((2, 3 * 2 * K + 4), dtype=BF16)
    dev["qkv"] = wide[:, :3 * 2 * K]  # row stride 3P + 4 elements: 8 bytes off 16
    with pytest.raises(ValueError, match="qkv"):
        run_op(kda_decode, dev, 2)


@pytest.mark.parametrize("gates", ["normal", "mixed"])
def test_decode_after_prefill_equals_prefill(gates):
    """prefill(L tokens) + 3 decode steps in slots 0, 1 == prefill(L + 3 tokens) in slots 2, 3."""
    import cupy

    from kda_rt.cuda.ops.kda_decode import kda_decode
    from kda_rt.cuda.ops.kda_prefill import kda_prefill

    num_heads, lengths, extra = 4, [3, 65], 3
    rng = np.random.default_rng(7)
    full = make_inputs(rng, [n + extra for n in lengths], num_heads, gates, num_slots=4, fresh=[True, False])
    full["state_slots"] = np.array([2, 3], dtype=np.int32)
    full["conv_pool"][0:2], full["rec_pool"][0:2] = full["conv_pool"][2:4], full["rec_pool"][2:4]
    dev_full = upload(full)
    out_full = to_np(run_op(kda_prefill, dev_full, num_heads))

    cu = full["cu_seqlens"]
    rows = [np.arange(cu[s], cu[s] + n) for s, n in enumerate(lengths)]
    part = dict(full, state_slots=np.array([0, 1], dtype=np.int32),
                cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    for name in ("qkv", "f", "b", "gate"):
        part[name] = full[name][np.concatenate(rows)]
    dev = upload(part)
    outs = [to_np(run_op(kda_prefill, dev, num_heads))]
    dev["context_lens"] = cupy.asarray(np.array(lengths, dtype=np.int32))
    dev["cu_seqlens"] = cupy.arange(len(lengths) + 1, dtype=cupy.int32)
    for j in range(extra):
        idx = np.array([cu[s] + n + j for s, n in enumerate(lengths)])
        for name in ("qkv", "f", "b", "gate"):
            dev[name] = cupy.asarray(full[name][idx].astype(np.float32).astype(BF16))
        outs.append(to_np(run_op(kda_decode, dev, num_heads)))
    # reassemble the decode outputs in full-batch token order
    got = np.empty_like(out_full)
    got[np.concatenate(rows)] = outs[0]
    for j in range(extra):
        got[[cu[s] + n + j for s, n in enumerate(lengths)]] = outs[1 + j]
    err_out = rms_rel(got, out_full)
    conv, rec = to_np(dev["conv_pool"]), to_np(dev["rec_pool"])
    conv_f, rec_f = to_np(dev_full["conv_pool"]), to_np(dev_full["rec_pool"])
    err_state = rms_rel(rec[0:2], rec_f[2:4])
    print(f"decode-after-prefill {gates}: out rms_rel {err_out:.2e}, state rms_rel {err_state:.2e}")
    # kda_prefill takes bf16 operands in its chunk products (as fla, spec §3.7: state error up to 6e-3
    # against the fp64 reference, tests/kernels/test_kda_prefill.py); the two sides round at different
    # chunk boundaries, so they agree to that level (H200: out 9.3e-4 / 9.1e-4, state 2.8e-3 / 1.2e-3)
    assert err_out <= 5e-3 and err_state <= 6e-3, (err_out, err_state)
    assert np.array_equal(conv[0:2], conv_f[2:4]), "conv state differs"
    ref_out = reference(full, num_heads)[0]
    assert rms_rel(out_full, ref_out) <= 5e-3


@pytest.mark.parametrize("variant", [None, (1, 256)], ids=["auto", "split1x256"])
def test_kda_decode_graph_capture(variant):
    """A step captured in a CUDA graph (out preallocated) matches the eager step."""
    import cupy

    from kda_rt.cuda.ops.kda_decode import kda_decode

    kw = variant_kw(variant)
    num_heads, num_seqs = 8, 6
    rng = np.random.default_rng(3)
    inp = make_inputs(rng, [1] * num_seqs, num_heads, num_slots=8)
    eager, graphed = upload(inp), upload(inp)
    out_eager = run_op(kda_decode, eager, num_heads, **kw)
    cupy.cuda.Device().synchronize()  # the uploads and the eager step ran on the legacy stream
    stream = cupy.cuda.Stream(non_blocking=True)
    out = cupy.empty((num_seqs, num_heads * K), dtype=BF16)
    with stream:
        stream.begin_capture()
        run_op(kda_decode, graphed, num_heads, out=out, stream=stream, **kw)
        graph = stream.end_capture()
        graph.launch(stream)
    stream.synchronize()
    assert np.array_equal(to_np(out), to_np(out_eager))
    assert np.array_equal(to_np(graphed["rec_pool"]), to_np(eager["rec_pool"]))
    assert np.array_equal(to_np(graphed["conv_pool"]), to_np(eager["conv_pool"]))


@pytest.mark.parametrize("num_seqs, smem", [(1, "0"), (6, "0"), (6, "1"), (6, "2"), (6, "3")],
                         ids=["B1", "B6", "B6-smem-state", "B6-smem-state-stores", "B6-persist"])
def test_kda_decode_early_state_after_a_pdl_writer(num_seqs, smem, monkeypatch):
    """A captured graph with programmatic dependent launch: rmsnorm (which lets the next launch go right after its
    own wait) writes q|k|v, then kda_decode with its state loaded before its wait (KDA_RT_KDA_EARLY_STATE=1);
    replayed four times on new inputs, the state carried in the pools from replay to replay.  Bit for bit the
    eager steps of the kernel that waits first (=0) on a copy of the same pools: a q|k|v read before the wait would
    see the previous replay's rows.  smem "1": the graph's kernel takes its state by bulk copies (SMEM_STATE) issued
    before its wait ("2": and writes it back by bulk copies; "3": the persistent form, its first heads' copies
    before its one wait, on 5 CTAs so that most heads' copies go out after it), the eager one the register form."""
    import cupy

    from kda_rt.cuda.ops import pdl
    from kda_rt.cuda.ops.kda_decode import kda_decode
    from kda_rt.cuda.ops.rmsnorm import rmsnorm

    num_heads = 8
    rng = np.random.default_rng(17 + num_seqs)
    inp = make_inputs(rng, [1] * num_seqs, num_heads, num_slots=num_seqs + 2)
    oracle, graphed = upload(inp), upload(inp)
    P3 = 3 * num_heads * K
    ones = cupy.ones(P3, dtype=BF16)
    src = cupy.empty((num_seqs, P3), dtype=BF16)
    out, out_o = cupy.empty((num_seqs, num_heads * K), dtype=BF16), cupy.empty((num_seqs, num_heads * K), dtype=BF16)
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    monkeypatch.setenv("KDA_RT_KDA_EARLY_STATE", "1")
    monkeypatch.setenv("KDA_RT_KDA_SMEM_STATE", smem)
    monkeypatch.setenv("KDA_RT_KDA_PERSIST_CTAS", "5")
    with stream, pdl.capturing() as on:  # the launches carry the programmatic attribute only inside this block
        if not on:
            pytest.skip("no programmatic dependent launch here (compute capability < 9.0 or KDA_RT_PDL=0)")
        stream.begin_capture()
        rmsnorm(src, ones, 1e-6, out=graphed["qkv"])
        run_op(kda_decode, graphed, num_heads, out=out, stream=stream)
        graph = stream.end_capture()
    for replay in range(4):
        src[...] = cupy.asarray(rng.normal(size=(num_seqs, P3)).astype(np.float32).astype(BF16))
        poison(out)
        cupy.cuda.Device().synchronize()
        monkeypatch.setenv("KDA_RT_KDA_EARLY_STATE", "0")
        monkeypatch.setenv("KDA_RT_KDA_SMEM_STATE", "0")
        rmsnorm(src, ones, 1e-6, out=oracle["qkv"])
        run_op(kda_decode, oracle, num_heads, out=out_o)
        cupy.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        assert np.array_equal(to_np(out), to_np(out_o)), f"replay {replay}: out"
        assert np.array_equal(to_np(graphed["rec_pool"]), to_np(oracle["rec_pool"])), f"replay {replay}: state"
        assert np.array_equal(to_np(graphed["conv_pool"]), to_np(oracle["conv_pool"])), f"replay {replay}: conv"
        for dev in (oracle, graphed):  # continuing sequences from the second replay on
            dev["context_lens"][...] = 1


if __name__ == "__main__":  # graph-replay times: tests/gpu/bench_decode_sweep.py --parts=kda
    raise SystemExit(pytest.main([__file__, "-q", "-s"]))
