"""`EngineConfig`: every runtime setting, in one place (the model's shape lives in `ModelConfig`).

`LLM(model, **settings)`, the server's engine process, `bench` and `generate` all build one of
these and forward it whole; the command-line flags are generated from the fields
(`add_cli_args` / `from_cli_args`), so no entry point spells the list out again.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

__all__ = ["SERVER_BATCHED_TOKENS", "EngineConfig", "offline_batched_tokens"]

SERVER_BATCHED_TOKENS = 8192  # the server's --max-num-batched-tokens default (vLLM's for its API server)

BACKENDS = ("auto", "numpy", "cuda")
POLICIES = ("fcfs", "priority")  # scheduling_policy (the scheduler's, kda_rt/engine/scheduler.py)
NUMPY_DTYPES = ("float32", "float64", "bfloat16")


def offline_batched_tokens(device_memory: int | None, device_name: str = "") -> int:
    """The offline default of max_num_batched_tokens (vLLM's rule for its LLM class): 16384 on a GPU with
    70 GiB or more that is not an A100 (where vLLM measured a loss), else 8192 (also with no GPU)."""
    if device_memory is not None and device_memory >= 70 * 2**30 and "a100" not in device_name.lower():
        return 16384
    return 8192


def default_max_num_seqs(device_memory: int | None, device_name: str = "") -> int:
    """vLLM's default max_num_seqs for its LLM class and its server: 1024 on a GPU with 70 GiB or more that is not an
    A100, else 256.  The CUDA runner caps it to what the memory holds (engine/pools.plan_pools)."""
    if device_memory is not None and device_memory >= 70 * 2**30 and "a100" not in device_name.lower():
        return 1024
    return 256


NUMPY_MAX_NUM_SEQS = 16  # the NumPy backend's default max_num_seqs (the reference runs a sequence at a time per op)

QUANTIZATIONS = ("fp8",)  # EngineConfig.quantization (loader/quant.quantize_experts)
LOAD_FORMATS = ("auto", "safetensors", "dummy")  # EngineConfig.load_format (vLLM's names; kda_rt/llm.py)


def _opt(default, help: str, **cli):  # noqa: A002  (argparse's name)
    return field(default=default, metadata={"help": help, **cli})


def _check_int(name: str, value: object, lo: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    backend: str = _opt("auto", "auto (CUDA when CuPy and a GPU are usable, else NumPy), numpy or cuda",
                        choices=BACKENDS)
    dtype: str = _opt("float32", "NumPy backend compute dtype: float32, float64, or bfloat16 (float32 math with "
                                 "bf16-rounded activations, the CUDA oracle); auto (vLLM's word): float32",
                        choices=("auto", *NUMPY_DTYPES))
    # None: resolved when the runner plans its pools (engine/pools.plan_pools): the CUDA backend takes vLLM's default
    # (1024 on a GPU of 70+ GiB that is not an A100, else 256) as long as the KDA state slots (42 MB a sequence on
    # the 48B shape) take at most half the memory left after the weights, else as many as do (a multiple of 16);
    # the NumPy backend 16
    max_num_seqs: int | None = _opt(None, "sequences running at once (= KDA state slots); default: CUDA vLLM's "
                                          "(1024 on a GPU of 70+ GiB, not A100, else 256) while their state slots "
                                          "take at most half the memory after the weights, else as many as do; "
                                          "NumPy 16")
    max_model_len: int | None = _opt(None, "prompt + output tokens per sequence (default: the model's limit when "
                                           "the KV pool holds it, else the largest length that fits)")
    block_size: int = _opt(64, "tokens per MLA page", choices=(16, 32, 64))
    num_blocks: int | None = _opt(None, "MLA pages (default: sized from memory)")
    # None: resolved by build_engine as vLLM does: offline (LLM, generate, bench) 16384 on a GPU of 70+ GiB
    # (not A100), else 8192; the server's flag defaults to 8192 (SERVER_BATCHED_TOKENS).  On the full 48B
    # shape (H200) 32 x 2048-token prompts prefill in 1.06 s with 16384-token steps, 1.14 s with 8192 and
    # 5.90 s with 2048 (docs/PERFORMANCE.md); a larger step stalls running decodes longer, which a server's
    # streams feel and an offline batch does not
    max_num_batched_tokens: int | None = _opt(None, "new tokens per engine step (prefill chunks + decodes); "
                                                    "default: 16384 offline on a GPU of 70+ GiB (not A100), "
                                                    "else 8192; the server's default is 8192")
    # None: max_num_batched_tokens // 64 (256 at 16384).  A step of the last few prompt tokens reads the weights as
    # a full step does: 32 x 2048-token prompts at 16384 took four full steps and one of 77 tokens (31 decodes);
    # with 256, four steps of 16384-16408 tokens: TTFT max 0.9555 -> 0.9106 s, mean 0.5873 -> 0.5722 s (H200, full
    # 48B shape, docs/PERFORMANCE.md, twenty-fourth session)
    prefill_tail_tokens: int | None = _opt(None, "tokens a step may run over max_num_batched_tokens to finish a "
                                                 "prompt, so that no later step runs just its last few tokens "
                                                 "(default: max_num_batched_tokens // 64; 0: never)")
    gpu_memory_utilization: float = _opt(0.90, "CUDA backend: share of device memory for weights + caches")
    seed: int = _opt(0, "seeds requests that bring no seed of their own")
    enforce_eager: bool = _opt(False, "CUDA backend: no CUDA graphs")
    # None: one decode graph for every power of two and every 1.5 x a power of two from 6 below max_num_seqs, and one
    # for max_num_seqs (a batch pays less than a third of its rows in padding; the graphs share one workspace, so the
    # extra sizes cost capture time, not memory); a decode batch runs the smallest graph of at least its rows (the rest
    # padding rows), a larger one eagerly
    cuda_graph_sizes: tuple[int, ...] | None = _opt(
        None, "CUDA backend: the decode batch sizes captured as graphs (vLLM's flag): one value N captures 1, 2, 4 "
              "and every multiple of 8 up to N, several values exactly those; sizes above max_num_seqs are left out; "
              "a batch runs the smallest graph that holds it, one larger than every graph eagerly (default: the "
              "powers of two and 1.5 x the powers of two from 6 below max_num_seqs, and max_num_seqs)", nargs="+")
    # on the full 48B shape (H200, batch 32) the engine's host work between steps is ~0.7 ms of an
    # ~11 ms step; overlapped, the GPU runs the next decode while the host postprocesses this one
    async_scheduling: bool = _opt(True, "launch the next decode step before this step's tokens reach the host "
                                        "(same outputs; off: every step waits for the previous one)")
    # a hybrid model's prefix is its MLA pages and the KDA state after it: states are kept where a chunk ends, at a
    # request's end and at the page boundary where a prompt parts from one seen before (kda_rt/engine/prefix_cache.py)
    enable_prefix_caching: bool = _opt(True, "keep computed prefixes for later requests: the MLA pages and the KDA "
                                              "state at a request's end and where its prompt parts from an earlier "
                                              "one (a shared system prompt, the turns of a chat)")
    prefix_cache_states: int = _opt(32, "prefix caching: KDA states kept (each the memory of one sequence's state "
                                        "slot, 42 MB on the 48B shape, taken from the KV pages' share: at most 1/8 "
                                        "of it, fewer states where these do not fit)")
    scheduling_policy: str = _opt("fcfs", "fcfs: requests run in order of arrival; priority: in order of each "
                                          "request's priority (lower first), then arrival, and the least urgent "
                                          "running request is the one preempted (vLLM's --scheduling-policy)",
                                  choices=POLICIES)
    quantization: str | None = _opt(None, "fp8: the routed experts (and a shared expert of their width) as e4m3 "
                                          "weights with one fp32 scale a row, quantized at load on either backend",
                                    choices=QUANTIZATIONS)
    load_format: str = _opt("auto", "auto / safetensors: the checkpoint's weights; dummy: random weights of the "
                                    "config.json's shapes, no weight files read (vLLM's flag, to benchmark or try a "
                                    "setup without the weights; the text is meaningless)",
                            choices=LOAD_FORMATS)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.dtype == "auto":  # vLLM command lines pass it; the CUDA backend always computes in bf16
            object.__setattr__(self, "dtype", "float32")
        if self.dtype not in NUMPY_DTYPES:
            raise ValueError(f"dtype must be one of {NUMPY_DTYPES}, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name))
        if self.prefill_tail_tokens is not None:
            _check_int("prefill_tail_tokens", self.prefill_tail_tokens, lo=0)
        if self.block_size not in (16, 32, 64):
            raise ValueError(f"block_size must be 16, 32 or 64, got {self.block_size!r}")
        if self.num_blocks is not None:
            _check_int("num_blocks", self.num_blocks)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        _check_int("prefix_cache_states", self.prefix_cache_states)
        for name in ("enforce_eager", "async_scheduling", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.cuda_graph_sizes is not None:
            sizes = self.cuda_graph_sizes
            if isinstance(sizes, (str, bytes)) or not isinstance(sizes, (list, tuple)) or not sizes:
                raise ValueError(f"cuda_graph_sizes must be a non-empty list of ints >= 1, got {sizes!r}")
            for size in sizes:
                if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                    raise ValueError(f"cuda_graph_sizes entries must be ints >= 1, got {size!r} in {list(sizes)!r}")
            object.__setattr__(self, "cuda_graph_sizes", tuple(sizes))  # (a list from msgpack / JSON: a tuple)
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {self.scheduling_policy!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")

    def graph_sizes(self, max_num_seqs: int) -> list[int]:
        """The decode batch sizes captured as graphs for `max_num_seqs` sequences, ascending (cuda_graph_sizes: one
        value N gives 1, 2, 4 and the multiples of 8 up to N, as vLLM's flag; sizes above max_num_seqs left out;
        None: the powers of two and 1.5 x the powers of two from 6 below max_num_seqs, then max_num_seqs).  Empty
        when every given size is above it."""
        if self.cuda_graph_sizes is None:
            out, b = [], 1
            while b < max_num_seqs:
                out += [b, 3 * b // 2] if b >= 4 else [b]
                b *= 2
            return sorted({x for x in out if x < max_num_seqs} | {max_num_seqs})
        sizes = self.cuda_graph_sizes
        if len(sizes) == 1:
            sizes = [1, 2, 4, *range(8, sizes[0] + 1, 8)] if sizes[0] >= 8 else [b for b in (1, 2, 4) if b <= sizes[0]]
        return sorted({b for b in sizes if b <= max_num_seqs})

    def tail_tokens(self) -> int:
        """prefill_tail_tokens as the scheduler takes it: the given value, else max_num_batched_tokens // 64 (which
        must be resolved by then)."""
        if self.prefill_tail_tokens is not None:
            return self.prefill_tail_tokens
        if self.max_num_batched_tokens is None:
            raise ValueError("prefill_tail_tokens follows max_num_batched_tokens, which is not resolved yet")
        return self.max_num_batched_tokens // 64

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Like the constructor, but an unknown name is a TypeError listing the known ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine setting(s) {unknown}; known: {sorted(names)}")
        return cls(**kwargs)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, exclude: tuple[str, ...] = (), **defaults) -> None:
        """One `--flag-name` per field (vLLM's names) but `exclude`; `defaults` override field defaults."""
        group = parser.add_argument_group("engine settings")
        for f in dataclasses.fields(cls):
            if f.name in exclude:
                continue
            flag = "--" + f.name.replace("_", "-")
            default = defaults.get(f.name, f.default)
            kw = {"default": default, "help": f.metadata["help"]}
            if f.type == "bool":
                group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
                continue
            kind = {"int": int, "float": float, "str": str, "int | None": int, "str | None": str,
                    "tuple[int, ...] | None": int}[f.type]
            for key in ("choices", "nargs"):
                if key in f.metadata:
                    kw[key] = f.metadata[key]
            group.add_argument(flag, type=kind, **kw)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, exclude: tuple[str, ...] = (), **overrides) -> EngineConfig:
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name not in exclude}
        values.update(overrides)
        return cls(**values)
