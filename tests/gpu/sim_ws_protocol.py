#!/usr/bin/env python3
"""Randomized interleaving simulation of moe_grouped_gemm_ws's MC = 1 protocol (kernels_cu/moe_gemm_wg.cu), a model of
the kernel's barriers and copies (keep it in step with the kernel when the protocol changes; CPU only):

    python tests/gpu/sim_ws_protocol.py [--runs 1000] [--seed 1] [--mutate NAME] [--stop]

Exit status 1 when a run violates a check (tests/kernels/test_ws_protocol.py runs 25 schedules and two mutations on
CI).  Written 2026-12-03 (forty-first session) to check the MC form before its first GPU run: 6,000
schedules clean, eight of ten injected protocol bugs caught in most runs.

Actors (each a generator that yields a readiness predicate before every atomic step):
  per CTA: producer thread p0 (claims / handoff / expect_tx / TMA issue / sentinel / counter reset),
           NP more producer threads (non-A_TMA builds: cp.async A pieces + cp.async.mbarrier.arrive.noinc),
           NW consumer warps (full wait, stage_item read, "wgmma" reads, local + remote empty arrivals, epilogue).
Asynchronous deliveries, picked at random like actors:
  - remote ops of one thread (st.shared::cluster + mbarrier.arrive.release.cluster) in per-thread FIFO order,
  - each TMA box (per destination CTA for multicast: each half lands in each CTA independently) = write + complete_tx,
  - cp.async pieces + their noinc arrival, FIFO per producer thread.
mbarriers: phase (completed count), pending count, tx-count; try_wait.parity is emulated by parity only and the
simulator asserts the phase it passes on is the one the code meant (ABA / early pass detection).
Checks: no deadlock; over-arrival; tx range; every read stage holds complete data of the right fill/item/k step;
no write (issued or landing) into a stage while a consumer of that CTA may still read it; stage_item not
rewritten while read; every (tile, feature block) computed exactly once by the right CTA with all k steps;
cluster barrier completes only with nothing in flight into either CTA; claim counter back to [0, 0] after every
launch (several clusters, two launches back to back).
Mutations (--mutate NAME) inject known bugs to show the checks catch them.
"""
from __future__ import annotations

import argparse
import random
import sys
from collections import deque

BOX = 16384          # bytes of one weight box (BN/2 rows x 128 B at BN = 256)
A_BYTES = 16384


MUTATIONS = ("ghost_bytes", "keep_slot", "no_taken_wait", "ready_parity", "reset_count_full_grid", "mc_any",
             "mc_half_expect", "rank1_no_empty_wait", "empty8_no_remote", "no_remote_arrive")  # keep_slot: not a bug


class Violation(Exception):
    pass


class MBar:
    def __init__(self, name, count):
        self.name, self.count = name, count
        self.pending, self.tx, self.phase = count, 0, 0
        self.min_tx = 0
        self.tags = []          # fill index of each arrival in the current phase (empty barriers)
        self.drift = 0          # phases that completed holding an arrival of a later fill

    def _check(self):
        if not (-(2**20 - 1) <= self.tx <= 2**20 - 1):
            raise Violation(f"{self.name}: tx-count {self.tx} out of range")
        if self.pending == 0 and self.tx == 0:
            if self.tags and any(t > self.phase for t in self.tags):
                self.drift += 1
            self.tags = []
            self.phase += 1
            self.pending = self.count

    def arrive(self, n=1, tx=0, tag=None):
        if tag is not None:
            self.tags.append(tag)
        self.tx += tx  # expect-tx before the arrive (one atomic operation)
        self.min_tx = min(self.min_tx, self.tx)
        if n > self.pending:
            raise Violation(f"{self.name}: {n} arrivals on a phase with {self.pending} pending (phase {self.phase})")
        self.pending -= n
        self._check()

    def complete_tx(self, b):
        self.tx -= b
        self.min_tx = min(self.min_tx, self.tx)
        if self.pending == 0 and self.tx < 0:
            raise Violation(f"{self.name}: complete_tx past zero after all arrivals (phase {self.phase})")
        self._check()


class G:  # global state of one run
    pass


def wait(bar, k, who):
    """mbarrier.try_wait.parity for the completion of phase k (parity k & 1), with the check that the passing
    phase is phase k's."""
    yield lambda: (bar.phase & 1) != (k & 1)
    if bar.phase != k + 1:
        raise Violation(f"{who}: parity wait for phase {k} of {bar.name} passed at completed={bar.phase}")


