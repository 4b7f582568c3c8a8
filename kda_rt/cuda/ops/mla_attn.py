"""MLA attention over the paged latent cache, absorbed form (kernels_cu/mla_attn.cu + two cuBLAS bmm).

    q_lat[t, h] = W_UK_hᵀ q_nope[t, h]                    bmm over heads (bf16 out)
    ctx[t, h]   = softmax(scale · [q_lat | q_pe] · kvᵀ) · c   mla_attn_split (+ mla_attn_combine)
    out[t, h]   = W_UV_h ctx[t, h]                         bmm over heads -> [T, H·Dv] for o_proj

Decode and prefill share the path (prefill queries are one group per token, causal by length).
Letters: T new tokens, B sequences, H heads, M page slots per sequence, R latent rank, Dn/Dr/Dv
nope/pe/value head dims, S context splits.  w_kvb is used as stored in the checkpoint
([H·(Dn+Dv), R], per head W_UK rows then W_UV rows): no load-time transform is needed.

Workspace (bytes from `decode_workspace_bytes`): q_lat/ctx bf16 [T, H, R], then when S > 1
partial fp32 [T, S, H, R] and stats fp32 [T, S, H, 2].  S depends only on (T, M, block_size, SMs),
so a decode launch has a fixed grid for a fixed (B, M) and captures in a CUDA graph; the kernel
shares each token's actual context out over the S splits at run time.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from kda_rt.cuda.gemm import bmm
from kda_rt.cuda.ops.check import BF16, expect, f32, i32, leading_dim
from kda_rt.cuda.ops.compile import get_kernel

__all__ = ["mla_attention", "mla_dims", "decode_workspace_bytes", "num_splits"]

_NT = 64  # positions per tile of mla_attn_split: 8 warps x n8 columns in the score GEMM
_THREADS = 256
_ROW_PAD_BYTES = 16  # after each shared-memory row, so ldmatrix phases hit 32 distinct banks


@functools.cache
def _sm_count(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.runtime.deviceGetAttribute(16, device_id))  # cudaDevAttrMultiProcessorCount


def num_splits(T: int, M: int, block_size: int) -> int:
    """S: enough (token, split) blocks for two waves, at most one split per tile of the table width.
    The kernel shares each token's own context out over the S splits."""
    import cupy

    tiles = max(1, math.ceil(M * block_size / _NT))
    want = max(1, math.ceil(2 * _sm_count(cupy.cuda.Device().id) / max(T, 1)))
    return min(tiles, want)


def _layout(T: int, H: int, R: int, S: int) -> tuple[int, int, int]:
    """(offset of partial, offset of stats, total bytes) in the workspace, 256-byte aligned."""
    up = lambda n: (n + 255) // 256 * 256  # noqa: E731
    o_partial = up(T * H * R * 2)
    o_stats = o_partial + (up(T * S * H * R * 4) if S > 1 else 0)
    return o_partial, o_stats, o_stats + (up(T * S * H * 8) if S > 1 else 0)


def decode_workspace_bytes(B: int, H: int, M: int, block_size: int, kv_lora_rank: int = 512) -> int:
    """Bytes of the `workspace` a decode call with B sequences and [B, M] block tables needs."""
    return _layout(B, H, kv_lora_rank, num_splits(B, M, block_size))[2]


def _view(buf, offset: int, shape: tuple, dtype, strides: tuple | None = None):
    import cupy

    dtype = np.dtype(dtype)
    strides = strides or tuple(int(np.prod(shape[i + 1:])) * dtype.itemsize for i in range(len(shape)))
    return cupy.ndarray(shape, dtype, memptr=buf.data + offset, strides=strides)


