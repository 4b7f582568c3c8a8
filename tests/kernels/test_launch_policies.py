"""The launchers' variant choices (CPU: the device queries are replaced), as measured on the H200 and
written down in docs/PERFORMANCE.md: the sampler's cluster / thread count / cached slice, the KDA
decode split, the wgmma switch, and the sampler variants the runner compiles at start."""

from __future__ import annotations

import sys
import types

import pytest

import kda_rt.cuda.ops.kda_decode as kd
import kda_rt.cuda.ops.moe_gemm_wg as wg
import kda_rt.sampler.sampling as smp

H200 = (90, 132, 232448)  # compute capability, SMs, opt-in shared memory per block
RTX4090 = (89, 128, 101376)


@pytest.fixture
def device(monkeypatch):
    """Pretend to run on a device of the given (cc, SMs, smem) without CuPy or a GPU."""
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda *a: types.SimpleNamespace(id=0)))
    monkeypatch.setitem(sys.modules, "cupy", fake)

    def use(spec):
        monkeypatch.setattr(smp, "_device", lambda _id: spec)
        monkeypatch.setattr(kd, "_clusters", lambda: spec[0] >= 90)
        monkeypatch.setattr(kd, "_smem_optin", lambda: spec[2])
    return use


def test_sampler_splits_rows_over_a_cluster_on_hopper(device):
    device(H200)
    V = 163840
    assert smp.sample_config(1, V) == (8, 1024, 1, True)    # 8 CTAs per row fit one per SM
    assert smp.sample_config(16, V) == (8, 1024, 1, True)
    assert smp.sample_config(32, V) == (8, 512, 2, True)    # two per SM: batch 32 in one wave
    assert smp.sample_config(4, 1003) == (1, 256, 1, True)  # small vocabularies: one CTA per row


def test_sampler_caches_a_slice_only_under_the_devices_limit(device):
    device(RTX4090)  # 99 KB of opt-in shared memory, no clusters
    assert smp.sample_config(1, 50257)[0] == 1
    assert smp.sample_config(1, 50257)[3] is False   # 196 KB of fp32 logits: reread from global
    assert smp.sample_config(1, 16000)[3] is True    # 62.5 KB fits beside the static shared memory
    with pytest.raises(ValueError, match="cluster"):
        smp.sample_config(1, 163840, cluster=8)


def test_runner_precompiles_every_thread_count_a_batch_can_pick(device, monkeypatch):
    device(H200)
    compiled = []
    monkeypatch.setattr(smp, "get_kernel", lambda f, n, **kw: compiled.append(kw["THREADS"]))
    assert smp.precompile(163840, 256) == 4  # 1024 threads (B <= 16) and 512, with and without logprobs
    assert sorted(compiled) == [512, 512, 1024, 1024]
    compiled.clear()
    assert smp.precompile(163840, 8) == 2    # batches up to 8 only ever use 1024 threads
    assert compiled == [1024, 1024]


@pytest.mark.parametrize(("num_seqs", "expected"), [(1, (4, 128, 7)), (4, (4, 128, 7)), (5, (1, 256, 2)),
                                                     (31, (1, 256, 2)), (32, (1, 256, 3)), (256, (1, 256, 3))])
def test_kda_decode_splits_heads_only_for_small_batches(device, num_seqs, expected, monkeypatch):
    monkeypatch.delenv("KDA_RT_KDA_SMEM_STATE", raising=False)
    device(H200)
    assert kd.decode_config(num_seqs=num_seqs) == expected
    assert kd.decode_config(fused=True, num_seqs=num_seqs)[0] == 4  # fused gates need the split kernel


def test_kda_decode_smem_state_switch(device, monkeypatch):
    """The one-CTA-per-head kernel takes its state by bulk copies into shared memory, launch bounds for three CTAs an
    SM, from 32 sequences on sm_90+ (ops/kda_decode.py SMEM_STATE_MIN_SEQS); KDA_RT_KDA_SMEM_STATE=1 / 0 forces it for
    every such batch or none; the split and fused variants and older GPUs keep theirs; other values are refused."""
    monkeypatch.delenv("KDA_RT_KDA_SMEM_STATE", raising=False)
    device(H200)
    assert [kd.decode_config(num_seqs=b) for b in (5, 31, 32, 256)] == [(1, 256, 2)] * 2 + [(1, 256, 3)] * 2
    monkeypatch.setenv("KDA_RT_KDA_SMEM_STATE", "1")
    assert kd.decode_config(num_seqs=5) == (1, 256, kd.SMEM_STATE_MIN_BLOCKS) == (1, 256, 3)
    assert kd.decode_config(num_seqs=1) == (4, 128, 7)
    assert kd.decode_config(fused=True, num_seqs=32)[2] == 4
    monkeypatch.setenv("KDA_RT_KDA_SMEM_STATE", "0")
    assert kd.decode_config(num_seqs=256) == (1, 256, 2)
    monkeypatch.delenv("KDA_RT_KDA_SMEM_STATE")
    device((80, 108, 166912))
    assert kd.decode_config(num_seqs=256) == (1, 256, 2)
    device((120, 170, 101376))  # sm_120: 99 KB a block holds one such CTA an SM: the register form, even when forced
    monkeypatch.setenv("KDA_RT_KDA_SMEM_STATE", "1")
    assert kd.decode_config(num_seqs=256) == (1, 256, 2) and kd.smem_state(1, False, 256) == 0
    monkeypatch.delenv("KDA_RT_KDA_SMEM_STATE")
    monkeypatch.setenv("KDA_RT_KDA_SMEM_STATE", "2")  # (the bulk stores' bench form: the same launch bounds)
    device(H200)
    assert kd.smem_state(1, False, 5) == 2 and kd.decode_config(num_seqs=5) == (1, 256, 3)
    monkeypatch.setenv("KDA_RT_KDA_SMEM_STATE", "3")  # the persistent form: one CTA an SM
    assert kd.smem_state(1, False, 64) == 3 and kd.decode_config(num_seqs=64) == (1, 256, 1)
    assert kd.decode_config(num_seqs=1) == (4, 128, 7)  # (the split kernel keeps its own)
    monkeypatch.setenv("KDA_RT_KDA_SMEM_STATE", "yes")
    with pytest.raises(ValueError, match="KDA_RT_KDA_SMEM_STATE must be 0, 1, 2 or 3"):
        kd.decode_config(num_seqs=32)


def test_kda_decode_without_clusters_runs_one_cta_per_head(device):
    device((80, 108, 166912))
    assert kd.decode_config(num_seqs=1) == (1, 256, 2)
    with pytest.raises(ValueError, match="split"):
        kd.decode_config(split=1, fused=True)


def test_wgmma_runs_on_sm90a_128_row_tiles_unless_switched_off(monkeypatch):
    monkeypatch.setattr(wg, "device_arch", lambda: "sm_90a")
    assert wg.available(128, 2304, 1024)
    assert not wg.available(64, 2304, 1024)       # 64- and 16-row tiles stay on mma.sync
    assert not wg.available(128, 2304, 1000)      # no BN divides the expert width
    monkeypatch.setenv("KDA_RT_WGMMA", "0")
    assert not wg.available(128, 2304, 1024)
    monkeypatch.delenv("KDA_RT_WGMMA")
    monkeypatch.setattr(wg, "device_arch", lambda: "sm_100a")
    assert not wg.available(128, 2304, 1024)      # Blackwell has no wgmma


def test_mla_prefill_wgmma_only_where_its_tile_fits(monkeypatch):
    """The wgmma MLA prefill attention: sm_90a, Dn / Dr multiples of 64, Dv = 128, its shared memory (Q and
    at least three K / Vᵀ stages) within 227 KB; else the mma.sync kernel.  Four stages where they fit."""
    import kda_rt.cuda.ops.mla_prefill as mp

    monkeypatch.setattr(mp, "device_arch", lambda: "sm_90a")
    assert mp.use_wgmma(128, 64, 128) and mp._wg_smem(128, 64, 3) == 169 * 1024
    assert mp._wg_stages(128, 64) == 4 and mp._wg_smem(128, 64, 4) == 209 * 1024
    assert mp.use_wgmma(64, 64, 128) and mp._wg_stages(64, 64) == 4
    assert mp.use_wgmma(128, 128, 128) and mp._wg_stages(128, 128) == 3  # 4 stages: 257 KB, 3: 209 KB
    assert not mp.use_wgmma(256, 64, 128)        # 249 KB of shared memory at 3 stages: too much
    assert not mp.use_wgmma(96, 64, 128) and not mp.use_wgmma(128, 64, 64)
    monkeypatch.setenv("KDA_RT_WGMMA", "0")
    assert not mp.use_wgmma(128, 64, 128)
    monkeypatch.delenv("KDA_RT_WGMMA")
    monkeypatch.setattr(mp, "device_arch", lambda: "sm_100a")
    assert not mp.use_wgmma(128, 64, 128)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_runner_precompiles_every_moe_tile_a_step_can_pick(monkeypatch, arch):
    """The 48B MoE shape (E = 256, top-8, shared expert in the stacks, D = 2304, I = 1024): the bucket and
    both GEMMs for 16-, 64- and 128-row tiles (32-row ones for bf16 steps of 4-5.5 rows an expert only with
    KDA_RT_MOE_FUSED32=auto: moe_gemm_tc.py FUSED32_BF16_MAX_AVG), the 128-row GEMMs on wgmma where it runs, the fused
    decode kernel (both GEMMs in one launch) for the two 16-row tiles and the 64-row one, the one-token GEMV gate/up and down, and the one-launch
    routing for each of its rows-per-block choices; exactly the variants moe_forward asks for (the same kernel
    helpers), so a mixed step never waits for NVRTC."""
    for name in ("KDA_RT_ROUTE_NORM_MAX_T", "KDA_RT_ROUTE_NORM", "KDA_RT_GEMV_ROUTED", "KDA_RT_MOE_GEMV",
                 "KDA_RT_FUSED_ROUTE", "KDA_RT_GEMV_SHARED_FIRST", "KDA_RT_GEMV_SIGNAL_OVERLAP", "KDA_RT_DOWN_GEMV",
                 "KDA_RT_MOE_FUSED32", "KDA_RT_MOE_FUSED64"):
        monkeypatch.delenv(name, raising=False)  # the policies' defaults, not a bench switch of the caller's shell
    import kda_rt.cuda.moe as moe
    import kda_rt.cuda.ops.moe_align as align
    import kda_rt.cuda.ops.moe_gemm_tc as tc
    import kda_rt.cuda.ops.moe_gemv as gemv
    import kda_rt.cuda.ops.moe_route as route

    built = []
    for mod in (align, tc, wg, route, gemv):
        monkeypatch.setattr(mod, "get_kernel", lambda f, n, _built=built, **kw: _built.append((f, kw)))
    monkeypatch.setattr(wg, "device_arch", lambda: arch)
    monkeypatch.setattr(tc, "device_arch", lambda: arch)
    monkeypatch.delenv("KDA_RT_MOE_DECODE_WS", raising=False)
    cfg = types.SimpleNamespace(num_experts=256, top_k=8, num_expert_group=1)
    assert moe.precompile(cfg, 2304, 1024, fused=True) == 21 + len({route.fused_route_rows(t)
                                                                     for t in range(1, moe.ROUTE_NORM_MAX_T + 1)})
    # the GEMV, and its variant that selects the token's experts itself (KDA_RT_GEMV_ROUTED)
    assert [(kw["KW"], kw.get("INTER"), kw.get("ROUTED", 0), kw.get("NE"), kw.get("SHARED"), kw.get("SHARED_FIRST"),
             kw.get("SIGNAL_OVERLAP")) for f, kw in built if f == "moe_gemv.cu" and not kw.get("DOWN")] == [
        (2304, 1024, 0, None, None, None, None), (2304, 1024, 1, 256, 1, 1, 1)]
    # the one-token down GEMV (KDA_RT_DOWN_GEMV, default 1), and not with the switch off
    assert [(kw["KW"], kw["NOUT"], kw["DOWN"]) for f, kw in built if f == "moe_gemv.cu" and kw.get("DOWN")] == [
        (1024, 2304, 1)]
    built.clear()
    monkeypatch.setenv("KDA_RT_DOWN_GEMV", "0")
    assert moe.precompile(cfg, 2304, 1024, fused=True) == 20 + len({route.fused_route_rows(t)
                                                                    for t in range(1, moe.ROUTE_NORM_MAX_T + 1)})
    assert not [kw for f, kw in built if f == "moe_gemv.cu" and kw.get("DOWN")]
    monkeypatch.delenv("KDA_RT_DOWN_GEMV")
    routes = sorted((kw["FR_TPB"], kw["BT"], kw["SHARED"], kw["E"], kw["D"], kw["ROUTE_NORM"]) for f, kw in built
                    if f == "moe_route.cu")
    norm_rows = {route.fused_route_rows(t) for t in range(1, moe.ROUTE_NORM_MAX_T + 1)}
    assert routes == sorted([(tpb, 16, 1, 256, 2304, 0) for tpb in (1, 2, 4, 8)]
                            + [(tpb, 16, 1, 256, 2304, 1) for tpb in norm_rows])
    assert {route.fused_route_rows(t) for t in range(1, route.FUSED_MAX_T + 1)} == {1, 2, 4, 8}
    assert route.fused_route_fits(route.FUSED_MAX_T, 256, 2304, 8, 1, True)
    assert not route.fused_route_fits(route.FUSED_MAX_T + 1, 256, 2304, 8, 1, True)
    assert not route.fused_route_fits(1, 256, 2304, 8, 8, True)  # grouped routing: three launches
    buckets = sorted(kw["BT"] for f, kw in built if f == "moe_align.cu")
    assert buckets == [16, 64, 128] and all(kw["E"] == 257 and kw["SHARED_A"] == 8
                                            for f, kw in built if f == "moe_align.cu")
    fused = sorted((kw["BN"], kw["STAGES"], kw["HIDDEN"], kw["INTER"], kw["TOPK"], kw.get("DEC_WS")) for f, kw in built
                   if kw.get("FUSED_DECODE"))
    # both 16-row tiles and the 64-row one (moe_gemm_tc.py FUSED64_BF16) take 128-byte k steps: the producer-warp
    # form (DEC_WS, sm_90+) for each
    assert fused == [(64, 6, 2304, 1024, 9, 1)] + [(128, 4, 2304, 1024, 9, 1)] * 2
    assert sorted(kw["BM"] for f, kw in built if kw.get("FUSED_DECODE")) == [16, 16, 64]
    gemms = sorted((f, kw.get("BM", 128), kw.get("BN"), kw["FUSE_SILU"] == 1, kw["TOPK"]) for f, kw in built
                   if "gemm" in f and not kw.get("FUSED_DECODE"))
    big = "moe_gemm_wg.cu" if arch == "sm_90a" else "moe_gemm_tc.cu"
    want = [("moe_gemm_tc.cu", bm, bn, fuse, 9) for bm, bn in ((16, 64), (16, 128), (64, 128))
            for fuse in (False, True)]
    want += [(big, 128, 256 if big == "moe_gemm_wg.cu" else 128, fuse, 9) for fuse in (False, True)]
    assert gemms == sorted(want)
    # KDA_RT_MOE_FUSED32=auto (the bf16 32-row band): its bucket, fused decode kernel and two GEMMs as well
    built.clear()
    monkeypatch.setenv("KDA_RT_MOE_FUSED32", "auto")
    assert moe.precompile(cfg, 2304, 1024, fused=True) == 25 + len({route.fused_route_rows(t)
                                                                     for t in range(1, moe.ROUTE_NORM_MAX_T + 1)})
    assert sorted(kw["BM"] for f, kw in built if kw.get("FUSED_DECODE")) == [16, 16, 32, 64]


