"""Dense GEMM through cuBLAS: y = x · Wᵀ (row-major), bf16 in, fp32 accumulate, bf16 or fp32 out
(calls of up to 8 rows and 4096 outputs go to our weight-streaming kernel instead: ops/skinny_gemm.py, and one-row
calls of 4-256 MB of weights with bf16 out to a GEMV that starts before the kernel before it ends: ops/gemv.py).

We call cuBLAS through ctypes with our own handle instead of CuPy's wrappers because CuPy's
refuse to run during CUDA-graph capture.  The handle gets a fixed workspace (so cuBLAS never
allocates inside a capture) and is bound to the stream of each call.  Row-major Y[M,N] = X[M,K]·W[N,K]ᵀ
is the column-major call C[N,M] = op(W)ᵀ-form: gemmEx(opA=T on W, opB=N on X, m=N, n=M, k=K,
lda=ldb=K, ldc=N) (measured at 798 TFLOP/s on H200 through CuPy's bindings, gpu_facts.md).
"""

from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

from kda_rt import env
from kda_rt.cuda.ops import gemv, trace
from kda_rt.cuda.ops import skinny_gemm as skinny
from kda_rt.cuda.ops.check import BF16, expect, leading_dim

__all__ = ["linear", "bmm", "CublasError"]

_CUDA_R_32F, _CUDA_R_16BF = 0, 14
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_ALGO_DEFAULT = -1
_WORKSPACE_BYTES = 32 << 20
_tls = threading.local()


class CublasError(RuntimeError):
    pass


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    import cupy_backends.cuda.libs.cublas  # noqa: F401  (loads libcublas into the process first)

    last = None
    for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError as exc:
            last = exc
    else:
        raise CublasError(f"cannot load libcublas ({last}); install the CuPy wheel's CUDA libraries") from last
    lib.cublasGemmEx.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                 ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_int, ctypes.c_int]
    ll = ctypes.c_longlong
    lib.cublasGemmStridedBatchedEx.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ll, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ll,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ll, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasError(f"{what} failed with cuBLAS status {status}")


class _Handle:
    def __init__(self) -> None:
        import cupy

        lib = _lib()
        self.ptr = ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(self.ptr)), "cublasCreate")
        self.workspace = cupy.empty(_WORKSPACE_BYTES, dtype=np.uint8)
        _check(lib.cublasSetWorkspace_v2(self.ptr, ctypes.c_void_p(self.workspace.data.ptr),
                                         ctypes.c_size_t(_WORKSPACE_BYTES)), "cublasSetWorkspace")
        self.stream = None

    def bind(self, stream_ptr: int) -> None:
        if stream_ptr != self.stream:
            _check(_lib().cublasSetStream_v2(self.ptr, ctypes.c_void_p(stream_ptr)), "cublasSetStream")
            self.stream = stream_ptr


def _handle() -> _Handle:
    import cupy

    key = cupy.cuda.Device().id
    handles = getattr(_tls, "handles", None)
    if handles is None:
        handles = _tls.handles = {}
    if key not in handles:
        handles[key] = _Handle()
    return handles[key]


_ONE = np.array(1.0, dtype=np.float32)
_ZERO = np.array(0.0, dtype=np.float32)


def linear(x, weight, *, out=None, out_dtype=BF16, accumulate: bool = False):
    """x: [M, K] bf16, weight: [N, K] bf16 -> out [M, N] (bf16 or float32).  With `accumulate`,
    out += x·Wᵀ (out must be given).  x and out may be row-strided views (column slices of a wider
    buffer).  Works inside CUDA-graph capture."""
    import cupy

    M, K = expect(x, "x", ndim=2, dtype=BF16, row_stride=True)
    N, _ = expect(weight, "weight", shape=(None, K), dtype=BF16)
    if out is None:
        if accumulate:
            raise ValueError("linear: accumulate=True needs an out array")
        out = cupy.empty((M, N), dtype=out_dtype)
    expect(out, "out", shape=(M, N), row_stride=True)
    if out.dtype not in (BF16, np.dtype(np.float32)):
        raise TypeError(f"out must be bfloat16 or float32, got {out.dtype.name}")
    if M == 0 or N == 0:
        return out
    if env.skinny() and skinny.fits(x, weight, out, accumulate):  # decode-sized: our weight-streaming kernel
        return skinny.skinny_gemm(x, weight, out)
    if gemv.fits(x, weight, out, accumulate):  # one wide row: a GEMV that starts before the kernel before ends
        return gemv.gemv_dense(x, weight, out)
    h = _handle()
    h.bind(cupy.cuda.get_current_stream().ptr)
    trace.record("cublasGemmEx")
    ctype = _CUDA_R_16BF if out.dtype == BF16 else _CUDA_R_32F
    beta = _ONE if accumulate else _ZERO
    status = _lib().cublasGemmEx(
        h.ptr, _OP_T, _OP_N, N, M, K, _ONE.ctypes.data, weight.data.ptr, _CUDA_R_16BF, K, x.data.ptr, _CUDA_R_16BF,
        leading_dim(x), beta.ctypes.data, out.data.ptr, ctype, leading_dim(out), _COMPUTE_32F, _ALGO_DEFAULT)
    _check(status, f"cublasGemmEx(M={M}, N={N}, K={K})")
    return out


