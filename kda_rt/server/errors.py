"""`InvalidRequest`: a request the server refuses with 400 (kept apart so `protocol` and `tools` share it)."""

from __future__ import annotations

__all__ = ["InvalidRequest"]


class InvalidRequest(ValueError):
    """A request body the server refuses with 400 (the message names the field)."""
