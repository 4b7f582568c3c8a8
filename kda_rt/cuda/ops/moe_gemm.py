"""Launcher for kernels_cu/moe_gemm.cu: grouped bf16 tensor-core GEMM over expert-sorted rows,
gate/up with the SiLU·up epilogue fused (bf16 out) or down (bf16 out)."""

from __future__ import annotations

from kda_rt.cuda.ops.check import BF16, expect
from kda_rt.cuda.ops.compile import get_kernel
from kda_rt.cuda.ops.moe_align import MoEPlan, max_tiles

__all__ = ["moe_gemm", "tile_rows_for"]


def tile_rows_for(num_pairs: int, num_experts: int) -> int:
    """Rows per tile (BT = 8·NT) from the average rows per touched expert: 8 for decode."""
    avg = num_pairs / max(1, min(num_experts, num_pairs))
    return 8 if avg <= 8 else 16 if avg <= 16 else 32


def _config(nout: int, k: int, nt: int, fuse_silu: bool) -> tuple[int, int, int]:
    """(MT, WARPS, KU) such that the feature blocks tile nout exactly and K splits into 32·KU chunks."""
    ku = next(u for u in ((2, 1) if nt == 4 else (4, 2, 1)) if k % (32 * u) == 0)
    feats = nout // 2 if fuse_silu else nout
    for mt in ((2,) if fuse_silu else (2, 1)):
        per_warp = 16 * (mt // 2 if fuse_silu else mt)
        warps = next((w for w in (4, 2, 1) if feats % (w * per_warp) == 0), None)
        if warps:
            return mt, warps, ku
    raise ValueError(f"moe_gemm: output width {feats} must be a multiple of 16")


_SMS_WARPS = 132 * 16  # warps that keep an H200's copy bandwidth busy (~8 KB of loads in flight each)


def _ksplit(num_pairs: int, num_experts: int, tile_rows: int, feat_blocks: int, warps: int, k: int,
            ku: int) -> tuple[int, int]:
    """(KSPLIT, KU): warps per block along K (moe_gemm.cu) when the expected grid (uniform routing) has
    too few warps to keep the loads in flight, as at batch 1 (8 experts touched); KU shrinks if the
    split K range needs it."""
    if tile_rows > 16:
        return 1, ku
    touched = num_experts * (1 - (1 - 1 / num_experts) ** num_pairs)  # expected distinct experts
    tiles = max(touched, num_pairs / tile_rows)
    fits = [(ks, next(u for u in (ku, 2, 1) if k % (32 * u * ks) == 0 or u == 1)) for ks in (1, 2, 4)]
    fits = [(ks, u) for ks, u in fits if k % (32 * u * ks) == 0]
    return next(((ks, u) for ks, u in fits if tiles * feat_blocks * warps * ks >= _SMS_WARPS), fits[-1])


def moe_gemm(src, weight, plan: MoEPlan, *, top_k: int, fuse_silu: bool, out, stream=None):
    """fuse_silu: src = x [T, K], weight = w13 [E, 2I, K] -> out h [N, I] bf16 (h = SiLU(gate)·up).
    else:       src = h [N, K], weight = w2 [E, D, K]  -> out y [N, D] bf16 (unscaled expert rows)."""
    rows, K = expect(src, "src", ndim=2, dtype=BF16)
    E, nout, _ = expect(weight, "weight", shape=(None, None, K), dtype=BF16)
    N = plan.sorted_pair.shape[0]
    if K % 32 or nout % 16 or (fuse_silu and nout % 32):
        raise ValueError(f"moe_gemm: K={K} must be a multiple of 32 and the output width of 16")
    if fuse_silu:
        expect(out, "out", shape=(N, nout // 2), dtype=BF16)
    else:
        expect(src, "src", shape=(N, K))
        expect(out, "out", shape=(N, nout), dtype=BF16)
    nt = plan.tile_rows // 8
    mt, warps, ku = _config(nout, K, nt, fuse_silu)
    feats_per_block = warps * 16 * (mt // 2 if fuse_silu else mt)
    grid = (max_tiles(N, E, plan.tile_rows), (nout // 2 if fuse_silu else nout) // feats_per_block)
    ks, ku = _ksplit(N, E, plan.tile_rows, grid[1], warps, K, ku)
    kernel = get_kernel("moe_gemm.cu", "moe_grouped_gemm", K=K, NOUT=nout, FUSE_SILU=fuse_silu, TOPK=top_k,
                        MT=mt, NT=nt, KU=ku, WARPS=warps, KSPLIT=ks)
    if N:
        kernel(grid, (warps * ks * 32,), (src, plan.sorted_pair, weight, plan.tile_expert, plan.tile_row, plan.expert_off,
                                     plan.num_tiles, out), stream=stream)
    return out
