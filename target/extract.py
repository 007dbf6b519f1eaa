"""One extraction worker: load the target once on its device, run its units, write them under the commit
protocol. Prefect-free; tasks/extract.py wraps it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import torch

from pipeline.config import ExtractConfig
from storage.layout import to_storage
from storage.store import Store
from storage.writer import UnitWriter
from target.batching import plan_batches
from target.capture import LayerCapture
from target.loader import load_target
from target.probe import ProbeReport

log = logging.getLogger(__name__)


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

    def to_dict(self) -> dict:
        return asdict(self)


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


class _Runner:
    """Runs batches with out-of-memory backoff: a batch that does not fit is split in halves."""

    def __init__(self, capture: LayerCapture, device: str, pad_id: int):
        self.capture, self.device, self.pad_id = capture, device, pad_id
        self.forward_passes = 0
        self.oom_splits = 0

    def run(self, seqs: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Packed rows for `seqs` (padding stripped, in order): hidden [N, K, H], last [N, H] or None."""
        try:
            return self._forward(seqs)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            if not _is_oom(e):
                raise
            if len(seqs) == 1:
                raise RuntimeError(f"out of memory on {self.device} for a single sample of {len(seqs[0])} "
                                   "tokens; lower data.max_length or use a device with more memory") from e
            if self.device.startswith("cuda"):
                torch.cuda.empty_cache()
            self.oom_splits += 1
            mid = len(seqs) // 2
            log.warning("out of memory on %s with %d samples; splitting the batch", self.device, len(seqs))
            h1, l1 = self.run(seqs[:mid])
            h2, l2 = self.run(seqs[mid:])
            return torch.cat([h1, h2]), (torch.cat([l1, l2]) if l1 is not None else None)

    def _forward(self, seqs: list[np.ndarray]):
        longest = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), longest), dtype=torch.long)
        for i, s in enumerate(seqs):  # right padding: causal layers never see it at real positions
            ids[i, : len(s)] = torch.from_numpy(s.astype(np.int64))
            mask[i, : len(s)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        self.forward_passes += 1
        hidden, last = self.capture(ids, mask)
        keep = mask.bool()
        return hidden[keep], (last[keep] if last is not None else None)


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
) -> WorkerResult:
    store = Store(store_root)
    result = WorkerResult(device=device, units=list(units))
    todo = [u for u in units if not store.commit_record(version, u).get("complete")]
    result.units_skipped = len(units) - len(todo)
    if not todo:
        log.info("%s: all %d units already complete; nothing to do", device, len(units))
        return result
    import zarr

    t0 = time.monotonic()
    model = load_target(report.model_path, report.dtype_kwarg, report.compute_dtype, device, attn_implementation)
    runner = _Runner(LayerCapture(model, report.layer_ids, report.capture_last), device, pad_id)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    total = sum(store.unit_info(version, u).n_tokens - store.commit_record(version, u)["committed_tokens"]
                for u in todo)
    done, t_start, last_report = 0, time.monotonic(), 0.0
    for unit in todo:
        writer = UnitWriter(store.unit_dir(version, unit), io_retries=cfg.io_retries)
        try:
            samples = writer.samples
            starts = [s[1] for s in samples]
            lengths = [s[2] for s in samples]
            ids = zarr.open_array(str(store.unit_dir(version, unit) / "input_ids"), mode="r")[:]
            u0, resume = time.monotonic(), writer.resume_token
            for a, b in plan_batches(lengths, cfg.token_budget):
                end_tok = starts[b - 1] + lengths[b - 1]
                if end_tok <= writer.resume_token:
                    continue
                seqs = [ids[starts[i] : starts[i] + lengths[i]] for i in range(a, b)]
                hidden, last = runner.run(seqs)
                hidden_np = to_storage(hidden.cpu(), store_dtype)
                last_np = to_storage(last.cpu(), store_dtype) if last is not None else None
                writer.add(starts[a], hidden_np, last_np)
                done += end_tok - max(starts[a], resume)
                now = time.monotonic()
                if progress and (now - last_report > 2.0 or done >= total):
                    rate = done / max(now - t_start, 1e-9)
                    progress(Progress(device, unit, done, total, rate, (total - done) / max(rate, 1e-9)))
                    last_report = now
            writer.finish()
            result.per_unit[unit] = time.monotonic() - u0
        finally:
            writer.close()
    result.tokens = done
    result.forward_passes = runner.forward_passes
    result.oom_splits = runner.oom_splits
    result.seconds = time.monotonic() - t0
    result.tokens_per_s = done / max(time.monotonic() - t_start, 1e-9)
    if device.startswith("cuda"):
        result.peak_gpu_gib = torch.cuda.max_memory_allocated(device) / 2**30
    log.info("%s: extracted %d tokens in %d units at %.0f tokens/s (%d forward passes, %d OOM splits)",
             device, done, len(todo), result.tokens_per_s, runner.forward_passes, runner.oom_splits)
    return result
