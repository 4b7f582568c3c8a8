"""ops/l2_partition.py: the grouping of SMs by L2 partition from their read latencies (synthetic latencies on the
CPU: the two ways a chip may show its partitions, and the measurements that must give no grouping), and the probe
itself on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

from kda_rt.cuda.ops.l2_partition import PART_SMS, group_sms

N_SM, N_LINES = 132, 512


def synthetic(rng, part, far_of, near=260.0, far=470.0, spread=25.0):
    """[SMs, lines] latencies: SM s reads line i slowly where far_of(part[s], i)."""
    slow = np.array([[far_of(p, i) for i in range(N_LINES)] for p in part])
    lat = np.where(slow, far, near) + rng.normal(0, spread, size=slow.shape)
    return np.maximum(lat, 1).astype(np.int64)


def same_groups(got, part):
    """got equals part up to the groups' names (0 / 1 are arbitrary)."""
    return got is not None and (np.array_equal(got, part) or np.array_equal(got, 1 - part))


@pytest.mark.parametrize("copies_kept", [False, True])
def test_two_partitions_are_found(copies_kept):
    """Half the lines are held by each partition: an SM reads the other half slowly (copies_kept False), or, where the
    storing CTA's partition kept copies of every line, that partition's SMs read every line fast (True)."""
    rng = np.random.default_rng(1)
    part = rng.permutation(np.arange(N_SM) % 2)
    home = rng.integers(0, 2, N_LINES)
    if copies_kept:
        far_of = lambda p, i: p == 1 and home[i] == 0  # noqa: E731
    else:
        far_of = lambda p, i: home[i] != p  # noqa: E731
    got = group_sms(synthetic(rng, part, far_of))
    assert same_groups(got, part), got
    assert got.dtype == np.int32 and got.shape == (N_SM,)


@pytest.mark.parametrize("case", ["sm-offsets", "far-cost-varies", "page-spikes"])
def test_two_partitions_through_uneven_sms(case):
    """The grouping holds where SMs sit at different distances from L2 (each SM's reads shifted by its own offset,
    std 40 cycles), where the far trip costs each SM differently (its slow reads 150-270 cycles above its fast ones),
    and where every 16th read takes 1500 cycles more (a page's first touch)."""
    rng = np.random.default_rng(4)
    part = rng.permutation(np.arange(N_SM) % 2)
    home = rng.integers(0, 2, N_LINES)
    lat = synthetic(rng, part, lambda p, i: home[i] != p).astype(np.float64)
    slow = home[None, :] != part[:, None]
    if case == "sm-offsets":
        lat += rng.normal(0, 40, size=(N_SM, 1))
    elif case == "far-cost-varies":
        lat += slow * rng.uniform(-60, 60, size=(N_SM, 1))
    else:
        lat[:, ::16] += 1500
    assert same_groups(group_sms(lat.astype(np.int64)), part)


def test_partition_table():
    """The kernel's table: PART_SMS int32 entries, each probed SM's group at its %smid, unprobed SMs and the rest 0."""
    from kda_rt.cuda.ops.l2_partition import partition_table

    t = partition_table(np.array([0, 1, -1, 1], dtype=np.int32))
    assert t.dtype == np.int32 and t.shape == (PART_SMS,) and t[:4].tolist() == [0, 1, 0, 1] and not t[4:].any()


def test_unprobed_sms_are_named_minus_one():
    """Rows of SMs no probe CTA landed on (-1) stay out of the grouping and come back as -1."""
    rng = np.random.default_rng(2)
    part = np.arange(N_SM) % 2
    home = rng.integers(0, 2, N_LINES)
    lat = synthetic(rng, part, lambda p, i: home[i] != p)
    lat[[5, 77]] = -1
    got = group_sms(lat)
    keep = np.ones(N_SM, bool)
    keep[[5, 77]] = False
    assert got is not None and (got[[5, 77]] == -1).all() and same_groups(got[keep], part[keep])


