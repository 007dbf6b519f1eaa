"""One extraction worker: load the target once on its device, run its units, write them under the commit
protocol. Prefect-free; tasks/extract.py wraps it.

On a GPU the three stages overlap (bench/RESULTS.md has the measurements):
- the forward of batch i runs on the GPU (no host synchronisation inside: inputs go up from pinned memory,
  no attention mask is needed (see _Runner._forward), and the real tokens are gathered by a precomputed
  index, not by a boolean mask);
- meanwhile the rows of batch i-1 go down by DMA, on a side stream, straight into the writer's pinned
  shard buffers (_ToWriter);
- the writer compresses and writes shards on its own threads (storage/writer.py).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch

from pipeline.config import ExtractConfig
from storage.layout import DTYPES, to_storage
from storage.store import Store
from storage.writer import BufferPool, UnitWriter
from target.batching import plan_batches
from target.capture import LayerCapture
from target.loader import load_planned
from target.placement import input_device, replica_devices
from target.probe import ProbeReport

log = logging.getLogger(__name__)
GIB = 2**30


@dataclass
class Progress:
    device: str
    unit: str
    tokens_done: int
    tokens_total: int
    tokens_per_s: float
    eta_s: float


@dataclass
class WorkerResult:
    device: str
    units: list[str]
    units_skipped: int = 0
    tokens: int = 0
    forward_passes: int = 0
    oom_splits: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    peak_gpu_gib: float = 0.0
    per_unit: dict[str, float] = field(default_factory=dict)
    gpu_busy_fraction: float = 0.0  # GPU time in forwards (CUDA events) / wall time of the extraction loop
    writer_wait_s: float = 0.0  # time the loop waited for the store writer (backpressure)
    copy_wait_s: float = 0.0  # time the loop waited for device-to-host copies
    host_buffer_gib: float = 0.0  # bound on host memory for rows in flight (UnitWriter.buffer_bytes)

    def to_dict(self) -> dict:
        return asdict(self)


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def default_writer_threads(device: str) -> int:
    """Store-writer threads per worker. A CPU worker produces a few MB/s: one thread keeps commits strictly
    in order, as the kill tests expect. A GPU worker produces up to ~1.4 GB/s of bf16, and zstd compresses
    ~0.2-0.4 GB/s per core next to the GPU feeder: 3/4 of the host's cores per GPU, at most 12 (on a 16-core
    H200 host 12 threads took the 8B shape from 26.7k to 29.0k tokens/s over 8: bench/RESULTS.md run 5)."""
    if not device.startswith("cuda"):
        return 1
    per_gpu = (os.cpu_count() or 4) // max(1, torch.cuda.device_count())
    return max(2, min(12, per_gpu * 3 // 4))


# The interpreter's GIL switch interval in a GPU worker. The thread that launches the forward's ~1,000
# kernels per batch competes for the GIL with the store-writer threads; at the default 5 ms it waited
# long enough to leave the GPU idle 14% of the time (8B shape on one H200: 28.3k -> 30.5k tokens/s at
# 0.2 ms, GPU busy 0.86 -> 0.93; bench/RESULTS.md run 9).
GPU_GIL_SWITCH_S = 0.0002


@contextmanager
def gil_switch_interval(seconds: float | None) -> Iterator[None]:
    old = sys.getswitchinterval()
    if seconds is not None:
        sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


class _Runner:
    """Runs batches with out-of-memory backoff: a batch that does not fit is split in halves."""

    def __init__(self, capture: LayerCapture, device: str, pad_id: int, dtype: torch.dtype):
        self.capture, self.device, self.pad_id, self.dtype = capture, device, pad_id, dtype
        self.cuda = device.startswith("cuda")
        self.forward_passes = 0
        self.oom_splits = 0
        self._timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def run(self, seqs: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Packed rows for `seqs` (padding stripped, in order), on the device, in the storage dtype:
        hidden [N, K, H], last [N, H] or None. On a GPU they may still be being computed."""
        try:
            return self._forward(seqs)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            if not _is_oom(e):
                raise
            if len(seqs) == 1:
                raise RuntimeError(f"out of memory on {self.device} for a single sample of {len(seqs[0])} "
                                   "tokens; lower data.max_length or use a device with more memory") from e
            if self.cuda:
                torch.cuda.empty_cache()
            self.oom_splits += 1
            mid = len(seqs) // 2
            log.warning("out of memory on %s with %d samples; splitting the batch", self.device, len(seqs))
            h1, l1 = self.run(seqs[:mid])
            h2, l2 = self.run(seqs[mid:])
            return torch.cat([h1, h2]), (torch.cat([l1, l2]) if l1 is not None else None)

    def _forward(self, seqs: list[np.ndarray]):
        n, longest = len(seqs), max(len(s) for s in seqs)
        ids = torch.full((n, longest), self.pad_id, dtype=torch.long, pin_memory=self.cuda)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.from_numpy(s.astype(np.int64))
        # Flat positions of the real tokens, in storage order.
        rows = torch.from_numpy(np.concatenate([np.arange(i * longest, i * longest + len(s)) for i, s in enumerate(seqs)]))
        if self.cuda:
            rows = rows.pin_memory()
        ids, rows = ids.to(self.device, non_blocking=True), rows.to(self.device, non_blocking=True)
        self.forward_passes += 1
        # No attention mask: padding is on the right and every layer of a decoder-only LM is causal (softmax
        # attention, Gated DeltaNet's recurrence and its causal conv), so a real position never sees a
        # padded one, and the padded positions are dropped. Without a mask, SDPA takes its causal
        # flash kernel with grouped KV heads instead of the masked kernel on repeated KV heads, and
        # transformers skips its host-synchronising mask checks.
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        hidden, last = self.capture.packed(ids, None, rows)
        hidden, last = hidden.to(self.dtype), (last.to(self.dtype) if last is not None else None)
        if self.cuda:
            end.record()
            self._timing.append((start, end))
        return hidden, last

    def gpu_seconds(self) -> float:
        """GPU time spent in forwards so far (waits for the last one)."""
        if not self._timing:
            return 0.0
        self._timing[-1][1].synchronize()
        return sum(s.elapsed_time(e) for s, e in self._timing) / 1000


