"""CUDA ops: one launcher per `kernels_cu/<op>.cu` (same stem), plus `compile.py`, the only place
that builds kernels.  Importing this package does not import CuPy; the launchers do."""
