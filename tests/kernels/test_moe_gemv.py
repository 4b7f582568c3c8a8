"""kernels_cu/moe_gemv.cu (a one-token step's MoE gate/up as a GEMV spread over every warp) against NumPy
float64 on fresh random bf16 inputs, over the plan moe_bucket builds for one token:

    h[r] = bf16( bf16(SiLU(bf16(x · W1_eᵀ))) · bf16(x · W3_eᵀ) )      [N, I] bf16, e the expert of row r

Tolerances as test_moe_gemm_tc.py's gate/up (the reference rounds where the kernel rounds; an fp32-vs-float64
difference can flip one of the four bf16 roundings): RMS ≤ 1e-3 and |out - ref| ≤ 3e-2 · |ref| + 1e-3 · RMS(ref).
Every output row is poisoned with NaN first, so a row left unwritten fails.  The launch configurations cover
the default (pipelined), the unpipelined variant, and grids with more warps than features (warps with no
work), and hidden widths that are not a multiple of 256 (lanes with no piece)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from helpers.gpu import bf16_round, poison, rand_bf16, to_np
from helpers.moe_gemm import check, make_ids, make_plan, reference_rows

pytestmark = pytest.mark.gpu

CASES = {  # name: (D, I, E, A)
    "D2304-I1024-E12-A9": (2304, 1024, 12, 9),  # the 48B shape's widths, 8 routed + the shared slot
    "D256-I128-E8-A2": (256, 128, 8, 2),
    "D72-I40-E5-A3": (72, 40, 5, 3),  # 9 pieces a row: lanes 9..31 hold none
    "D2312-I24-E4-A1": (2312, 24, 4, 1),  # 289 pieces: one lane holds a tenth; 24 features for 132 x 16 warps
}
CONFIGS = {"default": {}, "w8-b2": {"pipe": False, "blocks_per_sm": 2}, "w4-b3": {"warps": 4, "blocks_per_sm": 3},
           "w16-b4": {"warps": 16, "blocks_per_sm": 4, "pipe": False}}  # w16-b4: more CTAs than fit, one wave


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", list(CASES))
def test_moe_gemv_gate_up(name, config):
    import cupy

    from helpers.gpu import to_gpu_bf16
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_gemv import DEFAULT, moe_gemv_gate_up

    D, inter, E, A = CASES[name]
    rng = np.random.default_rng(zlib.crc32(f"{name}/{config}".encode()))
    crng = cupy.random.default_rng(int(rng.integers(1 << 30)))
    x_np = bf16_round(rng.normal(size=(1, D)))
    w13, w2 = rand_bf16(crng, (E, 2 * inter, D), 1 / np.sqrt(D)), rand_bf16(crng, (E, D, inter), 1 / np.sqrt(inter))
    ids = make_ids(1, E, A, False, rng)
    for bm in (8, 16):  # the plan's tile rows do not matter at one token (one row a tile)
        plan = make_plan(ids, E, bm)
        h = cupy.empty((A, inter), dtype=BF16)
        poison(h)
        moe_gemv_gate_up(to_gpu_bf16(x_np), w13, plan, out=h, cfg=DEFAULT._replace(**CONFIGS[config]))
        h_np = to_np(h)
        assert np.all(np.isfinite(h_np)), f"{name}/{config}: rows left unwritten (NaN)"
        off, sp = cupy.asnumpy(plan.expert_off), cupy.asnumpy(plan.sorted_pair)
        for e in np.unique(ids):
            rows, h_ref, _ = reference_rows(int(e), (off, sp), x_np, w13, w2, h_np, A)
            check(h_np[rows], h_ref, f"{name}/{config} bm{bm} h expert {e}", rms_tol=1e-3, rtol=3e-2, atol_rms=1e-3)


E4M3_CASES = {  # name: (D, I, E, A), D % 16 == 0
    "D2304-I1024-E12-A9": (2304, 1024, 12, 9),
    "D256-I128-E8-A2": (256, 128, 8, 2),
    "D80-I40-E5-A3": (80, 40, 5, 3),  # 5 e4m3 pieces a row: lanes 5..31 hold none
}


@pytest.mark.parametrize("config", ["default", "e4m3", "w8-b2"])  # e4m3: gate_up_config(e4m3=True), moe_forward's
@pytest.mark.parametrize("name", list(E4M3_CASES))
def test_moe_gemv_gate_up_e4m3(name, config):
    """w13 in e4m3 with a scale a row (moe_gemv.cu WFMT = 1, loader/quant.quantize_rows over every expert's rows)
    against the float64 reference on the dequantized weights, with the bf16 test's tolerances (the same rounding
    points; the scale adds one fp32 rounding to each sum).  Experts of magnitudes 2^-6 .. 2^4 apart, so a scale
    taken from the wrong expert or row, or the up row's scale on the gate row, fails by far."""
    import cupy

    from helpers.gpu import to_gpu_bf16
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_gemv import DEFAULT, gate_up_config, moe_gemv_gate_up
    from kda_rt.loader.quant import dequantize_rows, quantize_rows

    D, inter, E, A = E4M3_CASES[name]
    rng = np.random.default_rng(zlib.crc32(f"e4m3/{name}/{config}".encode()))
    x_np = bf16_round(rng.normal(size=(1, D)))
    w = rng.normal(size=(E, 2 * inter, D)) / np.sqrt(D) * 2.0 ** rng.integers(-6, 5, size=(E, 2, 1, 1)).repeat(
        inter, axis=2).reshape(E, 2 * inter, 1)
    q, scale = quantize_rows(w.reshape(E * 2 * inter, D), "w13")
    w_deq = dequantize_rows(q, scale).reshape(E, 2 * inter, D)
    w13 = cupy.asarray(q.view(np.uint8).reshape(E, 2 * inter, D))
    ids = make_ids(1, E, A, False, rng)
    plan = make_plan(ids, E, 16)
    h = cupy.empty((A, inter), dtype=BF16)
    poison(h)
    cfg = {"default": DEFAULT, "e4m3": gate_up_config(e4m3=True),
           "w8-b2": DEFAULT._replace(pipe=False, blocks_per_sm=2)}[config]
    moe_gemv_gate_up(to_gpu_bf16(x_np), w13, plan, out=h, scale=cupy.asarray(scale.reshape(E, 2 * inter)), cfg=cfg)
    h_np = to_np(h)
    assert np.all(np.isfinite(h_np)), f"{name}/{config}: rows left unwritten (NaN)"
    off, sp = cupy.asnumpy(plan.expert_off), cupy.asnumpy(plan.sorted_pair)
    w2 = np.zeros((E, D, inter), np.float32)  # (reference_rows also forms y; unused here)
    for e in np.unique(ids):
        rows, h_ref, _ = reference_rows(int(e), (off, sp), x_np, w_deq, w2, h_np, A)
        check(h_np[rows], h_ref, f"e4m3 {name}/{config} h expert {e}", rms_tol=1e-3, rtol=3e-2, atol_rms=1e-3)


