"""Test-suite root.  Its presence puts `tests/` on sys.path, so test files can `import helpers`."""

from __future__ import annotations
