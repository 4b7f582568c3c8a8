"""kda_rt/cuda/moe.py (moe_route + moe_align + moe_gemm kernels + cuBLAS shared expert) against
kda_rt.reference.moe.moe_forward in float64 on the same bf16 x / weights (fp32 router and bias).

    y = Σ_k w_k · W2_e (SiLU(W1_e x) ⊙ W3_e x) + Shared(x),  e = ids_k, per token (spec §5)

Tolerance: RMS(out - ref) / RMS(ref) ≤ 1e-2.  The GPU rounds the gate/up projections, SiLU and
the hidden activation to bf16 (transformers' rounding points) and the block output once; each is
~2^-9 RMS relative, so ~3e-3 is expected.  Selections cannot flip (inputs redrawn until every
top-A boundary has a gap > 2e-5, see test_moe_route).  Also: bitwise determinism across runs and
one CUDA-graph capture replayed on new inputs.  Run as a script for a decode benchmark.
Letters: T tokens, D hidden, E experts, A active experts, I / Is expert / shared width."""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence

import numpy as np
import pytest

from helpers.gpu import poison, rand_bf16, rms_rel, to_gpu_bf16, to_np
from helpers.moe_router import make_cfg, make_router

pytestmark = pytest.mark.gpu




class _LazyExperts(Sequence):
    """Routed experts of the fused GPU stacks as the schema's `MLPWeights`, copied to the host (float64)
    only when the NumPy model touches them (the E=256 stacks are GBs)."""

    def __init__(self, w13, w2):
        self.w13, self.w2 = w13, w2

    def __getitem__(self, e):
        from kda_rt.loader.schema import MLPWeights

        inter = self.w13.shape[1] // 2
        return MLPWeights(to_np(self.w13[e, :inter]), to_np(self.w13[e, inter:]), to_np(self.w2[e]))

    def __len__(self):
        return self.w13.shape[0]


def numpy_weights(router, bias, w13, w2, s13, s2):
    """The NumPy model's typed MoE weights, read from the fused GPU weights."""
    from kda_rt.loader.schema import MLPWeights, MoEWeights

    shared = None
    if s13 is not None:
        ks = s13.shape[0] // 2
        shared = MLPWeights(to_np(s13[:ks]), to_np(s13[ks:]), to_np(s2))
    return MoEWeights(router, bias, _LazyExperts(w13, w2), shared)


def make_block(T, D, inter, inter_s, cfg, seed):
    """GPU weights and inputs of one MoE block plus the NumPy view of them."""
    import cupy

    x, router, bias = make_router(T, D, cfg, seed)
    rng = cupy.random.default_rng(seed)
    E = cfg.num_experts
    w13 = rand_bf16(rng, (E, 2 * inter, D), 1 / np.sqrt(D))
    w2 = rand_bf16(rng, (E, D, inter), 1 / np.sqrt(inter))
    s13 = rand_bf16(rng, (2 * inter_s, D), 1 / np.sqrt(D)) if inter_s else None
    s2 = rand_bf16(rng, (D, inter_s), 1 / np.sqrt(inter_s)) if inter_s else None
    gpu = dict(x=to_gpu_bf16(x), w_router=cupy.asarray(router.astype(np.float32)),
               bias=cupy.asarray(bias.astype(np.float32)), w13=w13, w2=w2, shared_w13=s13, shared_w2=s2)
    return x, gpu, numpy_weights(router, bias, w13, w2, s13, s2)


def run(gpu, cfg, fused=False, **kw):
    """fused: the shared expert rides as expert E of the stacks (as cuda/weights.py uploads a model)."""
    import cupy

    from kda_rt.cuda.moe import moe_forward
    from kda_rt.cuda.weights import DeviceMLP, DeviceMoE

    if fused:
        if "w13_fused" not in gpu:
            gpu["w13_fused"] = cupy.concatenate([gpu["w13"], gpu["shared_w13"][None]])
            gpu["w2_fused"] = cupy.concatenate([gpu["w2"], gpu["shared_w2"][None]])
        w13, w2, E = gpu["w13_fused"], gpu["w2_fused"], gpu["w13"].shape[0]
        if "moe_fused" not in gpu:  # one DeviceMoE per block, as a model keeps (its routing counter with it)
            gpu["moe_fused"] = DeviceMoE(gpu["w_router"], gpu["bias"], w13, w2, DeviceMLP(w13[E], w2[E]),
                                         shared_in_stack=True)
        return moe_forward(gpu["x"], gpu["moe_fused"], cfg, **kw)
    if "moe" not in gpu:
        shared = DeviceMLP(gpu["shared_w13"], gpu["shared_w2"]) if gpu["shared_w13"] is not None else None
        gpu["moe"] = DeviceMoE(gpu["w_router"], gpu["bias"], gpu["w13"], gpu["w2"], shared)
    return moe_forward(gpu["x"], gpu["moe"], cfg, **kw)


CASES = {  # name: (T, D, I, Is, E, cfg kwargs)
    "T1-small": (1, 256, 128, 128, 16, dict(A=4)),
    "T7-small-noshared": (7, 256, 128, 0, 16, dict(A=4)),
    "T64-small-G4k2-norenorm": (64, 256, 128, 128, 16, dict(A=4, G=4, topk_group=2, renormalize=False)),
    "T300-small": (300, 256, 128, 128, 16, dict(A=4)),
    "T1-E256": (1, 2304, 1024, 1024, 256, dict()),
    "T7-E256": (7, 2304, 1024, 1024, 256, dict()),
    "T64-E16": (64, 2304, 1024, 1024, 16, dict()),
    "T300-E64-G8k4": (300, 2304, 1024, 1024, 64, dict(G=8, topk_group=4)),
    "T1024-E64-prefill": (1024, 2304, 1024, 1024, 64, dict()),
    "T256-E256": (256, 2304, 1024, 1024, 256, dict()),  # a serving batch's decode step: 64-row tiles (bf16)
}