def test_moe_gemv_gate_up_e4m3_refusals():
    """e4m3 calls refused by name: bf16 w13 with a scale, D not a multiple of 16, a scale of the wrong shape."""
    import cupy

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_gemv import moe_gemv_gate_up

    E, D, inter, A = 4, 256, 64, 2
    plan = make_plan(np.array([[0, 2]], np.int32), E, 16)
    h, x = cupy.empty((A, inter), dtype=BF16), cupy.zeros((1, D), dtype=BF16)
    with pytest.raises(TypeError, match="w13 must have dtype uint8"):
        moe_gemv_gate_up(x, cupy.zeros((E, 2 * inter, D), BF16), plan, out=h, scale=cupy.ones((E, 2 * inter), np.float32))
    with pytest.raises(ValueError, match="multiple of 16"):
        moe_gemv_gate_up(cupy.zeros((1, 24), BF16), cupy.zeros((E, 2 * inter, 24), np.uint8), plan, out=h,
                         scale=cupy.ones((E, 2 * inter), np.float32))
    with pytest.raises(ValueError, match="scale must have shape"):
        moe_gemv_gate_up(x, cupy.zeros((E, 2 * inter, D), np.uint8), plan, out=h, scale=cupy.ones((E, inter), np.float32))
    with pytest.raises(TypeError, match=r"w13 must have dtype bfloat16 \(or uint8 e4m3 bits with scale=\)"):
        moe_gemv_gate_up(x, cupy.zeros((E, 2 * inter, D), np.uint8), plan, out=h)
    # the routed variant checks its weights before the routing kernel is launched (moe_forward calls routed_kernel
    # first): e4m3 codes without their scales, and scales of the wrong shape, are refused there
    from kda_rt.cuda.ops.moe_gemv import GemvRouting, routed_kernel

    r = GemvRouting(cupy.zeros((1, E), np.float32), cupy.zeros(E, np.float32), 2, cupy.zeros(64, np.int32), 1, E, False)
    with pytest.raises(TypeError, match=r"w13 must have dtype bfloat16 \(or uint8 e4m3 bits with scale=\)"):
        routed_kernel(cupy.zeros((E, 2 * inter, D), np.uint8), A, r)
    with pytest.raises(ValueError, match="scale must have shape"):
        routed_kernel(cupy.zeros((E, 2 * inter, D), np.uint8), A, r, scale=cupy.ones((E, inter), np.float32))


