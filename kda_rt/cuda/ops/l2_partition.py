"""Which SMs share an L2 partition, measured (kernels_cu/l2_probe.cu), for the MoE prefill GEMMs that claim their
work by partition (KDA_RT_MOE_L2_SPLIT, ops/moe_gemm_wg.py).

The L2 of an H100/H200 is two partitions, each holding the lines of about half the addresses and keeping copies of
the other half's lines that its own SMs read; reading a line that neither the SM's partition holds nor has a copy
of crosses the fabric between them and takes longer.  CUDA does not say which SMs sit by which partition, so each SM
in turn reads the same lines (freshly stored by one CTA first, which should drop any copies) and their latencies
are kept: SMs of one partition find the same lines slow.  `group_sms` turns the latencies into two groups, or None where they
do not split cleanly (one partition, another chip, noise): then the GEMMs claim as without the switch."""

from __future__ import annotations

import logging
import threading

import numpy as np

from kda_rt.cuda.ops.compile import get_kernel, sm_count

__all__ = ["PART_SMS", "group_sms", "partition_table", "probe_latencies", "sm_partition"]

log = logging.getLogger("kda_rt")

PART_SMS = 1024  # the partition table's length (moe_gemm_wg.cu L2_PART_SMS: above every %smid)
N_LINES = 512  # lines each SM reads (l2_probe.cu PROBE_MAX_LINES at most)
STRIDE_WORDS = 33 * 128 // 4  # 33 lines (4224 bytes) from one line to the next: a new 4 KB page each, 2.1 MB in all
MIN_GAP = 1.15  # the slow mode at least (MIN_GAP - 1) x a fast read above the fast one (else no partitions seen)
MIN_AGREE, MAX_CROSS = 0.85, 0.65  # an SM's slow-line pattern against its group's / the other group's
MAX_ASTRAY = 1 / 16  # the share of SMs that may agree with neither group (the first probed, polluted)
_CACHE: dict[int, object] = {}
_LOCK = threading.Lock()


def probe_latencies(device_id: int, n_lines: int = N_LINES) -> np.ndarray:
    """[%nsmid, n_lines] int64: the clock cycles of one L2 read of each line from the SM whose %smid is the row
    (%smid values need not be contiguous: rows of ids no SM has, and of SMs no probe CTA landed on, stay -1).  Takes
    ~0.1 s (two launches an id)."""
    import cupy

    if not 1 <= n_lines <= N_LINES:
        raise ValueError(f"L2 partitions: 1 to {N_LINES} lines a probe (l2_probe.cu PROBE_MAX_LINES), got {n_lines}")
    n_sm = sm_count(device_id)
    with cupy.cuda.Device(device_id):
        touch = get_kernel("l2_probe.cu", "l2_touch")
        probe = get_kernel("l2_probe.cu", "l2_probe")
        nsmid = cupy.zeros(1, dtype=np.int32)
        get_kernel("l2_probe.cu", "l2_nsmid")((1,), (32,), (nsmid,))
        n_ids = max(n_sm, int(nsmid.get()[0]))
        if n_ids > PART_SMS:
            raise ValueError(f"L2 partitions: %nsmid {n_ids} is past the partition table's {PART_SMS} entries")
        lines = cupy.zeros(n_lines * STRIDE_WORDS, dtype=np.uint32)
        out = cupy.full((n_ids, n_lines), -1, dtype=np.int64)
        seen = cupy.zeros(n_ids, dtype=np.int32)
        args = (lines, np.int32(n_lines), np.int32(STRIDE_WORDS))
        # one probe thrown away first: the first probed SM found a quarter of the lines slow that its group found fast
        # (H200, 2026-12-03: the lines' zero fill left copies the first touch did not drop)
        touch((1,), (256,), args)
        probe((8 * n_sm,), (32,), (*args, np.int32(0), out[0], seen[0:], np.uint32(0)))
        out.fill(-1)
        seen.fill(0)
        for s in range(n_ids):
            touch((1,), (256,), args)
            # 8 one-warp CTAs an SM: every SM gets some; the first on SM s measures, the rest return at once
            probe((8 * n_sm,), (32,), (*args, np.int32(s), out[s], seen[s:], np.uint32(0)))
        result = out.get()
    return result


def _two_means(values: np.ndarray) -> tuple[float, float]:
    """The two centres of a 1D two-cluster split (medians, so that a few very slow reads, a page's first touch, do not
    drag a centre; started at the 10th and 90th percentiles)."""
    lo, hi = (float(v) for v in np.percentile(values, [10, 90]))
    for _ in range(50):
        cut = (lo + hi) / 2
        a, b = values[values <= cut], values[values > cut]
        if not len(a) or not len(b):
            break
        new = float(np.median(a)), float(np.median(b))
        if new == (lo, hi):
            break
        lo, hi = new
    return lo, hi


