"""One extraction worker: load the target once on its device, run its units, write them under the commit
protocol. Prefect-free; tasks/extract.py wraps it.

On a GPU the three stages overlap (bench/RESULTS.md has the measurements):
- the forward of batch i runs on the GPU (no host synchronisation inside: inputs go up from pinned memory,
  no attention mask is needed (see _Runner._forward), and the real tokens are gathered by a precomputed
  index, not by a boolean mask);
- meanwhile the rows of batch i-1 go down by DMA, on a side stream, straight into the writer's pinned
  shard buffers (_ToWriter);
- the writer compresses and writes shards in separate processes (storage/shardio.py; on a CPU worker, or
  with extract.store_writers=threads, on threads of this process: storage/writer.py).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing, contextmanager
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from dflash_pipeline.errors import StoreError
from dflash_pipeline.extraction.batching import plan_batches
from dflash_pipeline.extraction.capture import LayerCapture
from dflash_pipeline.extraction.config import ExtractConfig
from dflash_pipeline.extraction.loader import forward_or_eager, load_compiled
from dflash_pipeline.extraction.placement import input_device, replica_devices
from dflash_pipeline.extraction.spec import WorkerSpec
from dflash_pipeline.storage import quant
from dflash_pipeline.storage.layout import DTYPES, to_storage
from dflash_pipeline.storage.shardio import ShardProcesses, SharedBuffers
from dflash_pipeline.storage.store import Store
from dflash_pipeline.storage.writer import BufferPool, UnitWriter

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
    writer_wait_s: float = 0.0  # time the loop waited for the store writer (backpressure) within units
    drain_s: float = 0.0  # time the worker waited at the end for the last shards to be written
    copy_wait_s: float = 0.0  # time the loop waited for device-to-host copies
    host_buffer_gib: float = 0.0  # bound on host memory for rows in flight (UnitWriter.buffer_bytes)

    def to_dict(self) -> dict:
        return asdict(self)


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


# Threads per store-writer process, compressing the chunks of one shard at once: the cores for writing
# (default_store_writers) then go to fewer processes, and each shard is written sooner (the worker's end
# waits for its last shards). 1 until measured as a gain: on 2026-12-01 two and four threads cut that wait
# from 0.8 s to 0.5 and 0.4 s, but those runs were slowed by a fresh disk (bench/RESULTS.md, Extraction, 2026-12-01).
SHARD_CODEC_THREADS = 1


def uses_writer_processes(store_writers: str, device: str) -> bool:
    return store_writers == "processes" or (store_writers == "auto" and device.startswith("cuda"))


def default_store_writers(device: str, processes: bool) -> int:
    """Shards written at once per worker. A CPU worker produces a few MB/s: one keeps commits strictly in
    order, as the kill tests expect. A GPU worker produces up to ~1.6 GB/s of bf16, and zstd compresses
    ~0.2-0.3 GB/s per core: writer processes on all but two of the host's cores per GPU (one feeds the GPU),
    at most 14; writer threads share the feeder's interpreter, and more than 3/4 of the cores, at most 12,
    slowed it (bench/RESULTS.md runs 5 and 9)."""
    if not device.startswith("cuda"):
        return 1
    per_gpu = (os.cpu_count() or 4) // max(1, torch.cuda.device_count())
    if processes:
        return max(2, min(14, per_gpu - 2))
    return max(2, min(12, per_gpu * 3 // 4))


def _room_for_shared_buffers(shared: SharedBuffers, cfg: ExtractConfig, writers: int) -> bool:
    """Whether shared memory holds the writer processes' shard buffers (writers + 2 shards, plus the last
    layer's rows). Docker's default /dev/shm is 64 MiB: 'auto' then writes on threads, with a warning."""
    need, free = (writers + 2) * cfg.shard_mib * 2**20 * 1.25, shared.free_bytes()
    if free >= need:
        return True
    msg = (
        f"{shared.dir} has {free / GIB:.2f} GiB free; {writers} store-writer processes need about "
        f"{need / GIB:.1f} GiB for their shard buffers ({writers + 2} x extract.shard_mib {cfg.shard_mib:g} MiB)"
    )
    fix = "enlarge it (docker run --shm-size with at least this much per GPU) or lower extract.shard_mib"
    if cfg.store_writers == "processes":
        raise StoreError(f"{msg}: {fix}, or set extract.store_writers: threads")
    log.warning("%s; writing shards on threads of the worker instead (%s to use processes)", msg, fix)
    return False


def _pin_host(arr: np.ndarray) -> Callable[[], None]:
    """Page-lock a shared shard buffer for DMA (portable: any GPU of a split replica may copy into it)."""
    cudart, ptr = torch.cuda.cudart(), arr.ctypes.data
    rc = int(cudart.cudaHostRegister(ptr, arr.nbytes, 1))
    if rc != 0:
        raise RuntimeError(
            f"cudaHostRegister of a {arr.nbytes / 2**20:.0f} MiB shard buffer failed (CUDA error "
            f"{rc}); set extract.store_writers: threads to use torch's pinned memory instead"
        )
    return lambda: cudart.cudaHostUnregister(ptr)


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
    """Runs batches with out-of-memory backoff: a batch that does not fit is split in halves. If parts of the
    model are compiled (extract.compile) and compiling fails, it goes on with the eager forward."""

    def __init__(self, capture: LayerCapture, device: str, pad_id: int, dtype: torch.dtype, precision: str = "full"):
        self.capture, self.device, self.pad_id, self.dtype = capture, device, pad_id, dtype
        self.precision = precision
        self.cuda = device.startswith("cuda")
        self.forward_passes = 0
        self.oom_splits = 0
        self._timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def run(self, seqs: list[np.ndarray]) -> dict[str, torch.Tensor]:
        """Packed rows for `seqs` (padding stripped, in order), on the device, as stored: {"hidden": [N, K, H],
        "last_hidden": [N, H] (when captured)} in the storage dtype, or with a compact precision the quantized
        values plus "hidden_scale" [N, K] / "last_hidden_scale" [N]. On a GPU they may still be being computed."""
        try:
            return forward_or_eager(self.capture.model, lambda: self._forward(seqs))
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            if not _is_oom(e):
                raise
            if len(seqs) == 1:
                raise RuntimeError(
                    f"out of memory on {self.device} for a single sample of {len(seqs[0])} "
                    "tokens; lower data.max_length or use a device with more memory"
                ) from e
            if self.cuda:
                torch.cuda.empty_cache()
            self.oom_splits += 1
            mid = len(seqs) // 2
            log.warning("out of memory on %s with %d samples; splitting the batch", self.device, len(seqs))
            first, second = self.run(seqs[:mid]), self.run(seqs[mid:])
            return {k: torch.cat([first[k], second[k]]) for k in first}

    def _forward(self, seqs: list[np.ndarray]):
        n, longest = len(seqs), max(len(s) for s in seqs)
        ids = torch.full((n, longest), self.pad_id, dtype=torch.long, pin_memory=self.cuda)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.from_numpy(s.astype(np.int64))
        # Flat positions of the real tokens, in storage order.
        rows = torch.from_numpy(
            np.concatenate([np.arange(i * longest, i * longest + len(s)) for i, s in enumerate(seqs)])
        )
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
        out = {"hidden": hidden, **({"last_hidden": last} if last is not None else {})}
        if self.precision == "full":
            out = {k: v.to(self.dtype) for k, v in out.items()}
        else:  # quantized here, on the device: half the bytes (or less) go down to the host
            for k in list(out):
                out[k], out[quant.SCALE_OF[k]] = quant.quantize(out[k], self.precision)
        if self.cuda:
            end.record()
            self._timing.append((start, end))
        return out

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
    unit: str
    start: int
    rows: dict[str, torch.Tensor]  # on the device, as stored (_Runner.run)
    ready: torch.cuda.Event | None  # recorded after the forward on the compute stream; None on CPU
    last_of_unit: bool  # once this batch is handed over, the unit's writer only drains


_INT_OF_SIZE = {
    1: (torch.uint8, np.uint8),
    2: (torch.int16, np.int16),
    4: (torch.int32, np.int32),
    8: (torch.int64, np.int64),
}


class _ToWriter:
    """Moves a batch's rows into the store writer's shard buffers, one batch behind the forward.

    On a GPU the writer's shard buffers are pinned host memory (a BufferPool with a pinned allocator,
    recycled across shards and units; shared memory registered with CUDA when processes write the shards),
    and the rows go straight into them by DMA on a side stream: no staging buffer and no host memcpy, which
    at ~1 GB/s of rows kept the host loop from feeding the GPU.
    The loop calls `finish(batch i-1)` after queuing forward i, so the copies (and the wait for them,
    which releases the GIL) overlap forward i. On CPU the rows are handed over as numpy views."""

    def __init__(self, device: str, shared: SharedBuffers | None, writers: int):
        self.cuda = device.startswith("cuda")
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # as many buffers as one UnitWriter with `writers` threads holds at once (max_pending + 1)
        self.buffers = BufferPool(shared or (self._pinned if self.cuda else None), limit=writers + 2)
        self.wait_s = 0.0

    @staticmethod
    def _pinned(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        # numpy view of a pinned tensor (the array's base keeps the tensor, and so the memory, alive)
        return torch.empty(shape, dtype=_INT_OF_SIZE[dtype.itemsize][0], pin_memory=True).numpy().view(dtype)

    def ready(
        self,
        writer: UnitWriter,
        unit: str,
        start: int,
        rows: dict[str, torch.Tensor],
        last_of_unit: bool,
    ) -> _Batch:
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()  # on the compute stream, after this batch's forward
        return _Batch(writer, unit, start, rows, event, last_of_unit)

    def finish(self, b: _Batch, store_dtype: str) -> None:
        rows = dict(b.rows)
        if not self.cuda:  # numpy views of the stored values (bf16 as its uint16 bits, quantized as they are)
            rows = {
                k: to_storage(v, store_dtype) if v.is_floating_point() and "scale" not in k else v.numpy()
                for k, v in rows.items()
            }
            b.writer.add(b.start, rows.pop("hidden"), rows.pop("last_hidden", None), **rows)
            return
        self.stream.wait_event(b.ready)
        b.writer.add(b.start, rows.pop("hidden"), rows.pop("last_hidden", None), copy=self._copy, **rows)

    def _copy(self, dst: np.ndarray, src: torch.Tensor) -> None:
        """Rows `src` (device) into `dst` (a slice of a pinned shard buffer), bit for bit; returns once
        they are there, since the writer may hand the buffer to its threads right after."""
        tdtype, ndtype = _INT_OF_SIZE[dst.itemsize]
        with torch.cuda.stream(self.stream):
            torch.from_numpy(dst.view(ndtype)).copy_(src.view(tdtype), non_blocking=True)
        t0 = time.monotonic()
        self.stream.synchronize()
        self.wait_s += time.monotonic() - t0


def run_worker(spec: WorkerSpec, progress: Callable[[Progress], None] | None = None) -> WorkerResult:
    """Extract `spec.units` on `spec.device`; units already complete are skipped, a partial one resumes at
    its commit record."""
    store = Store(spec.store_root, spec.store_options)
    result = WorkerResult(device=spec.device, units=list(spec.units))
    todo = [u for u in spec.units if not store.commit_record(spec.version, u).get("complete")]
    result.units_skipped = len(spec.units) - len(todo)
    if not todo:
        log.info("%s: all %d units already complete; nothing to do", spec.device, len(spec.units))
        return result
    with ExitStack() as stack:  # writer processes stop, then their shared buffers go
        return _extract(stack, store, spec, todo, progress, result)


def _extract(
    stack: ExitStack,
    store: Store,
    spec: WorkerSpec,
    todo: list[str],
    progress: Callable[[Progress], None] | None,
    result: WorkerResult,
) -> WorkerResult:
    version, report, device, cfg, writers = spec.version, spec.report, spec.device, spec.extract, spec.writers
    store_dtype, pad_id = spec.store_dtype, spec.report.pad_id
    t0 = time.monotonic()
    gpus = [d for d in replica_devices(device) if d.startswith("cuda")]
    first = input_device(device)
    procs = shared = None
    if uses_writer_processes(cfg.store_writers, device):
        n = writers or default_store_writers(device, processes=True)
        shared = stack.enter_context(closing(SharedBuffers(_pin_host if gpus else None)))
        threads = min(SHARD_CODEC_THREADS, n)
        if _room_for_shared_buffers(shared, cfg, n // threads):
            # they start while the model loads
            procs = stack.enter_context(closing(ShardProcesses(n // threads, threads)))
        else:
            shared = None
    writers = len(procs) if procs else writers or default_store_writers(device, processes=False)
    if gpus:
        torch.cuda.set_device(first)  # CUDA events and streams below belong to the replica's first GPU
    to_writer = _ToWriter(first, shared, writers)
    open_writers: dict[str, UnitWriter] = {}

    def writer_for(unit: str) -> UnitWriter:
        if unit not in open_writers:
            open_writers[unit] = UnitWriter(
                store.unit_location(version, unit),
                io_retries=cfg.io_retries,
                threads=writers,
                buffers=to_writer.buffers,
                procs=procs,
            )
            stack.callback(open_writers[unit].close)  # idempotent; on an error, waits for its writes
        return open_writers[unit]

    # The shard buffers (pinned: page-locking ~2 GiB takes about a second) are made while the model loads.
    prefill = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="shard-buffers"))
    buffers_made = prefill.submit(writer_for(todo[0]).reserve_buffers)
    precision = quant.scheme(store.attrs(version))  # the version's own scheme (its arrays were planned for it)
    if gpus:  # and the quantization kernel's compile and check (storage/quant.py)
        cuda = torch.device("cuda", torch.cuda.current_device())
        kernel_checked = prefill.submit(
            quant.prepare, cuda, getattr(torch, report.compute_dtype), report.hidden_size, precision
        )
    model, mode, compiled = load_compiled(report, device, cfg.compile)
    if compiled:
        log.info(
            "%s: torch.compile on %d modules (extract.compile=%s: %s); the first batches compile them",
            device,
            compiled,
            cfg.compile,
            mode,
        )
    runner = _Runner(
        LayerCapture(model, report.layer_ids, report.capture_last),
        first,
        pad_id,
        DTYPES[store_dtype][1],
        precision,
    )
    buffers_made.result()  # re-raises, e.g. too little shared memory
    if gpus:
        kernel_checked.result()
    for g in gpus:
        torch.cuda.reset_peak_memory_stats(g)
    total = sum(
        store.unit_info(version, u).n_tokens - store.commit_record(version, u)["committed_tokens"] for u in todo
    )
    done, t_start, last_report = 0, time.monotonic(), 0.0
    unit_start: dict[str, float] = {}

    draining: dict[str, UnitWriter] = {}  # units whose rows are all handed over; shards still being written

    def finish(unit: str) -> None:
        draining.pop(unit).finish()
        result.per_unit[unit] = time.monotonic() - unit_start[unit]

    def hand_over(b: _Batch) -> None:
        """b's rows to its writer. A unit's last shards are written while the next unit's batches run: the
        loop never waits at a unit boundary (the shared buffer pool still bounds what is in flight)."""
        to_writer.finish(b, store_dtype)
        if b.last_of_unit:
            draining[b.unit] = b.writer
        for unit in [u for u, w in draining.items() if w.idle]:
            finish(unit)

    inflight: _Batch | None = None  # computed (or being computed), handed to its writer one batch later
    with gil_switch_interval(GPU_GIL_SWITCH_S if gpus else None):
        for unit in todo:
            unit_start[unit] = time.monotonic()
            writer = writer_for(unit)
            samples = writer.samples
            starts, lengths = [s[1] for s in samples], [s[2] for s in samples]
            resume = writer.resume_token
            plan = [
                (a, b) for a, b in plan_batches(lengths, report.token_budget) if starts[b - 1] + lengths[b - 1] > resume
            ]  # batches committed before a restart are skipped
            assert plan, f"unit {unit} is in the to-do list but has nothing left to extract"
            ids = store.open_unit(version, unit)["input_ids"][:]
            for k, (a, b) in enumerate(plan):
                seqs = [ids[starts[i] : starts[i] + lengths[i]] for i in range(a, b)]
                rows = runner.run(seqs)  # queued on the GPU
                batch = to_writer.ready(writer, unit, starts[a], rows, last_of_unit=k == len(plan) - 1)
                if inflight is not None:  # the previous batch goes to its writer while this forward runs
                    hand_over(inflight)
                inflight = batch
                done += starts[b - 1] + lengths[b - 1] - max(starts[a], resume)
                now = time.monotonic()
                if progress and (now - last_report > 2.0 or done >= total):
                    rate = done / max(now - t_start, 1e-9)
                    progress(Progress(device, unit, done, total, rate, (total - done) / max(rate, 1e-9)))
                    last_report = now
        if inflight is not None:
            hand_over(inflight)
        t = time.monotonic()
        for unit in list(draining):
            finish(unit)
        result.drain_s = time.monotonic() - t
    wall = time.monotonic() - t_start
    result.writer_wait_s = sum(w.blocked_s for w in open_writers.values())
    result.host_buffer_gib = max(w.buffer_bytes for w in open_writers.values()) / GIB
    result.tokens = done
    result.forward_passes = runner.forward_passes
    result.oom_splits = runner.oom_splits
    result.seconds = time.monotonic() - t0
    result.tokens_per_s = done / max(wall, 1e-9)
    result.copy_wait_s = to_writer.wait_s
    if gpus:
        result.peak_gpu_gib = max(torch.cuda.max_memory_allocated(g) for g in gpus) / GIB
        result.gpu_busy_fraction = runner.gpu_seconds() / max(wall, 1e-9)
    log.info(
        "%s: extracted %d tokens in %d units at %.0f tokens/s (%d forward passes, %d OOM splits, GPU busy "
        "%.0f%%, waited %.1f s for the writer, %.1f s for the last shards)",
        device,
        done,
        len(todo),
        result.tokens_per_s,
        runner.forward_passes,
        runner.oom_splits,
        100 * result.gpu_busy_fraction,
        result.writer_wait_s,
        result.drain_s,
    )
    return result
