"""A JSON file read with every failure named: the file (or the flag that gave it), the line and column of a syntax
error, and why (missing, unreadable, not UTF-8, nested too deeply, an integer past Python's digit limit, not an
object).  One reader for config.json, generation_config.json, the tokenizer's JSON files, the safetensors index and
the tools' --config files, each raising its own error type."""

from __future__ import annotations

import json
import os
from typing import Any


def read_json(path: str | os.PathLike[str], error: type[Exception] = ValueError, *, label: str | None = None,
              missing: str = "not found", want_object: bool = True) -> Any:
    """The parsed JSON of `path`; `error` otherwise, its message starting with `label` (default: the path).
    `missing` ends the message of a file that does not exist; want_object: the top level must be an object."""
    where = label if label is not None else os.fspath(path)
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):  # (a FIFO would block the open)
        raise error(f"{where}: not a regular file")
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:  # (a hub cache snapshot's link whose blob is gone is not an absent file)
        raise error(f"{where}: {'a link to a missing file' if os.path.islink(path) else missing}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{where}: not valid JSON ({exc})") from None
    except OSError as exc:
        raise error(f"{where}: cannot read ({exc.strerror or exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{where}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise error(f"{where}: not valid JSON (maximum recursion depth exceeded: nested too deeply)") from None
    except ValueError as exc:  # an integer literal past Python's digit limit
        raise error(f"{where}: not valid JSON ({exc})") from None
    if want_object and not isinstance(data, dict):
        raise error(f"{where}: top level must be a JSON object, got {type(data).__name__}")
    return data