def test_moe_gemv_rejects_bad_inputs():
    import cupy

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_gemv import moe_gemv_gate_up

    E, D, inter, A = 4, 256, 64, 2
    plan = make_plan(np.array([[0, 2]], np.int32), E, 16)
    w13 = cupy.zeros((E, 2 * inter, D), dtype=BF16)
    h = cupy.empty((A, inter), dtype=BF16)
    with pytest.raises(ValueError, match="x must have shape"):
        moe_gemv_gate_up(cupy.zeros((2, D), dtype=BF16), w13, plan, out=h)
    with pytest.raises(ValueError, match="out must have shape"):
        moe_gemv_gate_up(cupy.zeros((1, D), dtype=BF16), w13, plan, out=cupy.empty((A, inter + 1), dtype=BF16))
    with pytest.raises(ValueError, match="multiple of 8"):
        moe_gemv_gate_up(cupy.zeros((1, 12), dtype=BF16), cupy.zeros((E, 2 * inter, 12), dtype=BF16), plan, out=h)


DOWN_CASES = {  # name: (D, I, E, A)
    "D2304-I1024-E12-A9": (2304, 1024, 12, 9),  # the 48B shape: 8 routed + the shared slot
    "D72-I40-E5-A3": (72, 40, 5, 3),  # 5 pieces a row: lanes 5..31 hold none
    "D2312-I24-E4-A1": (2312, 24, 4, 1),  # one tile, 3 pieces a row, 1156 units for ~528 warps
    "D256-I136-E8-A8": (256, 136, 8, 8),  # 17 pieces a row (lanes 0..16 hold one), every expert routed
}


