"""The SASS lines with the most warp-stall samples in an ncu source-page CSV (tests/gpu/ncu_moe_gemm.sh): per
line its address, instruction, all stall samples and their share, so that the instructions the warps wait
at (a barrier, a wgmma wait, a cp.async wait) stand out.  With --regions, also the SASS cut at its block barriers
(BAR.SYNC / BAR.RED, in address order: a kernel whose stages end in __syncthreads(), as kda_prefill_intra's) with
each region's samples, executed warp instructions by kind (MUFU, shared loads and stores, tensor, FP32) and
its largest stall reasons: which stage waits on what.  Column names are matched loosely ("Source" for the
instruction, "Stall Sampling (All" for the samples): ncu versions differ in the exact wording.

    python tests/gpu/ncu_source_top.py FILE.csv [--top 30] [--regions]"""

from __future__ import annotations

import argparse
import csv


def _num(r: dict, col: str | None) -> float:
    """A row's number in column col (ncu writes thousands with commas); 0 where empty, absent or not a number."""
    try:
        return float((r.get(col) or "0").replace(",", "")) if col else 0.0
    except ValueError:
        return 0.0


def _col(header: list[str], *needles: str) -> str | None:
    for name in header:
        if all(n.lower() in name.lower() for n in needles):
            return name
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--regions", action="store_true", help="also the per-region table (cut at block barriers)")
    args = ap.parse_args()
    # one table per profiled kernel, each after a '"Kernel Name","<name>",' line
    tables: list[tuple[str, list[str]]] = []
    with open(args.path, newline="") as fh:
        for line in fh:
            if line.startswith('"Kernel Name"'):
                tables.append((next(csv.reader([line]))[1], []))
            elif line.strip():
                if not tables:
                    tables.append(("", []))
                tables[-1][1].append(line)
    if not tables:
        print(f"{args.path}: no rows")
        return 1
    for i, (name, lines) in enumerate(tables):
        print(f"--- kernel {i}: {name}")
        rows = list(csv.DictReader(lines))
        if _table(rows, args.path, args.top):
            return 1
        if args.regions:
            _regions(rows)
    return 0


def _table(rows: list[dict], path: str, top: int) -> int:
    if not rows:
        print(f"{path}: no rows")
        return 1
    header = [h for h in rows[0] if h is not None]
    src, samples = _col(header, "source"), _col(header, "stall sampling", "all") or _col(header, "stall sampling")
    addr = _col(header, "address")
    if src is None or samples is None:
        print(f"{path}: no source / stall-sampling columns among {header}")
        return 1

    def value(r: dict) -> float:
        return _num(r, samples)

    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    num = _num
    total = sum(value(r) for r in rows) or 1.0
    print(f"{len(rows)} SASS lines, {total:.0f} stall samples ({samples})")
    by_reason = sorted(((sum(num(r, c) for r in rows), c[6:]) for c in reasons), reverse=True)
    print("by reason: " + ", ".join(f"{n} {v / total:.1%}" for v, n in by_reason[:10]))
    for r in sorted(rows, key=value, reverse=True)[:top]:
        why = " ".join(f"{c[6:]}:{num(r, c):.0f}" for c in sorted(reasons, key=lambda c: -num(r, c))[:3])
        print(f"{value(r):9.0f} {value(r) / total:6.1%}  {(r.get(addr) or '')[-6:]:6s} {(r.get(src) or '')[:64]:64s} {why}")
    return 0


# executed-instruction kinds counted per region (by the SASS opcode's first word)
_KINDS = {
    "MUFU": ("MUFU",),
    "LDS": ("LDS",),  # LDS, LDSM
    "STS": ("STS",),
    "MMA": ("HMMA", "HGMMA", "IMMA"),
    "FP32": ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP"),
    "LDG": ("LDG",),  # LDG, LDGSTS
}


def _opcode(text: str) -> str:
    """The opcode of a SASS line, its predicate ("@P0 ", "@!UPT ") dropped."""
    words = text.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def _regions(rows: list[dict]) -> None:
    header = [h for h in rows[0] if h is not None]
    src = _col(header, "source")
    samples = _col(header, "stall sampling", "all") or _col(header, "stall sampling")
    executed = _col(header, "instructions executed") or _col(header, "inst_executed")
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    num = _num
    cuts: list[list[dict]] = [[]]
    for r in rows:
        cuts[-1].append(r)
        op = _opcode(r.get(src) or "")
        if op.startswith(("BAR.SYNC", "BAR.RED")) or op == "BAR":
            cuts.append([])
    total = sum(num(r, samples) for r in rows) or 1.0
    print(f"regions (cut after each block barrier; executed = warp instructions, column {executed!r}):")
    print(
        f"{'#':>3} {'lines':>5} {'samples':>8} {'share':>6} {'executed':>10} "
        + " ".join(f"{k:>8}" for k in _KINDS)
        + "  largest stalls"
    )
    for i, cut in enumerate(cuts):
        if not cut:
            continue
        kinds = {k: 0.0 for k in _KINDS}
        for r in cut:
            op = _opcode(r.get(src) or "")
            for k, prefixes in _KINDS.items():
                if op.startswith(prefixes):
                    kinds[k] += num(r, executed)
        by = sorted(((sum(num(r, c) for r in cut), c[6:]) for c in reasons), reverse=True)[:3]
        s = sum(num(r, samples) for r in cut)
        print(
            f"{i:3d} {len(cut):5d} {s:8.0f} {s / total:6.1%} {sum(num(r, executed) for r in cut):10.0f} "
            + " ".join(f"{kinds[k]:8.0f}" for k in _KINDS)
            + "  "
            + ", ".join(f"{n} {v / (s or 1):.0%}" for v, n in by)
        )


if __name__ == "__main__":
    raise SystemExit(main())