@pytest.mark.parametrize("fused", [False, True], ids=["shared-apart", "shared-in-stack"])
@pytest.mark.parametrize("name", list(CASES))
def test_moe_forward(name, fused):
    import cupy

    from kda_rt.cuda.moe import moe_workspace_bytes
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.reference.moe import moe_forward as moe_ref

    T, D, inter, inter_s, E, kw = CASES[name]
    cfg = make_cfg(E, **kw)
    cfg = dataclasses.replace(cfg, num_shared_experts=1 if inter_s else 0, intermediate_size=inter)
    if fused and not inter_s:
        pytest.skip("no shared expert")
    x, gpu, params = make_block(T, D, inter, inter_s, cfg, zlib.crc32(name.encode()))
    ref = moe_ref(params, x, cfg)
    out = cupy.empty((T, D), dtype=BF16)
    ws = cupy.empty(moe_workspace_bytes(T, cfg, D, inter, inter_s, fused), dtype=np.uint8)
    ws[...] = 0xFF  # poisoned scratch: every value the block reads must be written first
    poison(out)
    run(gpu, cfg, fused, out=out, workspace=ws)
    got = to_np(out)
    err = rms_rel(got, ref)
    print(f"\n{name}: rms rel err {err:.2e}", end="")
    assert err <= 1e-2, f"{name}: rms rel err {err:.3e}, max abs {np.max(np.abs(got - ref)):.3e}"
    again = run(gpu, cfg, fused)
    assert np.array_equal(cupy.asnumpy(again).view(np.uint16), cupy.asnumpy(out).view(np.uint16)), "not deterministic"


class _E4m3Experts(Sequence):
    """Routed experts of e4m3 GPU stacks as `MLPWeights` of their dequantized values (float64), per expert."""

    def __init__(self, q13, s13, q2, s2, count):
        from helpers.moe_gemm import Dequantized

        self.w13, self.w2, self.count = Dequantized(q13, s13), Dequantized(q2, s2), count

    def __getitem__(self, e):
        from kda_rt.loader.schema import MLPWeights

        if not 0 <= e < self.count:
            raise IndexError(e)
        w13 = self.w13[e]
        inter = w13.shape[0] // 2
        return MLPWeights(w13[:inter], w13[inter:], self.w2[e])

    def __len__(self):
        return self.count


E4M3_CASES = {  # id: (CASES name, switches): the launcher's paths, then the ones the switches pick instead
    "T1-E256": ("T1-E256", {}),
    "T1-E256-plan-gemv": ("T1-E256", {"KDA_RT_GEMV_ROUTED": "0"}),
    "T1-E256-tiled": ("T1-E256", {"KDA_RT_MOE_GEMV": "0", "KDA_RT_DOWN_GEMV": "0"}),
    "T7-E256": ("T7-E256", {}),
    "T7-E256-two-launches": ("T7-E256", {"KDA_RT_FUSED_MOE": "0"}),
    "T64-E16": ("T64-E16", {}),
    "T300-E64-G8k4": ("T300-E64-G8k4", {}),
    "T1024-E64-prefill": ("T1024-E64-prefill", {}),
    "T300-small": ("T300-small", {}),
    "T300-small-tc128": ("T300-small", {"KDA_RT_WGMMA": "0"}),
    "T1024-E64-prefill-w8a8": ("T1024-E64-prefill", {"KDA_RT_FP8_PREFILL": "1"}),  # e4m3 sources (WFMT = 2)
    "T300-small-w8a8": ("T300-small", {"KDA_RT_FP8_PREFILL": "1"}),  # I = 128: the down GEMM's one k step, BN 128
    "T256-E256": ("T256-E256", {}),  # ~9 rows an expert: moe_decode_fused's 16-row tiles (MIN_AVG_ROWS_E4M3)
    # the same step on moe_gemm_tc's 64-row tiles, and on moe_decode_fused's (KDA_RT_MOE_FUSED64)
    "T256-E256-tc64": ("T256-E256", {"KDA_RT_MOE_MIN_AVG_ROWS": "4", "KDA_RT_MOE_FUSED64": "0"}),
    # (the default for e4m3 steps of 18-48 rows an expert, moe_gemm_tc.py FUSED64_E4M3, brought down to this step)
    "T256-E256-fused64": ("T256-E256", {"KDA_RT_MOE_MIN_AVG_ROWS": "4", "KDA_RT_MOE_FUSED64": "auto"}),
    # the default path of a step of ~38 rows an expert: 64-row fused tiles of 33-63 rows (A rows lane + 32 copied)
    "T300-E64-G8k4-fused64": ("T300-E64-G8k4", {"KDA_RT_MOE_FUSED64": "auto"}),
    "T256-E256-fused32": ("T256-E256", {"KDA_RT_MOE_FUSED32": "1"}),  # moe_decode_fused on 32-row tiles
    # the 32-row tiles e4m3 steps of 18-48 rows an expert took before FUSED64_E4M3, brought down to this step
    "T256-E256-rows32": ("T256-E256", {"KDA_RT_MOE_MIN_AVG_ROWS": "4", "KDA_RT_MOE_FUSED32": "e4m3"}),
}


@pytest.mark.parametrize(("rows", "name"), [(32, "T256-E256"), (64, "T256-E256"), (64, "T300-E64-G8k4")])
@pytest.mark.parametrize("fused", [False, True], ids=["shared-apart", "shared-in-stack"])
def test_moe_forward_fused_rows(fused, rows, name, monkeypatch):
    """A 256-token step of the 48B shape (~9 rows an expert on average) on 32-row tiles (KDA_RT_MOE_FUSED32=1, bench
    switch) or on 64-row tiles (KDA_RT_MOE_FUSED32=0, KDA_RT_MOE_FUSED64=1: the producer lane copies A rows
    lane and lane + 32, and with the shared expert in the stack its 256 rows fill four whole tiles; the default
    for bf16 stacks of that many rows an expert), and a 300-token step of 64 experts (~38 rows an expert: tiles of 33-63 rows) on 64-row tiles,
    both GEMMs in moe_decode_fused (checked: it ran, on a plan of those rows), against the NumPy
    block with test_moe_forward's tolerance, and bit for bit the same step's two launches (KDA_RT_FUSED_MOE=0:
    moe_gemm_tc on tiles of as many rows; each output sums the same k16 products in the same order, whatever the warp
    layout)."""
    import cupy

    import kda_rt.cuda.moe as moe
    from kda_rt.cuda.moe import moe_workspace_bytes
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.reference.moe import moe_forward as moe_ref

    monkeypatch.setenv("KDA_RT_MOE_FUSED32", "1" if rows == 32 else "0")
    monkeypatch.setenv("KDA_RT_MOE_FUSED64", "1")
    monkeypatch.delenv("KDA_RT_MOE_MIN_AVG_ROWS", raising=False)
    monkeypatch.delenv("KDA_RT_FUSED_MOE", raising=False)
    T, D, inter, inter_s, E, kw = CASES[name]
    cfg = dataclasses.replace(make_cfg(E, **kw), num_shared_experts=1, intermediate_size=inter)
    x, gpu, params = make_block(T, D, inter, inter_s, cfg, zlib.crc32(f"fused{rows}/{name}".encode()))
    ref = moe_ref(params, x, cfg)
    plans = []
    real = moe.moe_decode_fused
    monkeypatch.setattr(moe, "moe_decode_fused", lambda *a, **k: plans.append(a[3].tile_rows) or real(*a, **k))
    outs = []
    for fused_moe in ("1", "0"):
        monkeypatch.setenv("KDA_RT_FUSED_MOE", fused_moe)
        out = cupy.empty((T, D), dtype=BF16)
        ws = cupy.full(moe_workspace_bytes(T, cfg, D, inter, inter_s, fused), 0xFF, dtype=np.uint8)
        poison(out)
        run(gpu, cfg, fused, out=out, workspace=ws)
        outs.append(to_np(out))
    assert plans == [rows], f"moe_decode_fused ran on plans of {plans} rows (want one {rows}-row call)"
    err = rms_rel(outs[0], ref)
    print(f"\n{name} {rows}-row tiles: rms rel err {err:.2e}", end="")
    assert err <= 1e-2, f"{name}: rms rel err {err:.3e}, max abs {np.max(np.abs(outs[0] - ref)):.3e}"
    assert np.array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16)), f"fused != two launches, {rows} rows"


