"""`CudaRunner`: weights and cache pools on the GPU, the model as kernel launches, and one CUDA
graph per decode batch-size bucket.

- Pools (planned by `kda_rt.engine.pools.plan_pools`): per KDA layer a conv-state pool and an fp32
  recurrent-state pool with one slot per running sequence plus one padding slot; per MLA layer a
  bf16 page pool [num_blocks, block_size, 576] plus one padding page.  The page count comes from
  `gpu_memory_utilization` after the weights are on the device (or `num_blocks`).
- Decode steps (every sequence has one new token) replay the graph of the smallest bucket
  (EngineConfig.graph_sizes: 1, 2, 4, 6, 8, 12, 16, 24, ... up to max_num_seqs by default, all captured when the
  runner starts, their buffers views of one shared workspace) that holds the batch;
  missing rows are padding that read a zero state (context 0) and write no KDA state and plan no MoE pairs (KDA_RT_SKIP_PAD,
  default 2: the KDA decode kernel's padding CTAs also skip their compute; with 0 they run on and write the padding
  slot and page).  Metadata is copied into the
  graph's static buffers before each replay.  Prefill and mixed steps run eagerly.
- A graph's block table is max_model_len / block_size pages wide; each step copies only the
  columns the batch uses (a 2D copy), the rest is never read (kernels stop at the context).
- Per step one pinned host -> device copy of the metadata, one of the sampling settings (one more of
  the grammar masks when a row has one), and one device -> host copy of the sampled ids, flags and
  logprobs (`cuda/staging.py`).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from kda_rt import env
from kda_rt.cuda.model import CudaModel, DeviceBatch
from kda_rt.cuda.ops import pdl
from kda_rt.cuda.ops.check import BF16
from kda_rt.cuda.staging import Staging, pack_layout
from kda_rt.cuda.weights import decode_rows, upload_weights
from kda_rt.cuda.workspace import Workspace, WorkspaceFull
from kda_rt.engine.runner import lead_ids_rows
from kda_rt.sampler.batch import SamplingBatch, StepOutput

if TYPE_CHECKING:
    from kda_rt.engine.batch import ForwardBatch
    from kda_rt.engine.config import EngineConfig
    from kda_rt.loader.config import ModelConfig

__all__ = ["CudaRunner"]

logger = logging.getLogger(__name__)


def _e4m3_dense(weights) -> list:
    """The e4m3 copies of dense projections in `weights` (ops/dense_w8a8; quantization="fp8")."""
    names = ("qkv_e4m3", "o_proj_e4m3", "q_kva_e4m3", "gate_up_e4m3", "down_e4m3")
    return [w for L in weights.layers for part in (L.mixer, L.mlp) for n in names
            if (w := getattr(part, n, None)) is not None]


def _decode_projection_shapes(weights) -> list[tuple[int, int, bool]]:
    """(N, K, fp32 out) of every dense projection a decode step sends through gemm.linear: the mixers'
    q|k|v|f_a|g_a|b (or q|k|v and f_a|g_a|b apart) and o_proj (KDA), q|kv_a and o_proj (MLA), the dense
    MLPs' and a separate shared expert's gate|up and down, and the MoE router split in three bf16 parts
    (fp32 logits)."""
    from kda_rt.cuda.weights import DeviceKDA, DeviceMLP, DeviceMoE

    shapes = []
    for layer in weights.layers:
        mixer, mlp = layer.mixer, layer.mlp
        if isinstance(mixer, DeviceKDA):
            mats = [mixer.qkv_fgb] if mixer.qkv_fgb is not None else [mixer.qkv, mixer.fgb]
            mats.append(mixer.o_proj)
        else:
            mats = [mixer.q_kva, mixer.o_proj]
        if isinstance(mlp, DeviceMLP):
            mats += [mlp.gate_up, mlp.down]
        elif isinstance(mlp, DeviceMoE):
            if mlp.shared is not None and not mlp.shared_in_stack:
                mats += [mlp.shared.gate_up, mlp.shared.down]
            if mlp.router_split is not None:
                shapes.append((*mlp.router_split.shape, True))
        shapes += [(*w.shape, False) for w in mats]
    return shapes


# prompt positions projected by lm_head at once in score_logprobs (671 MB of float32 logits at a 163,840-token vocab)
SCORE_ROWS = 1024


class _Pending:
    """A launched step: its sampling batch, logits and the pinned views its results land in (`parts` None: its
    sampler not queued yet, `launch(..., defer_sampling=True)`)."""

    def __init__(self, sampling: SamplingBatch, logits, parts: tuple | None, num_top: int | None, stage: str,
                 parity: int = 0) -> None:
        self.sampling, self.logits, self.parts, self.num_top, self.stage = sampling, logits, parts, num_top, stage
        self.parity = parity


class _Graph:
    def __init__(self, batch: DeviceBatch, ws: Workspace, graph, logits) -> None:
        self.batch, self.ws, self.graph, self.logits = batch, ws, graph, logits


class CudaRunner:
    name = "cuda"
    # the forward writes ForwardBatch.snapshot's states (kda_prefill_state's `snap`), but that path has not run on a GPU
    # yet: off (no prompt snapshots on this backend) until tests/kernels/test_kda_prefill.py::test_kda_prefill_snapshot
    # and tests/gpu/test_request_shapes.py::test_the_same_prompt_again_resumes_from_its_prompt_snapshot (which turn it
    # on for themselves) have passed there
    writes_snapshots = False

    def __init__(self, config: ModelConfig, weights: Mapping[str, np.ndarray], engine: EngineConfig, *,
                 progress: bool | None = None) -> None:
        import cupy

        from kda_rt.cuda.ops.compile import device_name, startup_log
        from kda_rt.cuda.ops.kda_decode import CONV_STATE_DTYPE, conv_state_shape
        from kda_rt.engine.config import default_max_num_seqs
        from kda_rt.engine.pools import check_weights_fit, plan_pools

        self.cupy = cupy
        self.config = config
        startup_log()
        gc.collect()  # runners dropped earlier in this process (a failed start kept alive by a traceback, say): give
        cupy.get_default_memory_pool().free_all_blocks()  # their memory back before it is counted as taken
        free, total = cupy.cuda.runtime.memGetInfo()
        check_weights_fit(config, engine.quantization, free_bytes=free, total_bytes=total,
                          device=device_name(cupy.cuda.Device().id))
        self.weights = upload_weights(config, weights, progress=progress, quantization=engine.quantization)
        cupy.get_default_memory_pool().free_all_blocks()  # (the upload's transient buffers; gc ran above)
        free, total = cupy.cuda.runtime.memGetInfo()
        used_by_others = total - free - self.weights.nbytes
        self.plan = plan = plan_pools(config, engine, itemsize=2, state_itemsize=4, memory_bytes=total,
                                      weight_bytes=self.weights.nbytes + max(0, used_by_others), padding=True,
                                      default_seqs=default_max_num_seqs(total, device_name(cupy.cuda.Device().id)))
        self.num_slots, self.num_blocks = plan.num_slots, plan.num_blocks
        self.pad_slot, self.pad_page = plan.pad_slot, plan.pad_page
        self.max_pages = plan.max_pages_per_seq
        self.block_size = engine.block_size
        need = plan.bytes
        logger.info("cuda pools: %d slots (%d prefix-cache states among them), %d pages of %d tokens (%.2f GiB); "
                    "max_model_len %d", self.num_slots, len(plan.snapshot_slots), self.num_blocks, engine.block_size,
                    need / 2**30, plan.max_model_len)
        try:
            kda_pools, mla_pools = {}, {}
            if config.kda is not None:
                kc = config.kda
                P = kc.num_heads * kc.head_dim
                for layer in config.kda_layer_ids:
                    conv = cupy.zeros(conv_state_shape(self.num_slots, P, kc.conv_kernel_size), dtype=CONV_STATE_DTYPE)
                    rec = cupy.zeros((self.num_slots, kc.num_heads, kc.head_dim, kc.head_dim), dtype=np.float32)
                    kda_pools[layer] = (conv, rec)
            if config.mla is not None:
                for layer in config.mla_layer_ids:
                    mla_pools[layer] = cupy.zeros((self.num_blocks, self.block_size, config.mla.cache_width), dtype=BF16)
        except cupy.cuda.memory.OutOfMemoryError as exc:
            raise MemoryError(f"cache pools ({need / 2**30:.1f} GiB) do not fit on the GPU after the weights: "
                              "lower --gpu-memory-utilization, --max-num-seqs or --max-model-len, or pass --num-blocks") from exc
        self.model = CudaModel(config, self.weights, kda_pools, mla_pools)
        self.kda_pools, self.mla_pools = kda_pools, mla_pools  # (the prefix cache's copies: copy_slots, copy_pages)
        # padding rows of decode graphs: slot -1 (no KDA state stored), the live count uploaded (the MoE plans the
        # live rows alone); read once, so the uploads and the captured kernels agree
        self.model.skip_pad = env.skip_pad()
        self.pad_row_slot = -1 if self.model.skip_pad else self.pad_slot  # (the slot padding rows carry)
        self.eager_ws = Workspace()
        self.sample_ws = Workspace()
        # KDA_RT_GPU_SAMPLING_EXTRAS: penalised rows sampled on the GPU from per-sequence token counts
        # (sampler/penalties.py, made on the first such row), bans and allowed_token_ids as bitmasks
        # (SamplingBatch.device_masks); the engine reads `device_extras` when it builds a step's SamplingBatch
        self.device_extras = env.gpu_sampling_extras()
        self.penalty_rows = None
        self.staging = Staging()
        self.enforce_eager = engine.enforce_eager
        self.buckets = engine.graph_sizes(plan.engine_slots)  # (the decode batch sizes captured as graphs)
        self.graphs: dict[int, _Graph] = {}
        self.graph_rows = [0, 0]  # decode rows replayed on graphs since start: live, padding (bench's padding share)
        # KDA_RT_SHARED_GRAPH_WS: one workspace for every decode graph (views of one allocation a name)
        self.graph_ws = Workspace(shared=True) if env.shared_graph_ws() else None
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._launches = 0  # parity of the staging set the next launch uses
        self._last_ids = None  # device ids sampled by the last launch (ids_from_last)
        self.graph_capture_s = 0.0  # seconds the start spent capturing the decode graphs (bench reports it)
        if not self.enforce_eager:  # as vLLM: every bucket's graph now, so no request waits for a capture
            started = time.perf_counter()
            # (a shared workspace: the largest first, so no later capture moves a buffer of an earlier graph; a second
            # pass recaptures any that a larger buffer of a later one made the runner drop: none in the usual case)
            for rows in [*sorted(self.buckets, reverse=self.graph_ws is not None), *self.buckets]:
                try:
                    self._graph(rows)
                except (cupy.cuda.memory.OutOfMemoryError, cupy.cuda.runtime.CUDARuntimeError,
                        cupy.cuda.driver.CUDADriverError) as exc:  # (a workspace a graph, unless shared)
                    if not isinstance(exc, cupy.cuda.memory.OutOfMemoryError) and getattr(exc, "status", None) != 2:
                        raise  # (2: cudaErrorMemoryAllocation, CUDA_ERROR_OUT_OF_MEMORY; anything else as it is)
                    held = self.graph_ws_bytes()
                    captured = len(self.graphs)
                    self.graphs.clear()  # (their memory back before the error travels up)
                    raise MemoryError(
                        f"the decode graph for {rows} sequences does not fit on the GPU after the weights, the cache "
                        f"pools and the graphs captured before it ({captured} of {self.buckets}, "
                        f"{held / 2**30:.2f} GiB of workspace): lower --gpu-memory-utilization, capture fewer or "
                        "smaller graphs (--cuda-graph-sizes, --max-num-seqs) or run without them (--enforce-eager)"
                    ) from exc
            held = self.graph_ws_bytes()
            self.graph_capture_s = time.perf_counter() - started
            logger.info("captured %d decode graphs (%s sequences) in %.1f s, %.2f GiB of workspace%s", len(self.graphs),
                        ", ".join(map(str, sorted(self.graphs))), self.graph_capture_s, held / 2**30,
                        " shared" if self.graph_ws is not None else "")
        from kda_rt.cuda.moe import precompile as precompile_moe
        from kda_rt.cuda.ops.compile import CompileError
        from kda_rt.cuda.ops.dense_w8a8 import precompile as precompile_dense
        from kda_rt.cuda.ops.gemv import precompile as precompile_gemv
        from kda_rt.cuda.ops.kda_prefill import precompile as precompile_kda
        from kda_rt.cuda.ops.skinny_gemm import precompile as precompile_skinny
        from kda_rt.cuda.weights import DeviceMoE
        from kda_rt.sampler.sampling import precompile

        precompile(config.vocab_size, plan.engine_slots, self.device_extras)  # nor for the sampler's variants
        moe = next((L.mlp for L in self.weights.layers if isinstance(L.mlp, DeviceMoE)), None)
        try:  # nor for a MoE tile size or a KDA state width the first steps did not use (mixed steps)
            shapes = _decode_projection_shapes(self.weights)
            precompile_skinny(shapes)  # nor for the decode projections' kernels
            precompile_gemv(shapes, {int(r.codes.shape[1]) for r in decode_rows(self.weights)},  # (fp8 decode GEMVs)
                            env.fp8_decode_gemv_max_t())
            if moe is not None:
                precompile_moe(config.moe, config.hidden_size, moe.w2.shape[2], moe.shared_in_stack, moe.e4m3)
            if config.kda is not None:
                precompile_kda(config.kda.num_heads, config.kda.head_dim, config.kda.conv_kernel_size)
            precompile_dense(_e4m3_dense(self.weights), config.hidden_size)  # (none without quantization="fp8")
        except (CompileError, cupy.cuda.driver.CUDADriverError, cupy.cuda.runtime.CUDARuntimeError) as exc:
            # a best-effort warm-up: a step that needs the variant raises the same error; others run
            logger.warning("could not build every kernel variant at start (%s: %s)", type(exc).__name__, exc)

    # ------------------------------------------------------------------------------------------

    def _upload(self, batch: ForwardBatch, ws: Workspace, decode: bool, rows: int | None = None,
                stage: str = "meta") -> DeviceBatch:
        """Copy the batch metadata into `ws` buffers with one pinned copy from staging buffer `stage`
        (padded to `rows` sequences for a graph, whose block table is `max_pages` wide: only the columns
        this batch uses are copied)."""
        B, T = batch.num_seqs, batch.num_tokens
        R = rows or B
        width = max(1, batch.block_tables.shape[1])
        if width > self.max_pages:
            raise ValueError(f"block table has {width} pages; max_model_len allows {self.max_pages}")
        nt = R if decode else T
        nl = R if decode else int(batch.logits_indices.shape[0])
        live = int(bool(rows and self.model.skip_pad))  # (KDA_RT_SKIP_PAD: the live row count, for the MoE)
        snap = batch.snapshot if not decode else None  # (a decode row has one token: never a snapshot)
        if snap is not None and int(snap[:, 1].max()) >= self.num_slots:
            raise ValueError(f"snapshot slot {int(snap[:, 1].max())} out of range: the state pool has "
                             f"{self.num_slots} slots")
        # ids, cu_seqlens, context, slots, logits rows, the live count (or nothing), snapshots (or nothing), tables
        sizes = (nt, R + 1, R, R, nl, live, 0 if snap is None else 2 * B, R * width)
        total = sum(sizes)
        offs = np.cumsum((0,) + sizes)  # the same layout on the host and in the device buffer
        host = self.staging.host(stage, 4 * total).view(np.int32)[:total]
        ids, cu, ctx, slots, lidx, num_live, snaps, tables = (host[offs[i]:offs[i + 1]] for i in range(8))
        ids[:T] = batch.input_ids
        ids[T:] = 0
        cu[:] = np.arange(R + 1) if decode else batch.cu_seqlens
        ctx[:B] = batch.context_lens
        ctx[B:] = 0
        slots[:B] = batch.state_slots
        slots[B:] = self.pad_row_slot
        lidx[:] = np.arange(R) if decode else batch.logits_indices
        num_live[:] = B
        if snap is not None:
            snaps[:] = snap.reshape(-1)
        tables = tables.reshape(R, width)
        tables[:] = -1
        tables[:B, : batch.block_tables.shape[1]] = batch.block_tables
        tables[B:, 0] = self.pad_page
        # a graph's buffer has room for the widest table, so its views never move
        meta = ws.get("meta", (total - R * width + R * self.max_pages if rows else total,), np.int32)
        self.staging.to_device(stage, meta, 4 * total, self.stream)
        dev = [meta[offs[i]:offs[i + 1]] for i in range(7)]
        if rows:  # the graph's table is max_pages wide: scatter the used columns into it on the device
            tab = ws.get("meta_tables", (R, self.max_pages), np.int32)
            self.cupy.cuda.runtime.memcpy2DAsync(tab.data.ptr, self.max_pages * 4, meta[offs[7]:].data.ptr,
                                                 width * 4, width * 4, R,
                                                 self.cupy.cuda.runtime.memcpyDeviceToDevice, self.stream.ptr)
        else:
            tab = meta[offs[7]:].reshape(R, width)
        max_len = 1 if decode else int(batch.seq_lens.max())
        return DeviceBatch(*dev[:4], tab, dev[4], num_tokens=nt, num_seqs=R, max_seqlen=max_len, decode=decode,
                           host_cu_seqlens=cu.copy(), host_context_lens=ctx.copy(), num_live=dev[5] if live else None,
                           snapshot=dev[6].reshape(B, 2) if snap is not None else None)

    def _padding_batch(self, rows: int) -> ForwardBatch:
        """A decode batch of `rows` padding sequences: context 0, the padding slot and page."""
        from kda_rt.engine.batch import ForwardBatch

        return ForwardBatch.build([[0]] * rows, [0] * rows, [self.pad_row_slot] * rows, [[self.pad_page]] * rows)

    def graph_ws_bytes(self) -> int:
        """Bytes of the captured decode graphs' workspaces (one shared workspace counted once)."""
        return sum(ws.nbytes() for ws in {id(g.ws): g.ws for g in self.graphs.values()}.values())

    def _graph(self, rows: int) -> _Graph:
        """The decode graph for `rows` sequences, captured on first use.  Warm-up and capture run on
        padding rows only: the warm-up executes (it must not advance a real sequence's state), the
        capture does not; real metadata is copied into the static buffers before each replay."""
        g = self.graphs.get(rows)
        if g is not None:
            return g
        ws = self.graph_ws if self.graph_ws is not None else Workspace()
        with self.stream:
            ws.frozen, ws.locked = False, ws.shared and bool(self.graphs)  # (shared: the graphs' buffers stay put)
            try:
                dev = self._upload(self._padding_batch(rows), ws, True, rows)
                self.model.forward(dev, ws)  # creates every buffer, compiles every kernel
            except WorkspaceFull:  # (shared) larger than the graphs captured on it: they go, the buffers grow
                self.stream.synchronize()  # (nothing in flight still uses them)
                self.graphs.clear()  # (recaptured when a batch needs them)
                ws.locked = False
                dev = self._upload(self._padding_batch(rows), ws, True, rows)
                self.model.forward(dev, ws)
            self.stream.synchronize()
            ws.frozen = True
            self.stream.begin_capture()
            try:
                with pdl.capturing():  # our kernels as programmatic dependent launches (sm_90+)
                    logits = self.model.forward(dev, ws)
            finally:
                graph = self.stream.end_capture()
        g = self.graphs[rows] = _Graph(dev, ws, graph, logits)
        logger.info("captured the decode graph for %d sequences", rows)
        return g

    def _forward(self, batch: ForwardBatch, stage: str = "meta", ids_from=None):
        """Device logits [R, vocab] float32 whose first N rows are batch.logits_indices' rows.  `ids_from`:
        (device int32 ids, rows) from `lead_ids_rows`: the batch's first len(rows) sequences, one token each,
        take ids[rows] on the device in place of their input_ids (the previous step's samples, which the host
        has not seen yet)."""
        decode = bool(np.all(batch.seq_lens == 1)) and batch.logits_indices.shape[0] == batch.num_seqs
        B = batch.num_seqs
        with self.stream:
            if decode and not self.enforce_eager and self.buckets and B <= self.buckets[-1]:
                rows = next(b for b in self.buckets if b >= B)
                g = self._graph(rows)
                self.graph_rows[0] += B
                self.graph_rows[1] += rows - B
                dev = self._upload(batch, g.ws, True, rows, stage)
                self._ids_from(dev, ids_from)
                g.graph.launch(self.stream)
                return g.logits
            dev = self._upload(batch, self.eager_ws, decode, stage=stage)
            self._ids_from(dev, ids_from)
            return self.model.forward(dev, self.eager_ws)

    def _ids_from(self, dev: DeviceBatch, ids_from) -> None:
        """Queued after the metadata copy, before the forward (the later write wins): one device copy a run of
        consecutive rows (one in the usual case: every row of the previous launch, in order); rows of -1 keep the
        id uploaded with the metadata."""
        if ids_from is None:
            return
        src, rows = ids_from
        rt = self.cupy.cuda.runtime
        start = 0
        while start < len(rows):
            end = start + 1
            if rows[start] >= 0:
                while end < len(rows) and rows[end] == rows[end - 1] + 1:
                    end += 1
                rt.memcpyAsync(dev.input_ids.data.ptr + 4 * start, src.data.ptr + 4 * rows[start], 4 * (end - start),
                               rt.memcpyDeviceToDevice, self.stream.ptr)
            start = end

    def score(self, batch: ForwardBatch) -> np.ndarray:
        """[N, vocab] float32 logits at batch.logits_indices (host array)."""
        n = batch.logits_indices.shape[0]
        logits = self._forward(batch)
        if n == 0:
            self.stream.synchronize()
            return np.zeros((0, self.config.vocab_size), np.float32)
        with self.stream:
            return logits[:n].get(stream=self.stream)

    def score_logprobs(self, batch: ForwardBatch, targets: np.ndarray, num: int):
        """Prompt logprobs of a one-sequence all-logits batch (`LLMEngine.prompt_logprob_rows`): the forward's final
        hidden rows but the last, projected by lm_head SCORE_ROWS at a time and each chunk's logits reduced on the
        GPU (sampler/prompt_logprobs.py with CuPy), so only the rows' logprob, rank and top `num` come back; no
        [T, vocab] float32 logits anywhere (21 GB at 32K tokens of the 48B shape's 163,840-token vocabulary)."""
        from kda_rt.cuda.gemm import linear
        from kda_rt.sampler.prompt_logprobs import PromptLogprobRows, prompt_logprob_rows

        cp = self.cupy
        m = max(int(batch.logits_indices.shape[0]) - 1, 0)
        if m == 0:  # a one-token prompt has no prompt logprobs: nothing to compute
            return prompt_logprob_rows(np.zeros((0, self.config.vocab_size), np.float32), targets[:0], num)
        with self.stream:
            dev = self._upload(batch, self.eager_ws, False)
            final = self.model.forward(dev, self.eager_ws, hidden_only=True)
            rows = final.take(cp.asarray(np.asarray(batch.logits_indices[:m], np.int64)), axis=0)
            parts = []
            for r0 in range(0, m, SCORE_ROWS):
                r1 = min(m, r0 + SCORE_ROWS)
                logits = linear(rows[r0:r1], self.model.w.lm_head, out_dtype=np.float32)
                parts.append(prompt_logprob_rows(logits, targets[r0:r1], num, xp=cp))
                del logits
        return PromptLogprobRows(*(np.concatenate(field) for field in zip(*parts, strict=True)))

    def execute(self, batch: ForwardBatch, sampling: SamplingBatch) -> StepOutput:
        """Forward, then sample every row on the GPU: `collect(launch(batch, sampling))`."""
        return self.collect(self.launch(batch, sampling))

    def launch(self, batch: ForwardBatch, sampling: SamplingBatch, *, ids_from_last=(),
               defer_sampling: bool = False) -> _Pending:
        """Queue the forward and the GPU sampler (sampler/sampling.py) without waiting: the sampling
        settings go up in one pinned copy, grammar masks (asked for only after the forward is queued, so
        the host's grammar work overlaps it) in another, and the token ids, flags and logprobs come back
        in one, read by `collect`.  `ids_from_last` (the engine's async scheduling; `lead_ids_rows`): the
        batch's first sequences, one token each, are fed the ids the previous launch sampled in those rows
        (still on the device).  `defer_sampling`: the forward only; `sample(handle)` queues the sampler
        later (the engine's async steps whose grammar masks wait for the previous step's tokens).

        Staging buffers alternate between two sets, so a launch can be queued while the previous one's
        results are still being read; the logits of a step with host rows are read in `collect`, so no
        launch may follow such a step before it is collected (the engine never does)."""
        n = sampling.num_rows
        parity = self._launches % 2
        self._launches += 1
        ids_from = None
        if ids_from_last is True or len(ids_from_last):
            last = self._last_ids
            ids_from = (last, lead_ids_rows(batch, ids_from_last, None if last is None else int(last.shape[0])))
        self._last_ids = None
        if n == 0:  # prefill chunks that finish no prompt: the caches fill, nothing is sampled
            self._forward(batch, f"meta{parity}", ids_from)
            return _Pending(sampling, None, (), None, f"results{parity}")
        pending = _Pending(sampling, self._forward(batch, f"meta{parity}", ids_from)[:n], None, None,
                           f"results{parity}", parity)
        if not defer_sampling:
            self.sample(pending)
        return pending

    def sample(self, pending: _Pending) -> None:
        """Queue the sampler of a launch (`launch` does, unless `defer_sampling`), asking for its grammar masks
        now; its ids then feed the next launch's `ids_from_last`."""
        from kda_rt.sampler.sampling import sample

        if pending.logits is None:  # (a launch that samples no row)
            return
        if pending.parts is not None:
            raise RuntimeError("sample: this launch's sampler is already queued")
        cp = self.cupy
        sampling, logits, parity = pending.sampling, pending.logits, pending.parity
        n = sampling.num_rows
        V = logits.shape[1]
        want_lp = sampling.num_logprobs >= 0
        num_top = int(sampling.num_logprobs.max(initial=0))
        i32, f32, u64 = np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.uint64)
        # settings: seeds, temperature, top_k, top_p, min_p, steps (and with device penalties repetition, presence,
        # frequency, the rows' counts rows and their update map); outputs: ids, flags, logprob, top ids / logprobs
        ins = [(n, u64), (n, f32), (n, i32), (n, f32), (n, f32), (n, i32)]
        values = [sampling.seeds, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, sampling.steps]
        pen = None
        if self.device_extras:  # (prepare: None without a penalised or biased device row)
            from kda_rt.sampler.penalties import PenaltyRows
            from kda_rt.sampler.sampling import update_counts

            if self.penalty_rows is None:
                self.penalty_rows = PenaltyRows(V, cp, lambda c, ids_, rows: update_counts(c, ids_, rows=rows,
                                                                                            stream=self.stream))
            with self.stream:  # (a new row's fill, a growth: stream-ordered after the steps that read the rows)
                pen = self.penalty_rows.prepare(sampling)
        if pen is not None:
            ins += [(n, f32)] * 3 + [(n, i32)] * 2
            values += [np.array([getattr(p, f) for p in sampling.params], np.float32)
                       for f in ("repetition_penalty", "presence_penalty", "frequency_penalty")]
            values += list(pen[:2])
        outs = [(n, i32), (n, i32), (n, f32), (n * num_top, i32), (n * num_top, f32)]
        in_offs, in_bytes = pack_layout(ins)
        out_offs, out_bytes = pack_layout(outs)
        host = self.staging.host(f"sampling{parity}", in_bytes)
        for off, (count, dtype), value in zip(in_offs, ins, values, strict=True):
            host[off:off + count * dtype.itemsize].view(dtype)[:] = value
        view = lambda buf, off, count, dtype: cp.ndarray((count,), dtype, memptr=buf.data + off)  # noqa: E731
        with self.stream:  # buffers from the pool of the stream that uses them
            dev_in = self.sample_ws.get(f"in{parity}", (in_bytes,), np.uint8)
            dev_out = self.sample_ws.get(f"out{parity}", (out_bytes,), np.uint8)
            seeds, temp, top_k, top_p, min_p, steps, *pen_in = (view(dev_in, o, c, d)
                                                                 for o, (c, d) in zip(in_offs, ins, strict=True))
            ids, flags, lp, top_ids, top_lp = (view(dev_out, o, c, d) for o, (c, d) in zip(out_offs, outs, strict=True))
            self.staging.to_device(f"sampling{parity}", dev_in, in_bytes, self.stream)
            allowed = None
            # computed now, while the forward runs (KDA_RT_GPU_SAMPLING_EXTRAS: bans and allowed_token_ids in the
            # rows' masks too)
            rows = sampling.device_masks(V) if self.device_extras else sampling.allowed
            if any(m is not None for m in rows):
                words = (V + 31) // 32
                masks = self.staging.host(f"masks{parity}", n * words * 4).view(np.int32)[: n * words].reshape(n, words)
                # (a grammar mask sized for a larger tokenizer vocabulary: its tokens past the logits do not exist)
                for i, m in enumerate(rows):
                    masks[i] = -1 if m is None else m[:words]
                allowed = self.sample_ws.get(f"masks{parity}", (n, words), np.int32)
                self.staging.to_device(f"masks{parity}", allowed, masks.nbytes, self.stream)
            penalties = None
            if pen is not None:
                rep, pres, freq, rows, _ = pen_in
                penalties = (self.penalty_rows.counts, self.penalty_rows.prompt, rep, pres, freq, rows,
                             *((self.penalty_rows.bias,) if pen[2] else ()))
            sample(logits, temp, top_k, top_p, min_p, seeds, steps, penalties=penalties, allowed=allowed,
                   out_ids=ids, out_logprobs=lp if want_lp.any() else None, num_logprobs=num_top,
                   out_top_ids=top_ids.reshape(n, num_top) if num_top else None,
                   out_top_logprobs=top_lp.reshape(n, num_top) if num_top else None, out_flags=flags,
                   stream=self.stream)
            if pen is not None:  # this step's tokens into the counts, before any later step reads them
                self.penalty_rows.after_sample(sampling, ids, pen_in[4])
            got = self.staging.from_device_async(f"results{parity}", dev_out, out_bytes, self.stream)
        self._last_ids = ids
        pending.parts = tuple(got[o:o + c * d.itemsize].view(d) for o, (c, d) in zip(out_offs, outs, strict=True))
        pending.num_top = num_top

    def collect(self, pending: _Pending) -> StepOutput:
        """Wait for a launch's results; rows the GPU sampler could not take are sampled on the host: host
        rows (sampler/batch.needs_host_sampling, unless KDA_RT_GPU_SAMPLING_EXTRAS: a logit_bias, a min_tokens ban,
        allowed_token_ids, bad_words or penalties; with it, a penalised or biased row PenaltyRows found no memory for)
        and rows where nothing is allowed (flag 2) by the NumPy reference sampler from their logits; rows with
        non-finite logits (flag 1; flag 3: a device penalty's overflow) get that error, as the reference would
        report it."""
        from kda_rt.sampler.reference import nonfinite_error, penalty_error, sample_rows

        sampling = pending.sampling
        n = sampling.num_rows
        out = StepOutput.empty(n)
        if n == 0:  # nothing to wait for: the next step's work queues behind this one on the stream
            return out
        if pending.parts is None:  # (deferred and never sampled: a launch the engine drops, all its rows finished)
            return out
        self.staging.wait(pending.stage)
        ids_h, flags_h, lp_h, top_ids_h, top_lp_h = pending.parts
        num_top = pending.num_top
        want_lp = sampling.num_logprobs >= 0
        host_rows = np.flatnonzero(sampling.host_rows | (flags_h == 2))
        with self.stream:
            host_logits = {int(i): pending.logits[int(i)].get(stream=self.stream) for i in host_rows}
        top_ids_h, top_lp_h = top_ids_h.reshape(n, num_top), top_lp_h.reshape(n, num_top)
        for i in range(n):
            if i in host_logits:
                continue
            if flags_h[i] in (1, 3):  # the model's logits are not finite (3: a device penalty overflowed): an error
                step = int(sampling.steps[i])
                out.errors[i] = nonfinite_error(step) if flags_h[i] == 1 else penalty_error(step)
                continue
            tok = int(ids_h[i])
            out.token_ids[i] = tok
            if want_lp[i]:
                lps = {tok: float(lp_h[i])}
                for j in range(int(sampling.num_logprobs[i])):
                    if np.isfinite(top_lp_h[i, j]):  # masked tokens (-inf) are not listed, as on the host
                        lps.setdefault(int(top_ids_h[i, j]), float(top_lp_h[i, j]))
                out.logprobs[i] = lps
        sample_rows(host_logits, sampling, sorted(host_logits), out)  # the host rows, in place
        return out

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """KDA states (conv and recurrent, every KDA layer) of slots `src` into slots `dst`, queued on the runner's
        stream behind the steps launched so far (the prefix cache's snapshots; `dst` distinct, none of them a
        source)."""
        self._copy_rows([a for pair in self.kda_pools.values() for a in pair], src, dst)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """MLA pages `src` (every MLA layer) into pages `dst`, queued as `copy_slots`."""
        self._copy_rows(list(self.mla_pools.values()), src, dst)

    def _copy_rows(self, pools: list, src: list[int], dst: list[int]) -> None:
        cp = self.cupy
        with self.stream:
            s = cp.asarray(np.asarray(src, dtype=np.int64))
            d = cp.asarray(np.asarray(dst, dtype=np.int64))
            for pool in pools:  # (as unsigned ints of the same width: bf16 pools take no arithmetic here)
                rows = pool.view({2: cp.uint16, 4: cp.uint32}.get(pool.dtype.itemsize, pool.dtype))
                rows[d] = rows[s]

    def report(self) -> str:
        """Each op of one decode step with the kernels it launched (traced on an eager step of one
        padding sequence), plus the sampler; a CUDA graph replays exactly these launches."""
        from kda_rt.cuda.ops.trace import Trace

        batch = self._padding_batch(1)
        ws = Workspace()
        with self.stream:
            dev = self._upload(batch, ws, True)
            self.model.forward(dev, ws)  # compile and create buffers outside the trace
            with Trace() as tr:
                self.model.forward(dev, ws)
            self.stream.synchronize()
        graphs = ("off (--enforce-eager)" if self.enforce_eager else f"one per bucket {self.buckets}" if self.buckets
                  else "none (every --cuda-graph-sizes value is above max_num_seqs: decode steps run eagerly)")
        return (f"fast-path report (cuda backend, {self.config.num_hidden_layers} layers; decode CUDA graphs: {graphs})\n"
                f"{tr.table(self._layers_per_op())}\n"
                f"{'sampling':<22} {'sampling.cu:sample_rows':<44} 1 (after the graph)")

    def _layers_per_op(self) -> dict[str, int]:
        """Model op name (as traced in cuda/model.py) -> how many layers run it in one decode step."""
        c = self.config
        return {"kda.decode": len(c.kda_layer_ids), "mla.decode": len(c.mla_layer_ids),
                "moe": c.mlp_types.count("moe"), "dense": c.mlp_types.count("dense"),
                "norm+residual": c.num_hidden_layers}

    def experts_touched(self, reset: bool = False) -> dict[int, float]:
        """MoE layer id -> mean experts touched per decode step (graph-replayed and eager decode steps
        since the last reset; padding rows of a graph bucket route too).  The bench's bytes floor."""
        self.stream.synchronize()
        stats = self.model.expert_stats.get()
        if reset:
            self.model.expert_stats.fill(0)
            self.cupy.cuda.Device().synchronize()
        return {i: float(n) / c for i, (n, c) in enumerate(stats) if c}

    def peak_memory_bytes(self) -> int:
        free, total = self.cupy.cuda.runtime.memGetInfo()
        return int(total - free)