@pytest.mark.parametrize("fp8_prefill", ["1", "0"])
def test_runner_precompiles_the_e4m3_prefill_variants(monkeypatch, fp8_prefill):
    """e4m3 stacks of the 48B MoE shape on sm_90a: the 128-row wgmma GEMMs with widened weights (WFMT = 1) and, with
    KDA_RT_FP8_PREFILL (default 1), with e4m3 sources too (WFMT = 2) and the activation quantizer for each source
    width (x: 2304, h: 1024), the variants moe_forward asks for in a large prefill step."""
    import kda_rt.cuda.moe as moe
    import kda_rt.cuda.ops.moe_align as align
    import kda_rt.cuda.ops.moe_gemm_tc as tc
    import kda_rt.cuda.ops.moe_gemv as gemv
    import kda_rt.cuda.ops.moe_route as route
    import kda_rt.cuda.ops.quant as quant
    import kda_rt.cuda.ops.rmsnorm as rms

    monkeypatch.setenv("KDA_RT_FP8_PREFILL", fp8_prefill)
    monkeypatch.delenv("KDA_RT_NORM_E4M3", raising=False)
    monkeypatch.delenv("KDA_RT_MOE_FUSED32", raising=False)
    monkeypatch.delenv("KDA_RT_MOE_FUSED64", raising=False)
    built = []
    for mod in (align, tc, wg, route, gemv, quant, rms):
        monkeypatch.setattr(mod, "get_kernel", lambda f, n, _built=built, **kw: _built.append((f, n, kw)))
    monkeypatch.setattr(wg, "device_arch", lambda: "sm_90a")
    monkeypatch.setattr(tc, "device_arch", lambda: "sm_90a")
    monkeypatch.delenv("KDA_RT_MOE_DECODE_WS", raising=False)
    cfg = types.SimpleNamespace(num_experts=256, top_k=8, num_expert_group=1)
    moe.precompile(cfg, 2304, 1024, fused=True, e4m3=True)
    # the e4m3 fused decode kernels (128-code k steps: 128 bytes) in their producer-warp form, on 16- and (from 18
    # rows an expert, moe_gemm_tc.py FUSED64_E4M3) 64-row tiles
    fused = sorted((kw["BM"], kw["BK"], kw["WFMT"], kw.get("DEC_WS")) for f, n, kw in built if kw.get("FUSED_DECODE"))
    assert fused == [(16, 128, 1, 1), (64, 128, 1, 1)]
    wgs = sorted((kw["K"], kw["FUSE_SILU"], kw["WFMT"]) for f, n, kw in built if f == "moe_gemm_wg.cu")
    want = [(2304, 1, 1), (1024, 0, 1)] + ([(2304, 1, 2), (1024, 0, 2)] if fp8_prefill == "1" else [])
    assert wgs == sorted(want)
    quantizers = sorted(kw.get("ROW_K") for f, n, kw in built if f == "quant.cu")
    assert quantizers == ([1024, 2304] if fp8_prefill == "1" else [])
    # the norm before the block that writes x's codes too (KDA_RT_NORM_E4M3, default 1)
    norms = [(n, kw["D"], kw["HAS_RESIDUAL"], kw.get("E4M3_OUT")) for f, n, kw in built if f == "rmsnorm.cu"]
    assert norms == ([("rmsnorm_fwd_e4m3", 2304, True, 1)] if fp8_prefill == "1" else [])


def test_dense_e4m3_copies_only_for_shapes_the_consumers_take(monkeypatch):
    """ops/dense_w8a8.fits: K a multiple of 128 codes; padded widths only where the caller takes row-strided output
    (pad=True: MLA's q|kv_a, o_proj, down), never for KDA q|k|v with an odd head count (3P = 384 H is not a
    multiple of 256) or a gate|up whose halves need padding (the MLP's h is quantized as contiguous rows); a forced
    tile that does not fit gives no copy instead of an error."""
    from kda_rt.cuda.ops.dense_w8a8 import fits

    assert fits(12288, 2304) and fits(12288, 2304, pad=False)  # 48B q|k|v (32 heads)
    assert fits(6720, 2304) and not fits(6720, 2304, pad=False)  # MLA q|kv_a: padded to 6912
    assert fits(1152, 256) and not fits(1152, 256, pad=False)  # q|k|v of 3 heads
    assert fits(18432, 2304, True, pad=False) and not fits(2 * 384, 256, True, pad=False)  # gate|up, F = 9216 / 384
    assert not fits(2304, 192) and not fits(401, 256, True)  # K % 128; an odd gate|up
    monkeypatch.setenv("KDA_RT_W8A8_TILE", "256x4")
    assert not fits(768, 128)  # one k step: 256x4 needs two
    monkeypatch.delenv("KDA_RT_W8A8_TILE")
    assert fits(768, 128)  # the launcher picks 128x3


def test_runner_precompiles_the_dense_e4m3_variants(monkeypatch):
    """The 48B shape's dense e4m3 copies: one GEMM variant per (padded width, K, SiLU), one activation quantizer per
    source width, and both e4m3 norms (first layer without the residual add, the others with it)."""
    import numpy as np

    import kda_rt.cuda.ops.dense_w8a8 as dense
    import kda_rt.cuda.ops.quant as quant
    import kda_rt.cuda.ops.rmsnorm as rms

    built = []
    for mod in (wg, quant, rms):
        monkeypatch.setattr(mod, "get_kernel", lambda f, n, _built=built, **kw: _built.append((f, n, kw)))

    def copy(nout, K, fuse=False):
        return dense.E4m3Dense(np.zeros((1, nout, K), np.uint8), np.zeros((1, nout), np.float32), nout, fuse)

    copies = [copy(12288, 2304), copy(2304, 4096), copy(6912, 2304), copy(2304, 4096), copy(18432, 2304, True),
              copy(2304, 9216)]
    assert dense.precompile(copies, 2304) == 5 + 3 + 2
    gemms = sorted((kw["NOUT"], kw["K"], kw["FUSE_SILU"], kw["TOPK"], kw["WFMT"]) for f, n, kw in built
                   if f == "moe_gemm_wg.cu")
    assert gemms == sorted([(12288, 2304, 0, 1, 2), (2304, 4096, 0, 1, 2), (6912, 2304, 0, 1, 2),
                            (18432, 2304, 1, 1, 2), (2304, 9216, 0, 1, 2)])
    quant_kernels = [(n, kw.get("ROW_K")) for f, n, kw in built if f == "quant.cu"]  # 9216 > 8192: a block a row
    assert sorted(quant_kernels, key=str) == sorted([("quantize_rows_e4m3_warp", 2304), ("quantize_rows_e4m3_warp", 4096),
                                                     ("quantize_rows_e4m3", None)], key=str)
    norms = sorted((kw["HAS_RESIDUAL"], kw.get("E4M3_OUT")) for f, n, kw in built if f == "rmsnorm.cu")
    assert norms == [(False, 1), (True, 1)]


def test_runner_precompiles_every_kda_state_width(monkeypatch):
    """kda_prefill's state width follows the number of sequences (32 for one, 64 from two at 32 heads); each width is
    its own module (~1.5 s of NVRTC), so the runner builds all of them at start, with the exact defines
    the launcher uses."""
    import kda_rt.cuda.ops.kda_prefill as kp

    built = []
    monkeypatch.setattr(kp, "get_kernel", lambda f, n, **kw: built.append((n, kw["VB"], kw["STATE_PF"],
                                                                            kw.get("max_dynamic_smem"))))
    assert kp.precompile(32, 128, 4, sms=132) == 3
    assert sorted({(vb, pf) for _, vb, pf, _ in built}) == [(32, 2), (64, 0), (64, 2)]
    assert {n for n, _, _, _ in built} == {"kda_prefill_intra", "kda_prefill_state", "kda_prefill_norm"}
    assert {smem for n, vb, pf, smem in built if n == "kda_prefill_state"} == {
        kp._state_smem_bytes(128, 64, 32, 2), kp._state_smem_bytes(128, 64, 64, 0), kp._state_smem_bytes(128, 64, 64, 2)}
    assert [kp._state_columns(b, 32, 128) for b in (1, 2, 3, 8, 16, 17, 256)] == [32, 64, 64, 64, 64, 64, 64]