def test_a_few_astray_sms_join_the_closer_group():
    """Up to 1/16 of the SMs may agree with neither group (here 8 of 132, the first among them: the seeds must not
    come from an astray SM); each joins the group it is closer to."""
    rng = np.random.default_rng(5)
    part = rng.permutation(np.arange(N_SM) % 2)
    home = rng.integers(0, 2, N_LINES)
    lat = synthetic(rng, part, lambda p, i: home[i] != p)
    astray = [0, 20, 40, 60, 80, 100, 120, 131]
    for r in astray:  # a quarter of the other group's slow lines read fast: closer to its own group still
        lat[r] = synthetic(rng, [part[r]], lambda p, i: home[i] != p and rng.random() < 0.75)[0]
    assert same_groups(group_sms(lat), part)


def test_the_h200_measurement():
    """The probe's latencies measured on an H200 (2026-12-03, tests/gpu/probe_l2.py --out, as uint16): the SMs of the
    storing CTA's partition read every line fast, the others half the lines slow, and the first SM probed found a
    quarter slow (copies the zero fill left); 66 and 66 SMs, in %smid pairs."""
    from pathlib import Path

    lat = np.load(Path(__file__).parent / "data" / "h200_l2_latency.npz")["lat"].astype(np.int64)
    got = group_sms(lat)
    assert got is not None and (got == 0).sum() == (got == 1).sum() == 66
    assert (got[0::2] == got[1::2]).all()  # the two SMs of a TPC share a partition


@pytest.mark.parametrize("case", ["one-partition", "random-patterns", "many-astray", "lopsided", "too-few"])
def test_no_clean_split_gives_none(case):
    """No grouping (None: the GEMMs claim as without the switch) where the latencies are one mode, where every SM sees
    its own random slow lines, where more than 1/16 of the SMs agree with neither group, where one group is under a quarter of the SMs,
    and with fewer than 4 SMs probed."""
    rng = np.random.default_rng(3)
    home = rng.integers(0, 2, N_LINES)
    part = np.arange(N_SM) % 2
    if case == "one-partition":
        lat = synthetic(rng, part, lambda p, i: False)
    elif case == "random-patterns":
        noise = rng.integers(0, 2, (N_SM, N_LINES)).astype(bool)
        lat = synthetic(rng, np.arange(N_SM), lambda s, i: noise[s, i])
    elif case == "many-astray":
        lat = synthetic(rng, part, lambda p, i: home[i] != p)
        for r in range(0, 9 * 13, 13):  # 9 of 132 SMs: past the 1/16 the grouping lets agree with neither group
            lat[r] = synthetic(rng, [0], lambda p, i: rng.random() < 0.5)[0]
    elif case == "lopsided":
        part = (np.arange(N_SM) < 20).astype(int)
        lat = synthetic(rng, part, lambda p, i: home[i] != p)
    else:
        lat = synthetic(rng, part, lambda p, i: home[i] != p)
        lat[3:] = -1
    assert group_sms(lat) is None


@pytest.mark.gpu
def test_probe_on_the_gpu():
    """The probe on this GPU: every SM probed once (a row of cycle counts for as many %smid values as there are
    SMs, the other ids' rows left at -1), reads that took between 10 and 100,000 cycles, and on Hopper (sm_90a, whose L2 is two partitions) two groups of SMs, with a
    table the WS kernel can index by %smid (int32, PART_SMS entries of 0 or 1, both present); elsewhere a grouping or
    none.  The latencies and groups are printed for the record (docs/PERFORMANCE.md)."""
    import cupy

    from kda_rt.cuda.ops.compile import device_arch, sm_count
    from kda_rt.cuda.ops.l2_partition import probe_latencies, sm_partition

    dev = cupy.cuda.Device().id
    lat = probe_latencies(dev)
    rows = (lat != -1).all(axis=1)  # (ids no SM has stay -1: %smid need not be contiguous)
    assert lat.shape[0] >= sm_count(dev) and lat.shape[1] == 512 and rows.sum() == sm_count(dev), rows.sum()
    assert (lat[rows] > 10).all() and (lat[rows] < 100_000).all() and (lat[~rows] == -1).all(), lat[rows].min()
    groups = group_sms(lat)
    print("latency percentiles (cycles) 5/25/50/75/95:", np.percentile(lat, [5, 25, 50, 75, 95]).round(),
          "groups:", None if groups is None else np.bincount(groups[groups >= 0]).tolist())
    if device_arch() == "sm_90a":
        assert groups is not None, "no two L2 partitions found on Hopper"
    table = sm_partition(dev)
    if groups is None:
        assert table is None
    else:
        t = cupy.asnumpy(table)
        assert t.dtype == np.int32 and t.shape == (PART_SMS,) and set(np.unique(t)) <= {0, 1}
        assert 0 < t[: len(groups)].sum() < len(groups)


