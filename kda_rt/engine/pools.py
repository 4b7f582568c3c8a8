"""Cache-pool planning: how many KDA state slots and MLA pages a backend allocates, and the
`max_model_len` those pools can serve.  Both backends, the bench and the server use `plan_pools`.

- Slots: `max_num_seqs` for the engine, plus one padding slot on the CUDA backend (graph rows
  that carry no sequence write there).  `max_num_seqs` None takes the runner's `default_seqs` (vLLM's default
  on CUDA) while that many slots take at most half the budget left after the weights, else as many as do
  (a multiple of 16 past 16), so that the KV pages keep the other half.  Pages: what the memory budget
  holds (the CUDA backend: `gpu_memory_utilization` of the device minus weights and state; the NumPy backend: the same
  share of host memory, and never more than `max_num_seqs` full-length sequences need), plus one
  padding page on CUDA.  `num_blocks` overrides the page count.
- Snapshot slots (`enable_prefix_caching`, on by default): `prefix_cache_states` more KDA state slots after the
  padding slot, where the prefix cache keeps the states of cached prefixes; their memory comes out of the pages'
  budget, at most 1/8 of it (`SNAPSHOT_SHARE`; with `num_blocks` given, what the pages leave), fewer states (one
  log line) where 32 do not fit there, none where not one does (the engine then runs without the cache).
- `max_model_len` as vLLM resolves it: None means the model's limit when the pool can hold one
  sequence of that length, otherwise the largest length that fits (one log line says so); an
  explicit value over the model's limit or over what the pool holds is a ValueError naming both.
- `LLM.score()` borrows a free slot and free pages from the engine's pools for its one prefill,
  so nothing is reserved for it here.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kda_rt.engine import EngineConfig
    from kda_rt.loader.config import ModelConfig

__all__ = ["PoolPlan", "check_weights_fit", "fit_max_num_seqs", "host_memory_bytes", "kv_bytes_per_block",
           "plan_pools", "state_bytes_per_slot"]

logger = logging.getLogger(__name__)

SNAPSHOT_SHARE = 8  # the prefix cache's KDA states take at most 1/8 of the memory the KV pages would have


def kv_bytes_per_block(config: ModelConfig, block_size: int, itemsize: int) -> int:
    """Bytes of one MLA page over all MLA layers (576 values per token per layer at full size)."""
    width = config.mla.cache_width if config.mla is not None else 0
    return len(config.mla_layer_ids) * block_size * width * itemsize


def state_bytes_per_slot(config: ModelConfig, itemsize: int, state_itemsize: int | None = None) -> int:
    """Bytes of one KDA state slot over all KDA layers: conv state (`itemsize` per value) + recurrent
    state (`state_itemsize`, default `itemsize`; the CUDA backend keeps bf16 conv and fp32 state)."""
    kda = config.kda
    if kda is None:
        return 0
    p = kda.num_heads * kda.head_dim
    conv = 3 * (kda.conv_kernel_size - 1) * p * itemsize
    rec = kda.num_heads * kda.head_dim * kda.head_dim * (state_itemsize or itemsize)
    return len(config.kda_layer_ids) * (conv + rec)


def host_memory_bytes() -> int:
    """Physical memory of this machine (the NumPy backend's 'device')."""
    import os

    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX: assume a modest machine
        return 16 * 2**30


@dataclass(frozen=True)
class PoolPlan:
    """What the runner allocates and what the engine may hand out (ids below engine_*)."""

    max_model_len: int
    block_size: int
    engine_slots: int  # slots 0 .. engine_slots-1 belong to the scheduler
    engine_blocks: int  # pages 0 .. engine_blocks-1 belong to the scheduler
    num_slots: int  # allocated (engine + padding)
    num_blocks: int
    pad_slot: int | None  # CUDA graph padding rows write here (None: no padding)
    pad_page: int | None
    bytes: int  # slots + pages
    snapshot_slots: tuple[int, ...] = ()  # the prefix cache's state slots (after the padding slot)

    @property
    def max_pages_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)