def test_kda_intra_variant_switches_reach_the_defines(monkeypatch):
    """Each KDA_RT_KDA_* intra-kernel switch set to 0 puts its define (= 0) into kda_prefill.cu's module, and none is
    there when on or unset (the kernel's default 1: the default module's cache key has no variant in it); T_ROWS (2 by default) passes 1 or 4 and refuses anything else; a
    switch that is not 0 or 1 is refused, named."""
    import kda_rt.cuda.ops.kda_prefill as kp

    switches = {"KDA_RT_KDA_CONV_ONE_ROUND": "CONV_ONE_ROUND", "KDA_RT_KDA_GATE_FAST": "GATE_FAST",
                "KDA_RT_KDA_SCALE_UNROLL": "SCALE_UNROLL", "KDA_RT_KDA_ROW_NORM_SPREAD": "ROW_NORM_SPREAD",
                "KDA_RT_KDA_EXP2_FTZ": "EXP2_FTZ", "KDA_RT_KDA_CONV_PAIRS": "CONV_PAIRS", "KDA_RT_KDA_T_HALVES": "T_HALVES",
                "KDA_RT_KDA_BETA_EARLY": "BETA_EARLY", "KDA_RT_KDA_COPY_ROWS": "COPY_ROWS",
                "KDA_RT_KDA_EARLY_LOOKUP": "EARLY_LOOKUP", "KDA_RT_KDA_G_BALANCE": "G_BALANCE",
                "KDA_RT_KDA_SILU_FAST": "SILU_FAST", "KDA_RT_KDA_G_STAGED": "G_STAGED",
                "KDA_RT_KDA_ROW_SCATTER": "ROW_SCATTER", "KDA_RT_KDA_GATE_POLY": "GATE_POLY",
                "KDA_RT_KDA_LOOKUP_BOUNDS": "LOOKUP_BOUNDS", "KDA_RT_KDA_PAD_FIXUP": "PAD_FIXUP",
                "KDA_RT_KDA_E_SCAN": "E_SCAN"}
    for name in (*switches, "KDA_RT_KDA_T_ROWS"):  # whatever the shell has set
        monkeypatch.delenv(name, raising=False)
    assert not (set(switches.values()) | {"T_ROWS"}) & set(kp._consts(128, 4, 32, 0))
    for name in switches:
        monkeypatch.setenv(name, "1")
    assert not set(switches.values()) & set(kp._consts(128, 4, 32, 0))
    for name, define in switches.items():
        monkeypatch.setenv(name, "0")
        consts = kp._consts(128, 4, 32, 0)
        assert consts[define] == 0 and not (set(switches.values()) - {define}) & set(consts), name
        monkeypatch.setenv(name, "1")
    for name in switches:
        monkeypatch.setenv(name, "0")
    assert all(kp._consts(128, 4, 32, 0)[d] == 0 for d in switches.values())
    for name in switches:
        monkeypatch.delenv(name)
    for rows in ("1", "2", "4"):
        monkeypatch.setenv("KDA_RT_KDA_T_ROWS", rows)
        assert kp._consts(128, 4, 32, 0).get("T_ROWS") == (None if rows == "2" else int(rows)), rows
    for bad in ("0", "3", "8", "two"):
        monkeypatch.setenv("KDA_RT_KDA_T_ROWS", bad)
        with pytest.raises(ValueError, match="KDA_RT_KDA_T_ROWS must be"):
            kp._consts(128, 4, 32, 0)
    monkeypatch.delenv("KDA_RT_KDA_T_ROWS")
    for name in switches:
        monkeypatch.setenv(name, "2")
        with pytest.raises(ValueError, match=f"{name} must be 0 or 1"):
            kp._consts(128, 4, 32, 0)
        monkeypatch.delenv(name)


@pytest.mark.parametrize("kw", [{"state_columns": 48}, {"state_columns": 0}, {"state_columns": True},
                                {"state_prefetch": 3}, {"state_prefetch": True}, {"state_prefetch": 1.5}])
def test_kda_prefill_refuses_bad_variant(kw):
    """kda_prefill's bench and test overrides name the bad value before anything is built or launched."""
    import kda_rt.cuda.ops.kda_prefill as kp

    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"kda_prefill: {name} must be"):
        kp.kda_prefill(*[None] * 13, num_heads=32, head_dim=128, eps=1e-5, **kw)


def test_kda_state_prefetch_rule():
    """kda_prefill_state streams every tile a chunk ahead (STATE_PF 2) only when its grid is one wave at one CTA an SM
    (one or two long prompts: 128 CTAs at 32 heads), where no second CTA hides a chunk's copies, A_qk and kd only (1)
    at 32 state columns otherwise (two CTAs an SM still fit; smaller GPUs or explicit widths), nothing ahead (0) at
    64 columns; the shared-memory plan
    of each depth as kda_prefill.cu's ST_* defines add up (bf16 tiles, row strides K + 8, L + 8, vb + 8)."""
    import kda_rt.cuda.ops.kda_prefill as kp

    assert [kp._state_prefetch(b, 32, 128, kp._state_columns(b, 32, 128), 132) for b in (1, 2, 3, 64)] == [2, 2, 0, 0]
    assert kp._state_prefetch(2, 32, 128, 32, 132) == 1  # 256 CTAs at an explicit 32 columns
    assert kp._state_prefetch(1, 40, 128, 32, 132) == 1  # 160 CTAs: two waves at one an SM
    assert kp._state_prefetch(1, 40, 128, 32, 160) == 2
    tile_k, tile_a, tile_v = 64 * 136 * 2, 64 * 72 * 2, 64 * 40 * 2  # [L][K+8], [L][L+8], [L][vb+8] bf16 at vb 32
    base = 3 * tile_k + tile_a + 2 * tile_v + 128 * 40 * 2  # W, qg, kd, A_qk, U, V_new, S
    assert [kp._state_smem_bytes(128, 64, 32, pf) for pf in (0, 1, 2)] == [
        base, base + tile_k + tile_a, base + 3 * tile_k + tile_a + tile_v]
    assert kp._state_smem_bytes(128, 64, 32, 1) <= 113 * 1024  # two CTAs an SM still fit at depth 1


def test_moe_route_select_policy():
    """Ungrouped routing selects with one warp per token at every T (H200: 3.80 vs 4.59 us at 1 token, 13.5
    vs 148 at 8192), grouped routing by rank counting."""
    from kda_rt.cuda.ops.moe_route import default_select

    assert [default_select(t, 1) for t in (1, 32, 255, 256, 8192)] == ["warp"] * 5
    assert [default_select(t, 8) for t in (1, 8192)] == ["rank"] * 2