@pytest.mark.parametrize(("name", "T", "live", "norm"), [
    ("T7-E256", 7, 5, ""), ("T7-E256", 7, 5, "after"), ("T7-E256", 4, 3, "before"), ("T256-E256", 256, 160, ""),
    ("T256-E256", 256, 1, "after"), ("T300-E64-G8k4", 300, 200, "after"), ("T1024-E64-prefill", 1024, 600, "")],
    ids=["T7-live5", "T7-live5-norm", "T4-live3-norm-before", "T256-live160", "T256-live1-norm", "T300-live200-norm",
         "T1024-live600-wide"])
def test_moe_forward_live_count(name, T, live, norm, monkeypatch):
    """moe_forward(live=) (KDA_RT_SKIP_PAD's MoE half, default on: kernels_cu/moe_bucket.cuh LIVE_PAIRS / LIVE_TOKENS):
    tokens from `live` on are a decode graph's padding rows.  With the shared expert in the stack: the live rows'
    outputs bit for bit those of the call without the count (each row's products and k-order sum are the same
    whatever else is planned), the padding rows' outputs zeros, and with the combine's residual add and RMSNorm
    ("after") their residual rows untouched; the plan holds the live pairs alone (expert_off[E + 1] = live x 9, read
    from a workspace filled with 0xFF first) and the experts-touched counter counts the live tokens' experts (as a
    call on those tokens alone).  The paths: 7 tokens (moe_route_fused's bucketing, the fused decode kernel), 4 with
    the norm before the block in the routing kernel too ("before": its ROUTE_NORM build), 256 (the select and the
    one-block bucketing; 1 live token), 300 tokens of 64 experts (64-row tiles) and 1024 (9216 pairs: the
    three-launch bucketing, blocks past the live pairs with none).  Outputs poisoned before each call."""
    import cupy

    import kda_rt.cuda.moe as moe
    from kda_rt.cuda.moe import moe_workspace_bytes
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_align import NormAfter
    from kda_rt.cuda.ops.moe_route import NormBefore

    monkeypatch.delenv("KDA_RT_MOE_MIN_AVG_ROWS", raising=False)
    _, D, inter, inter_s, E, kw = CASES[name]
    cfg = dataclasses.replace(make_cfg(E, **kw), num_shared_experts=1, intermediate_size=inter)
    _, gpu, _ = make_block(T, D, inter, inter_s, cfg, zlib.crc32(f"live/{name}/{T}".encode()))
    crng = cupy.random.default_rng(live)
    res0 = (crng.standard_normal((T, D), dtype=np.float32)).astype(BF16)
    w_next, w_post = ((1 + 0.1 * crng.standard_normal(D, dtype=np.float32)).astype(BF16) for _ in range(2))
    parts = moe._layout(T, cfg, D, inter, inter_s, True)
    off = moe._offsets(parts)[0][[n for n, _, _ in parts].index("expert_off")]
    results = []
    for count in (None, cupy.asarray([live], dtype=np.int32)):
        out = cupy.empty((T, D), dtype=BF16)
        poison(out)
        stats = cupy.zeros(2, dtype=np.int32)
        ws = cupy.full(moe_workspace_bytes(T, cfg, D, inter, inter_s, True), 0xFF, dtype=np.uint8)
        res = res0.copy()
        extra = {"norm": NormAfter(res, w_next, 1e-6)} if norm else {}
        if norm == "before":
            h, a = cupy.empty((T, D), BF16), cupy.empty((T, D), BF16)
            poison(h)
            poison(a)
            extra["norm_before"] = NormBefore(res, w_post, 1e-6, h, a)
        run(gpu, cfg, True, out=out, stats=stats, workspace=ws, live=count, **extra)
        rows = int(ws[off + 4 * (E + 1):off + 4 * (E + 2)].view(np.int32)[0])  # expert_off[bins]: the planned rows
        results.append((cupy.asnumpy(out.view(np.uint16)), cupy.asnumpy(res.view(np.uint16)), cupy.asnumpy(stats),
                        rows))
    (out_all, res_all, _, rows_all), (out_live, res_live, stats_live, rows_live) = results
    assert (rows_all, rows_live) == (T * 9, live * 9), f"{name}: planned rows {rows_all} / {rows_live}"
    assert np.array_equal(out_all[:live], out_live[:live]), f"{name}: the live rows differ with the live count"
    assert not np.any(out_live[live:]), f"{name}: padding rows not zeroed"
    if norm:
        assert np.array_equal(res_all[:live], res_live[:live]), f"{name}: the live residual rows differ"
    if norm == "after":  # (with the norm before the block too, the padding rows' stream is left where it was)
        assert np.array_equal(res_live[live:], cupy.asnumpy(res0.view(np.uint16))[live:]), \
            f"{name}: a padding row's residual was written"
    stats_alone = cupy.zeros(2, dtype=np.int32)
    alone, extra = dict(gpu, x=gpu["x"][:live]), {}
    if norm == "before":  # (the routing is of RMSNorm(x + residual) then: the same for the live tokens alone)
        res = res0[:live].copy()
        extra = {"norm": NormAfter(res, w_next, 1e-6), "norm_before": NormBefore(
            res, w_post, 1e-6, cupy.empty((live, D), BF16), cupy.empty((live, D), BF16))}
    run(alone, cfg, True, stats=stats_alone, **extra)
    assert stats_live[0] == int(stats_alone[0]) and stats_live[1] == 1, \
        f"{name}: experts touched {stats_live} against {cupy.asnumpy(stats_alone)} for the live tokens alone"