def check_weights_fit(config: ModelConfig, quantization: str | None, *, free_bytes: int, total_bytes: int,
                      device: str) -> int:
    """The device bytes the weights take at least (matmuls in bf16, routers and small tensors in fp32, the experts
    in e4m3 with a scale a row under quantization "fp8"; the fp8 models' e4m3 copies of dense projections not
    counted), returned; a ValueError naming the model's size, the device and its free memory (and fp8 where that
    would fit) when they exceed `free_bytes`, before any upload starts (was: CuPy's OutOfMemoryError part way in)."""
    import dataclasses

    from kda_rt.floors import weight_bytes

    bf16 = dataclasses.replace(config, dtype="bfloat16")
    moe_layers = sum(kind == "moe" for kind in config.mlp_types)
    experts = config.moe.num_experts * moe_layers if config.moe is not None else 0

    def total(quant: str | None) -> int:
        w = weight_bytes(bf16, quant)
        return w.dense + w.per_expert * experts + (0 if config.tie_word_embeddings else config.vocab_size * w.embed_row)

    need = total(quantization)
    if need <= free_bytes:
        return need
    gib = 2**30
    hint = ""
    if quantization is None and config.moe is not None:
        need8 = total("fp8")
        hint = (f"; with quantization=\"fp8\" (--quantization fp8: the experts in e4m3) they need {need8 / gib:.1f} GiB"
                + ("" if need8 <= free_bytes else ", still too many"))
    kind = "fp8 experts" if quantization and config.moe is not None else "bf16"
    raise ValueError(f"the weights need {need / gib:.1f} GiB on the GPU ({kind}) "
                     f"but {device} has {free_bytes / gib:.1f} GiB free of {total_bytes / gib:.1f} GiB{hint}")