def test_moe_route_logits_tokens_per_block():
    """The logits kernel stages the fewest rows (1, 2, 4, 8) that cover a decode batch, 8 from 8 tokens on,
    and fewer where 8 rows of a wide hidden size would not fit its 48 KB of staged x."""
    from kda_rt.cuda.ops.moe_route import logits_tokens_per_block

    assert [logits_tokens_per_block(t, 2304) for t in (1, 2, 3, 4, 5, 8, 9, 8192)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert logits_tokens_per_block(100, 7168) == 2 and logits_tokens_per_block(1, 2 * 24 * 1024) is None


def test_moe_decode_tile_by_batch():
    """16-row decode tiles: 64 features (3 CTAs per SM) for batches of up to 8 tokens, so a batch-1 step's
    144 + 162 CTAs of the 48B shape fit one pass over the 132 SMs; 128 features from 9 tokens on."""
    from kda_rt.cuda.ops.moe_gemm_tc import tile_config

    for nout, k, fuse in ((2048, 2304, True), (2304, 1024, False)):
        assert [tile_config(16, nout, k, fuse, tokens=t).bn for t in (1, 8, 9, 256)] == [64, 64, 128, 128]
        assert tile_config(16, nout, k, fuse).bn == 128 and tile_config(64, nout, k, fuse, tokens=1).bm == 64



def _fake(shape, *, dtype=None, ptr=256, row_stride=None, contiguous=True):
    """Enough of a device array for the launch policies: shape, dtype, strides, flags, data.ptr."""
    import numpy as np

    from kda_rt.cuda.ops.check import BF16

    dtype = np.dtype(dtype or BF16)
    stride = (row_stride or shape[-1]) * dtype.itemsize
    return types.SimpleNamespace(shape=shape, dtype=dtype, itemsize=dtype.itemsize, strides=(stride, dtype.itemsize),
                                 flags=types.SimpleNamespace(c_contiguous=contiguous),
                                 data=types.SimpleNamespace(ptr=ptr))


@pytest.mark.parametrize("clusters", [False, True])
def test_skinny_gemm_takes_narrow_projections_of_up_to_8_rows(monkeypatch, clusters):
    """The decode projections the skinny kernel measured faster than cuBLAS on the H200 (o_proj, f_a|g_a|b,
    the dense down: M <= 8, N <= 4096), and nothing it cannot run; 9 to 32 rows only with thread-block
    clusters (skinny_gemm_cl), K <= 4096."""
    import numpy as np

    import kda_rt.cuda.ops.skinny_gemm as sk
    from kda_rt.cuda.ops.skinny_gemm import fits

    monkeypatch.setattr(sk, "clusters_supported", lambda: clusters)

    def ok(M, K, N, **kw):
        x = _fake((M, K), ptr=kw.get("x_ptr", 256), row_stride=kw.get("ldx"))
        w = _fake((N, K), contiguous=kw.get("contiguous", True))
        return fits(x, w, _fake((M, N), dtype=kw.get("out_dtype")), kw.get("accumulate", False))

    assert ok(1, 4096, 2304) and ok(8, 2304, 288) and ok(8, 9216, 2304) and ok(3, 2304, 4096, out_dtype=np.float32)
    assert ok(2, 2304, 576, ldx=2368)                                  # a column slice of a wider buffer
    assert ok(9, 4096, 2304) == clusters and ok(32, 2304, 288) == clusters  # 9 to 32 rows: clusters
    assert not ok(16, 9216, 2304) and not ok(33, 4096, 2304)           # K > 4096, more rows: cuBLAS
    monkeypatch.setenv("KDA_RT_SKINNY_WIDE", "0")
    assert not ok(16, 4096, 2304)
    monkeypatch.delenv("KDA_RT_SKINNY_WIDE")
    assert not ok(1, 2304, 12288) and not ok(1, 2304, 163840)          # wide outputs (q|k|v, lm_head): cuBLAS
    assert not ok(4, 128, 4096) and not ok(4, 2304, 8)                 # K % 256, N % 16
    assert not ok(4, 2304, 288, accumulate=True) and not ok(4, 2304, 288, contiguous=False)
    assert not ok(4, 2304, 288, x_ptr=258) and not ok(4, 2304, 288, ldx=2310)   # 16-byte rows
    assert not ok(4, 2304, 288, out_dtype=np.float16)


def test_runner_precompiles_the_wide_skinny_variants_of_the_model(monkeypatch):
    """The 48B shape's dense decode projections (KDA, MLA, a dense MLP, a MoE layer with the router split):
    the runner builds the 8-row kernel by output dtype and, with clusters, skinny_gemm_cl for each shape that
    wide_plan takes at 16 and at 32 rows: o_proj (KDA and MLA: one shape), f_a|g_a|b and the router split
    (fp32 out); not q|k|v, q|kv_a or the dense MLP (wide outputs, K > 4096)."""
    import kda_rt.cuda.ops.skinny_gemm as sk
    from kda_rt.cuda.runner import _decode_projection_shapes
    from kda_rt.cuda.weights import DeviceKDA, DeviceLayer, DeviceMLA, DeviceMLP, DeviceMoE

    kda = DeviceKDA(qkv=_fake((12288, 2304)), fgb=_fake((288, 2304)), f_b=None, g_b=None, conv_w=None, A_log=None,
                    dt_bias=None, o_norm=None, o_proj=_fake((2304, 4096)), rank_f=128, rank_g=128)
    mla = DeviceMLA(q_kva=_fake((6720, 2304)), kv_norm=None, kv_b=None, o_proj=_fake((2304, 4096)))
    dense = DeviceMLP(gate_up=_fake((18432, 2304)), down=_fake((2304, 9216)))
    moe = DeviceMoE(router=None, bias=None, w13=None, w2=None, shared=None, shared_in_stack=True,
                    router_split=_fake((768, 2304)))
    weights = types.SimpleNamespace(layers=[DeviceLayer(None, kda, None, dense), DeviceLayer(None, mla, None, moe),
                                            DeviceLayer(None, kda, None, moe)])
    built = []
    monkeypatch.setattr(sk, "get_kernel", lambda f, n, _built=built, **kw: _built.append((n, kw)))
    monkeypatch.setattr(sk, "_sms", lambda: 132)
    monkeypatch.setenv("KDA_RT_ARCH", "sm_90a")
    plans = sorted([(0, 64, 4, 1024, 2), (0, 64, 4, 1024, 4), (0, 32, 6, 384, 2), (0, 32, 6, 384, 4),
                    (1, 64, 6, 384, 2), (1, 64, 6, 384, 4)])
    for ws, form in (("0", "skinny_gemm_cl"), ("1", "skinny_gemm_ws")):  # (every plan's k slice: whole 128-wide steps)
        monkeypatch.setenv("KDA_RT_SKINNY_WS", ws)
        for clusters, want in ((False, 2), (True, 11)):
            built.clear()
            monkeypatch.setattr(sk, "clusters_supported", lambda c=clusters: c)
            assert sk.precompile(_decode_projection_shapes(weights)) == want
        wide = sorted((kw["OUT_F32"], kw["FPC"], kw["SPLITS"], kw["KS"], kw["NT"]) for n, kw in built if n == form)
        assert wide == plans, form
        assert not [n for n, _ in built if n in ("skinny_gemm_cl", "skinny_gemm_ws") and n != form]
    staged = sorted((kw["OUT_F32"], kw["SROWS"], kw["SK"]) for n, kw in built if n == "skinny_gemm_staged")
    assert staged == [(0, 3, 2304), (0, 18, 4096), (1, 6, 2304)]  # f_a|g_a|b, o_proj, the router split


def test_skinny_ws_form_rules(monkeypatch):
    """skinny_gemm_ws takes skinny_gemm_cl's plan where the k slice is whole 128-wide ring steps, with 2 or 4 n-tiles,
    on sm_90+ (tensor maps), unless KDA_RT_SKINNY_WS=0; the model's plans all qualify (o_proj, f_a|g_a|b, the router
    split at 16 and 32 rows), and its shared memory stays under half an H200 SM's (two CTAs an SM)."""
    import kda_rt.cuda.ops.skinny_gemm as sk

    monkeypatch.setenv("KDA_RT_ARCH", "sm_90a")
    for M, N, K in ((16, 2304, 4096), (32, 2304, 4096), (32, 288, 2304), (16, 768, 2304), (32, 768, 2304)):
        plan = sk.wide_plan(M, N, K)
        assert sk.ws_applies(plan, K), (M, N, K, plan)
        assert sk._ws_smem(*plan) <= 113 * 1024
    assert sk.wide_plan(31, 64, 512) == (64, 8, 4) and not sk.ws_applies((64, 8, 4), 512)  # 64-wide k slices
    assert not sk.ws_applies((64, 4, 1), 4096)  # one n-tile
    assert not sk.ws_applies((64, 3, 4), 4096)  # a k slice that is not whole 128-wide steps
    monkeypatch.setenv("KDA_RT_ARCH", "sm_100a")
    assert sk.ws_applies((64, 4, 4), 4096)
    for arch in ("sm_89", "sm_120"):  # no tensor maps; 99 KB of shared memory a CTA
        monkeypatch.setenv("KDA_RT_ARCH", arch)
        assert not sk.ws_applies((64, 4, 4), 4096), arch
    monkeypatch.setenv("KDA_RT_ARCH", "sm_90a")
    monkeypatch.setenv("KDA_RT_SKINNY_WS_MIN_K", "4097")
    assert not sk.ws_applies((64, 4, 4), 4096)
    monkeypatch.delenv("KDA_RT_SKINNY_WS_MIN_K")
    monkeypatch.setenv("KDA_RT_SKINNY_WS", "0")
    assert not sk.ws_applies((64, 4, 4), 4096)


def test_staged_skinny_plan_keeps_a_ctas_weight_rows_in_shared_memory():
    """skinny_gemm_staged: one CTA per SM (fewer for narrow outputs), and only where that CTA's weight rows fit
    the shared-memory budget beside the kernel before it: o_proj (18 rows of 4096), not the dense down (K = 9216)."""
    from kda_rt.cuda.ops.skinny_gemm import _STAGED_SMEM_MAX, _staged_smem, staged_plan

    assert staged_plan(2304, 4096, 132) == (132, 18)
    assert staged_plan(2304, 4096, 148) == (148, 16)  # B200
    assert staged_plan(16, 256, 132) == (16, 1)
    assert staged_plan(2304, 9216, 132) is None and staged_plan(4096, 4096, 132) is None
    assert staged_plan(2304, 4096, 64) is None  # 36 rows a CTA: too many
    assert staged_plan(288, 100, 132) is None  # K not whole 32-wide chunks per warp
    assert _staged_smem(18, 4096) <= _STAGED_SMEM_MAX < _staged_smem(32, 4096)


def test_decode_projection_shapes_take_the_fused_kda_projection():
    """With q|k|v|f_a|g_a|b in one weight (qkv_fgb, as upload_weights builds it), a KDA layer's decode step
    sends one [3P + 2R + H, D] GEMM through linear instead of q|k|v and f_a|g_a|b apart."""
    from kda_rt.cuda.runner import _decode_projection_shapes
    from kda_rt.cuda.weights import DeviceKDA, DeviceLayer

    kda = DeviceKDA(qkv=_fake((12288, 2304)), fgb=_fake((288, 2304)), f_b=None, g_b=None, conv_w=None, A_log=None,
                    dt_bias=None, o_norm=None, o_proj=_fake((2304, 4096)), rank_f=128, rank_g=128,
                    qkv_fgb=_fake((12576, 2304)))
    weights = types.SimpleNamespace(layers=[DeviceLayer(None, kda, None, None)])
    assert _decode_projection_shapes(weights) == [(12576, 2304, False), (2304, 4096, False)]


def test_fused_moe_norm_needs_one_block_per_row():
    from kda_rt.cuda.ops.moe_align import fits_norm

    assert fits_norm(2304) and fits_norm(4096) and fits_norm(132)
    assert not fits_norm(4100) and not fits_norm(2306)


def test_norm_before_the_moe_rides_in_the_fused_routing_only(monkeypatch):
    """The add and RMSNorm before a MoE block go into moe_route_fused for steps of up to ROUTE_NORM_MAX_T tokens
    (measured), where that kernel routes the step (ungrouped routing) and the combine can carry the norm after
    the block; the model (cuda/model.py) asks only for steps whose combine carries it (T <= FUSED_NORM_MAX_T)."""
    from kda_rt.cuda.moe import ROUTE_NORM_MAX_T, takes_norm_before
    from kda_rt.cuda.ops.moe_align import FUSED_NORM_MAX_T
    from kda_rt.cuda.ops.moe_route import FUSED_MAX_T

    cfg = types.SimpleNamespace(num_experts=256, top_k=8, num_expert_group=1)
    assert 1 <= ROUTE_NORM_MAX_T <= min(FUSED_NORM_MAX_T, FUSED_MAX_T)
    assert all(takes_norm_before(t, cfg, 2304, True) for t in range(1, ROUTE_NORM_MAX_T + 1))
    assert not takes_norm_before(ROUTE_NORM_MAX_T + 1, cfg, 2304, True)
    assert not takes_norm_before(1, cfg, 4100, True)  # no one-block norm in the combine
    assert not takes_norm_before(1, types.SimpleNamespace(num_experts=256, top_k=8, num_expert_group=8), 2304, True)
    monkeypatch.setenv("KDA_RT_ROUTE_NORM", "0")
    assert not takes_norm_before(1, cfg, 2304, True)
    monkeypatch.setenv("KDA_RT_ROUTE_NORM", "2")
    with pytest.raises(ValueError, match="KDA_RT_ROUTE_NORM"):
        takes_norm_before(1, cfg, 2304, True)


def test_early_weight_copies_only_in_the_small_decode_down_gemm(monkeypatch):
    from kda_rt.cuda.ops.moe_gemm_tc import copies_weights_early, tile_config

    monkeypatch.delenv("KDA_RT_EARLY_WEIGHTS", raising=False)
    down_b1, down_b32 = (tile_config(16, 2304, 1024, False, tokens=t) for t in (1, 32))
    assert copies_weights_early(down_b1, False)
    assert not copies_weights_early(down_b32, False)  # one CTA per SM: an early block would hold gate/up's SM
    assert not copies_weights_early(tile_config(16, 2048, 2304, True, tokens=1), True)  # gate/up reads the plan first
    assert not copies_weights_early(tile_config(128, 2304, 1024, False), False)
    monkeypatch.setenv("KDA_RT_EARLY_WEIGHTS", "0")
    assert not copies_weights_early(down_b1, False)


def test_mla_combine_groups():
    """mla_attn_combine{4,8,16}: the split groups per block follow the launch's split count S (a power of two in [4, 16],
    raised until a block's 2048 / groups columns divide R): batch 32 at 2K context has S = 4, and 16 groups
    left three quarters of the threads idle."""
    from kda_rt.cuda.ops.mla_attn import _best_splits, combine_groups

    assert [combine_groups(s, 512) for s in (2, 3, 4, 5, 8, 9, 16, 20, 132)] == [4, 4, 4, 8, 8, 16, 16, 16, 16]
    assert combine_groups(4, 256) == 8 and combine_groups(4, 128) == 16
    assert combine_groups(4, 384) == 16 and combine_groups(4, 640) == 16 and combine_groups(8, 768) == 8
    assert _best_splits(32, 2560, 132) == 4 and _best_splits(16, 1088, 132) == 6


def test_mla_launch_splits(monkeypatch):
    """A decode launch uses at most one wave of split blocks (SMs // T splits per token), however wide the
    table: batch 32 with the 1M-token table of the 48B shape has S = 33 but launches 4."""
    import kda_rt.cuda.ops.mla_attn as mla

    monkeypatch.setattr(mla, "sm_count", lambda device_id: 132)
    monkeypatch.setitem(__import__("sys").modules, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0))))
    assert mla._best_splits(32, 16384 * 64, 132) == 33
    assert [mla.launch_splits(T, 33) for T in (1, 8, 16, 32, 64, 132, 200)] == [33, 16, 8, 4, 2, 1, 1]
    assert mla.launch_splits(32, 3) == 3 and mla.launch_splits(0, 5) == 5
    # more tokens than SMs: one split a token, or (KDA_RT_MLA_WAVE_SPLITS=1, bench switch) the count of at most
    # min(S, 8) minimising waves x (2K context's tiles / splits + the split cost): batch 160 4 (5 waves of a quarter
    # context against 2 of whole ones), 192 2, 256 1 (two nearly full waves); any other value refused by name
    monkeypatch.delenv("KDA_RT_MLA_WAVE_SPLITS", raising=False)
    assert [mla.launch_splits(T, 33) for T in (133, 160, 192, 256, 300)] == [1] * 5
    monkeypatch.setenv("KDA_RT_MLA_WAVE_SPLITS", "1")
    assert [mla.launch_splits(T, 33) for T in (64, 132, 133, 160, 192, 200, 256, 300, 384)] == [2, 1, 4, 4, 2, 3, 1, 3, 1]
    assert mla.launch_splits(160, 2) == 2 and mla.launch_splits(160, 1) == 1  # (never more than S: the workspace's)
    monkeypatch.setenv("KDA_RT_MLA_WAVE_SPLITS", "x")
    with pytest.raises(ValueError, match="KDA_RT_MLA_WAVE_SPLITS must be 0 or 1, got 'x'"):
        mla.launch_splits(160, 33)