@pytest.mark.parametrize(("rows", "name", "e4m3"), [(16, "T7-E256", False), (32, "T256-E256", False),
                                                   (64, "T64-E16", False), (64, "T300-E64-G8k4", False),
                                                   (16, "T7-E256", True), (64, "T300-E64-G8k4", True)])
def test_moe_decode_fused_a_rows_async(rows, name, e4m3, monkeypatch):
    """KDA_RT_MOE_DEC_A_ASYNC=1 (the default since the fifty-third session: moe_gemm_tc.cu DEC_A_ASYNC): the producer
    warp copies the A rows by cp.async from all its lanes instead of one bulk copy a row (=0), completing on the same stage mbarrier; the same
    stage layout and products, so moe_forward's output is bit for bit the bulk-copy form's, on 16-, 32- and 64-row
    tiles (tiles of 1 to 63 live rows: the 64-row case holds ~38 rows an expert, its shared bin whole tiles), bf16 and
    e4m3 (2 rows a pass of the warp instead of 4), the shared expert in the stack; the plan's rows checked.  So is
    KDA_RT_MOE_DEC_REVERSE=1 (also the default: the items in reverse tile order, the shared bin's first), alone and
    with the cp.async rows, and in the plain form (KDA_RT_MOE_DECODE_WS=0)."""
    import cupy

    import kda_rt.cuda.moe as moe
    from helpers.moe_gemm import e4m3_stack
    from kda_rt.cuda.moe import moe_forward, moe_workspace_bytes
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.compile import arch_number, device_arch
    from kda_rt.cuda.weights import DeviceMLP, DeviceMoE

    if arch_number(device_arch()) < 90:
        pytest.skip("the producer-warp form (DEC_WS) needs sm_90+")
    for key, value in {"KDA_RT_MOE_FUSED32": "1" if rows == 32 else "0", "KDA_RT_MOE_FUSED64": "1",
                       "KDA_RT_MOE_MIN_AVG_ROWS": "", "KDA_RT_FUSED_MOE": "", "KDA_RT_MOE_DECODE_WS": "",
                       "KDA_RT_FP8_PREFILL": "0"}.items():
        monkeypatch.setenv(key, value)
    T, D, inter, inter_s, E, kw = CASES[name]
    cfg = dataclasses.replace(make_cfg(E, **kw), num_shared_experts=1, intermediate_size=inter)
    seed = zlib.crc32(f"a-async/{name}/{e4m3}".encode())
    if e4m3:
        x, router, bias = make_router(T, D, cfg, seed)
        crng, rng = cupy.random.default_rng(seed), np.random.default_rng(seed)
        q13, s13 = e4m3_stack(crng, rng, E + 1, 2 * inter, D, expert_spread=False)
        q2, s2 = e4m3_stack(crng, rng, E + 1, D, inter, expert_spread=False)
        w = DeviceMoE(cupy.asarray(router.astype(np.float32)), cupy.asarray(bias.astype(np.float32)), q13, q2,
                      DeviceMLP(q13[E], q2[E]), shared_in_stack=True, scale13=s13, scale2=s2)
    else:
        x, gpu, _ = make_block(T, D, inter, inter_s, cfg, seed)
    plans, outs = [], []
    real = moe.moe_decode_fused
    monkeypatch.setattr(moe, "moe_decode_fused", lambda *a, **k: plans.append(a[3].tile_rows) or real(*a, **k))
    variants = (("0", "0", ""), ("1", "0", ""), ("0", "1", ""), ("1", "1", ""), ("0", "1", "0"))
    for a_async, reverse, dec_ws in variants:  # (bulk copies; cp.async; reversed; both; reversed, plain form)
        monkeypatch.setenv("KDA_RT_MOE_DEC_A_ASYNC", a_async)
        monkeypatch.setenv("KDA_RT_MOE_DEC_REVERSE", reverse)
        monkeypatch.setenv("KDA_RT_MOE_DECODE_WS", dec_ws)
        out = cupy.empty((T, D), dtype=BF16)
        ws = cupy.full(moe_workspace_bytes(T, cfg, D, inter, inter_s, True, e4m3=e4m3), 0xFF, dtype=np.uint8)
        poison(out)
        if e4m3:
            moe_forward(to_gpu_bf16(x), w, cfg, out=out, workspace=ws)
        else:
            run(gpu, cfg, True, out=out, workspace=ws)
        outs.append(to_np(out))
    assert plans == [rows] * len(variants), f"{name}: moe_decode_fused ran on plans of {plans} rows (want {rows})"
    assert np.all(np.isfinite(outs[0])), f"{name}: non-finite outputs"
    for v, out in zip(variants[1:], outs[1:], strict=True):
        assert np.array_equal(outs[0].view(np.uint16), out.view(np.uint16)), f"{name}: variant {v} differs"


