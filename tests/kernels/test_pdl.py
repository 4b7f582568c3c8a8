"""Programmatic dependent launch (kda_rt/cuda/ops/pdl.py, KDA_PDL_ENTRY() in kernels_cu/common.cuh).

The contract that keeps the stream order exact: every kernel of kernels_cu/ waits for its predecessor
(griddepcontrol.wait) before touching memory, so a kernel launched early still reads all of its
predecessor's writes.  The source check runs everywhere (CI); the GPU tests run a chain of dependent
kernels captured with PDL launches (each adds 1 to what the one before wrote: a kernel that ran ahead of
its predecessor would lose an increment) and check every argument type the launcher marshals."""

from __future__ import annotations

import re

import numpy as np
import pytest

from helpers.gpu import KERNELS, inline_module


def _kernel_bodies(src: str):
    """(name, text after the opening brace) of every __global__ function in a source (comments and
    preprocessor lines blanked first: attributes may sit in #if blocks)."""
    src = re.sub(r"//[^\n]*", "", src)
    src = re.sub(r"(?m)^\s*#.*$", "", src)
    for m in re.finditer(r"__global__", src):
        i = m.end()
        while True:  # skip __launch_bounds__(...) / __cluster_dims__(...)
            attr = re.match(r"\s*(?:void\s+)?(__launch_bounds__|__cluster_dims__)\s*\(", src[i:])
            if not attr:
                break
            depth, j = 0, i + attr.end() - 1
            while True:
                depth += {"(": 1, ")": -1}.get(src[j], 0)
                if depth == 0:
                    break
                j += 1
            i = j + 1
        name = re.search(r"(\w+)\s*\(", src[i:])
        start = i + name.end() - 1
        depth, j = 0, start
        while True:
            depth += {"(": 1, ")": -1}.get(src[j], 0)
            if depth == 0:
                break
            j += 1
        brace = src.index("{", j)
        assert src[j + 1:brace].strip() == "", f"unexpected text between {name.group(1)}'s parameters and body"
        yield name.group(1), src[brace + 1:]


# kernels that may defer their wait (KDA_PDL_ENTRY_DEFERRED, common.cuh), directly or through a macro of their
# file: the entry line they start with; their body must also execute KDA_PDL_WAIT() or KDA_PDL_WAIT_AFTER(dep)
DEFERRED = {"moe_grouped_gemm_tc": "TC_PDL_ENTRY();", "moe_route_fused": "KDA_PDL_ENTRY_DEFERRED();",
            "skinny_gemm_cl": "KDA_PDL_ENTRY_DEFERRED();", "skinny_gemm_ws": "KDA_PDL_ENTRY_DEFERRED();",
            "skinny_gemm_staged": "KDA_PDL_ENTRY_DEFERRED();",
            "gemv_dense": "KDA_PDL_ENTRY_DEFERRED();", "kda_decode_step": "KD_PDL_ENTRY();",
            "moe_gemv_down": "KDA_PDL_ENTRY_DEFERRED();", "mla_absorb_q": "MLA_UP_PDL_ENTRY();",
            "mla_expand_out": "MLA_UP_PDL_ENTRY();"}


# kernels whose entry is a macro of their file that waits in only some threads (the others start on a signal of
# the kernel before, in the kernel's own code): every definition of the macro must contain KDA_PDL_ENTRY()
SIGNALLED = {"moe_gemv_gate_up": "GEMV_PDL_ENTRY"}


def _macro_text(src: str, start: int) -> str:
    """A #define's text from `start` to the end of its last continued line."""
    lines = []
    for line in src[start:].split("\n"):
        lines.append(line)
        if not line.rstrip().endswith("\\"):
            break
    return "\n".join(lines)


def test_every_kernel_starts_with_the_pdl_wait():
    found = []
    for path in sorted(KERNELS.glob("*.cu")):
        src = path.read_text()
        for name, body in _kernel_bodies(src):
            found.append(name)
            first = body.lstrip().split("\n", 1)[0].strip()
            if name in DEFERRED:
                waits = "KDA_PDL_WAIT();" in body or "KDA_PDL_WAIT_AFTER(" in body
                assert first == DEFERRED[name] and waits, f"{path.name}: kernel {name}"
                continue
            if name in SIGNALLED:
                macro = SIGNALLED[name]
                assert first == f"{macro}();", f"{path.name}: kernel {name} starts with {first!r}"
                defs = [_macro_text(src, m.end()) for m in re.finditer(rf"#define {macro}\(\)", src)]
                assert len(defs) == 2 and all("KDA_PDL_ENTRY()" in d for d in defs), f"{path.name}: {macro} {defs}"
                continue
            assert first == "KDA_PDL_ENTRY();", f"{path.name}: kernel {name} starts with {first!r}"
    assert len(found) >= 20, found  # every file's kernels were parsed


CHAIN = r"""
#include "common.cuh"
extern "C" __global__ void add_one(const float* __restrict__ src, float* __restrict__ dst, int n) {
    KDA_PDL_ENTRY();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i] + 1.f;
}
extern "C" __global__ void echo(int a, unsigned b, long long c, unsigned long long d, float e, double* out) {
    KDA_PDL_ENTRY();
    out[0] = a, out[1] = b, out[2] = (double)c, out[3] = (double)d, out[4] = e;
}
"""


def _module():
    return inline_module(CHAIN)


@pytest.mark.gpu
def test_pdl_chain_in_a_captured_graph_is_exact():
    import cupy

    from kda_rt.cuda.ops import pdl

    if not pdl.supported():
        pytest.skip("programmatic dependent launch needs sm_90+")
    kernel = pdl.Kernel(_module().get_function("add_one"))
    n, chain = 132 * 256 * 4, 64
    base = cupy.random.default_rng(0).integers(0, 1000, n).astype(np.float32)
    bufs = [base.copy(), cupy.empty_like(base)]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        with pdl.capturing() as active:
            assert active
            for k in range(chain):
                kernel((n // 256,), (256,), (bufs[k % 2], bufs[(k + 1) % 2], np.int32(n)))
        graph = stream.end_capture()
        for _ in range(5):
            graph.launch(stream)
        stream.synchronize()
    assert bool((bufs[0] == base + 5 * chain).all())


@pytest.mark.gpu
def test_pdl_launch_passes_every_argument_type():
    import cupy

    from kda_rt.cuda.ops import pdl

    if not pdl.supported():
        pytest.skip("programmatic dependent launch needs sm_90+")
    fn = _module().get_function("echo")
    out = cupy.full(5, np.nan, dtype=np.float64)
    args = (np.int32(-7), np.uint32(3_000_000_000), np.int64(-(1 << 40)), np.uint64(1 << 50), np.float32(0.375), out)
    assert pdl.launch(fn, (1,), (1,), args)
    assert out.get().tolist() == [-7, 3_000_000_000, -(1 << 40), 1 << 50, 0.375]
    assert not pdl.launch(fn, (1,), (1,), (-7, *args[1:]))  # a Python int: not marshalled, nothing launched