def test_gemv_dense_precompile_builds_what_linear_takes(monkeypatch):
    """ops/gemv.precompile (the runner calls it with the decode projections' shapes) builds gemv_dense once per
    reduction width (and row count up to KDA_RT_DENSE_GEMV_MAX_T) that `fits` can take: bf16 out, K <= MAX_K, 4-256 MB of weights (not the fp32 lm_head, not
    o_proj's K = 4096, not a small matrix), and nothing with KDA_RT_DENSE_GEMV=0."""
    import kda_rt.cuda.ops.gemv as gemv

    built = []
    monkeypatch.setattr(gemv, "get_kernel", lambda f, n, **kw: built.append((f, n, kw)))
    monkeypatch.delenv("KDA_RT_DENSE_GEMV_PRE", raising=False)
    monkeypatch.delenv("KDA_RT_DENSE_GEMV_MAX_T", raising=False)
    shapes = [(12576, 2304, False), (6720, 2304, False), (18432, 2304, False), (163840, 2304, True),
              (2304, 4096, False), (8, 64, False)]
    monkeypatch.setenv("KDA_RT_DENSE_GEMV", "1")
    assert gemv.precompile(shapes) == 1
    assert built == [("moe_gemv.cu", "gemv_dense", dict(DENSE=1, KW=2304, WARPS=gemv.DEFAULT.warps,
                                                        DENSE_PRE=gemv.PRE_UNITS))]
    built.clear()
    monkeypatch.setenv("KDA_RT_DENSE_GEMV_MAX_T", "3")  # (2-3 rows of the bf16 projections too)
    assert gemv.precompile(shapes) == 3
    assert [(kw["KW"], kw.get("MROWS")) for f, n, kw in built] == [(2304, None), (2304, 2), (2304, 3)]
    monkeypatch.delenv("KDA_RT_DENSE_GEMV_MAX_T")
    monkeypatch.setenv("KDA_RT_DENSE_GEMV", "0")
    assert gemv.precompile(shapes) == 0
    # the fp8 decode GEMVs: each e4m3 width for 1 to e4m3_rows rows of x (KDA_RT_FP8_DECODE_GEMV_MAX_T), MROWS only
    # past one row (the one-row build's defines as before)
    built.clear()
    assert gemv.precompile(shapes, {2304, 4096}, 3) == 6
    assert [(kw["KW"], kw["WFMT"], kw.get("MROWS")) for f, n, kw in built] == [
        (2304, 1, None), (2304, 1, 2), (2304, 1, 3), (4096, 1, None), (4096, 1, 2), (4096, 1, 3)]


def test_chain_probe_switch_reaches_only_the_routing_chain_builds(monkeypatch):
    """KDA_RT_CHAIN_PROBE=N (bench only: tests/gpu/probe_route_chain.py) builds the fused routing kernel and the
    routed gate/up GEMV with CHAIN_PROBE=N, and no other variant (the plain GEMV stays the runtime's); unset or 0,
    neither build has the define; a negative or non-integer value is refused by name."""
    import kda_rt.cuda.ops.moe_gemv as mg
    import kda_rt.cuda.ops.moe_route as mr

    built = []
    monkeypatch.setattr(mr, "get_kernel", lambda f, n, **kw: built.append((n, kw.get("CHAIN_PROBE"))))
    monkeypatch.setattr(mg, "get_kernel", lambda f, n, **kw: built.append((n, kw.get("ROUTED"), kw.get("CHAIN_PROBE"))))
    for value, want in (("", None), ("0", None), ("64", 64)):
        built.clear()
        monkeypatch.setenv("KDA_RT_CHAIN_PROBE", value)
        mr.fused_kernel(1, 256, 2304, 16, True, norm=True)
        mg.gemv_kernel(2304, 1024, routed=(256, True))
        mg.gemv_kernel(2304, 1024)
        assert built == [("moe_route_fused", want), ("moe_gemv_gate_up", 1, want), ("moe_gemv_gate_up", None, None)]
    for bad in ("-1", "x"):
        monkeypatch.setenv("KDA_RT_CHAIN_PROBE", bad)
        with pytest.raises(ValueError, match="KDA_RT_CHAIN_PROBE"):
            mr.fused_kernel(1, 256, 2304, 16, True)


def test_pdl_dep_switch_reaches_the_register_preloading_kernels(monkeypatch):
    """The kernels that load weights into registers before their programmatic-launch wait (moe_route_fused,
    skinny_gemm_cl) build with the wait fed by those loads (common.cuh KDA_PDL_WAIT_AFTER: PDL_DEP's default) unless
    KDA_RT_PDL_DEP=0, which passes PDL_DEP=0 (the plain wait, bench only); a value other than 0 or 1 is refused."""
    import kda_rt.cuda.ops.moe_route as mr
    import kda_rt.cuda.ops.skinny_gemm as sk

    built = []
    monkeypatch.setattr(mr, "get_kernel", lambda f, n, **kw: built.append((n, kw.get("PDL_DEP"))))
    monkeypatch.setattr(sk, "get_kernel", lambda f, n, **kw: built.append((n, kw.get("PDL_DEP"))))
    for value, want in (("", None), ("1", None), ("0", 0)):
        built.clear()
        monkeypatch.setenv("KDA_RT_PDL_DEP", value)
        mr.fused_kernel(1, 256, 2304, 16, True, norm=True)
        sk._wide_kernel(False, 64, 4, 4, 4096)
        assert built == [("moe_route_fused", want), ("skinny_gemm_cl", want)]
    monkeypatch.setenv("KDA_RT_PDL_DEP", "2")
    with pytest.raises(ValueError, match="KDA_RT_PDL_DEP"):
        mr.fused_kernel(1, 256, 2304, 16, True)


@pytest.mark.parametrize(("cc", "arch"), [("80", "sm_80"), ("89", "sm_89"), ("90", "sm_90a"), ("100", "sm_100a"),
                                          ("120", "sm_120")])
def test_device_arch_reads_two_and_three_digit_capabilities(cc, arch, monkeypatch):
    """CuPy gives the capability as a string of digits: "90" on H200, "100" on B200 (not major 1, minor 00: that
    built for sm_10 and failed on every Blackwell GPU).  arch_number reads the number back."""
    import types

    from kda_rt.cuda.ops import compile as c

    monkeypatch.delenv("KDA_RT_ARCH", raising=False)
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda *a: types.SimpleNamespace(compute_capability=cc)))
    monkeypatch.setattr(c, "_cupy", lambda: fake)
    assert c.device_arch() == arch
    assert c.arch_number(arch) == int(cc)
    for bad in ("gfx90a", "sm90", "sm_"):
        with pytest.raises(ValueError, match="not a CUDA arch name"):
            c.arch_number(bad)


@pytest.mark.parametrize(("arch", "ok"), [("sm_80", False), ("sm_86", False), ("sm_89", True), ("sm_90a", True),
                                          ("sm_100a", True), ("compute_120", True)])
def test_e4m3_weights_need_sm89(arch, ok, monkeypatch):
    """The e4m3 GEMVs (cvt.rn.f16x2.e4m3x2) refuse GPUs before sm_89 by name (KDA_RT_ARCH stands in for the GPU)."""
    from kda_rt.cuda.ops.gemv import check_e4m3_arch

    monkeypatch.setenv("KDA_RT_ARCH", arch)
    if ok:
        check_e4m3_arch("gemv_dense")
    else:
        with pytest.raises(ValueError, match=f"gemv_dense: e4m3 weights need sm_89 or newer .*{arch}"):
            check_e4m3_arch("gemv_dense")


def test_kda_state_hints_rule(monkeypatch):
    """kda_decode.cu STATE_HINTS by batch (1 up to 128 sequences, 2 above), and the switch's override and refusals."""
    monkeypatch.delenv("KDA_RT_KDA_STATE_HINTS", raising=False)
    assert kd.state_hints(1) == 1 and kd.state_hints(kd.HINTS_BOTH_MAX_SEQS) == 1
    assert kd.state_hints(kd.HINTS_BOTH_MAX_SEQS + 1) == 2
    monkeypatch.setenv("KDA_RT_KDA_STATE_HINTS", "0")
    assert kd.state_hints(300) == 0
    monkeypatch.setenv("KDA_RT_KDA_STATE_HINTS", "4")
    with pytest.raises(ValueError, match="KDA_RT_KDA_STATE_HINTS must be 0, 1, 2 or 3"):
        kd.state_hints(8)
    monkeypatch.setenv("KDA_RT_KDA_STATE_HINTS", "x")
    with pytest.raises(ValueError, match="KDA_RT_KDA_STATE_HINTS must be an integer"):
        kd.state_hints(8)


def test_one_token_moe_gemv_shapes_by_format(monkeypatch):
    """moe_gemv_down's (warps, stages) and the gate/up GEMV's warps by weight format (e4m3: more warps, the measured
    choice), the switches' overrides, the e4m3 ring's shared memory, and refusals of values below 1."""
    from kda_rt.cuda.ops import moe_gemv as mg

    for name in ("KDA_RT_DOWN_WARPS", "KDA_RT_DOWN_STAGES", "KDA_RT_GEMV_WARPS"):
        monkeypatch.delenv(name, raising=False)
    assert mg.down_shape() == (4, 6) and mg.down_shape(e4m3=True) == (16, 3)
    assert mg.gate_up_config().warps == 8 and mg.gate_up_config(e4m3=True).warps == 12
    # the e4m3 ring: 16 warps x 3 stages x two 1024-byte rows, 9 h rows of 2048 bytes, a scale pair a stage
    assert mg._down_smem(1024, 9, e4m3=True) == 16 * 3 * 2 * 1024 + 9 * 2048 + 16 * 3 * 8
    assert mg.down_fits(1024, 2304) and mg.down_fits(1024, 2304, e4m3=True)
    assert not mg.down_fits(1032, 2304, e4m3=True) and mg.down_fits(1032, 2304)  # e4m3: 16 weights a piece
    assert not mg.fits(1, 2312, e4m3=True) and mg.fits(1, 2312)
    monkeypatch.setattr(mg, "_device_id", lambda: 0)  # a GPU whose blocks may opt in to 99 KB (sm_89)
    monkeypatch.setattr(mg, "smem_optin", lambda device: 101376)
    mg._smem_cap.cache_clear()
    assert mg.down_fits(1024, 2304) is False and mg.down_fits(1024, 2304, e4m3=True) is False
    assert mg.down_fits(256, 2304, e4m3=True)
    mg._smem_cap.cache_clear()
    monkeypatch.undo()
    for name in ("KDA_RT_DOWN_WARPS", "KDA_RT_DOWN_STAGES", "KDA_RT_GEMV_WARPS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KDA_RT_DOWN_WARPS", "8")
    monkeypatch.setenv("KDA_RT_DOWN_STAGES", "2")
    monkeypatch.setenv("KDA_RT_GEMV_WARPS", "4")
    assert mg.down_shape() == (8, 2) == mg.down_shape(e4m3=True)
    assert mg.gate_up_config(e4m3=True).warps == 4
    monkeypatch.setenv("KDA_RT_DOWN_STAGES", "64")  # a ring past the shared memory the kernel may take
    assert not mg.down_fits(1024, 2304)
    for name, low, high in (("KDA_RT_DOWN_WARPS", 1, 32), ("KDA_RT_DOWN_STAGES", 1, 64), ("KDA_RT_GEMV_WARPS", 3, 31)):
        monkeypatch.setenv(name, str(low - 1))
        with pytest.raises(ValueError, match=f"{name} must be >= {low}"):
            mg.down_shape(), mg.gate_up_config()
        monkeypatch.setenv(name, str(high + 1))
        with pytest.raises(ValueError, match=f"{name} must be <= {high}"):
            mg.down_shape(), mg.gate_up_config()
        monkeypatch.setenv(name, str(low + 2))