class CTA:
    def __init__(self, g, cl, rank):
        self.g, self.cl, self.rank = g, cl, rank
        S = g.S
        m = g.mut
        self.full = [MBar(f"c{cl}r{rank}.full[{s}]", g.FULL_COUNT) for s in range(S)]
        ecount = 8 if m == "empty8_no_remote" else g.NW * 2
        self.empty = [MBar(f"c{cl}r{rank}.empty[{s}]", ecount) for s in range(S)]
        self.ready = [MBar(f"c{cl}r{rank}.ready[{s}]", 1) for s in range(2)]
        self.taken = [MBar(f"c{cl}r{rank}.taken[{s}]", 1) for s in range(2)]
        self.pair_slot = [None, None]
        self.claimed = [None, None]
        self.stage_item = [None] * S
        self.data = [dict() for _ in range(S)]         # region -> token
        self.readers = [set() for _ in range(S)]       # consumer warps whose products may still read the stage
        self.meta_readers = [set() for _ in range(S)]  # warps that read stage_item and have not freed the stage
        self.inflight = [dict() for _ in range(S)]     # region -> count of writes issued, not landed
        self.pbar = [0, 0]  # producer named barrier: arrived count, generation


def pair_item(g, w, rank):
    q = w // g.NFB
    fb = w - q * g.NFB
    tile = 2 * q + rank
    ghost = tile >= g.ntiles
    mc = 2 * q + 1 < g.ntiles and g.tile_expert[2 * q] == g.tile_expert[2 * q + 1]
    if g.mut == "mc_any" and 2 * q + 1 < g.ntiles:
        mc = True
    e = 0 if ghost else g.tile_expert[tile]
    nrows = 0 if ghost else g.tile_nrows[tile]
    return dict(tile=tile, fb=fb, ghost=ghost, mc=mc, e=e, nrows=nrows)


def issue_write(g, cta, stage, region, token, then):
    """An asynchronous write into cta's stage: checked when issued (it may start at once) and when it lands."""
    if cta.readers[stage]:
        raise Violation(f"c{cta.cl}r{cta.rank} stage {stage} region {region}: write issued while warps "
                        f"{sorted(cta.readers[stage])} may still read it")
    cta.inflight[stage][region] = cta.inflight[stage].get(region, 0) + 1

    def land():
        if cta.readers[stage]:
            raise Violation(f"c{cta.cl}r{cta.rank} stage {stage} region {region}: write landed while warps "
                            f"{sorted(cta.readers[stage])} read it")
        cta.data[stage][region] = token
        cta.inflight[stage][region] -= 1
        then()
    return land