@pytest.mark.parametrize("fused", [False, True], ids=["shared-apart", "shared-in-stack"])
@pytest.mark.parametrize("case", list(E4M3_CASES))
def test_moe_forward_e4m3(case, fused, monkeypatch):
    """moe_forward on e4m3 expert stacks (DeviceMoE.scale13 / scale2; codes over every finite e4m3 value, row
    scales; with the shared expert in the stack it is e4m3 too, apart it stays bf16) against the NumPy block on the
    dequantized weights, with the bf16 test's tolerance.  Every expert's scales sit at one level (each adds about as
    much to the output, so a wrong one shows).  The cases take each path: one token on the routed gate/up GEMV and
    the down GEMV (checked: routed), on the plan-reading GEMV, on the tiled GEMMs; 7 tokens on the fused decode
    kernel and on its two launches; 256 tokens (~9 rows an expert) on the fused decode kernel (16- and, with
    KDA_RT_MOE_FUSED32, 32-row tiles) and on 64-row tiles;
    64-row tiles on moe_gemm_tc; 128-row tiles on the wgmma kernel (sm_90a) and on
    moe_gemm_tc."""
    import cupy

    import kda_rt.cuda.moe as moe
    from helpers.moe_gemm import e4m3_stack
    from kda_rt.cuda.moe import moe_forward, moe_workspace_bytes
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.compile import arch_number, device_arch
    from kda_rt.cuda.weights import DeviceMLP, DeviceMoE
    from kda_rt.loader.schema import MLPWeights, MoEWeights
    from kda_rt.reference.moe import moe_forward as moe_ref

    if arch_number(device_arch()) < 89:
        pytest.skip("e4m3 weights need sm_89 or newer")
    name, switches = E4M3_CASES[case]
    # widened weights unless the case names the e4m3 sources; the policy's tiles unless it names a switch
    switches = {"KDA_RT_FP8_PREFILL": "0", "KDA_RT_MOE_FUSED32": "0", "KDA_RT_MOE_FUSED64": "0",
                "KDA_RT_MOE_MIN_AVG_ROWS": "", **switches}
    for key, value in switches.items():
        monkeypatch.setenv(key, value)
    T, D, inter, inter_s, E, kw = CASES[name]
    cfg = make_cfg(E, **kw)
    cfg = dataclasses.replace(cfg, num_shared_experts=1 if inter_s else 0, intermediate_size=inter)
    if fused and (not inter_s or inter_s != inter):
        pytest.skip("no shared expert of the experts' width")
    seed = zlib.crc32(f"e4m3/{name}".encode())
    x, router, bias = make_router(T, D, cfg, seed)
    rng = np.random.default_rng(seed)
    crng = cupy.random.default_rng(seed)
    stacked = E + 1 if fused else E
    q13, s13 = e4m3_stack(crng, rng, stacked, 2 * inter, D, expert_spread=False)
    q2, s2 = e4m3_stack(crng, rng, stacked, D, inter, expert_spread=False)
    experts = _E4m3Experts(q13, s13, q2, s2, E)
    if fused:
        shared_np = _E4m3Experts(q13, s13, q2, s2, E + 1)[E]
        shared_dev = DeviceMLP(q13[E], q2[E])  # (views; the stacks carry it)
    elif inter_s:
        sg = rand_bf16(crng, (2 * inter_s, D), 1 / np.sqrt(D))
        sd = rand_bf16(crng, (D, inter_s), 1 / np.sqrt(inter_s))
        shared_np = MLPWeights(to_np(sg[:inter_s]), to_np(sg[inter_s:]), to_np(sd))
        shared_dev = DeviceMLP(sg, sd)
    else:
        shared_np = shared_dev = None
    params = MoEWeights(router, bias, experts, shared_np)
    w = DeviceMoE(cupy.asarray(router.astype(np.float32)), cupy.asarray(bias.astype(np.float32)), q13, q2, shared_dev,
                  shared_in_stack=fused, scale13=s13, scale2=s2)
    seen, fused_runs = [], []  # fused_runs: the plan's tile rows of each moe_decode_fused call
    real = moe.moe_gemv_gate_up
    monkeypatch.setattr(moe, "moe_gemv_gate_up", lambda *a, **k: seen.append(k.get("routed")) or real(*a, **k))
    real_fused = moe.moe_decode_fused
    monkeypatch.setattr(moe, "moe_decode_fused",
                        lambda *a, **k: fused_runs.append(a[3].tile_rows) or real_fused(*a, **k))
    from kda_rt.cuda.ops.moe_gemm_wg import w8a8_fits

    w8a8 = switches["KDA_RT_FP8_PREFILL"] == "1" and w8a8_fits(D, inter)
    ref = moe_ref(params, x, cfg, e4m3_sources=w8a8, shared_e4m3_sources=w8a8 and fused)
    out = cupy.empty((T, D), dtype=BF16)
    ws = cupy.full(moe_workspace_bytes(T, cfg, D, inter, inter_s, fused, e4m3=True), 0xFF, dtype=np.uint8)
    poison(out)
    if w8a8:  # the e4m3-source GEMMs must be the ones that run (a sm_90a build with K % 128 == 0)
        if device_arch() != "sm_90a":
            pytest.skip("e4m3 sources run on the wgmma kernel (sm_90a)")
        real_q = moe.quantize_activations_e4m3
        quantized = []
        monkeypatch.setattr(moe, "quantize_activations_e4m3", lambda *a, **k: quantized.append(1) or real_q(*a, **k))
    moe_forward(to_gpu_bf16(x), w, cfg, out=out, workspace=ws)
    got = to_np(out)
    err = rms_rel(got, ref)
    print(f"\n{name} e4m3: rms rel err {err:.2e}", end="")
    # e4m3 sources: the oracle quantizes the same rows (reference.moe.e4m3_rows), so what is left is the kernels'
    # drift (the e4m3 tensor cores' ~14-bit partial sums: 4e-3 RMS on h, test_moe_gemm_wg_w8a8) and its effect on
    # h's codes: where the GPU's h and the oracle's straddle an e4m3 rounding boundary (~4e-3 / ~9% spacing, ~4% of
    # elements) the code moves one step (~9%), ~2% RMS on the down GEMM's sources; twice that bounds it.  One wrong
    # expert of the 8 (each adds about as much) moves the output by ~35%
    bound = 4e-2 if w8a8 else 1e-2
    assert err <= bound, f"{name} e4m3: rms rel err {err:.3e}, max abs {np.max(np.abs(got - ref)):.3e}"
    if w8a8:
        assert len(quantized) == 2, f"{name}: the e4m3-source GEMMs did not run ({len(quantized)} quantizations)"
    if case == "T1-E256":  # the one-token step's gate/up GEMV selected its experts itself (the routed, e4m3 build)
        assert seen and seen[0] is not None, "the one-token step did not take the routed GEMV"
    if name in ("T256-E256", "T300-E64-G8k4"):  # the path the case names ran: moe_decode_fused's tiles, or none
        want = {"T256-E256": [16], "T256-E256-fused32": [32], "T256-E256-rows32": [32], "T256-E256-tc64": [],
                "T256-E256-fused64": [64], "T300-E64-G8k4": [], "T300-E64-G8k4-fused64": [64]}[case]
        assert fused_runs == want, f"{case}: moe_decode_fused ran on plans of {fused_runs} rows, want {want}"
    with pytest.raises(ValueError, match="need both scale13 and scale2"):
        moe_forward(to_gpu_bf16(x), DeviceMoE(w.router, w.bias, q13, q2, shared_dev, shared_in_stack=fused,
                                              scale13=s13), cfg)


@pytest.mark.parametrize("route", ["one", "three"], ids=["fused-route", "three-route"])
@pytest.mark.parametrize("launches", ["one", "two"], ids=["fused-gemms", "two-gemms"])
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("fused", [False, True], ids=["shared-apart", "shared-in-stack"])
@pytest.mark.parametrize("T,E", [(1, 256), (4, 256), (16, 64), (128, 64), (512, 16)],
                         ids=["T1-E256-gemv", "T4-E256-decode", "T16-E64-decode", "T128-E64-decode64",
                              "T512-E16-prefill"])