def group_sms(lat: np.ndarray) -> np.ndarray | None:
    """From probe_latencies' [SMs, lines] cycles: int32 [SMs], each SM's group (0 or 1; -1 where it was not probed),
    or None when the SMs do not fall in two clean groups: each SM's reads are taken relative to its own fast ones
    (its 10th percentile), and they must be bimodal (the slow mode at least (MIN_GAP - 1) x a fast read above it;
    each SM's slow lines are those above the cut between its own two modes),
    every SM's pattern of slow lines but at most MAX_ASTRAY of them must agree with its group's on >= MIN_AGREE of the
    lines and with the other group's on <= MAX_CROSS, and each group must hold at least a quarter of the SMs probed."""
    lat = np.asarray(lat)
    probed = (lat > 0).all(axis=1)
    if probed.sum() < 4:
        return None
    L = lat[probed].astype(np.float64)
    base = float(np.median(np.percentile(L, 10, axis=1)))  # a fast read's cycles
    L -= np.percentile(L, 10, axis=1, keepdims=True)  # each SM's fast reads at 0 (SMs sit at different distances)
    fast, slow = _two_means(L.ravel())
    if slow - fast < (MIN_GAP - 1) * base:
        return None
    # each SM's own cut between its modes (the far trip's cost varies by SM), or the common one where the SM has no
    # second mode (every line fast: a partition that kept copies of the lines)
    cut = np.full(len(L), (fast + slow) / 2)
    for r, row in enumerate(L):
        f, sl = _two_means(row)
        if sl - f >= (slow - fast) / 2:
            cut[r] = (f + sl) / 2
    slow_bits = L > cut[:, None]  # [SMs probed, lines]
    agree = (slow_bits[:, None, :] == slow_bits[None, :, :]).mean(axis=2)
    a = int(np.argmax(np.median(agree, axis=1)))  # a typical SM (not one astray): one group's seed
    b = int(np.argmin(agree[a]))  # the SM least like it: the other group's seed
    member = agree[:, b] > agree[:, a]  # in b's group
    if not (len(L) // 4 <= member.sum() <= len(L) - len(L) // 4):
        return None
    pattern = [slow_bits[member == g].mean(axis=0) > 0.5 for g in (False, True)]  # each group's slow lines
    own = np.where(member, (slow_bits == pattern[1]).mean(axis=1), (slow_bits == pattern[0]).mean(axis=1))
    other = np.where(member, (slow_bits == pattern[0]).mean(axis=1), (slow_bits == pattern[1]).mean(axis=1))
    astray = (own < MIN_AGREE) | (other > MAX_CROSS)
    if astray.sum() > len(L) * MAX_ASTRAY:  # (a few astray SMs join the group they are closer to: a table entry
        return None                        # only steers which work an SM claims first, never the result)
    groups = np.full(len(lat), -1, dtype=np.int32)
    groups[probed] = member.astype(np.int32)
    return groups


def partition_table(groups: np.ndarray) -> np.ndarray:
    """group_sms' groups as the table moe_gemm_wg.cu L2_SPLIT indexes by %smid: int32 [PART_SMS], SMs not probed 0."""
    table = np.zeros(PART_SMS, dtype=np.int32)
    table[: len(groups)] = np.maximum(groups, 0)
    return table


def sm_partition(device_id: int):
    """The device's partition table for moe_gemm_wg.cu L2_SPLIT (partition_table's, as a CuPy array), measured on
    first use and kept; None when the SMs do not split in two groups, when the probe failed (both logged once), and
    while the current stream is capturing a CUDA graph before the first measurement (the probe cannot run there)."""
    import cupy

    with _LOCK:
        if device_id not in _CACHE:
            if cupy.cuda.get_current_stream().is_capturing():
                return None
            try:
                groups = group_sms(probe_latencies(device_id))
            except Exception as exc:  # (a launch or build error: the GEMMs claim as without the switch)
                log.warning("L2 partitions of device %d: the probe failed (%s); KDA_RT_MOE_L2_SPLIT has no effect",
                            device_id, exc)
                groups = None
            if groups is None:
                log.info("L2 partitions: the SMs of device %d do not split in two groups; KDA_RT_MOE_L2_SPLIT has no "
                         "effect there", device_id)
                _CACHE[device_id] = None
            else:
                log.info("L2 partitions of device %d: %d and %d SMs", device_id, int((groups == 0).sum()),
                         int((groups == 1).sum()))
                with cupy.cuda.Device(device_id):
                    _CACHE[device_id] = cupy.asarray(partition_table(groups))
        return _CACHE[device_id]