@pytest.mark.parametrize("name", list(DOWN_CASES))
def test_moe_gemv_down(name):
    """moe_gemv_down (the one-token down projection, its first weight rows copied into per-warp shared-memory rings
    before the programmatic-launch wait) against NumPy: y[r] = bf16(h[r] · w2_eᵀ) from the same bf16 h.
    The kernel rounds its fp32 sum once (half an ulp, <= 2^-8 |y|) and its fp32 sum of I products is off by at most
    I 2^-24 Σ|h w| (<= 2^-14 Σ|h w| here): |y - ref| <= 2^-8 |ref| + 2^-13 Σ|h w|; a wrong expert, row or stage is
    off by ~Σ|h w| / sqrt(I), 100x that bound or more.  y is poisoned first, so a row left unwritten fails."""
    import cupy

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_gemv import moe_gemv_down

    D, inter, E, A = DOWN_CASES[name]
    rng = np.random.default_rng(zlib.crc32(f"down/{name}".encode()))
    crng = cupy.random.default_rng(int(rng.integers(1 << 30)))
    w2 = rand_bf16(crng, (E, D, inter), 1 / np.sqrt(inter))
    ids = make_ids(1, E, A, False, rng)
    plan = make_plan(ids, E, 16)
    h_np = bf16_round(rng.normal(size=(A, inter)))
    y = cupy.empty((A, D), dtype=BF16)
    poison(y)
    moe_gemv_down(cupy.asarray(h_np.astype(np.float32).astype(BF16)), w2, plan, out=y)
    y_np = to_np(y)
    assert np.all(np.isfinite(y_np)), f"{name}: rows left unwritten (NaN)"
    off = cupy.asnumpy(plan.expert_off)
    for e in np.unique(ids):
        rows = np.arange(off[e], off[e + 1])
        w2e = to_np(w2[e])
        ref, mag = h_np[rows] @ w2e.T, np.abs(h_np[rows]) @ np.abs(w2e).T
        bad = ~(np.abs(y_np[rows] - ref) <= 2.0**-8 * np.abs(ref) + 2.0**-13 * mag)
        assert not bad.any(), f"{name} expert {e}: {int(bad.sum())} outputs off"


def test_moe_gemv_down_rejects_bad_inputs():
    import cupy

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_gemv import moe_gemv_down

    E, D, inter = 4, 256, 64
    plan = make_plan(np.array([[0, 2]], np.int32), E, 16)
    w2 = cupy.zeros((E, D, inter), dtype=BF16)
    h, y = cupy.zeros((2, inter), dtype=BF16), cupy.empty((2, D), dtype=BF16)
    with pytest.raises(ValueError, match="out must have shape"):
        moe_gemv_down(h, w2, plan, out=cupy.empty((2, D + 2), dtype=BF16))
    with pytest.raises(ValueError, match="w2 must have shape"):
        moe_gemv_down(h, cupy.zeros((E, D, inter + 8), dtype=BF16), plan, out=y)
    with pytest.raises(ValueError, match="% 8"):
        moe_gemv_down(cupy.zeros((2, 12), dtype=BF16), cupy.zeros((E, D, 12), dtype=BF16), plan, out=y)
    with pytest.raises(ValueError, match="the plan's"):
        moe_gemv_down(cupy.zeros((3, inter), dtype=BF16), w2, plan, out=cupy.empty((3, D), dtype=BF16))


E4M3_DOWN_CASES = {  # name: (D, I, E, A), I % 16 == 0
    "D2304-I1024-E12-A9": (2304, 1024, 12, 9),  # the 48B shape: 64 e4m3 pieces a row (lanes hold two)
    "D72-I48-E5-A3": (72, 48, 5, 3),  # 3 pieces a row: lanes 3..31 hold none
    "D2312-I32-E4-A1": (2312, 32, 4, 1),  # one tile, 2 pieces a row, 1156 units for ~528 warps
    "D256-I144-E8-A8": (256, 144, 8, 8),  # 9 pieces a row, every expert routed
}