def test_moe_forward_in_cuda_graph(T, E, fused, pdl, launches, route, monkeypatch):
    """Capture once (out + workspace given: nothing allocated), replay on a new x: new routing,
    new per-expert counts, same grids.  T128-E64 (~16 rows an expert) takes 64-row tiles: moe_decode_fused's
    (KDA_RT_MOE_FUSED64=1, as by default) or, with two launches, moe_gemm_tc's.  T512-E16 (256 rows per expert) takes moe_gemm_tc.cu.  pdl: captured
    with programmatic dependent launches, as the decode graphs are.  launches: the decode steps' two expert
    GEMMs in one launch (moe_decode_fused, whose counters the replay's bucketing zeroes again) or two (the
    down GEMM then copies its first weight steps while gate/up runs, EARLY_B).  route: the decode steps'
    logits, select and bucketing in one launch (moe_route_fused, its counter left 0 by the eager calls and
    by every launch) or three.  T1: the gate/up GEMV, which with the fused route selects the token's experts
    itself from the routing kernel's logits (moe_gemv.cu ROUTED: its counters left 0 by every launch), then the
    down GEMV (moe_gemv_down), which reads the plan before its programmatic-launch wait: T1 with pdl is its graph
    test; the two-launch MoE is the same there.  The workspace is poisoned before the eager calls."""
    import cupy

    if launches == "two":
        monkeypatch.setenv("KDA_RT_FUSED_MOE", "0")
    if route == "three":
        monkeypatch.setenv("KDA_RT_FUSED_ROUTE", "0")
    if T >= 512 and (launches == "one" or route == "one"):
        pytest.skip("prefill sizes take the two-launch, three-kernel route path either way")
    if T == 128 and route == "one":
        pytest.skip("128 tokens take the three-kernel route path either way")
    monkeypatch.setenv("KDA_RT_MOE_FUSED64", "1")  # T128: ~16 rows an expert on moe_decode_fused's 64-row tiles
    monkeypatch.delenv("KDA_RT_MOE_FUSED32", raising=False)
    monkeypatch.delenv("KDA_RT_MOE_MIN_AVG_ROWS", raising=False)
    import kda_rt.cuda.moe as moe

    plans = []
    real_fused = moe.moe_decode_fused
    monkeypatch.setattr(moe, "moe_decode_fused", lambda *a, **k: plans.append(a[3].tile_rows) or real_fused(*a, **k))
    if T == 1 and launches == "two":
        pytest.skip("one token takes the gate/up and down GEMVs either way")

    from kda_rt.cuda.moe import moe_workspace_bytes
    from kda_rt.cuda.ops import pdl as pdl_launch
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.reference.moe import moe_forward as moe_ref

    D, inter = 2304, 1024
    cfg = make_cfg(E)
    x, gpu, params = make_block(T, D, inter, inter, cfg, 11)
    out = cupy.empty((T, D), dtype=BF16)
    ws = cupy.empty(moe_workspace_bytes(T, cfg, D, inter, inter, fused), dtype=np.uint8)
    ws[...] = 0xFF
    run(gpu, cfg, fused, out=out, workspace=ws)  # builds the fused stacks outside the capture
    stream = cupy.cuda.Stream(non_blocking=True)  # does not wait for the null stream: sync by hand
    cupy.cuda.Device().synchronize()
    with stream:
        run(gpu, cfg, fused, out=out, workspace=ws, stream=stream)  # warm up: compile, cuBLAS handle
        with pdl_launch.capturing(pdl) as on:
            if pdl and not on:
                pytest.skip("no programmatic dependent launch here (compute capability < 9.0 or KDA_RT_PDL=0)")
            stream.begin_capture()
            run(gpu, cfg, fused, out=out, workspace=ws, stream=stream)
            graph = stream.end_capture()
    stream.synchronize()
    for replay, seed in enumerate((12, 13)):  # twice: the first replay leaves every counter as it found it
        x2, _, _ = make_router(T, D, cfg, seed)
        gpu["x"][...] = to_gpu_bf16(x2)
        poison(out)
        cupy.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        err = rms_rel(to_np(out), moe_ref(params, x2, cfg))
        assert err <= 1e-2, f"graph replay {replay}: rms rel err {err:.3e}"
    if T == 128:  # (the eager calls and the capture each went through moe_forward: 64-row fused tiles, or none)
        assert set(plans) == ({64} if launches == "one" else set()) and (plans or launches == "two"), plans


