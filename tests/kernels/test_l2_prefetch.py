"""kernels_cu/l2_prefetch.cu: an L2 hint that writes nothing, and keeps the stream order exact when it sits
between two dependent kernels of a decode graph captured with programmatic dependent launch (it lets the
next launch go before it waits).  Also the launcher's refusals and the KDA_RT_L2_PREFETCH switch."""

from __future__ import annotations

import numpy as np
import pytest

from kda_rt import env


def test_switch_letters(monkeypatch):
    monkeypatch.delenv("KDA_RT_L2_PREFETCH", raising=False)
    assert env.l2_prefetch() == frozenset("osm")
    for value, want in (("0", ""), ("1", "osm"), ("s", "s"), ("om", "om")):
        monkeypatch.setenv("KDA_RT_L2_PREFETCH", value)
        assert env.l2_prefetch() == frozenset(want)
    monkeypatch.setenv("KDA_RT_L2_PREFETCH", "ox")
    with pytest.raises(ValueError, match="KDA_RT_L2_PREFETCH must be 0, 1 or letters of osm"):
        env.l2_prefetch()


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [(16,), (16384,), (16400, 48), (3 * 16384 + 208, 5 * 16384)])
def test_prefetch_writes_nothing(sizes):
    import cupy

    from kda_rt.cuda.ops.l2_prefetch import l2_prefetch

    rng = cupy.random.default_rng(sum(sizes))
    regions = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    before = [r.copy() for r in regions]
    l2_prefetch(*regions)
    cupy.cuda.Device().synchronize()
    assert all(bool((r == b).all()) for r, b in zip(regions, before, strict=True))


@pytest.mark.gpu
def test_prefetch_refusals():
    import cupy

    from kda_rt.cuda.ops.l2_prefetch import l2_prefetch

    a = cupy.zeros((64, 64), dtype=np.float32)
    with pytest.raises(ValueError, match="first must be contiguous"):
        l2_prefetch(a[:, :8])
    with pytest.raises(ValueError, match="second must start 16-byte aligned and span a multiple of 16 bytes"):
        l2_prefetch(a, a.ravel()[1:5])
    with pytest.raises(ValueError, match="first must start 16-byte aligned and span a multiple of 16 bytes"):
        l2_prefetch(a.ravel()[:3])


@pytest.mark.gpu
def test_prefetch_between_dependent_kernels_keeps_the_order():
    """add_one chains (each kernel adds 1 to what the one before wrote) with a prefetch of a 64 MB region
    between every two, captured with PDL launches and replayed: a kernel that ran before its predecessor
    finished would lose an increment."""
    import cupy
    from kernels.test_pdl import _module

    from kda_rt.cuda.ops import pdl
    from kda_rt.cuda.ops.l2_prefetch import l2_prefetch

    if not pdl.supported():
        pytest.skip("programmatic dependent launch needs sm_90+")
    kernel = pdl.Kernel(_module().get_function("add_one"))
    n, chain = 132 * 256 * 4, 48
    weights = cupy.random.default_rng(1).integers(0, 256, 64 << 20, dtype=np.uint8)
    base = cupy.random.default_rng(0).integers(0, 1000, n).astype(np.float32)
    bufs = [base.copy(), cupy.empty_like(base)]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        with pdl.capturing() as active:
            assert active
            for k in range(chain):
                kernel((n // 256,), (256,), (bufs[k % 2], bufs[(k + 1) % 2], np.int32(n)))
                l2_prefetch(weights[(k % 4) << 24:((k % 4) + 1) << 24])
        graph = stream.end_capture()
        for _ in range(5):
            graph.launch(stream)
        stream.synchronize()
    assert bool((bufs[0] == base + 5 * chain).all())
