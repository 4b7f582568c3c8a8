"""Shared test helpers, one module per concern (fixtures stay in the conftest.py files; tests/ is on
sys.path through tests/conftest.py, so tests write `from helpers.<module> import ...`):

- `configs`: `tiny_config()` and `k48_config()`, both derived from the demo's `DEMO_CONFIG`.
- `engine`: an `LLM` on a checkpoint directory, greedy params, random prompts, the no-leak check.
- `server`: a real `python -m kda_rt.serve` subprocess on a free loopback port.
- `kda_ref`: the float64 per-token KDA gold reference (recurrence and whole mixer).
- `safetensors_files`: every-dtype tensors, a valid file as bytes, the reader contract on any bytes.
- `gpu`, `kda_kernel`, `mla_kernel`, `moe_router`: kernel-test inputs, references and error measures.
  They import CuPy inside functions only, so importing them never needs a GPU.
"""
