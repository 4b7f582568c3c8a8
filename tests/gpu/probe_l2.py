"""The L2 partition probe's raw measurements on this GPU (ops/l2_partition.py, kernels_cu/l2_probe.cu), for reading
when the grouping finds no partitions or finds unexpected ones: the latency histogram, each SM's share of slow
reads, how well each SM agrees with its group, the groups' %smid lists, and the [SMs, lines] cycles saved as .npy.

    PYTHONPATH=. python tests/gpu/probe_l2.py [--out l2_latency.npy] [--lines 512]
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    import cupy

    from kda_rt.cuda.ops.l2_partition import _two_means, group_sms, probe_latencies

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="", help="save the [SMs, lines] cycles here (.npy)")
    ap.add_argument("--lines", type=int, default=512)
    args = ap.parse_args()
    dev = cupy.cuda.Device().id
    lat = probe_latencies(dev, args.lines)
    if args.out:
        np.save(args.out, lat)
    probed = (lat > 0).all(axis=1)
    print(f"{int(probed.sum())} of {len(lat)} SMs probed, {lat.shape[1]} lines each")
    L = lat[probed].astype(np.float64)
    print("cycles, percentiles 1/10/25/50/75/90/99:", np.percentile(L, [1, 10, 25, 50, 75, 90, 99]).round().tolist())
    rel = L - np.percentile(L, 10, axis=1, keepdims=True)
    fast, slow = _two_means(rel.ravel())
    print(f"relative to each SM's fast reads: modes at {fast:.0f} and {slow:.0f} cycles")
    hist, edges = np.histogram(rel.ravel(), bins=24, range=(np.percentile(rel, 1), np.percentile(rel, 99)))
    for n, lo in zip(hist, edges, strict=False):
        print(f"  {lo:8.0f} {'#' * int(60 * n / max(1, hist.max()))}")
    bits = rel > (fast + slow) / 2
    print("slow share per SM, percentiles 0/25/50/75/100:",
          np.percentile(bits.mean(axis=1), [0, 25, 50, 75, 100]).round(3).tolist())
    agree = (bits[:, None, :] == bits[None, :, :]).mean(axis=2)
    print("pairwise agreement, percentiles 1/25/50/75/99:", np.percentile(agree, [1, 25, 50, 75, 99]).round(3).tolist())
    groups = group_sms(lat)
    if groups is None:
        print("grouping: none (the switch KDA_RT_MOE_L2_SPLIT would have no effect)")
    else:
        for g in (0, 1):
            print(f"group {g}: {int((groups == g).sum())} SMs, %smid {np.flatnonzero(groups == g).tolist()}")


if __name__ == "__main__":
    main()
