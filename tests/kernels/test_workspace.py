"""kda_rt/cuda/workspace.py: named device buffers that keep their allocation across shapes (see its docstring)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_workspace_reuses_its_allocation_across_shapes():
    """The same shape and dtype: the same array.  Another shape that fits the name's allocation (its bytes plus
    HEADROOM): a C-contiguous view at the same address, with the right shape and dtype, whose writes land there.
    Larger than that: a new allocation of the new size plus HEADROOM.  Frozen: any other shape is an error, even one
    that fits; an empty shape works."""
    import cupy

    from kda_rt.cuda.workspace import HEADROOM, Workspace

    ws = Workspace()
    a = ws.get("x", (16384, 64), cupy.float32)
    assert ws.get("x", (16384, 64), np.float32) is a
    ptr, cap = a.data.ptr, a.nbytes + int(a.nbytes * HEADROOM)
    assert ws.nbytes() == cap
    for shape, dtype in (((16392, 64), np.float32), ((100, 3), np.float16), ((8192, 64), np.float32),
                         ((cap // 4,), np.float32)):
        b = ws.get("x", shape, dtype)
        assert b.shape == shape and b.dtype == dtype and b.flags.c_contiguous and b.data.ptr == ptr
        b[...] = 3
        assert float(b.sum()) == 3 * b.size
    c = ws.get("x", (cap // 4 + 1,), np.float32)
    assert c.data.ptr != ptr and ws.nbytes() == c.nbytes + int(c.nbytes * HEADROOM)
    other = ws.get("y", (7,), np.int32)
    assert other.data.ptr not in (c.data.ptr,) and other.data.ptr % 256 == 0
    assert ws.get("z", (0, 2304), np.uint16).shape == (0, 2304)
    ws.frozen = True
    assert ws.get("x", (cap // 4 + 1,), np.float32) is c
    with pytest.raises(RuntimeError, match="would be allocated inside a CUDA-graph capture"):
        ws.get("x", (10,), np.float32)
