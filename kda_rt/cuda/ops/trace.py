"""Launch tracing for the fast-path report (`python -m kda_rt.generate --report`), and per-op
timing for `python -m kda_rt.bench --profile` (`Profile`: CUDA events around each model op).

While a `Trace` is active, every kernel fetched through `compile.get_kernel` and every cuBLAS call
in `ops.gemm` is counted under the model op that launched it (`with trace_scope("kda.decode")`).
Tracing one eager decode step therefore lists each op, the kernels it used, and the launches per
step (a CUDA graph replays exactly these launches)."""

from __future__ import annotations

import contextlib
from collections import Counter

__all__ = ["Trace", "Profile", "format_table", "trace_scope", "record", "active"]

_active: Trace | None = None
_profile: Profile | None = None
_scope: list[str] = ["-"]


class Trace:
    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def __enter__(self) -> Trace:
        global _active
        _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = None

    def total(self) -> int:
        return sum(self.counts.values())

    def table(self, layers: dict[str, int] | None = None) -> str:
        """Launches per step by (op, kernel); with `layers` ({op: how many layers run it}) also each
        op's launches per layer."""
        rows = [f"{'op':<22} {'kernel':<44} launches/step"]
        for (op, kernel), n in sorted(self.counts.items()):
            rows.append(f"{op:<22} {kernel:<44} {n}")
        rows.append(f"{'total':<22} {'':<44} {self.total()}")
        if layers:
            per_op: Counter[str] = Counter()
            for (op, _), n in self.counts.items():
                per_op[op] += n
            parts = [f"{op} {per_op[op] / k:g}" for op, k in layers.items() if k and op in per_op]
            rows.append("launches per layer: " + ", ".join(parts))
        return "\n".join(rows)


def active() -> Trace | None:
    return _active


def record(kernel: str) -> None:
    if _active is not None:
        _active.counts[(_scope[-1], kernel)] += 1


class Profile:
    """Times every `trace_scope` (model op) of the work run inside it with CUDA events on the current
    stream; `summary()` synchronises and returns {op: (milliseconds, calls)} summed over the calls."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object, object]] = []

    def __enter__(self) -> Profile:
        global _profile
        _profile = self
        return self

    def __exit__(self, *exc) -> None:
        global _profile
        _profile = None

    def summary(self) -> dict[str, tuple[float, int]]:
        out: dict[str, list] = {}
        for name, start, end in self.spans:
            end.synchronize()
            ms = float(__import__("cupy").cuda.get_elapsed_time(start, end))
            acc = out.setdefault(name, [0.0, 0])
            acc[0] += ms
            acc[1] += 1
        return {k: (v[0], v[1]) for k, v in out.items()}

    def table(self, work: dict[str, tuple[float, str]] | None = None) -> str:
        """Per op: ms, share of the step, calls, and with `work` ({op: (bytes or FLOPs, 'B' | 'FLOP')},
        kda_rt.floors.op_work) the rate it ran at: TB/s or TFLOP/s of that minimum work."""
        return format_table(self.summary(), work)


def format_table(summ: dict[str, tuple[float, int]], work: dict[str, tuple[float, str]] | None = None) -> str:
    total = sum(ms for ms, _ in summ.values()) or 1.0
    rows = [f"{'op':<22} {'ms':>9} {'share':>6} {'calls':>5}" + ("  rate of the op's minimum work" if work else "")]
    for name, (ms, n) in sorted(summ.items(), key=lambda kv: -kv[1][0]):
        row = f"{name:<22} {ms:9.3f} {ms / total:6.1%} {n:5d}"
        if work and name in work and ms > 0:
            amount, unit = work[name]
            row += f"  {amount / ms / 1e9:8.2f} {'TB/s' if unit == 'B' else 'TFLOP/s'} of {amount / 1e9:.3g} G{unit}"
        rows.append(row)
    rows.append(f"{'total':<22} {total:9.3f}")
    return "\n".join(rows)


@contextlib.contextmanager
def trace_scope(name: str):
    _scope.append(name)
    prof = _profile
    if prof is not None and len(_scope) == 2:  # outermost op only: nested scopes are inside its span
        import cupy

        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
    try:
        yield
    finally:
        _scope.pop()
        if prof is not None and len(_scope) == 1:
            end.record()
            prof.spans.append((name, start, end))


class Counted:
    """A kernel proxy that records each launch before forwarding it."""

    def __init__(self, fn, label: str) -> None:
        self.fn, self.label = fn, label

    def __call__(self, *args, **kwargs):
        record(self.label)
        return self.fn(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __setattr__(self, name, value):
        if name in ("fn", "label"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.fn, name, value)