def fit_max_num_seqs(default_seqs: int, slot_bytes: int, room: int) -> int:
    """max_num_seqs when the caller gives none: `default_seqs`, or fewer when that many state slots of `slot_bytes`
    would take more than half of `room` (the memory budget after the weights): as many as fit there, a multiple of
    16 past 16, at least 1."""
    if slot_bytes <= 0 or default_seqs * slot_bytes <= room // 2:
        return default_seqs
    fit = max(1, (room // 2) // slot_bytes)
    return fit - fit % 16 if fit > 16 else fit


def plan_pools(config: ModelConfig, engine: EngineConfig, *, itemsize: int, state_itemsize: int | None = None,
               memory_bytes: int, weight_bytes: int = 0, padding: bool = False, cap_to_sequences: bool = False,
               where: str = "GPU", default_seqs: int = 16) -> PoolPlan:
    """Plan the pools within `memory_bytes * gpu_memory_utilization - weight_bytes`.

    `cap_to_sequences` (NumPy backend): never more pages than `max_num_seqs` sequences of
    `max_model_len` tokens use.  `where` names the memory in errors ("GPU" or "host").  `default_seqs`: the
    max_num_seqs an unset one starts from (fit_max_num_seqs).
    """
    bs, seqs, limit = engine.block_size, engine.max_num_seqs, config.max_model_len
    pad = 1 if padding else 0
    asked = engine.prefix_cache_states if engine.enable_prefix_caching else 0
    page = kv_bytes_per_block(config, bs, itemsize)
    slot = state_bytes_per_slot(config, itemsize, state_itemsize)
    room = int(memory_bytes * engine.gpu_memory_utilization) - weight_bytes - pad * (slot + page)
    if seqs is None:
        seqs = fit_max_num_seqs(default_seqs, slot, room)
        logger.info("max_num_seqs %d (default %d; %d state slots of %.1f MiB, %.2f GiB of the %.2f GiB after the "
                    "weights)", seqs, default_seqs, seqs, slot / 2**20, seqs * slot / 2**30, room / 2**30)
    budget = room - seqs * slot
    # the prefix cache's snapshots come out of the pages' share, at most SNAPSHOT_SHARE of it (or what an explicit
    # num_blocks leaves): never fewer sequences or a shorter max_model_len than without the cache by more than that
    spare = budget - engine.num_blocks * page if engine.num_blocks is not None else budget // SNAPSHOT_SHARE
    snaps = asked if slot == 0 else min(asked, max(0, spare) // slot)
    if snaps < asked:
        logger.warning("prefix caching keeps %d KDA states, not prefix_cache_states %d: %s", snaps, asked,
                       "the memory after the weights, the state slots and num_blocks holds no more"
                       if engine.num_blocks is not None else
                       f"they may take 1/{SNAPSHOT_SHARE} of the KV pages' {max(0, budget) / 2**30:.2f} GiB")
    budget -= snaps * slot
    if engine.num_blocks is not None:
        fit_pages = engine.num_blocks
        if page and fit_pages > max(0, budget // page):  # (was: NumPy's "Unable to allocate 144. PiB" at the pool)
            raise ValueError(
                f"num_blocks {fit_pages} does not fit: {fit_pages} pages of {page / 2**20:.2f} MiB need "
                f"{fit_pages * page / 2**30:.2f} GiB, the {where} memory budget ({engine.gpu_memory_utilization} x "
                f"{memory_bytes / 2**30:.1f} GiB) after the weights and {seqs + pad + snaps} state slots holds at most "
                f"{max(0, budget // page)} pages")
    elif page == 0:  # no MLA layer: positions cost no pages' memory
        fit_pages = seqs * math.ceil(limit / bs)
    else:
        fit_pages = max(0, budget // page)
        if fit_pages == 0:
            raise ValueError(
                f"the {where} memory budget ({engine.gpu_memory_utilization} x {memory_bytes / 2**30:.1f} GiB) leaves "
                f"no room for KV pages after the weights ({weight_bytes / 2**30:.1f} GiB) and {seqs + pad + snaps} "
                f"state slots ({(seqs + pad + snaps) * slot / 2**30:.2f} GiB): raise gpu_memory_utilization or lower "
                f"max_num_seqs" + (" or prefix_cache_states" if snaps else ""))
    fit_len = fit_pages * bs
    requested = engine.max_model_len
    if requested is None:
        max_model_len = min(limit, fit_len)
        if max_model_len < limit:
            logger.warning("max_model_len %d (the model allows %d): the KV page pool holds %d pages of %d tokens "
                           "(pass --max-model-len, --num-blocks or --gpu-memory-utilization to change it)",
                           max_model_len, limit, fit_pages, bs)
    else:
        if requested > limit:
            raise ValueError(f"max_model_len {requested} exceeds the model's limit {limit} (config.json)")
        if requested > fit_len:
            src = "num_blocks" if engine.num_blocks is not None else f"{where} memory"
            raise ValueError(f"max_model_len {requested} does not fit: the KV page pool ({src}) holds {fit_len} tokens "
                             f"({fit_pages} pages of {bs}); lower max_model_len to {fit_len} or give the pool more room")
        max_model_len = requested
    engine_blocks = fit_pages
    if cap_to_sequences and engine.num_blocks is None:
        engine_blocks = min(fit_pages, seqs * math.ceil(max_model_len / bs))
    num_slots, num_blocks = seqs + pad + snaps, engine_blocks + pad
    return PoolPlan(max_model_len=max_model_len, block_size=bs, engine_slots=seqs, engine_blocks=engine_blocks,
                    num_slots=num_slots, num_blocks=num_blocks, pad_slot=seqs if pad else None,
                    pad_page=engine_blocks if pad else None, bytes=num_slots * slot + num_blocks * page,
                    snapshot_slots=tuple(range(seqs + pad, seqs + pad + snaps)))
