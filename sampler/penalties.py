"""`PenaltyRows`: each penalised sequence's token counts on the device, so the GPU sampler applies repetition,
presence and frequency penalties (kernels_cu/sampling.cu HAS_PENALTIES) and no such row goes to the host sampler.

Two arrays of R rows: `counts` [R, V] int32 (how often each token is in the sequence's output) and `prompt`
[R, V] uint8 (1 where a token is in its prompt), the shapes the sampling kernel reads through its row map; from the
first row with a logit_bias on, a third, `bias` [R, V] float32 (the request's biases, 0 elsewhere: HAS_BIAS), so a
biased row is sampled on the GPU too.
Row 0 stays zero: the batch rows without a device penalty read it (repetition 1, presence and frequency 0 leave
their logits bit for bit as they are).  A sequence gets a row the first launch it samples in (found by its key,
`SamplingBatch.keys`), filled from its prompt and outputs; after each launch the sampled ids are added on the
device (`update_counts`, queued right after the sampler), so the next step's counts hold the token even before
the host has it (async scheduling's pending token).  Each key's entry records how many of its outputs the device
has counted; a row whose `steps` disagrees (a token sampled on the host, a step that failed) is filled again from
its history.

Rows of keys not seen in this launch or the one before are reused first (least recently seen), else the arrays
grow by doubling (the old rows copied on the device, in stream order).  Memory: 5 bytes x V a row (0.8 MB at V =
163840; 9 bytes, 1.5 MB, once a biased row came), allocated on the first penalised or biased row, so only servers
that get such requests pay it; at most about twice max_num_seqs rows.  When the GPU has no memory to grow (or for
the bias array), the rows that needed it are sampled on the host instead (`prepare` marks them in
`sampling.host_rows`, which the engine reads after the launch: no step goes ahead of them; none of them has a
pending token, since it has no device row yet), and a later launch tries again.

`xp` is the array module (CuPy on the GPU; NumPy in the CPU tests, with `add_sampled` as `np.add.at`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

__all__ = ["PenaltyRows"]

logger = logging.getLogger(__name__)


class PenaltyRows:
    def __init__(self, vocab: int, xp, add_sampled: Callable, *, first_capacity: int = 8) -> None:
        """`add_sampled(counts, ids, rows)`: counts[rows[b], ids[b]] += 1 where rows[b] >= 0 (ids: the sampler's
        device output; sampler/sampling.update_counts on the GPU)."""
        self.vocab = vocab
        self.xp = xp
        self.add_sampled = add_sampled
        self.first_capacity = first_capacity
        self.counts = None  # [R, V] int32, R = 1 + capacity (row 0: zeros)
        self.prompt = None  # [R, V] uint8
        self.bias = None  # [R, V] float32: each row's logit_bias (0 elsewhere), from the first biased row on
        self.want_bias = False
        self.entries: dict[int, list[int]] = {}  # key -> [row, tokens counted on the device, last launch seen]
        self.free: list[int] = []
        self.launch = 0
        self.warned = False

    @property
    def capacity(self) -> int:
        return 0 if self.counts is None else self.counts.shape[0] - 1

    def prepare(self, sampling) -> tuple[np.ndarray, np.ndarray, bool] | None:
        """For a launch about to sample `sampling`: (row of each batch row, 0 for rows without a device penalty or
        bias; the same with -1 there, for `after_sample`), both [N] int32 host arrays, and whether the kernel must
        add `bias`, once every such row's counts equal its `steps`; None when no row has a device penalty or
        bias.  RuntimeError when a row's counts would need a token only the device has (a pending token it did not
        count: not produced by the engine)."""
        self.launch += 1
        device = np.flatnonzero(self._device_rows(sampling))
        if device.size == 0:
            return None
        keys = [int(sampling.keys[i]) for i in device]
        if min(keys) < 0:
            raise ValueError("PenaltyRows: a row with a device penalty needs its sequence key (SamplingBatch.keys)")
        for key in keys:  # (stamped first, so no row of this batch is taken for another of its keys)
            if key in self.entries:
                self.entries[key][2] = self.launch
        rows = np.zeros(sampling.num_rows, np.int32)
        biased = any(sampling.logit_bias[i] is not None for i in device)
        if biased and self.bias is None:
            self.want_bias = True
            if self.counts is not None:  # (else the first growth makes it)
                try:
                    self.bias = self.xp.zeros(self.counts.shape, dtype=np.float32)
                except MemoryError:  # the biased rows to the host this time (none is pending: no bias row ran yet)
                    for i in device:
                        if sampling.logit_bias[i] is not None:
                            sampling.host_rows[i] = True
                    self._warn_memory()
        for i, key in zip(device, keys, strict=True):
            if sampling.host_rows[i]:
                continue
            entry = self.entries.get(key)
            if entry is None:
                try:
                    row = self._take_row()
                except MemoryError:  # (CuPy's OutOfMemoryError is one) no room to grow: the host samples the row
                    sampling.host_rows[i] = True  # (its history has every output: a new key has no pending token)
                    self._warn_memory()
                    continue
                entry = self.entries[key] = [row, -1, self.launch]
            steps = int(sampling.steps[i])
            if entry[1] != steps:
                prompt, outputs = sampling.history[i]
                if len(outputs) != steps:
                    raise RuntimeError(f"PenaltyRows: sequence {key} samples output token {steps} but the host holds "
                                       f"{len(outputs)} of its outputs and the device counted {entry[1]}")
                self._fill(entry[0], prompt, outputs, sampling.logit_bias[i])
                entry[1] = steps
            rows[i] = entry[0]
        if not rows.any():  # (every such row went to the host)
            return None
        update = np.where(rows > 0, rows, -1).astype(np.int32)
        return rows, update, biased and self.bias is not None

    def _warn_memory(self) -> None:
        if not self.warned:
            self.warned = True
            logger.warning("no GPU memory for more per-sequence sampling rows (%d rows of %d tokens); penalised or "
                           "biased rows without one are sampled on the host meanwhile", self.capacity, self.vocab)

    def after_sample(self, sampling, ids, update_dev) -> None:
        """Queue the sampled `ids` (device [N] int32) into the counts of the rows `prepare` mapped (`update_dev`,
        its second array on the device); each such sequence then counts one token more."""
        self.add_sampled(self.counts, ids, update_dev)
        for i in np.flatnonzero(self._device_rows(sampling)):
            self.entries[int(sampling.keys[i])][1] += 1

    @staticmethod
    def _device_rows(sampling) -> np.ndarray:
        """[N] bool: rows with a penalty or a logit_bias that the device samples."""
        biased = np.array([b is not None for b in sampling.logit_bias], dtype=bool)
        return (sampling.penalty_rows | biased) & ~sampling.host_rows

    def _take_row(self) -> int:
        if not self.free:
            idle = [(e[2], k) for k, e in self.entries.items() if e[2] < self.launch - 1]
            if idle:
                _, key = min(idle)
                self.free.append(self.entries.pop(key)[0])
            else:
                self._grow()
        return self.free.pop()

    def _grow(self) -> None:
        xp, old = self.xp, self.capacity
        cap = max(self.first_capacity, 2 * old)
        counts = xp.zeros((cap + 1, self.vocab), dtype=np.int32)
        prompt = xp.zeros((cap + 1, self.vocab), dtype=np.uint8)
        bias = xp.zeros((cap + 1, self.vocab), dtype=np.float32) if self.want_bias else None
        if old:
            counts[: old + 1] = self.counts
            prompt[: old + 1] = self.prompt
            if self.bias is not None:
                bias[: old + 1] = self.bias
        self.counts, self.prompt, self.bias = counts, prompt, bias
        self.free.extend(range(cap, old, -1))  # (popped from the end: the lowest new row first)

    def _fill(self, row: int, prompt, outputs, logit_bias=None) -> None:
        """The row's counts of `outputs`, marks of `prompt` and (with the bias array) its `logit_bias` ((ids, values)
        or None); token ids outside [0, V) are left out, as the kernels and the host sampler leave them."""
        xp, V = self.xp, self.vocab
        self.counts[row] = 0
        self.prompt[row] = 0
        if self.bias is not None:
            self.bias[row] = 0
            if logit_bias is not None:
                ids, values = logit_bias
                keep = (ids >= 0) & (ids < V)
                if keep.any():
                    self.bias[row, xp.asarray(ids[keep])] = xp.asarray(values[keep].astype(np.float32))
        out = np.asarray(outputs, dtype=np.int64)
        ids, num = np.unique(out[(out >= 0) & (out < V)], return_counts=True)
        if ids.size:
            self.counts[row, xp.asarray(ids)] = xp.asarray(num.astype(np.int32))
        seen = np.unique(np.asarray(prompt, dtype=np.int64))
        seen = seen[(seen >= 0) & (seen < V)]
        if seen.size:
            self.prompt[row, xp.asarray(seen)] = 1