def producer(g, cta, p):
    peer = g.ctas[cta.cl][cta.rank ^ 1]
    me = f"c{cta.cl}r{cta.rank}.prod{p}"
    fifo = g.fifos.setdefault(me, deque())
    S, KT = g.S, g.KT
    it = 0
    n = 0
    while True:
        w = None
        if p == 0:
            slot = n & 1
            if cta.rank == 0:
                if n >= 2 and g.mut != "no_taken_wait":
                    yield from wait(cta.taken[slot], (n >> 1) - 1, me)
                yield lambda: True
                w = g.claim[0]
                g.claim[0] += 1
                g.claims_made.append((cta.cl, w))

                def handoff(w=w, slot=slot):
                    peer.pair_slot[slot] = w  # st.shared::cluster, then the release arrive (ordered)
                    peer.ready[slot].arrive(1)
                fifo.append((peer, handoff))
                yield lambda: True
            else:
                k = (n >> 1) if g.mut != "ready_parity" else (n >> 1) + 1
                yield from wait(cta.ready[slot], k, me)
                w = cta.pair_slot[slot]
                if w is None:
                    raise Violation(f"{me}: read an empty pair slot")
                cta.pair_slot[slot] = None if g.mut != "keep_slot" else w  # mark consumed (a re-read would show)
                fifo.append((peer, lambda slot=slot: peer.taken[slot].arrive(1)))
                yield lambda: True
        if not g.A_TMA:
            if p == 0:
                cta.claimed[n & 1] = w
            # producer_barrier (NP threads)
            gen = cta.pbar[1]
            cta.pbar[0] += 1
            if cta.pbar[0] == g.NP:
                cta.pbar[0] = 0
                cta.pbar[1] += 1
            yield lambda gen=gen: cta.pbar[1] > gen
            w = cta.claimed[n & 1]
        items = g.items
        if w >= items:
            break
        im = pair_item(g, w, cta.rank)
        for kt in range(KT):
            stage = it % S
            skip_empty = g.mut == "rank1_no_empty_wait" and cta.rank == 1
            if it >= S and not skip_empty:
                yield from wait(cta.empty[stage], it // S - 1, me)
            if p == 0:
                if kt == 0:
                    if cta.meta_readers[stage]:
                        raise Violation(f"{me}: stage_item[{stage}] rewritten while read by {cta.meta_readers[stage]}")
                    cta.stage_item[stage] = (it // S, w)
                if im["ghost"]:
                    bytes_ = 0 if g.mut != "ghost_bytes" else 2 * BOX
                else:
                    bytes_ = 2 * BOX + (A_BYTES if g.A_TMA else 0)
                    if g.mut == "mc_half_expect" and im["mc"]:
                        bytes_ -= BOX
                cta.full[stage].arrive(1, bytes_)
                yield lambda: True
                def btok(h, it=it, e=im["e"], fb=im["fb"], kt=kt):
                    return ("B", it, e, fb, kt, h)

                if im["mc"]:
                    h = cta.rank
                    for dst in (cta, peer):
                        ev = issue_write(g, dst, stage, f"B{h}", btok(h),
                                         lambda dst=dst, stage=stage: dst.full[stage].complete_tx(BOX))
                        g.events.append(ev)
                elif not im["ghost"]:
                    for h in (0, 1):
                        ev = issue_write(g, cta, stage, f"B{h}", btok(h),
                                         lambda stage=stage: cta.full[stage].complete_tx(BOX))
                        g.events.append(ev)
                if g.A_TMA and not im["ghost"]:
                    ev = issue_write(g, cta, stage, "A", ("A", it, im["tile"], kt),
                                     lambda stage=stage: cta.full[stage].complete_tx(A_BYTES))
                    g.events.append(ev)
                yield lambda: True
            if not g.A_TMA:
                tok = ("A", it, im["tile"] if not im["ghost"] else "zero", kt)
                ev = issue_write(g, cta, stage, f"A{p}", tok, lambda stage=stage: cta.full[stage].arrive(1))
                g.cpq.setdefault(me, deque()).append(ev)  # (the noinc arrival once this thread's pieces land)
                yield lambda: True
            it += 1
        n += 1
    if p == 0:
        stage = it % S
        if it >= S:
            yield from wait(cta.empty[stage], it // S - 1, me)
        if cta.meta_readers[stage]:
            raise Violation(f"{me}: sentinel stage_item[{stage}] written while read")
        cta.stage_item[stage] = (it // S, -1)
        cta.full[stage].arrive(g.FULL_COUNT)
        yield lambda: True
        if cta.rank == 0:
            old = g.claim[1]
            g.claim[1] += 1
            ndone = g.nclusters if g.mut != "reset_count_full_grid" else 2 * g.nclusters
            if old == ndone - 1:
                g.claim[0] = 0
                g.claim[1] = 0
            yield lambda: True
    yield from cluster_barrier(g, cta, me)


def consumer(g, cta, wid):
    peer = g.ctas[cta.cl][cta.rank ^ 1]
    me = f"c{cta.cl}r{cta.rank}.warp{wid}"
    fifo = g.fifos.setdefault(me, deque())
    S, KT = g.S, g.KT
    wg = wid // (g.NW // 2)
    it = 0

    def free(step):
        stage, fill = step % S, step // S
        cta.readers[stage].discard(wid)
        cta.meta_readers[stage].discard(wid)
        cta.empty[stage].arrive(1, tag=fill)
        if g.mut not in ("empty8_no_remote", "no_remote_arrive"):
            fifo.append((peer, lambda: peer.empty[stage].arrive(1, tag=fill)))

    while True:
        stage = it % S
        yield from wait(cta.full[stage], it // S, me)
        tag = cta.stage_item[stage]
        if tag is None or tag[0] != it // S:
            raise Violation(f"{me}: stage_item[{stage}] = {tag}, expected fill {it // S}")
        w = tag[1]
        cta.meta_readers[stage].add(wid)
        if w < 0:
            break
        im = pair_item(g, w, cta.rank)
        mma = wg * 64 < im["nrows"]
        for kt in range(KT):
            stage = it % S
            if kt > 0:
                yield from wait(cta.full[stage], it // S, me)
            if mma:
                d = cta.data[stage]
                want = {f"B{h}": ("B", it, im["e"], im["fb"], kt, h) for h in (0, 1)}
                if g.A_TMA:
                    want["A"] = ("A", it, im["tile"], kt)
                else:
                    for pp in range(g.NP):
                        want[f"A{pp}"] = ("A", it, im["tile"], kt)
                for r, tok in want.items():
                    if d.get(r) != tok:
                        raise Violation(f"{me}: step {it} (tile {im['tile']} fb {im['fb']} kt {kt}) region {r} holds "
                                        f"{d.get(r)}, expected {tok}")
                    if cta.inflight[stage].get(r, 0):
                        raise Violation(f"{me}: step {it} region {r} read while a write into it is in flight")
                cta.readers[stage].add(wid)
                g.products.setdefault((cta.cl, cta.rank, wid, im["tile"], im["fb"]), []).append(kt)
            yield lambda: True
            if kt > 0:
                free(it - 1)
                yield lambda: True
            it += 1
        free(it - 1)
        yield lambda: True
        if im["ghost"]:
            continue
        g.epilogues.append((cta.cl, cta.rank, wid, im["tile"], im["fb"], mma))
    yield from cluster_barrier(g, cta, me)


def cluster_barrier(g, cta, me):
    # barrier.cluster.arrive.release: this thread's earlier remote ops are performed first
    yield lambda: not g.fifos.get(me)
    cb = g.cbar[cta.cl]
    cb["arrived"] += 1
    if cb["arrived"] == cb["expected"]:
        for c in g.ctas[cta.cl]:
            for s in range(g.S):
                if any(c.inflight[s].values()):
                    raise Violation(f"cluster {cta.cl}: barrier completes with copies in flight into c{c.cl}r{c.rank}")
        for q in g.fifos.values():
            if q and any(dst.cl == cta.cl for dst, _ in q):
                raise Violation(f"cluster {cta.cl}: barrier completes with remote ops in flight")
        cb["done"] = True
    yield lambda: cb["done"]


def make_plan(rng):
    E = rng.randint(1, 5)
    counts = [rng.choice([0, 0, 1, 1, 2, 3, 4, 5]) for _ in range(E)]
    if sum(counts) == 0:
        counts[rng.randrange(E)] = rng.randint(1, 3)
    tile_expert, tile_nrows = [], []
    for e, c in enumerate(counts):
        for i in range(c):
            tile_expert.append(e)
            tile_nrows.append(128 if i < c - 1 else rng.choice([1, 30, 64, 65, 100, 128]))
    return tile_expert, tile_nrows


def run_once(seed, mut=None, verbose=False):
    rng = random.Random(seed)
    g = G()
    g.mut = mut
    g.A_TMA = rng.random() < 0.5
    g.NW = 8
    g.NP = 0 if g.A_TMA else rng.choice([1, 2, 3])  # producer threads (128 on the GPU)
    g.FULL_COUNT = 1 if g.A_TMA else 1 + g.NP
    g.S = rng.choice([3, 4])
    g.KT = rng.randint(max(1, g.S - 2), 6)
    g.NFB = rng.randint(1, 3)
    g.tile_expert, g.tile_nrows = make_plan(rng)
    g.ntiles = len(g.tile_expert)
    g.items = (g.ntiles + 1) // 2 * g.NFB
    sms = rng.choice([2, 4, 6, 8])
    g.nclusters = min(sms // 2, g.NFB * ((g.ntiles + 1) // 2 + rng.randint(0, 1)))
    g.claim = [0, 0]
    launches = 2
    weights_spread = rng.random() < 0.7
    stats = dict(min_tx=0, steps=0, drift=0)
    for launch in range(launches):
        g.ctas = [[None, None] for _ in range(g.nclusters)]
        for cl in range(g.nclusters):
            for r in (0, 1):
                g.ctas[cl][r] = CTA(g, cl, r)
        g.events, g.fifos, g.cpq = [], {}, {}
        g.products, g.epilogues, g.claims_made = {}, [], []
        nper = (g.NP if not g.A_TMA else 1) + g.NW
        g.cbar = [dict(arrived=0, expected=2 * nper, done=False) for _ in range(g.nclusters)]
        actors = []
        for cl in range(g.nclusters):
            for r in (0, 1):
                cta = g.ctas[cl][r]
                for p in range(max(1, g.NP)):
                    actors.append([f"c{cl}r{r}.prod{p}", producer(g, cta, p), None])
                for wdx in range(g.NW):
                    actors.append([f"c{cl}r{r}.warp{wdx}", consumer(g, cta, wdx), None])
        speed = {a[0]: (10 ** rng.uniform(-2.5, 0) if weights_spread else 1.0) for a in actors}
        ev_speed = 10 ** rng.uniform(-2, 0)
        fifo_speed = 10 ** rng.uniform(-2, 0)
        # prime every actor to its first yield
        for a in actors:
            a[2] = next(a[1])
        done = set()
        while True:
            cands = []
            for i, a in enumerate(actors):
                if a[0] not in done and a[2]():
                    cands.append((speed[a[0]], "actor", i))
            for i, _ in enumerate(g.events):
                cands.append((ev_speed, "event", i))
            for k, q in g.fifos.items():
                if q:
                    cands.append((fifo_speed * speed.get(k, 1.0) ** 0.5, "fifo", k))
            for k, q in g.cpq.items():
                if q:
                    cands.append((ev_speed, "cp", k))
            if not cands:
                if len(done) == len(actors):
                    break
                blocked = [a[0] for a in actors if a[0] not in done]
                raise Violation(f"deadlock (launch {launch}): blocked {blocked[:6]}{'...' if len(blocked) > 6 else ''}")
            tot = sum(c[0] for c in cands)
            x = rng.random() * tot
            for c in cands:
                x -= c[0]
                if x <= 0:
                    break
            stats["steps"] += 1
            kind, ref = c[1], c[2]
            if kind == "actor":
                a = actors[ref]
                try:
                    a[2] = a[1].send(None)
                except StopIteration:
                    done.add(a[0])
            elif kind == "event":
                g.events.pop(ref)()
            elif kind == "fifo":
                _, fn = g.fifos[ref].popleft()
                fn()
            else:
                g.cpq[ref].popleft()()
        # end-of-launch checks
        if g.claim != [0, 0]:
            raise Violation(f"launch {launch}: claim counter left at {g.claim}")
        for cl in range(g.nclusters):
            for r in (0, 1):
                c = g.ctas[cl][r]
                for b in c.full + c.empty:
                    stats["min_tx"] = min(stats["min_tx"], b.min_tx)
                for b in c.empty:
                    stats["drift"] += b.drift
        seen = {}
        for (cl, rank, wid, tile, fb, mma) in g.epilogues:
            seen.setdefault((tile, fb), set()).add((cl, rank, wid))
            if mma and sorted(g.products.get((cl, rank, wid, tile, fb), [])) != list(range(g.KT)):
                raise Violation(f"tile {tile} fb {fb}: warp {wid} products over k steps "
                                f"{g.products.get((cl, rank, wid, tile, fb))}")
            if rank != tile & 1:
                raise Violation(f"tile {tile} computed by rank {rank}")
        for tile in range(g.ntiles):
            for fb in range(g.NFB):
                who = seen.get((tile, fb), set())
                ctas = {(cl, r) for cl, r, _ in who}
                if len(ctas) != 1 or len(who) != g.NW:
                    raise Violation(f"tile {tile} fb {fb} computed by {sorted(who)} (want one CTA, {g.NW} warps)")
        if set(seen) - {(t, f) for t in range(g.ntiles) for f in range(g.NFB)}:
            raise Violation("a ghost or out-of-range tile was computed")
    return g, stats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mutate", default=None, choices=MUTATIONS)
    ap.add_argument("--stop", action="store_true", help="stop at the first violation")
    a = ap.parse_args()
    bad = 0
    neg = 0
    drift_runs = 0
    mc_runs = ghost_runs = cross_runs = 0
    first = None
    for i in range(a.runs):
        seed = a.seed * 1_000_003 + i
        try:
            g, st = run_once(seed, a.mutate)
            if st["min_tx"] < 0:
                neg += 1
            drift_runs += st["drift"] > 0
            te = g.tile_expert
            pairs = [(te[2 * q], te[2 * q + 1]) for q in range(g.ntiles // 2)]
            mc_runs += any(x == y for x, y in pairs)
            cross_runs += any(x != y for x, y in pairs)
            ghost_runs += g.ntiles % 2
        except Violation as ex:
            bad += 1
            if first is None:
                first = (seed, str(ex))
            if a.stop:
                break
    print(f"mutation={a.mutate} runs={a.runs} violations={bad} "
          f"(runs with an mc pair {mc_runs}, a cross-expert pair {cross_runs}, a ghost {ghost_runs}, "
          f"a transiently negative tx-count {neg}, "
          f"an empty phase completed holding an arrival for the stage's next fill {drift_runs})")
    if first:
        print(f"  first: seed {first[0]}: {first[1]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