@pytest.mark.parametrize("inputs", ["random", "tied", "nan"])
@pytest.mark.parametrize("norm_before", [False, True], ids=["x", "norm-before"])
@pytest.mark.parametrize("fused", [False, True], ids=["shared-apart", "shared-in-stack"])
def test_moe_forward_gemv_routed(fused, norm_before, inputs, monkeypatch):
    """One token: the GEMV that selects its experts from the routing kernel's logits (KDA_RT_GEMV_ROUTED=1, the
    default) gives bit for bit the output (and residual stream) of the GEMV that reads the routing kernel's plan
    (=0), three calls in a row on new inputs (its counters done[1:3] back to 0 after each), with x as the block
    input or with the add and norm before the block in the routing kernel (norm_before: the GEMV then reads the
    kernel's a_out).  inputs: random; tied (router and bias zero: every score equal, the choice is the lowest
    indices by the tie rule); nan (a NaN in x: NaN logits rank as -inf, the ids stay valid and the output is NaN
    in both).  The GEMV is checked to get `routed` (=1) or not (=0).  The routed GEMV with a shared expert in the
    stack runs its units first (KDA_RT_GEMV_SHARED_FIRST=1, the default) or in tile order (=0): the same output bit
    for bit, the variant checked by its build defines; so does the routed GEMV that takes its CTA count on thread 0
    before the selection (KDA_RT_GEMV_SIGNAL_OVERLAP=0) instead of on warp 1 beside it (=1).  The down projection
    on the down GEMV (KDA_RT_DOWN_GEMV=1, the default; checked to run) against the tiled down GEMM (0): within
    2e-3 RMS (only the fp32 summation order differs), and bit for bit between the routed and the plan-reading
    gate/up GEMV before it.  Outputs and workspace poisoned first."""
    import cupy

    import kda_rt.cuda.moe as moe
    from kda_rt.cuda.moe import moe_workspace_bytes
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_align import NormAfter
    from kda_rt.cuda.ops.moe_route import NormBefore

    D, inter, E, eps = 2304, 1024, 256, 1e-6
    cfg = dataclasses.replace(make_cfg(E), num_shared_experts=1, intermediate_size=inter)
    _, gpu, _ = make_block(1, D, inter, inter, cfg, 21)
    if inputs == "tied":
        gpu["w_router"][...] = 0
        gpu["bias"][...] = 0
    rng = np.random.default_rng(22)
    calls = [(rng.normal(size=(1, D)), rng.normal(size=(1, D)) * 3.0) for _ in range(3)]
    if inputs == "nan":
        calls[1][0][0, 7] = np.nan
    w_post, w_next = (to_gpu_bf16(rng.uniform(0.5, 1.5, size=D)) for _ in range(2))
    import kda_rt.cuda.ops.moe_gemv as gemv_ops

    seen, built = [], []
    real = moe.moe_gemv_gate_up
    monkeypatch.setattr(moe, "moe_gemv_gate_up", lambda *a, **kw: seen.append(kw.get("routed")) or real(*a, **kw))
    real_get = gemv_ops.get_kernel

    def spy(*a, **kw):  # the routed gate/up variants' build defines (not the down GEMV's)
        if kw.get("ROUTED"):
            built.append((kw["SHARED_FIRST"], kw["SIGNAL_OVERLAP"]))
        return real_get(*a, **kw)

    monkeypatch.setattr(gemv_ops, "get_kernel", spy)
    downs = []
    real_down = moe.moe_gemv_down
    monkeypatch.setattr(moe, "moe_gemv_down", lambda *a, **kw: downs.append(1) or real_down(*a, **kw))
    results = {}
    paths = {"1": ("1", "1", "1", "0"), "1-in-order": ("1", "0", "1", "0"), "1-count-first": ("1", "1", "0", "0"),
             "0": ("0", "1", "1", "0"), "down-gemv": ("1", "1", "1", "1"), "down-gemv-unrouted": ("0", "1", "1", "1")}
    for path, (routed, first, overlap, down) in paths.items():
        monkeypatch.setenv("KDA_RT_GEMV_ROUTED", routed)
        monkeypatch.setenv("KDA_RT_GEMV_SHARED_FIRST", first)
        monkeypatch.setenv("KDA_RT_GEMV_SIGNAL_OVERLAP", overlap)
        monkeypatch.setenv("KDA_RT_DOWN_GEMV", down)
        seen.clear()
        built.clear()
        downs.clear()
        got = []
        for x, residual in calls:
            gpu["x"] = to_gpu_bf16(x)
            out = cupy.empty((1, D), dtype=BF16)
            poison(out)
            ws = cupy.full(moe_workspace_bytes(1, cfg, D, inter, inter, fused), 0xFF, dtype=np.uint8)
            res = to_gpu_bf16(residual)
            kw = dict(norm=NormAfter(res, w_next, eps))
            if norm_before:
                h, a = cupy.empty((1, D), BF16), cupy.empty((1, D), BF16)
                poison(h)
                poison(a)
                kw["norm_before"] = NormBefore(res, w_post, eps, h, a)
            run(gpu, cfg, fused, out=out, workspace=ws, **kw)
            cupy.cuda.Device().synchronize()
            assert np.isnan(to_np(out)).any() == (inputs == "nan" and len(got) == 1)
            assert cupy.asnumpy(ws[:12].view(np.int32)).tolist() == [0, 0, 0], "routing counters not left at 0"
            got.append((cupy.asnumpy(out.view(np.uint16)), cupy.asnumpy(res.view(np.uint16))))
        assert len(seen) == 3 and all((r is not None) == (routed == "1") for r in seen), seen
        assert len(downs) == (3 if down == "1" else 0), (path, downs)
        if routed == "1":  # the routed variant's build defines: shared units first only with a shared slot
            assert built and set(built) == {(int(fused and first == "1"), int(overlap))}, (path, built)
        results[path] = got
    for path in ("1", "1-in-order", "1-count-first"):
        for (o1, r1), (o0, r0) in zip(results[path], results["0"], strict=True):
            assert np.array_equal(o1, o0) and np.array_equal(r1, r0), f"the routed GEMV's output differs ({path})"
    # the down GEMV (KDA_RT_DOWN_GEMV=1) against the tiled down GEMM (0), after the routed and the plan-reading
    # gate/up GEMV: the same bf16 roundings, only the fp32 summation order of the down products differs (a bf16
    # ulp on a few expert outputs): within 2e-3 RMS
    for (o1, r1), (o0, r0) in zip(results["down-gemv"], results["down-gemv-unrouted"], strict=True):
        assert np.array_equal(o1, o0) and np.array_equal(r1, r0), "the down GEMV differs after the routed gate/up GEMV"
    for path in ("down-gemv", "down-gemv-unrouted"):
        for i, ((o1, _), (o2, _)) in enumerate(zip(results["1"], results[path], strict=True)):
            a, b = (o.view(np.uint16).astype(np.uint32) << 16 for o in (o1, o2))
            a, b = a.view(np.float32), b.view(np.float32)
            if inputs == "nan" and i == 1:
                assert np.isnan(a).any() and np.isnan(b).any()
                continue
            err = rms_rel(a, b)
            assert err <= 2e-3, f"{path} call {i}: down GEMV against the tiled down GEMM, rms rel {err:.3e}"


@pytest.mark.parametrize("fused", [False, True], ids=["shared-apart", "shared-in-stack"])
@pytest.mark.parametrize("T", [1, 8])
def test_moe_forward_norm_before(T, fused, monkeypatch):
    """moe_forward(delta, norm_before=..., norm=...) (the add and RMSNorm before the block in the routing kernel,
    the ones after it in the combine) against rmsnorm.cu then moe_forward(a, norm=...): the new residual
    stream and the block's output (the next block's normalised input) within 1e-2 RMS (a differs from
    rmsnorm.cu's by at most one bf16 ulp in <= 1% of the entries: test_moe_route_fused_norm_before).  T = 8
    raises the policy's ROUTE_NORM_MAX_T (4) so that the 8-rows-a-block kernel runs end to end.  Also the
    refusals: without `norm`, and at T = 32 (over ROUTE_NORM_MAX_T and the fused routing's FUSED_MAX_T)."""
    import cupy

    import kda_rt.cuda.moe as moe
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_align import NormAfter
    from kda_rt.cuda.ops.moe_route import NormBefore
    from kda_rt.cuda.ops.rmsnorm import rmsnorm

    monkeypatch.setattr(moe, "ROUTE_NORM_MAX_T", max(T, moe.ROUTE_NORM_MAX_T))
    D, inter, E, eps = 2304, 1024, 256, 1e-6
    cfg = dataclasses.replace(make_cfg(E), num_shared_experts=1, intermediate_size=inter)
    _, gpu, _ = make_block(T, D, inter, inter, cfg, 40 + T)
    rng = np.random.default_rng(T)
    delta, residual = to_gpu_bf16(rng.normal(size=(T, D))), rng.normal(size=(T, D)) * 3.0
    w_post, w_next = (to_gpu_bf16(rng.uniform(0.5, 1.5, size=D)) for _ in range(2))
    # two kernels before the block, then the block with the norm after it
    res1 = to_gpu_bf16(residual)
    gpu["x"] = rmsnorm(delta, w_post, eps, residual=res1)
    out1 = cupy.empty((T, D), BF16)
    run(gpu, cfg, fused, out=out1, norm=NormAfter(res1, w_next, eps))
    # the norm in the routing kernel
    res2 = to_gpu_bf16(residual)
    h, a, out2 = (cupy.empty((T, D), BF16) for _ in range(3))
    for arr in (h, a, out2):
        poison(arr)
    gpu["x"] = delta
    run(gpu, cfg, fused, out=out2, norm=NormAfter(res2, w_next, eps), norm_before=NormBefore(res2, w_post, eps, h, a))
    for name, got, want in (("residual", res2, res1), ("out", out2, out1)):
        err = rms_rel(to_np(got), to_np(want))
        assert err <= 1e-2, f"{name}: rms rel err {err:.3e}"
    with pytest.raises(ValueError, match="needs `norm`"):
        run(gpu, cfg, fused, norm_before=NormBefore(res2, w_post, eps, h, a))
    x32 = to_gpu_bf16(rng.normal(size=(32, D)))
    gpu["x"] = x32
    with pytest.raises(ValueError, match="ROUTE_NORM_MAX_T"):
        r32 = cupy.zeros((32, D), BF16)
        run(gpu, cfg, fused, norm=NormAfter(r32, w_next, eps),
            norm_before=NormBefore(r32, w_post, eps, cupy.empty_like(x32), cupy.empty_like(x32)))


