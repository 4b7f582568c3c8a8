"""kernels_cu/kda_prefill.cu against the float64 NumPy KDA (kda_rt.reference.kda_core) on the same
bf16-rounded inputs: conv -> SiLU -> bf16 -> l2norm -> gate -> beta -> recurrence -> bf16(o) -> gated norm.

Tolerances: out RMS(out - ref) / RMS(ref) <= 5e-3 (bf16 rounding of o and y, plus rare 1-ulp flips
where the fp32 conv output sits on a bf16 rounding boundary); recurrent state per slot <= 1e-4
(fp32 chunked math vs float64 token loop); conv state exact (it is a copy of bf16 inputs); slots
not in the batch untouched.  Letters: T tokens, B sequences, H heads, K = V = 128, P = H*K, W = 4, S slots.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.gpu import BF16
from helpers.kda_kernel import K, check, make_inputs, reference, run_op, upload

pytestmark = pytest.mark.gpu



CASES = [  # (lengths, H, gates)
    ([1, 3, 64, 65, 200], 4, "normal"),
    ([1, 3, 64, 65, 200], 4, "mixed"),
    ([200, 65, 3], 8, "extreme"),
    ([130, 1], 8, "near_zero"),
    ([130], 32, "normal"),
]


@pytest.mark.parametrize("lengths, num_heads, gates", CASES,
                         ids=[f"L{'-'.join(map(str, c[0]))}-H{c[1]}-{c[2]}" for c in CASES])
def test_kda_prefill(lengths, num_heads, gates):
    from kda_rt.cuda.ops.kda_prefill import kda_prefill

    rng = np.random.default_rng(sum(lengths) * num_heads)
    inp = make_inputs(rng, lengths, num_heads, gates)
    dev = upload(inp)
    out = run_op(kda_prefill, dev, num_heads)
    check(out, dev, reference(inp, num_heads), inp, f"prefill {lengths} H{num_heads} {gates}")


def bench_prefill(num_seqs=8, seqlen=2048, num_heads=32, iters=5):
    """Time one layer's kda_prefill (prep + chunk) at num_seqs x seqlen tokens."""
    import cupy

    from kda_rt.cuda.ops.kda_prefill import kda_prefill

    rng = np.random.default_rng(0)
    lengths = [seqlen] * num_seqs
    inp = make_inputs(rng, [1] * num_seqs, num_heads, num_slots=num_seqs)  # small host pools, then big device inputs
    dev = upload(inp)
    T, P = num_seqs * seqlen, num_heads * K
    for name, cols in (("qkv", 3 * P), ("f", P), ("gate", P)):
        dev[name] = cupy.random.standard_normal((T, cols), dtype=np.float32).astype(BF16)
    dev["b"] = cupy.random.standard_normal((T, num_heads), dtype=np.float32).astype(BF16)
    dev["cu_seqlens"] = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    out = run_op(kda_prefill, dev, num_heads)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(iters):
        run_op(kda_prefill, dev, num_heads, out=out)
    stop.record()
    stop.synchronize()
    ms = cupy.cuda.get_elapsed_time(start, stop) / iters
    print(f"kda_prefill {num_seqs}x{seqlen} H{num_heads}: {ms:.3f} ms, {T / ms / 1e3:.2f} M tok/s")


if __name__ == "__main__":
    import sys

    for case in CASES:
        test_kda_prefill(*case)
    if "--bench" in sys.argv:
        bench_prefill(1, 2048)
        bench_prefill(8, 2048)