@dataclass
class _Batch:
    """A batch whose rows are computed (or being computed) and not yet handed to the writer."""
    writer: UnitWriter
    start: int
    hidden: torch.Tensor  # on the device, in the storage dtype
    last: torch.Tensor | None
    ready: torch.cuda.Event | None  # recorded after the forward on the compute stream; None on CPU


_INT_OF_SIZE = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32),
                8: (torch.int64, np.int64)}


class _ToWriter:
    """Moves a batch's rows into the store writer's shard buffers, one batch behind the forward.

    On a GPU the writer's shard buffers are pinned host memory (a BufferPool with a pinned allocator,
    recycled across shards and units), and the rows go straight into them by DMA on a side stream: no
    staging buffer and no host memcpy, which at ~1 GB/s of rows kept the host loop from feeding the GPU.
    The loop calls `finish(batch i-1)` after queuing forward i, so the copies (and the wait for them,
    which releases the GIL) overlap forward i. On CPU the rows are handed over as numpy views."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.buffers = BufferPool(self._pinned if self.cuda else None)
        self.wait_s = 0.0

    @staticmethod
    def _pinned(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        # numpy view of a pinned tensor (the array's base keeps the tensor, and so the memory, alive)
        return torch.empty(shape, dtype=_INT_OF_SIZE[dtype.itemsize][0], pin_memory=True).numpy().view(dtype)

    def ready(self, writer: UnitWriter, start: int, hidden: torch.Tensor, last: torch.Tensor | None) -> _Batch:
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()  # on the compute stream, after this batch's forward
        return _Batch(writer, start, hidden, last, event)

    def finish(self, b: _Batch, store_dtype: str) -> None:
        if not self.cuda:
            b.writer.add(b.start, to_storage(b.hidden, store_dtype),
                         to_storage(b.last, store_dtype) if b.last is not None else None)
            return
        self.stream.wait_event(b.ready)
        b.writer.add(b.start, b.hidden, b.last, copy=self._copy)

    def _copy(self, dst: np.ndarray, src: torch.Tensor) -> None:
        """Rows `src` (device) into `dst` (a slice of a pinned shard buffer), bit for bit; returns once
        they are there, since the writer may hand the buffer to its threads right after."""
        tdtype, ndtype = _INT_OF_SIZE[dst.itemsize]
        with torch.cuda.stream(self.stream):
            torch.from_numpy(dst.view(ndtype)).copy_(src.view(tdtype), non_blocking=True)
        t0 = time.monotonic()
        self.stream.synchronize()
        self.wait_s += time.monotonic() - t0


def run_worker(
    store_root: str,
    version: str,
    units: list[str],
    report: ProbeReport,
    device: str,
    cfg: ExtractConfig,
    store_dtype: str,
    pad_id: int,
    progress: Callable[[Progress], None] | None = None,
    attn_implementation: str | None = None,
    writer_threads: int | None = None,
    store_options: dict | None = None,
) -> WorkerResult:
    """`writer_threads` overrides default_writer_threads(device) (benchmarks compare settings);
    `store_options`: the non-secret options of an s3:// store (RunConfig.store_options)."""
    store = Store(store_root, store_options)
    result = WorkerResult(device=device, units=list(units))
    todo = [u for u in units if not store.commit_record(version, u).get("complete")]
    result.units_skipped = len(units) - len(todo)
    if not todo:
        log.info("%s: all %d units already complete; nothing to do", device, len(units))
        return result

    t0 = time.monotonic()
    gpus = [d for d in replica_devices(device) if d.startswith("cuda")]
    first = input_device(device)
    if gpus:
        torch.cuda.set_device(first)  # CUDA events and streams below belong to the replica's first GPU
    model = load_planned(report, device, attn_implementation)
    runner = _Runner(LayerCapture(model, report.layer_ids, report.capture_last), first, pad_id,
                     DTYPES[store_dtype][1])
    to_writer = _ToWriter(first)
    threads = writer_threads or default_writer_threads(device)
    for g in gpus:
        torch.cuda.reset_peak_memory_stats(g)
    total = sum(store.unit_info(version, u).n_tokens - store.commit_record(version, u)["committed_tokens"]
                for u in todo)
    done, t_start, last_report = 0, time.monotonic(), 0.0
    writer_bytes = 0
    with gil_switch_interval(GPU_GIL_SWITCH_S if gpus else None):
        for unit in todo:
            writer = UnitWriter(store.unit_location(version, unit), io_retries=cfg.io_retries, threads=threads,
                                buffers=to_writer.buffers)
            writer_bytes = max(writer_bytes, writer.buffer_bytes)
            inflight: _Batch | None = None
            try:
                samples = writer.samples
                starts = [s[1] for s in samples]
                lengths = [s[2] for s in samples]
                ids = store.open_unit(version, unit)["input_ids"][:]
                u0, resume = time.monotonic(), writer.resume_token
                for a, b in plan_batches(lengths, report.token_budget):
                    end_tok = starts[b - 1] + lengths[b - 1]
                    if end_tok <= writer.resume_token:
                        continue
                    seqs = [ids[starts[i] : starts[i] + lengths[i]] for i in range(a, b)]
                    hidden, last = runner.run(seqs)  # queued on the GPU
                    batch = to_writer.ready(writer, starts[a], hidden, last)
                    if inflight is not None:  # the previous batch goes to the writer while this forward runs
                        to_writer.finish(inflight, store_dtype)
                    inflight = batch
                    done += end_tok - max(starts[a], resume)
                    now = time.monotonic()
                    if progress and (now - last_report > 2.0 or done >= total):
                        rate = done / max(now - t_start, 1e-9)
                        progress(Progress(device, unit, done, total, rate, (total - done) / max(rate, 1e-9)))
                        last_report = now
                if inflight is not None:
                    to_writer.finish(inflight, store_dtype)
                    inflight = None
                writer.finish()
                result.per_unit[unit] = time.monotonic() - u0
            finally:
                writer.close()
                result.writer_wait_s += writer.blocked_s
    wall = time.monotonic() - t_start
    result.tokens = done
    result.forward_passes = runner.forward_passes
    result.oom_splits = runner.oom_splits
    result.seconds = time.monotonic() - t0
    result.tokens_per_s = done / max(wall, 1e-9)
    result.copy_wait_s = to_writer.wait_s
    result.host_buffer_gib = writer_bytes / GIB
    if gpus:
        result.peak_gpu_gib = max(torch.cuda.max_memory_allocated(g) for g in gpus) / GIB
        result.gpu_busy_fraction = runner.gpu_seconds() / max(wall, 1e-9)
    log.info("%s: extracted %d tokens in %d units at %.0f tokens/s (%d forward passes, %d OOM splits, "
             "GPU busy %.0f%%, waited %.1f s for the writer)", device, done, len(todo), result.tokens_per_s,
             runner.forward_passes, runner.oom_splits, 100 * result.gpu_busy_fraction, result.writer_wait_s)
    return result