def bench(T=32, D=2304, inter=1024, E=256, reps=50):
    """Decode-shaped timing by CUDA-graph replay; bytes = touched experts' w13 + w2, shared expert,
    router (each read once), the floor for this memory-bound step."""
    import cupy

    from kda_rt.cuda.moe import moe_workspace_bytes
    from kda_rt.cuda.ops.check import BF16

    cfg = make_cfg(E)
    _, gpu, _ = make_block(T, D, inter, inter, cfg, 5)
    out = cupy.empty((T, D), dtype=BF16)
    ws = cupy.empty(moe_workspace_bytes(T, cfg, D, inter, inter), dtype=np.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()  # weights and x are written on the null stream
    with stream:
        run(gpu, cfg, out=out, workspace=ws, stream=stream)
        stream.begin_capture()
        run(gpu, cfg, out=out, workspace=ws, stream=stream)
        graph = stream.end_capture()
        for _ in range(3):
            graph.launch(stream)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(reps):
            graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
    ms = cupy.cuda.get_elapsed_time(start, stop) / reps
    from kda_rt.cuda.ops.moe_route import moe_route

    ids, _ = moe_route(gpu["x"], gpu["w_router"], gpu["bias"], top_k=cfg.top_k, num_groups=1, topk_group=1,
                       renormalize=True, scaling=1.0)
    touched = len(np.unique(cupy.asnumpy(ids)))
    nbytes = touched * 3 * inter * D * 2 + 3 * inter * D * 2 + E * D * 4
    print(f"moe_forward T={T} E={E} D={D} I={inter} A={cfg.top_k}: {ms * 1e3:.1f} us per call (graph), "
          f"{touched} experts touched, {nbytes / 1e6:.1f} MB -> {nbytes / ms / 1e6:.0f} GB/s "
          f"(floor at 4.3 TB/s: {nbytes / 4.3e9 * 1e3:.1f} us)")
    return ms


def bench_parts(T=32, D=2304, inter=1024, E=256, reps=20, configs=((2, 4, 4),)):
    """Per-stage times (each stage queued `reps` times between two events; stages are idempotent),
    and the two grouped GEMMs under other (MT, WARPS, KU) tile configs."""
    import cupy

    import kda_rt.cuda.ops.moe_gemm as mg
    from kda_rt.cuda.ops import moe as mo
    from kda_rt.cuda.ops.moe_align import MoEPlan, moe_bucket, moe_combine
    from kda_rt.cuda.ops.moe_route import moe_route

    cfg = make_cfg(E)
    _, g, _ = make_block(T, D, inter, inter, cfg, 5)
    parts = mo._layout(T, cfg, D, inter, inter)
    offs, nbytes = mo._offsets(parts)
    buf = cupy.empty(nbytes, dtype=np.uint8)
    ws = {n: cupy.ndarray(s, d, memptr=buf.data + o) for (n, s, d), o in zip(parts, offs, strict=True)}
    plan = MoEPlan(ws["expert_off"], ws["sorted_pair"], ws["pair_pos"], ws["tile_expert"], ws["tile_row"],
                   ws["num_tiles"], mg.tile_rows_for(T * cfg.top_k, E))
    out = cupy.empty((T, D), dtype=g["x"].dtype)
    stages = {
        "route": lambda: moe_route(g["x"], g["w_router"], g["bias"], top_k=8, num_groups=1, topk_group=1,
                                   renormalize=True, scaling=2.446, out_ids=ws["ids"], out_w=ws["w"],
                                   logits=ws["logits"]),
        "bucket": lambda: moe_bucket(ws["ids"], E, plan),
        "gemm13": lambda: mg.moe_gemm(g["x"], g["w13"], plan, top_k=8, fuse_silu=True, out=ws["h"]),
        "gemm2": lambda: mg.moe_gemm(ws["h"], g["w2"], plan, top_k=8, fuse_silu=False, out=ws["y"]),
        "combine": lambda: moe_combine(ws["y"], plan.pair_pos, ws["w"], ws["y_s"], out=out),
    }
    touched = None
    default_config = mg._config
    for cfg_i, conf in enumerate(configs):
        mg._config = (lambda c: (lambda nout, k, nt, fuse: c))(conf) if cfg_i else default_config
        for name, fn in stages.items():
            if cfg_i and not name.startswith("gemm"):
                continue
            fn()
            cupy.cuda.Device().synchronize()
            if touched is None and name == "bucket":
                touched = int(np.count_nonzero(np.diff(cupy.asnumpy(ws["expert_off"]))))
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            for _ in range(reps):
                fn()
            stop.record()
            stop.synchronize()
            us = cupy.cuda.get_elapsed_time(start, stop) / reps * 1e3
            wbytes = touched * (2 if name == "gemm13" else 1) * inter * D * 2 if name.startswith("gemm") else 0
            extra = f" {wbytes / 1e6:.0f} MB weights -> {wbytes / us / 1e3:.0f} GB/s" if wbytes else ""
            print(f"  T={T} E={E} {name:8s} config={conf if cfg_i else 'default'}: {us:8.1f} us{extra}")
    mg._config = default_config


if __name__ == "__main__":
    bench(T=32)
    bench(T=1)
    bench(T=64)
    bench_parts(T=32, configs=((2, 4, 4), (2, 4, 2), (4, 4, 4), (2, 8, 4), (4, 4, 2)))
