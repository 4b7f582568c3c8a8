"""kernels_cu/embed.cu: out[t] = table[ids[t]] — a copy, so the check is exact (bit equality);
ids outside [0, V) give zero rows."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.gpu import bf16_round, poison, to_gpu_bf16, to_np

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T, V, D", [(1, 1000, 2304), (37, 32768, 2304), (300, 64, 72), (5, 7, 8)], ids=str)
def test_embed(T, V, D):
    import cupy

    from kda_rt.cuda.ops.embed import embed

    rng = np.random.default_rng(T + V + D)
    table = bf16_round(rng.normal(size=(V, D)))
    ids = rng.integers(0, V, size=T).astype(np.int32)
    out = to_gpu_bf16(np.zeros((T, D)))
    poison(out)
    embed(cupy.asarray(ids), to_gpu_bf16(table), out=out)
    assert np.array_equal(to_np(out), table[ids]), "embed must copy rows exactly"


def test_embed_out_of_range_ids_give_zero_rows():
    import cupy

    from kda_rt.cuda.ops.embed import embed

    table = bf16_round(np.random.default_rng(0).normal(size=(10, 64)))
    ids = np.array([3, -1, 10, 9], dtype=np.int32)
    got = to_np(embed(cupy.asarray(ids), to_gpu_bf16(table)))
    assert np.array_equal(got[[0, 3]], table[[3, 9]]) and not got[[1, 2]].any()


if __name__ == "__main__":
    test_embed(37, 32768, 2304)
    print("ok")
