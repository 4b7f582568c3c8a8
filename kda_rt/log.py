"""One log format for kda_rt, uvicorn and the engine process (vLLM's shape, with timestamps):

    INFO 05-14 12:00:03 [kda_rt.server] engine process 4242 ready (backend numpy, max_model_len 256)
"""

from __future__ import annotations

import logging
import sys

__all__ = ["DATE_FORMAT", "FORMAT", "configure"]

FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"
_UVICORN = ("uvicorn", "uvicorn.error", "uvicorn.access")


def configure(level: str | int) -> None:
    """Root handler on stderr with FORMAT at `level` (a name such as "warning", or a number); uvicorn's
    loggers lose their own handlers and propagate to it, so every line looks the same."""
    if isinstance(level, str):
        level = level.upper()
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
    for name in _UVICORN:
        log = logging.getLogger(name)
        log.handlers.clear()
        log.propagate = True
        log.setLevel(logging.NOTSET)