def test_moe_b_tma_switch_reaches_the_define(monkeypatch):
    """KDA_RT_MOE_B_TMA=1 builds the wgmma grouped GEMM with B_TMA=1 for bf16 weights and for e4m3 weights with e4m3
    sources, never for e4m3 weights with bf16 sources (widened in shared memory: the kernel refuses B_TMA there);
    unset or 0, no B_TMA define at all (the default module's key unchanged); anything else is refused, named."""
    import kda_rt.cuda.ops.moe_gemm_wg as wg_ops

    monkeypatch.setenv("KDA_RT_MOE_WS", "0")  # (the plain kernel's switches)
    seen = []
    monkeypatch.setattr(wg_ops, "get_kernel", lambda *a, **kw: seen.append(kw) or "kernel")
    tile = wg_ops.WgTile(256, 4)
    cases = {"bf16": dict(), "e4m3": dict(e4m3=True), "w8a8": dict(e4m3=True, e4m3_src=True)}
    for value, expect_on in ((None, set()), ("0", set()), ("1", {"bf16", "w8a8"})):
        if value is None:
            monkeypatch.delenv("KDA_RT_MOE_B_TMA", raising=False)
        else:
            monkeypatch.setenv("KDA_RT_MOE_B_TMA", value)
        for name, kw in cases.items():
            seen.clear()
            wg_ops.wg_kernel(tile, 2304, 2048, True, 8, **kw)
            assert seen[0].get("B_TMA") == (1 if name in expect_on else None), (value, name, seen[0])
            assert wg_ops.b_tma(kw.get("e4m3", False), kw.get("e4m3_src", False)) == (name in expect_on)
    monkeypatch.setenv("KDA_RT_MOE_B_TMA", "yes")
    with pytest.raises(ValueError, match="KDA_RT_MOE_B_TMA must be 0 or 1"):
        wg_ops.wg_kernel(tile, 2304, 2048, True, 8)


def test_moe_ws_switch_reaches_the_define(monkeypatch):
    """KDA_RT_MOE_WS=1 builds the persistent, warp-specialized kernel (moe_grouped_gemm_ws, WS=1 with B_TMA=1, and
    A_TMA=1 for the down GEMM unless src_map is False) for bf16 weights and for e4m3 weights with e4m3 sources, never
    for e4m3 weights with bf16 sources; its stages are the tile's or as many as fit beside the staged epilogue's own
    tile (down, BN = 256: 3), within the block's 227 KB; unset, for e4m3 sources only (w8a8); 0, the plain kernel with
    no WS define; anything else is refused, named."""
    import kda_rt.cuda.ops.moe_gemm_wg as wg_ops

    for name in ("KDA_RT_MOE_B_TMA", "KDA_RT_MOE_A_TMA", "KDA_RT_MOE_MC"):  # (the other switches at their defaults)
        monkeypatch.delenv(name, raising=False)
    seen = []
    monkeypatch.setattr(wg_ops, "get_kernel", lambda *a, **kw: seen.append((a[1], kw)) or "kernel")
    tile = wg_ops.WgTile(256, 4)
    cases = {"bf16": dict(), "e4m3": dict(e4m3=True), "w8a8": dict(e4m3=True, e4m3_src=True)}
    for value in (None, "0", "1"):
        if value is None:
            monkeypatch.delenv("KDA_RT_MOE_WS", raising=False)
        else:
            monkeypatch.setenv("KDA_RT_MOE_WS", value)
        for name, kw in cases.items():
            for fuse, staged, stages in ((True, False, 4), (False, True, 3)):
                seen.clear()
                t = tile._replace(staged_out=staged)
                wg_ops.wg_kernel(t, 2304 if fuse else 1024, 2048 if fuse else 2304, fuse, 8, **kw)
                kname, defs = seen[0]
                on = (value == "1" and name != "e4m3") or (value is None and name == "w8a8")
                assert kname == ("moe_grouped_gemm_ws" if on else "moe_grouped_gemm_wg"), (value, name, kname)
                assert defs.get("WS") == (1 if on else None) and defs.get("B_TMA") == (1 if on else None), defs
                assert defs.get("A_TMA") == (1 if on and not fuse else None), (value, name, fuse, defs)
                assert defs["STAGES"] == (stages if on else 4), (value, name, fuse, defs)
                if on:
                    assert defs["max_dynamic_smem"] <= wg_ops.SMEM_LIMIT - wg_ops._WS_STATIC
                    assert wg_ops.SMEM_LIMIT == 232448
                assert wg_ops.ws(kw.get("e4m3", False), kw.get("e4m3_src", False)) == on
    monkeypatch.setenv("KDA_RT_MOE_WS", "1")
    seen.clear()
    wg_ops.wg_kernel(tile, 1024, 2304, False, 8, src_map=False)  # a source too small for a 128-row box: cp.async
    assert seen[0][0] == "moe_grouped_gemm_ws" and "A_TMA" not in seen[0][1] and seen[0][1]["B_TMA"] == 1
    assert wg_ops.ws_stages(wg_ops.WgTile(128, 4), False) == 4 and wg_ops.ws_stages(wg_ops.WgTile(128, 3, False), True) == 3
    for ws, mc, want in (("1", "1", 1), ("1", "0", None), ("0", "1", None)):  # KDA_RT_MOE_MC: only with WS
        monkeypatch.setenv("KDA_RT_MOE_WS", ws)
        monkeypatch.setenv("KDA_RT_MOE_MC", mc)
        seen.clear()
        wg_ops.wg_kernel(tile, 2304, 2048, True, 8)
        assert seen[0][1].get("MC") == want, (ws, mc, seen[0])
    monkeypatch.setenv("KDA_RT_MOE_WS", "1")
    monkeypatch.setenv("KDA_RT_MOE_MC", "2")
    with pytest.raises(ValueError, match="KDA_RT_MOE_MC must be 0 or 1"):
        wg_ops.wg_kernel(tile, 2304, 2048, True, 8)
    monkeypatch.delenv("KDA_RT_MOE_MC")
    monkeypatch.setenv("KDA_RT_MOE_WS", "on")
    with pytest.raises(ValueError, match="KDA_RT_MOE_WS must be 0 or 1"):
        wg_ops.wg_kernel(tile, 2304, 2048, True, 8)