def l2_split_claims(tile_expert, nfb, parts, rng, pairs=False):
    """moe_gemm_wg.cu L2_SPLIT's claims, step for step (thread 0 of each CTA's producer, or with `pairs` (MC) of each
    cluster's rank 0, whose items are pairs of tiles; `parts`: each claimer's partition), the atomics interleaved at
    random: [(claimer, item)] in claim order, the counters at the end, and the tile where the halves meet."""
    ntiles = len(tile_expert)
    items = (ntiles + 1) // 2 * nfb if pairs else ntiles * nfb
    mid = split = ntiles // 2
    for d in range(17) if 0 < mid < ntiles else ():  # (L2_SCAN = 16)
        if mid - d > 0 and tile_expert[mid - d] != tile_expert[mid - d - 1]:
            split = mid - d
            break
        if mid + d < ntiles and tile_expert[mid + d] != tile_expert[mid + d - 1]:
            split = mid + d
            break
    cut = (split // 2 if pairs else split) * nfb
    claim = [0, 0, 0, 0]
    state = []
    for part in parts:
        own = (cut, items, 0, cut, 2, 0) if part else (0, cut, cut, items, 0, 2)
        state.append({"own_lo": own[0], "own_hi": own[1], "oth_lo": own[2], "oth_hi": own[3], "own": own[4],
                      "oth": own[5], "stolen": False, "done": False})
    got = []
    while not all(s["done"] for s in state):
        c = int(rng.choice([i for i, s in enumerate(state) if not s["done"]]))
        s = state[c]
        if not s["stolen"]:
            w = s["own_lo"] + claim[s["own"]]
            claim[s["own"]] += 1
            if w < s["own_hi"]:
                got.append((c, w))
                continue
            s["stolen"] = True
            continue  # (the kernel claims from the other half at once: one atomic an interleaving step here)
        w = s["oth_lo"] + claim[s["oth"]]
        claim[s["oth"]] += 1
        if w < s["oth_hi"]:
            got.append((c, w))
        else:
            s["done"] = True
            claim[1] += 1
            if claim[1] == len(parts):
                claim[0] = claim[1] = claim[2] = 0
    return got, claim, split


@pytest.mark.parametrize("pairs", [False, True], ids=["tiles", "mc-pairs"])
@pytest.mark.parametrize("seed", range(6))
def test_l2_split_claims_every_item_once(seed, pairs):
    """The split claims (as moe_gemm_wg.cu L2_SPLIT takes them): every item exactly once across the CTAs, each CTA's
    own half first, the halves cut at the expert boundary nearest the middle tile (the middle itself with one
    expert), the counters back at 0 when the last CTA is done; plans with 0, 1 and many tiles, one expert, and more
    CTAs of one partition than the other."""
    rng = np.random.default_rng(seed)
    ntiles = [0, 1, 2, 37, 150, 64][seed]
    tile_expert = np.sort(rng.integers(0, 1 if seed == 5 else 40, ntiles))
    parts = (rng.random(int(rng.integers(1, 40))) < (0.8 if seed == 4 else 0.5)).astype(int)
    got, claim, split = l2_split_claims(tile_expert, 8, parts, rng, pairs)
    n_items = (ntiles + 1) // 2 * 8 if pairs else ntiles * 8
    assert sorted(w for _, w in got) == list(range(n_items)) and claim == [0, 0, 0, 0]
    bounds = [t for t in range(1, ntiles) if tile_expert[t] != tile_expert[t - 1]]  # every expert boundary
    if bounds and min(abs(t - ntiles // 2) for t in bounds) <= 16:  # the nearest one within the scan
        assert abs(split - ntiles // 2) == min(abs(t - ntiles // 2) for t in bounds) and split in bounds, split
    else:
        assert split == ntiles // 2
    cut = (split // 2 if pairs else split) * 8
    for c in range(len(parts)):  # a CTA takes its own half's items before any of the other's
        halves = [int(w >= cut) for cc, w in got if cc == c]
        first_other = next((i for i, h in enumerate(halves) if h != parts[c]), len(halves))
        assert all(h != parts[c] for h in halves[first_other:]), (c, halves)