def _constants(H: int, R: int, Dr: int, Dn: int, block_size: int, split: bool) -> dict[str, int]:
    """The -D constants of mla_attn.cu (its cache key): the shapes, the tile and the padded row strides."""
    return dict(H=H, R=R, DR=Dr, DN=Dn, BLOCK_SIZE=block_size, SPLIT=int(split), THREADS=_THREADS, NT=_NT,
                HP=-(-H // 16) * 16,  # heads padded to whole m16 tiles
                LDK=R + Dr + _ROW_PAD_BYTES // 2, LDS_S=_NT + _ROW_PAD_BYTES // 4, LDP=_NT + _ROW_PAD_BYTES // 2)


def _split_smem_bytes(c: dict[str, int]) -> int:
    """mla_attn_split's shared memory: Q and two KV stages (bf16), scores (fp32), probabilities (bf16), alpha."""
    return (c["HP"] + 2 * c["NT"]) * c["LDK"] * 2 + c["HP"] * (c["LDS_S"] * 4 + c["LDP"] * 2 + 4)


def mla_dims(q, kv_pool, w_kvb, H: int):
    """(q as [T, H·(Dn+Dr)], (QW, block_size, KD, HW, R, Dr, Dqk, Dkv, Dn, Dv)) after the shared checks:
    q row width, page size, pool width, kv_b rows, latent rank, and the per-head dims (Dn nope, Dr rope,
    Dqk = Dn + Dr, Dkv = Dn + Dv, Dv value)."""
    q2 = q.reshape(q.shape[0], -1) if q.ndim == 3 else q
    _, QW = expect(q2, "q", ndim=2, dtype=BF16, row_stride=True)
    _, block_size, KD = expect(kv_pool, "kv_pool", ndim=3, dtype=BF16)
    HW, R = expect(w_kvb, "w_kvb", ndim=2, dtype=BF16)
    Dr, Dqk, Dkv = KD - R, QW // H, HW // H
    Dn, Dv = Dqk - Dr, Dkv - (Dqk - Dr)
    return q2, (QW, block_size, KD, HW, R, Dr, Dqk, Dkv, Dn, Dv)


def mla_attention(q, kv_pool, w_kvb, cu_seqlens, context_lens, block_tables, *, num_heads: int, scale: float,
                  max_seqlen: int, decode: bool, out=None, workspace=None, stream=None):
    """q: [T, H, Dn+Dr] bf16 (or a row-strided [T, H·(Dn+Dr)] view), kv_pool: [num_blocks, block_size, R+Dr]
    bf16 (rows already stored), w_kvb: [H·(Dn+Dv), R] bf16, cu_seqlens [B+1] / context_lens [B] /
    block_tables [B, M] int32.  Token i of sequence b attends to positions 0 .. context_lens[b] + i.
    Returns out [T, H·Dv] bf16.  decode=True needs T == B and max_seqlen == 1; with `out` and
    `workspace` (uint8, >= decode_workspace_bytes) it allocates nothing and never reads the device."""
    import cupy

    H = num_heads
    T = q.shape[0]
    if q.ndim == 3:
        expect(q, "q", shape=(None, H, None), dtype=BF16)
    q2, (QW, block_size, KD, HW, R, Dr, Dqk, Dkv, Dn, Dv) = mla_dims(q, kv_pool, w_kvb, H)
    if QW != H * Dqk or HW != H * Dkv or Dr <= 0 or Dn <= 0 or Dv <= 0 or H > 32 or R % 128 or Dr % 8 or Dn % 8:
        raise ValueError(f"mla_attention: inconsistent dims (q {q.shape}, kv_pool width {KD}, w_kvb {w_kvb.shape}, "
                         f"H {H}); need H <= 32, R % 128 == 0, Dr and Dn multiples of 8")
    if leading_dim(q2) % 8 or q2.data.ptr % 16:
        raise ValueError("mla_attention: q rows must start on 16-byte boundaries")
    (B1,) = expect(cu_seqlens, "cu_seqlens", ndim=1, dtype=np.int32)
    expect(context_lens, "context_lens", shape=(B1 - 1,), dtype=np.int32)
    _, M = expect(block_tables, "block_tables", shape=(B1 - 1, None), dtype=np.int32)
    if decode and (T != B1 - 1 or max_seqlen != 1):
        raise ValueError(f"mla_attention(decode=True) needs one token per sequence: T={T}, B={B1 - 1}, "
                         f"max_seqlen={max_seqlen}")
    out = cupy.empty((T, H * Dv), dtype=BF16) if out is None else out
    expect(out, "out", shape=(T, H * Dv), dtype=BF16, row_stride=True)
    S = num_splits(T, M, block_size)
    o_partial, o_stats, nbytes = _layout(T, H, R, S)
    workspace = cupy.empty(nbytes, dtype=np.uint8) if workspace is None else workspace
    (W,) = expect(workspace, "workspace", ndim=1, dtype=np.uint8)
    if W < nbytes:
        raise ValueError(f"workspace has {W} bytes, this call needs {nbytes} (decode_workspace_bytes)")
    if T == 0:
        return out
    ldq, ldo = leading_dim(q2), leading_dim(out)
    isz = 2
    q_lat = _view(workspace, 0, (H, T, R), BF16, (R * isz, H * R * isz, isz))  # per-head view of [T, H, R]
    stream = cupy.cuda.get_current_stream() if stream is None else stream
    with stream:
        bmm(_view(q2, 0, (H, T, Dn), BF16, (Dqk * isz, ldq * isz, isz)),
            _view(w_kvb, 0, (H, Dn, R), BF16, (Dkv * R * isz, R * isz, isz)), out=q_lat)
        consts = _constants(H, R, Dr, Dn, block_size, S > 1)
        smem = _split_smem_bytes(consts)
        kernel = get_kernel("mla_attn.cu", "mla_attn_split", max_dynamic_smem=smem, **consts)
        partial = workspace[o_partial:] if S > 1 else workspace
        stats = workspace[o_stats:] if S > 1 else workspace
        kernel((T, S), (_THREADS,), (workspace, q2, i32(ldq), kv_pool, cu_seqlens, context_lens, block_tables,
                                     i32(B1 - 1), i32(M), f32(scale * math.log2(math.e)), workspace,
                                     partial, stats), shared_mem=smem, stream=stream)
        if S > 1:
            combine = get_kernel("mla_attn.cu", "mla_attn_combine", **consts)
            combine((T, H), (R // 4,), (partial, stats, i32(S), cu_seqlens, i32(B1 - 1), workspace), stream=stream)
        bmm(q_lat, _view(w_kvb, Dn * R * isz, (H, Dv, R), BF16, (Dkv * R * isz, R * isz, isz)),
            out=_view(out, 0, (H, T, Dv), BF16, (Dv * isz, ldo * isz, isz)), transpose_b=True)
    return out
