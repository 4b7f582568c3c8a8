"""Kernel tests (a regular package, so `kernels.<test module>` names these files even when a distribution named
`kernels` is installed: transformers 5.25 brings one, and a namespace package loses to it)."""
