"""The SASS lines with the most warp-stall samples in an ncu source-page CSV (tests/gpu/ncu_moe_gemm.sh): per
line its address, instruction, all stall samples and their share, so that the instructions the warps wait
at (a barrier, a wgmma wait, a cp.async wait) stand out.  Column names are matched loosely ("Source" for the
instruction, "Stall Sampling (All" for the samples): ncu versions differ in the exact wording.

    python tests/gpu/ncu_source_top.py FILE.csv [--top 30]"""

from __future__ import annotations

import argparse
import csv


def _col(header: list[str], *needles: str) -> str | None:
    for name in header:
        if all(n.lower() in name.lower() for n in needles):
            return name
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    with open(args.path, newline="") as fh:
        rows = list(csv.DictReader(line for line in fh if line.strip()))
    if not rows:
        print(f"{args.path}: no rows")
        return 1
    header = list(rows[0])
    src, samples = _col(header, "source"), _col(header, "stall sampling", "all") or _col(header, "stall sampling")
    addr = _col(header, "address")
    if src is None or samples is None:
        print(f"{args.path}: no source / stall-sampling columns among {header}")
        return 1

    def value(r: dict) -> float:
        try:
            return float((r.get(samples) or "0").replace(",", ""))
        except ValueError:
            return 0.0

    total = sum(value(r) for r in rows) or 1.0
    print(f"{len(rows)} SASS lines, {total:.0f} stall samples ({samples})")
    for r in sorted(rows, key=value, reverse=True)[: args.top]:
        print(f"{value(r):9.0f} {value(r) / total:6.1%}  {(r.get(addr) or '')[:10]:10s} {(r.get(src) or '')[:100]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