@pytest.mark.parametrize("shape", ["default", "4x6", "24x2"])  # (warps x stages; default: down_shape(e4m3=True))
@pytest.mark.parametrize("name", list(E4M3_DOWN_CASES))
def test_moe_gemv_down_e4m3(name, shape, monkeypatch):
    """moe_gemv_down with w2 in e4m3 and a scale a row (moe_gemv.cu WFMT = 1: the rows' scale pair rides in the ring
    stage with the rows) against NumPy on the dequantized weights, with the bf16 test's bound (the conversion to fp32
    is exact; the scale adds one fp32 rounding).  Rows of magnitudes 2^-6 .. 2^4 apart, so a scale from another stage,
    row or expert fails by far; y poisoned first.  The launch shapes: the e4m3 default, the bf16 one's, and more
    warps than a 16-warp CTA (KDA_RT_DOWN_WARPS / KDA_RT_DOWN_STAGES)."""
    if shape != "default":
        warps, stages = shape.split("x")
        monkeypatch.setenv("KDA_RT_DOWN_WARPS", warps)
        monkeypatch.setenv("KDA_RT_DOWN_STAGES", stages)
    import cupy

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_gemv import moe_gemv_down
    from kda_rt.loader.quant import dequantize_rows, quantize_rows

    D, inter, E, A = E4M3_DOWN_CASES[name]
    rng = np.random.default_rng(zlib.crc32(f"down-e4m3/{name}".encode()))
    w = rng.normal(size=(E, D, inter)) / np.sqrt(inter) * 2.0 ** rng.integers(-6, 5, size=(E, D, 1))
    q, scale = quantize_rows(w.reshape(E * D, inter), "w2")
    w_deq = dequantize_rows(q, scale).astype(np.float64).reshape(E, D, inter)
    ids = make_ids(1, E, A, False, rng)
    plan = make_plan(ids, E, 16)
    h_np = bf16_round(rng.normal(size=(A, inter)))
    y = cupy.empty((A, D), dtype=BF16)
    poison(y)
    moe_gemv_down(cupy.asarray(h_np.astype(np.float32).astype(BF16)), cupy.asarray(q.view(np.uint8).reshape(E, D, inter)),
                  plan, out=y, scale=cupy.asarray(scale.reshape(E, D)))
    y_np = to_np(y)
    assert np.all(np.isfinite(y_np)), f"{name}: rows left unwritten (NaN)"
    off = cupy.asnumpy(plan.expert_off)
    for e in np.unique(ids):
        rows = np.arange(off[e], off[e + 1])
        ref, mag = h_np[rows] @ w_deq[e].T, np.abs(h_np[rows]) @ np.abs(w_deq[e]).T
        bad = ~(np.abs(y_np[rows] - ref) <= 2.0**-8 * np.abs(ref) + 2.0**-13 * mag)
        assert not bad.any(), f"e4m3 {name} expert {e}: {int(bad.sum())} outputs off"


def test_moe_gemv_down_e4m3_refusals():
    """e4m3 down calls refused by name: uint8 w2 without a scale, an expert width not a multiple of 16, a scale of
    the wrong shape."""
    import cupy

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_gemv import moe_gemv_down

    E, D, inter = 4, 256, 64
    plan = make_plan(np.array([[0, 2]], np.int32), E, 16)
    h, y = cupy.zeros((2, inter), dtype=BF16), cupy.empty((2, D), dtype=BF16)
    w2 = cupy.zeros((E, D, inter), dtype=np.uint8)
    with pytest.raises(TypeError, match=r"w2 must have dtype bfloat16 \(or uint8 e4m3 bits with scale=\)"):
        moe_gemv_down(h, w2, plan, out=y)
    with pytest.raises(ValueError, match="% 16 == 0"):
        moe_gemv_down(cupy.zeros((2, 24), dtype=BF16), cupy.zeros((E, D, 24), dtype=np.uint8), plan, out=y,
                      scale=cupy.ones((E, D), np.float32))
    with pytest.raises(ValueError, match="scale must have shape"):
        moe_gemv_down(h, w2, plan, out=y, scale=cupy.ones((E, D + 2), np.float32))
    with pytest.raises(TypeError, match=r"w2 must have dtype uint8 \(e4m3 bits, with scale=\)"):
        moe_gemv_down(h, cupy.zeros((E, D, inter), dtype=BF16), plan, out=y, scale=cupy.ones((E, D), np.float32))
    with pytest.raises(TypeError, match="scale must have dtype float32"):
        moe_gemv_down(h, w2, plan, out=y, scale=cupy.ones((E, D), np.float64))
    with pytest.raises(ValueError, match="8-byte boundary"):
        moe_gemv_down(h, w2, plan, out=y, scale=cupy.ones(E * D + 1, np.float32)[1:].reshape(E, D))
