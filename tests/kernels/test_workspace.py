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


def test_shared_workspace_views_and_lock():
    """A shared workspace (KDA_RT_SHARED_GRAPH_WS: every decode graph's buffers views of one allocation a name):
    frozen, it still hands out views of other shapes that fit (each graph's own shapes at its replays' metadata
    upload), at the same address; a shape that does not fit is the capture error as before; locked (graphs captured
    on it), an allocation that would move a buffer is WorkspaceFull instead, while a new name is allocated (it moves
    nothing a captured graph uses), and unlocked it grows."""
    import cupy

    from kda_rt.cuda.workspace import Workspace, WorkspaceFull

    ws = Workspace(shared=True)
    big = ws.get("logits", (7, 1024), np.float32)
    ws.frozen = True
    small = ws.get("logits", (5, 1024), np.float32)
    assert small.data.ptr == big.data.ptr and small.shape == (5, 1024)
    small[...] = 2
    assert float(cupy.asarray(big[:5]).sum()) == 2 * 5 * 1024
    with pytest.raises(RuntimeError, match="would be allocated inside a CUDA-graph capture"):
        ws.get("logits", (70, 1024), np.float32)
    ws.frozen, ws.locked = False, True
    assert ws.get("logits", (3, 1024), np.float32).data.ptr == big.data.ptr
    with pytest.raises(WorkspaceFull, match="'logits' \\(70, 1024\\) float32 is larger than its allocation"):
        ws.get("logits", (70, 1024), np.float32)
    new = ws.get("new_name", (4,), np.float32)
    assert new.shape == (4,) and ws.get("logits", (7, 1024), np.float32).data.ptr == big.data.ptr
    with pytest.raises(WorkspaceFull, match="'new_name' \\(8,\\) float32"):
        ws.get("new_name", (8,), np.float32)
    ws.locked = False
    grown = ws.get("logits", (70, 1024), np.float32)
    assert grown.shape == (70, 1024) and ws.get("new_name", (8,), np.float32).shape == (8,)
    plain = Workspace()  # (not shared: frozen refuses every other shape, as test_workspace_reuses... says)
    plain.get("x", (8,), np.float32)
    plain.frozen = True
    with pytest.raises(RuntimeError, match="would be allocated"):
        plain.get("x", (4,), np.float32)
