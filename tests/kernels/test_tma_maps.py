"""kda_rt/cuda/ops/tma.py's map cache: a map made with keep=True outlives any number of others (a captured decode
graph holds its address), the others are evicted oldest first past _MAX_MAPS."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_kept_maps_are_never_evicted(monkeypatch):
    import cupy

    from kda_rt.cuda.ops import tma
    from kda_rt.cuda.ops.compile import compute_capability

    if compute_capability(cupy.cuda.Device().id) < 90:
        pytest.skip("tensor maps need sm_90+")
    monkeypatch.setattr(tma, "_MAX_MAPS", 4)
    monkeypatch.setattr(tma, "_MAPS", type(tma._MAPS)())
    monkeypatch.setattr(tma, "_KEPT", {})
    arrays = [cupy.zeros((64, 128), dtype=np.uint8) for _ in range(8)]
    kept = tma.map_2d_swizzled(arrays[0], 64, "kept", keep=True)
    first = tma.map_2d_swizzled(arrays[1], 64, "evicted")
    for a in arrays[2:]:
        tma.map_2d_swizzled(a, 64, "other")
    assert len(tma._MAPS) == 4 and len(tma._KEPT) == 1
    assert tma.map_2d_swizzled(arrays[0], 64, "kept") is kept  # still the same buffer (no new encoding)
    assert tma.map_2d_swizzled(arrays[1], 64, "evicted") is not first  # encoded again
    again = tma.map_2d_swizzled(arrays[2], 64, "other")  # an LRU hit made a kept one: moved out of the LRU
    assert tma.map_2d_swizzled(arrays[2], 64, "other", keep=True) is again and len(tma._KEPT) == 2