def test_ws_launch_arguments_and_grid(monkeypatch):
    """moe_gemm_wg's launches of the WS kernel (no GPU: the checks, maps, counters and the kernel replaced by recorders):
    the arguments in the kernel's order (moe_grouped_gemm_ws: the plain kernel's ten, the weights' map, the claim
    counters, the source's map for the down GEMM only), 384 threads, one CTA an SM at most (never more than the
    items), with MC an even grid of pair items; without WS the plain kernel's 256-thread grid and arguments."""
    import types

    import numpy as np

    import kda_rt.cuda.ops.moe_gemm_wg as wg_ops

    for name in ("KDA_RT_MOE_B_TMA", "KDA_RT_MOE_A_TMA", "KDA_RT_MOE_MC", "KDA_RT_MOE_WS"):
        monkeypatch.delenv(name, raising=False)
    launches = []

    def fake_get_kernel(file, name, **kw):
        return lambda grid, block, args, shared_mem, stream=None: launches.append((name, kw, grid, block, args,
                                                                                   shared_mem))

    monkeypatch.setattr(wg_ops, "get_kernel", fake_get_kernel)
    monkeypatch.setattr(wg_ops, "check_grouped_gemm", lambda src, w, plan, fuse, out, **kw: (
        src.shape[1], w.shape[0], w.shape[1], plan.sorted_pair.shape[0]))
    monkeypatch.setattr(wg_ops, "weight_map", lambda *a, **k: "b_map")
    monkeypatch.setattr(wg_ops, "source_map", lambda *a, **k: "a_map")
    monkeypatch.setattr(wg_ops, "allocation_rows", lambda src: src.shape[0])
    monkeypatch.setattr(wg_ops, "_claim_counter", lambda stream: "claim")
    monkeypatch.setattr(wg_ops, "sm_count", lambda dev: 132)
    monkeypatch.setattr(wg_ops, "device_arch", lambda: "sm_90a")

    class Arr:  # the shape and device of an array, nothing else
        def __init__(self, *shape):
            self.shape, self.device = shape, types.SimpleNamespace(id=0)

    T, A, E, D, inter = 512, 8, 256, 2304, 1024
    N = T * A
    plan = types.SimpleNamespace(sorted_pair=Arr(N), tile_expert="te", tile_row="tr", expert_off="eo",
                                 num_tiles="nt", tile_rows=128)
    x, h, y = Arr(T, D), Arr(N, inter), Arr(N, D)
    w13, w2 = Arr(E, 2 * inter, D), Arr(E, D, inter)
    tiles = wg_ops.max_tiles(N, E, 128)

    def run(fuse):
        launches.clear()
        if fuse:
            wg_ops.moe_gemm_wg(x, w13, plan, top_k=A, fuse_silu=True, out=h)
        else:
            wg_ops.moe_gemm_wg(h, w2, plan, top_k=A, fuse_silu=False, out=y)
        (launch,) = launches
        return launch

    plain_args = lambda src, w, out: (src, plan.sorted_pair, w, "te", "tr", "eo", "nt", out, np.uint64(0),  # noqa: E731
                                      np.uint64(0))
    name, kw, grid, block, args, smem = run(True)  # bf16, WS unset: the plain kernel
    assert name == "moe_grouped_gemm_wg" and block == (256,) and grid == (8, tiles) and len(args) == 10
    assert all(a is b or a == b for a, b in zip(args, plain_args(x, w13, h), strict=True))
    monkeypatch.setenv("KDA_RT_MOE_WS", "1")
    for fuse, fb in ((True, 8), (False, 9)):
        name, kw, grid, block, args, smem = run(fuse)
        src, w, out = (x, w13, h) if fuse else (h, w2, y)
        assert name == "moe_grouped_gemm_ws" and block == (384,) and grid == (min(132, fb * tiles),)
        assert args[:10] == plain_args(src, w, out) and args[10:] == (("b_map", "claim") if fuse else
                                                                       ("b_map", "claim", "a_map")), args[10:]
        assert kw.get("A_TMA") == (None if fuse else 1) and smem == wg_ops.ws_smem(wg_ops.wg_tile(
            w.shape[1], src.shape[1], fuse), fuse)
    monkeypatch.setenv("KDA_RT_MOE_MC", "1")
    for fuse, fb in ((True, 8), (False, 9)):
        name, kw, grid, block, args, smem = run(fuse)
        assert kw["MC"] == 1 and grid == (2 * min(66, fb * ((tiles + 1) // 2)),) and grid[0] % 2 == 0
    plan.sorted_pair = Arr(8)  # one token: fewer items than SMs, the grid is the items (pairs with MC)
    x1, h1, y1 = Arr(1, D), Arr(8, inter), Arr(8, D)
    wg_ops.moe_gemm_wg(h1, w2, plan, top_k=A, fuse_silu=False, out=y1)
    assert launches[-1][2] == (2 * 9 * ((wg_ops.max_tiles(8, E, 128) + 1) // 2),)
    monkeypatch.setenv("KDA_RT_MOE_MC", "0")
    wg_ops.moe_gemm_wg(x1, w13, plan, top_k=A, fuse_silu=True, out=h1)
    assert launches[-1][2] == (min(132, 8 * wg_ops.max_tiles(8, E, 128)),)


def test_ws_claim_counters_one_pair_a_stream(monkeypatch):
    """The WS kernel's claim counters (moe_gemm_wg._claim_counter): one zeroed pair for each (device, stream), the same
    pair again for the same stream, and for CUDA's per-thread default stream (one handle, a different stream in each
    host thread) one pair for each host thread."""
    import sys
    import threading
    import types

    import numpy as np

    import kda_rt.cuda.ops.moe_gemm_wg as wg_ops

    class Stream:
        def __init__(self, ptr):
            self.ptr = ptr

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    fake = types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0), get_current_stream=lambda: Stream(7)),
        zeros=lambda n, dtype: np.zeros(n, dtype=dtype))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(wg_ops, "_claims", {})
    a, b = wg_ops._claim_counter(Stream(7)), wg_ops._claim_counter(None)
    assert a is b and a.dtype == np.int32 and a.shape == (2,) and not a.any()
    assert wg_ops._claim_counter(Stream(8)) is not a
    here = wg_ops._claim_counter(Stream(2))
    other = []
    t = threading.Thread(target=lambda: other.append(wg_ops._claim_counter(Stream(2))))
    t.start()
    t.join()
    assert other[0] is not here and wg_ops._claim_counter(Stream(2)) is here


def test_tensor_map_arguments():
    """ops/tma.encode_args_2d: the driver's arguments for a [rows, cols] array and boxes of 128-byte rows (dims inner
    first, the row stride in bytes, the box 128 bytes wide), and the limits it refuses before the driver is asked."""
    from kda_rt.cuda.ops.tma import encode_args_2d

    assert encode_args_2d(0x1000, 256 * 2048, 2304, 2, 128) == (1, (2304, 256 * 2048), (4608,), (64, 128))
    assert encode_args_2d(0x1000, 256 * 2304, 1024, 1, 64) == (0, (1024, 256 * 2304), (1024,), (128, 64))
    for args, match in (((0x1000, 64, 64, 4, 32), "elements of 1 or 2 bytes"),
                        ((0x1008, 64, 64, 2, 32), "multiples of 16"),
                        ((0x1000, 64, 36, 2, 32), "multiples of 16"),
                        ((0x1000, 64, 32, 2, 32), "at least 128 bytes"),
                        ((0x1000, 64, 64, 2, 0), "box rows must be 1-256"),
                        ((0x1000, 64, 64, 2, 257), "box rows must be 1-256"),
                        ((0x1000, 16, 64, 2, 32), "at most the array's 16 rows"),
                        ((0x1000, (1 << 32) + 1, 64, 2, 32), "past the driver's limits")):
        with pytest.raises(ValueError, match=match):
            encode_args_2d(*args)


def test_moe_a_tma_switch_reaches_the_define(monkeypatch):
    """KDA_RT_MOE_A_TMA=1 with KDA_RT_MOE_B_TMA=1 builds the down GEMM (contiguous source rows) with A_TMA=1, never
    gate/up (a gather) and never without B_TMA; src_map= overrides the switches (the launcher's choice where a
    128-row box does not fit the source's allocation)."""
    import kda_rt.cuda.ops.moe_gemm_wg as wg_ops

    monkeypatch.setenv("KDA_RT_MOE_WS", "0")  # (the plain kernel's switches)
    seen = []
    monkeypatch.setattr(wg_ops, "get_kernel", lambda *a, **kw: seen.append(kw) or "kernel")
    tile = wg_ops.WgTile(256, 4)
    for b, a in (("0", "1"), ("1", "0"), ("1", "1")):
        monkeypatch.setenv("KDA_RT_MOE_B_TMA", b)
        monkeypatch.setenv("KDA_RT_MOE_A_TMA", a)
        for fuse in (True, False):
            for kw in (dict(), dict(e4m3=True, e4m3_src=True)):
                seen.clear()
                wg_ops.wg_kernel(tile, 1024, 2304, fuse, 8, **kw)
                want = b == a == "1" and not fuse
                assert seen[0].get("A_TMA") == (1 if want else None), (b, a, fuse, kw, seen[0])
                assert wg_ops.a_tma(fuse, kw.get("e4m3", False), kw.get("e4m3_src", False)) == want
    seen.clear()
    wg_ops.wg_kernel(tile, 1024, 2304, False, 8, src_map=False)
    assert "A_TMA" not in seen[0] and seen[0]["B_TMA"] == 1
    seen.clear()
    wg_ops.wg_kernel(tile, 1024, 2304, False, 8, e4m3=True)  # e4m3 weights, bf16 sources: neither (widened first)
    assert "A_TMA" not in seen[0] and "B_TMA" not in seen[0]
    monkeypatch.setenv("KDA_RT_MOE_B_TMA", "0")
    seen.clear()
    wg_ops.wg_kernel(tile, 1024, 2304, False, 8, src_map=True)  # src_map never builds A_TMA without B_TMA
    assert "A_TMA" not in seen[0] and "B_TMA" not in seen[0]


def test_decode_ws_form_by_arch_tile_and_switch(monkeypatch):
    """moe_decode_fused's producer-warp form (moe_gemm_tc.cu DEC_WS): on sm_90+ with KDA_RT_MOE_DECODE_WS on (the
    default) for tiles with 128-byte k steps (bf16 BK 64, e4m3 BK 128), at most 256-row boxes and room for the
    swizzled stages' 1024-byte alignment; else the plain form (0)."""
    import kda_rt.cuda.ops.moe_gemm_tc as tc

    monkeypatch.delenv("KDA_RT_MOE_DECODE_WS", raising=False)
    bf16_tile, e4m3_tile = tc.TileConfig(16, 128, 64, 4, 1, 4, 2), tc.TileConfig(16, 128, 128, 3, 1, 4, 3)
    for arch, on in (("sm_80", 0), ("sm_89", 0), ("sm_90a", 1), ("sm_100a", 1)):
        monkeypatch.setattr(tc, "device_arch", lambda a=arch: a)
        assert tc.decode_ws() == on and tc.decode_ws(bf16_tile) == on and tc.decode_ws(e4m3_tile, True) == on
    assert tc.decode_ws(tc.TileConfig(16, 64, 64, 6, 1, 2, 3)) == 1  # the small-batch tile
    assert tc.decode_ws(bf16_tile, True) == 0  # e4m3 codes with a 64-wide k step: 64-byte rows
    assert tc.decode_ws(e4m3_tile) == 0  # bf16 with a 128-wide k step: 256-byte rows
    assert tc.decode_ws(tc.TileConfig(16, 1024, 64, 2, 1, 4, 1)) == 0  # boxes of 512 rows
    # the padded rows' slack (16 bytes a B row a stage) must hold the 1023 bytes of alignment: 1 stage x 32 rows not
    assert tc.decode_ws(tc.TileConfig(16, 32, 64, 1, 1, 2, 1)) == 0 and tc.decode_ws(tc.TileConfig(16, 64, 64, 1, 1, 2, 1)) == 1
    monkeypatch.setenv("KDA_RT_MOE_DECODE_WS", "0")
    assert tc.decode_ws(bf16_tile) == 0


@pytest.mark.parametrize(("tokens", "bf16_rows", "e4m3_rows"),
                         [(8, 16, 16), (114, 16, 16), (115, 64, 16), (157, 64, 16), (158, 64, 16), (256, 64, 16),
                          (513, 64, 16), (514, 64, 64),
                          (1370, 64, 64), (1371, 128, 128)])
def test_moe_tile_rows_by_weight_format(tokens, bf16_rows, e4m3_rows, monkeypatch):
    """The MoE GEMMs' tile rows of a step of the 48B shape (8 experts + the shared slot a token, 257 bins), by the
    average rows an expert: bf16 stacks leave the 16-row decode tiles at 4 rows (MIN_AVG_ROWS) for 64-row ones (with
    KDA_RT_MOE_FUSED32=auto 32-row ones up to 5.5: moe_gemm_tc.py FUSED32_BF16_MAX_AVG), e4m3 stacks at 18 (MIN_AVG_ROWS_E4M3:
    moe_decode_fused streams codes faster than the 64-row tiles widen them, measured to batch 512) for 64-row ones,
    on moe_decode_fused (FUSED64_E4M3; with KDA_RT_MOE_FUSED64=0 32-row ones, FUSED32_E4M3; the bf16 stacks' 64-row
    tiles on moe_decode_fused too, FUSED64_BF16, two launches with KDA_RT_MOE_FUSED64=e4m3; KDA_RT_MOE_FUSED32=0:
    64-row in both formats, e4m3: the bf16 stacks' 64-row), both take 128-row tiles from 48;
    KDA_RT_MOE_MIN_AVG_ROWS overrides the first threshold for both."""
    from kda_rt.cuda.ops.moe_gemm_tc import built_tile_rows, fused_rows, prefill_tile_rows

    monkeypatch.delenv("KDA_RT_MOE_MIN_AVG_ROWS", raising=False)
    monkeypatch.delenv("KDA_RT_MOE_FUSED32", raising=False)
    monkeypatch.delenv("KDA_RT_MOE_FUSED64", raising=False)
    pairs, bins = 9 * tokens, 257
    assert prefill_tile_rows(pairs, bins, 2304, 1024) == bf16_rows
    assert prefill_tile_rows(pairs, bins, 2304, 1024, e4m3=True) == e4m3_rows
    assert bf16_rows in built_tile_rows(False) and e4m3_rows in built_tile_rows(True)
    assert (e4m3_rows in fused_rows(True)) == (e4m3_rows < 128) and (bf16_rows in fused_rows(False)) == (bf16_rows < 128)
    monkeypatch.setenv("KDA_RT_MOE_FUSED64", "e4m3")  # (the fifty-second session's default: bf16 64 on two launches)
    assert (e4m3_rows in fused_rows(True)) == (e4m3_rows < 128) and (bf16_rows in fused_rows(False)) == (bf16_rows < 64)
    monkeypatch.setenv("KDA_RT_MOE_FUSED64", "0")
    assert prefill_tile_rows(pairs, bins, 2304, 1024, e4m3=True) == (32 if e4m3_rows == 64 else e4m3_rows)
    assert 32 in built_tile_rows(True) and 64 not in built_tile_rows(True)
    monkeypatch.delenv("KDA_RT_MOE_FUSED64")
    monkeypatch.setenv("KDA_RT_MOE_FUSED32", "0")
    assert prefill_tile_rows(pairs, bins, 2304, 1024, e4m3=True) == e4m3_rows
    assert prefill_tile_rows(pairs, bins, 2304, 1024) == (64 if bf16_rows == 32 else bf16_rows)
    monkeypatch.setenv("KDA_RT_MOE_FUSED32", "e4m3")
    assert prefill_tile_rows(pairs, bins, 2304, 1024, e4m3=True) == e4m3_rows
    assert prefill_tile_rows(pairs, bins, 2304, 1024) == (64 if bf16_rows == 32 else bf16_rows)
    assert 64 in built_tile_rows(False) and 32 not in built_tile_rows(False)
    monkeypatch.setenv("KDA_RT_MOE_FUSED32", "auto")  # (the bf16 32-row band: 4 to 5.5 rows an expert)
    assert prefill_tile_rows(pairs, bins, 2304, 1024) == (32 if 115 <= tokens <= 157 else bf16_rows)
    assert prefill_tile_rows(pairs, bins, 2304, 1024, e4m3=True) == e4m3_rows
    assert 32 in built_tile_rows(False) and 64 in built_tile_rows(False)
    monkeypatch.setenv("KDA_RT_MOE_FUSED32", "2")
    with pytest.raises(ValueError, match="KDA_RT_MOE_FUSED32 must be auto, e4m3, 1 or 0, got '2'"):
        prefill_tile_rows(pairs, bins, 2304, 1024)
    monkeypatch.delenv("KDA_RT_MOE_FUSED32")
    monkeypatch.setenv("KDA_RT_MOE_MIN_AVG_ROWS", "1000")
    assert prefill_tile_rows(pairs, bins, 2304, 1024) == (128 if tokens >= 1371 else 16)
    monkeypatch.setenv("KDA_RT_MOE_MIN_AVG_ROWS", "0")
    with pytest.raises(ValueError, match="KDA_RT_MOE_MIN_AVG_ROWS must be >= 1"):
        prefill_tile_rows(pairs, bins, 2304, 1024)


def _record_moe_builds(monkeypatch, *unset: str):
    """The 48B MoE shape's precompile on a pretend sm_90a with every kernel build recorded instead of made: (moe, tc,
    built, cfg, shapes); `unset` switches (and the ones every such test clears) at their defaults."""
    import kda_rt.cuda.moe as moe
    import kda_rt.cuda.ops.moe_align as align
    import kda_rt.cuda.ops.moe_gemm_tc as tc
    import kda_rt.cuda.ops.moe_gemv as gemv
    import kda_rt.cuda.ops.moe_route as route
    import kda_rt.cuda.ops.quant as quant
    import kda_rt.cuda.ops.rmsnorm as rms

    for name in ("KDA_RT_MOE_MIN_AVG_ROWS", "KDA_RT_MOE_DECODE_WS", "KDA_RT_FP8_PREFILL", *unset):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tc, "device_arch", lambda: "sm_90a")
    monkeypatch.setattr(wg, "device_arch", lambda: "sm_90a")
    built = []
    for mod in (align, tc, wg, route, gemv, quant, rms):
        monkeypatch.setattr(mod, "get_kernel", lambda f, n, _built=built, **kw: _built.append((f, kw)))
    cfg = types.SimpleNamespace(num_experts=256, top_k=8, num_expert_group=1)
    return moe, tc, built, cfg, [(2048, 2304, True), (2304, 1024, False)]


@pytest.mark.parametrize("e4m3", [False, True], ids=["bf16", "e4m3"])
def test_moe_fused32_switch(monkeypatch, e4m3):
    """KDA_RT_MOE_FUSED32=1 (bench switch): steps of 4-48 rows an expert take 32-row tiles in both formats, both
    GEMMs on moe_decode_fused's producer-warp form (bf16: the _DECODE k step; e4m3: 128 codes, 3 stages, 2 CTAs an
    SM), and the precompile builds the 32-row bucket, tiled GEMMs and fused kernel; with 0 nothing of them; by
    default (e4m3) e4m3 stacks take them from 18 rows an expert where KDA_RT_MOE_FUSED64=0 leaves them (by default
    the 64-row fused tiles take those) and bf16 stacks never; with auto bf16 stacks from 4 to 5.5 rows an expert."""
    moe, tc, built, cfg, shapes = _record_moe_builds(monkeypatch)

    def rows(tokens):
        return tc.prefill_tile_rows(9 * tokens, 257, 2304, 1024, e4m3=e4m3)

    monkeypatch.delenv("KDA_RT_MOE_FUSED64", raising=False)
    default = [rows(t) for t in (8, 115, 256, 600, 1371)]
    moe.precompile(cfg, 2304, 1024, fused=True, e4m3=e4m3)
    # (e4m3 stacks: the 64-row fused tiles by default, moe_gemm_tc.py FUSED64_E4M3; the 32-row ones without them)
    assert not [kw for f, kw in built if kw.get("BM") == 32 or kw.get("BT") == 32]
    built.clear()
    monkeypatch.setenv("KDA_RT_MOE_FUSED64", "0")
    assert rows(600) == (32 if e4m3 else 64)
    moe.precompile(cfg, 2304, 1024, fused=True, e4m3=e4m3)
    assert bool([kw for f, kw in built if kw.get("BM") == 32 or kw.get("BT") == 32]) == e4m3
    monkeypatch.delenv("KDA_RT_MOE_FUSED64")
    built.clear()
    monkeypatch.setenv("KDA_RT_MOE_FUSED32", "auto")  # (bf16: 4 to 5.5 rows an expert, FUSED32_BF16_MAX_AVG)
    auto = [rows(t) for t in (8, 115, 256, 600, 1371)]
    moe.precompile(cfg, 2304, 1024, fused=True, e4m3=e4m3)
    assert bool([kw for f, kw in built if kw.get("BM") == 32 or kw.get("BT") == 32]) != e4m3
    built.clear()
    monkeypatch.setenv("KDA_RT_MOE_FUSED32", "0")
    off = [rows(t) for t in (8, 115, 256, 600, 1371)]
    moe.precompile(cfg, 2304, 1024, fused=True, e4m3=e4m3)
    assert not [kw for f, kw in built if kw.get("BM") == 32 or kw.get("BT") == 32]
    built.clear()
    monkeypatch.setenv("KDA_RT_MOE_FUSED32", "1")
    assert [rows(t) for t in (8, 114, 115, 256, 600, 1370, 1371)] == [16, 16, 32, 32, 32, 32, 128]
    assert off == ([16, 16, 16, 64, 128] if e4m3 else [16, 64, 64, 64, 128])
    assert default == off
    assert auto == ([16, 16, 16, 64, 128] if e4m3 else [16, 32, 64, 64, 128])
    tile = tc.fused_decode_tile(256, 2304, 1024, 32)
    assert tile == tc.TileConfig(32, 128, 64, 4, 1, 4, 2)
    if e4m3:
        tile = tc.fused_e4m3_tile(tile, shapes)
        assert tile == tc.TileConfig(32, 128, 128, 3, 1, 4, 2)
    assert tc.decode_ws(tile, e4m3) == 1 and 2 * tile.smem(e4m3) <= 227 * 1024
    assert tc.fused_decode_tile(256, 2304, 1024, 128) is None  # (moe_decode_fused takes 16, 32 or 64 rows)
    monkeypatch.setenv("KDA_RT_MOE_MIN_AVG_ROWS", "2")  # the override lowers the switch's start too
    assert [rows(t) for t in (57, 58, 115)] == [16, 32, 32]
    monkeypatch.delenv("KDA_RT_MOE_MIN_AVG_ROWS")
    moe.precompile(cfg, 2304, 1024, fused=True, e4m3=e4m3)
    assert [kw["BT"] for f, kw in built if f == "moe_align.cu" and kw["BT"] == 32] == [32]
    assert sorted(kw["FUSE_SILU"] for f, kw in built if f == "moe_gemm_tc.cu" and kw.get("BM") == 32
                  and not kw.get("FUSED_DECODE")) == [False, True]
    fused32 = [(kw["BK"], kw["STAGES"], kw["MIN_BLOCKS"], kw.get("DEC_WS"), kw.get("WFMT")) for f, kw in built
               if kw.get("FUSED_DECODE") and kw["BM"] == 32]
    assert fused32 == ([(128, 3, 2, 1, 1)] if e4m3 else [(64, 4, 2, 1, None)])


@pytest.mark.parametrize("e4m3", [False, True], ids=["bf16", "e4m3"])
def test_moe_fused64_switch(monkeypatch, e4m3):
    """KDA_RT_MOE_FUSED64 (bench switch): which steps that take 64-row tiles run moe_decode_fused on them, in its
    producer-warp form with two warp rows of 32 (bf16: the _DECODE k step, 4 stages; e4m3: 128 codes, 3 stages; 2 CTAs
    an SM either way): by default (auto) and with 1 both formats (moe_gemm_tc.py FUSED64_E4M3, FUSED64_BF16), with e4m3
    e4m3 stacks alone, with 0 neither (moe_grouped_gemm_tc's two launches, and e4m3 stacks back on the 32-row fused
    tiles); the precompile builds the 64-row fused kernel exactly where a step takes it; any other value is refused by
    name."""
    moe, tc, built, cfg, shapes = _record_moe_builds(monkeypatch, "KDA_RT_MOE_FUSED32", "KDA_RT_MOE_FUSED64")

    def fused64_built():
        built.clear()
        moe.precompile(cfg, 2304, 1024, fused=True, e4m3=e4m3)
        return [(kw["BK"], kw["STAGES"], kw["WARPS_M"], kw["WARPS_N"], kw["MIN_BLOCKS"], kw.get("DEC_WS"),
                 kw.get("WFMT")) for f, kw in built if kw.get("FUSED_DECODE") and kw["BM"] == 64]

    want = [(128, 3, 2, 4, 2, 1, 1)] if e4m3 else [(64, 4, 2, 4, 2, 1, None)]
    rows = tc.prefill_tile_rows(9 * 600, 257, 2304, 1024, e4m3=e4m3)
    assert rows == 64 and 64 in tc.fused_rows(e4m3)  # (auto)
    assert fused64_built() == want
    tile = tc.fused_decode_tile(600, 2304, 1024, 64)
    assert tile == tc.TileConfig(64, 128, 64, 4, 2, 4, 2)
    if e4m3:
        tile = tc.fused_e4m3_tile(tile, shapes)
        assert tile == tc.TileConfig(64, 128, 128, 3, 2, 4, 2)
    assert tc.decode_ws(tile, e4m3) == 1 and 2 * (tile.smem(e4m3) + 1024) <= 228 * 1024
    assert tc.fused_decode_tile(600, 64, 64, 64) is None  # (K = 64: fewer k steps than the stages; two launches)
    monkeypatch.setenv("KDA_RT_MOE_FUSED64", "1")
    assert tc.fused_rows(e4m3) == (16, 32, 64) and tc.prefill_tile_rows(9 * 600, 257, 2304, 1024, e4m3=e4m3) == 64
    assert fused64_built() == want
    monkeypatch.setenv("KDA_RT_MOE_FUSED64", "e4m3")
    assert (64 in tc.fused_rows(e4m3)) == e4m3 and tc.prefill_tile_rows(9 * 600, 257, 2304, 1024, e4m3=e4m3) == 64
    assert fused64_built() == (want if e4m3 else [])
    monkeypatch.setenv("KDA_RT_MOE_FUSED64", "0")
    assert tc.fused_rows(e4m3) == (16, 32)
    assert tc.prefill_tile_rows(9 * 600, 257, 2304, 1024, e4m3=e4m3) == (32 if e4m3 else 64)
    assert fused64_built() == []
    monkeypatch.setenv("KDA_RT_MOE_FUSED64", "2")
    with pytest.raises(ValueError, match="KDA_RT_MOE_FUSED64 must be auto, e4m3, 1 or 0, got '2'"):
        tc.fused_rows(e4m3)


def test_moe_dec_a_async_switch(monkeypatch):
    """KDA_RT_MOE_DEC_A_ASYNC (bench switch, default 1): builds moe_decode_fused's producer-warp form with DEC_A_ASYNC
    (its A rows by cp.async), and only that form (the plain form has no producer warp); KDA_RT_MOE_DEC_REVERSE
    (default 1): builds either form with DEC_REVERSE; 0 leaves the define out; any other value is refused by name."""
    moe, tc, built, cfg, shapes = _record_moe_builds(monkeypatch, "KDA_RT_MOE_DEC_A_ASYNC", "KDA_RT_MOE_DEC_REVERSE")
    tile = tc.fused_decode_tile(32, 2304, 1024, 16)
    tc.fused_kernel(tile, 2304, 1024, 9)  # (the defaults)
    tc.fused_kernel(tile, 2304, 1024, 9, form=0)
    monkeypatch.setenv("KDA_RT_MOE_DEC_REVERSE", "0")
    tc.fused_kernel(tile, 2304, 1024, 9)
    monkeypatch.setenv("KDA_RT_MOE_DEC_A_ASYNC", "0")
    tc.fused_kernel(tile, 2304, 1024, 9)
    tc.fused_kernel(tile, 2304, 1024, 9, form=0)
    monkeypatch.setenv("KDA_RT_MOE_DEC_REVERSE", "1")  # (KDA_RT_MOE_DEC_REVERSE: both forms)
    tc.fused_kernel(tile, 2304, 1024, 9)
    assert [(kw.get("DEC_WS"), kw.get("DEC_A_ASYNC"), kw.get("DEC_REVERSE")) for f, kw in built] == [
        (1, 1, 1), (None, None, 1), (1, 1, None), (1, None, None), (None, None, None), (1, None, 1)]
    monkeypatch.setenv("KDA_RT_MOE_DEC_A_ASYNC", "2")
    with pytest.raises(ValueError, match="KDA_RT_MOE_DEC_A_ASYNC must be 0 or 1, got '2'"):
        tc.fused_kernel(tile, 2304, 1024, 9)
    monkeypatch.setenv("KDA_RT_MOE_DEC_A_ASYNC", "0")
    monkeypatch.setenv("KDA_RT_MOE_DEC_REVERSE", "x")
    with pytest.raises(ValueError, match="KDA_RT_MOE_DEC_REVERSE must be 0 or 1, got 'x'"):
        tc.fused_kernel(tile, 2304, 1024, 9)
