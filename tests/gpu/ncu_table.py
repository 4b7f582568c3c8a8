"""Table of the kernels of the last decode step in an ncu CSV (tests/gpu/ncu_decode.sh): the kernels
between the last two launches of the sampling kernel, with their GPU time in microseconds."""

from __future__ import annotations

import csv
import sys
from collections import defaultdict


def main(path: str) -> None:
    with open(path) as fh:
        lines = [ln for ln in fh if ln.startswith('"')]
    rows = [r for r in csv.DictReader(lines) if r.get("Metric Name") == "gpu__time_duration.sum"]
    names = [(r["Kernel Name"], float(r["Metric Value"].replace(",", "")) / 1e3) for r in rows]
    samples = [i for i, (n, _) in enumerate(names) if "sample_rows" in n]
    if len(samples) < 2:
        print(f"{len(names)} kernels, fewer than two sampling launches: nothing to show")
        return
    step = names[samples[-2] + 1:samples[-1] + 1]
    per = defaultdict(lambda: [0.0, 0])
    for n, us in step:
        print(f"{us:9.1f} us  {n[:110]}")
        per[n.split("(")[0][:60]][0] += us
        per[n.split("(")[0][:60]][1] += 1
    print(f"\n{len(step)} kernels, {sum(us for _, us in step):.1f} us of GPU time in the step")
    for n, (us, c) in sorted(per.items(), key=lambda kv: -kv[1][0]):
        print(f"{us:9.1f} us  {c:3d}x  {n}")


if __name__ == "__main__":
    main(sys.argv[1])
