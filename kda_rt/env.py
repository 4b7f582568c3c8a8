"""Every `KDA_RT_*` environment variable: typed, with a default and a one-line doc."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir", "arch_override", "api_key", "log_stats_interval"]


def cache_dir() -> Path:
    """KDA_RT_CACHE_DIR: where compiled kernels (cubins + msgpack manifest) live. Default ~/.cache/kda_rt."""
    return Path(os.environ.get("KDA_RT_CACHE_DIR") or Path.home() / ".cache" / "kda_rt")


def arch_override() -> str | None:
    """KDA_RT_ARCH: compile for this arch (e.g. sm_90a) instead of the device's; for compile-only checks."""
    return os.environ.get("KDA_RT_ARCH") or None


def api_key() -> str | None:
    """KDA_RT_API_KEY: default for `python -m kda_rt.serve --api-key` (require 'Authorization: Bearer KEY')."""
    return os.environ.get("KDA_RT_API_KEY") or None


def log_stats_interval() -> float:
    """KDA_RT_LOG_STATS_INTERVAL: seconds between the server's throughput log lines while busy (default 10; 0 = off)."""
    value = os.environ.get("KDA_RT_LOG_STATS_INTERVAL") or "10"
    try:
        return max(0.0, float(value))
    except ValueError:
        raise ValueError(f"KDA_RT_LOG_STATS_INTERVAL must be a number of seconds, got {value!r}") from None
