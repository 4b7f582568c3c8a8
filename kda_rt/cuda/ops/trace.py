"""Launch tracing for the fast-path report (`python -m kda_rt.generate --report`).

While a `Trace` is active, every kernel fetched through `compile.get_kernel` and every cuBLAS call
in `ops.gemm` is counted under the model op that launched it (`with trace_scope("kda.decode")`).
Tracing one eager decode step therefore lists each op, the kernels it used, and the launches per
step (a CUDA graph replays exactly these launches)."""

from __future__ import annotations

import contextlib
from collections import Counter

__all__ = ["Trace", "trace_scope", "record", "active"]

_active: Trace | None = None
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

    def table(self) -> str:
        rows = [f"{'op':<22} {'kernel':<44} launches/step"]
        for (op, kernel), n in sorted(self.counts.items()):
            rows.append(f"{op:<22} {kernel:<44} {n}")
        rows.append(f"{'total':<22} {'':<44} {self.total()}")
        return "\n".join(rows)


def active() -> Trace | None:
    return _active


def record(kernel: str) -> None:
    if _active is not None:
        _active.counts[(_scope[-1], kernel)] += 1


@contextlib.contextmanager
def trace_scope(name: str):
    _scope.append(name)
    try:
        yield
    finally:
        _scope.pop()


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