def _strided3(arr, name: str, shape: tuple) -> tuple[int, int]:
    """Check a 3-D [batch, rows, cols] view with contiguous rows; returns (batch stride, row stride) in elements."""
    import cupy

    if not isinstance(arr, cupy.ndarray) or arr.ndim != 3:
        raise TypeError(f"{name} must be a 3-D cupy.ndarray, got {getattr(arr, 'shape', type(arr).__name__)}")
    if any(s is not None and s != a for s, a in zip(shape, arr.shape, strict=True)):
        raise ValueError(f"{name} must have shape {shape}, got {arr.shape}")
    sb, sr, sc = arr.strides
    item = arr.itemsize
    if sc != item or sb < 0 or sb % item or sr % item or sr < arr.shape[2] * item:
        raise ValueError(f"{name} must have contiguous, non-overlapping rows (strides {arr.strides})")
    if arr.device.id != cupy.cuda.Device().id:
        raise ValueError(f"{name} is on device {arr.device.id}, expected {cupy.cuda.Device().id}")
    return sb // item, sr // item


def bmm(a, b, *, out, transpose_b: bool = False):
    """out[i] = a[i] · (b[i]ᵀ if transpose_b else b[i]) for every batch i, one strided-batched cuBLAS call.

    a: [Bt, M, K] bf16, b: [Bt, K, N] (or [Bt, N, K] with transpose_b) bf16, out: [Bt, M, N] bf16 or
    float32.  All three may be strided views (e.g. per-head slices: batch stride = head width) as long
    as each row is contiguous.  fp32 accumulation.  Works inside CUDA-graph capture."""
    import cupy

    if a.dtype != BF16 or b.dtype != BF16:
        raise TypeError(f"bmm: a and b must be bfloat16, got {a.dtype.name} and {b.dtype.name}")
    sa, lda = _strided3(a, "a", (None, None, None))
    Bt, M, K = a.shape
    N = b.shape[1 if transpose_b else 2] if b.ndim == 3 else None
    sbb, ldb = _strided3(b, "b", (Bt, N, K) if transpose_b else (Bt, K, N))
    so, ldo = _strided3(out, "out", (Bt, M, N))
    if out.dtype not in (BF16, np.dtype(np.float32)):
        raise TypeError(f"out must be bfloat16 or float32, got {out.dtype.name}")
    if Bt == 0 or M == 0 or N == 0:
        return out
    h = _handle()
    h.bind(cupy.cuda.get_current_stream().ptr)
    ctype = _CUDA_R_16BF if out.dtype == BF16 else _CUDA_R_32F
    # column-major: outᵀ[N, M] = op(b)ᵀ-view [N, K] · aᵀ-view [K, M]
    trace.record("cublasGemmStridedBatchedEx")
    status = _lib().cublasGemmStridedBatchedEx(
        h.ptr, _OP_T if transpose_b else _OP_N, _OP_N, N, M, K, _ONE.ctypes.data, b.data.ptr, _CUDA_R_16BF, ldb, sbb,
        a.data.ptr, _CUDA_R_16BF, lda, sa, _ZERO.ctypes.data, out.data.ptr, ctype, ldo, so, Bt, _COMPUTE_32F,
        _ALGO_DEFAULT)
    _check(status, f"cublasGemmStridedBatchedEx(batch={Bt}, M={M}, N={N}, K={K})")
    return out
