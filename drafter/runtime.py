"""Process plumbing of training: device and torch.distributed setup, stop signals, the resumable
data order and the learning-rate schedule. Kept apart from the training step so train.py reads as
the recipe."""

from __future__ import annotations

import itertools
import logging
import math
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dflash_pipeline.drafter.batching import collate, pack
from dflash_pipeline.drafter.config import TrainConfig
from dflash_pipeline.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class Dist:
    rank: int
    world: int
    device: torch.device
    owns_group: bool = False


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {spec!r} asked for, but no GPU is visible; use 'cpu' or 'auto'")
    return torch.device(spec)


def setup(cfg: TrainConfig) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(0, 1, resolve_device(cfg.device))
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        dev = torch.device(f"cuda:{local}")
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), dev, owns)


class StopAtStepBoundary:
    """SIGTERM, SIGINT (Ctrl-C) or SIGHUP -> flag, checked at step boundaries, where the training saves a checkpoint
    and returns. A second Ctrl-C stops at once (no checkpoint). Only the main thread may install handlers; SIGINT
    and SIGHUP are only caught where Python already handles them (the CLI; Python's own Ctrl-C).

    Once the checkpoint is saved (the with-block ends), the signal that arrived is handed to the handler that was
    there before, if it was Python's: Prefect's (a cancelled flow run: the task then ends as stopped, not as a
    finished training that evaluation would follow, and is not retried), the CLI's (a stop), Python's own SIGINT
    handler (KeyboardInterrupt). With the default SIGTERM handler (`python -m dflash_pipeline.drafter.train`,
    torchrun) train() returns `interrupted` and main exits 143.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self):
        self.signum: int | None = None
        self.at_once = False  # a second Ctrl-C: no checkpoint at all
        self._prev: dict[int, Any] = {}

    @property
    def flag(self) -> bool:
        return self.signum is not None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:  # SIGINT and SIGHUP only where Python handles them (Ctrl-C, the CLI's stop)
                if sig == signal.SIGTERM or callable(signal.getsignal(sig)):
                    self._prev[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.flag and signum == signal.SIGINT:  # Ctrl-C again: now, as without this handler
            self.at_once = True
            prev = self._prev[signum]
            if callable(prev):
                prev(signum, frame)
            raise KeyboardInterrupt
        log.warning(
            "%s: saving a checkpoint at the next step boundary (Ctrl-C again stops at once, without it)",
            signal.Signals(signum).name,
        )
        self.signum = signum

    def __exit__(self, exc_type, *exc):
        for sig, prev in self._prev.items():
            signal.signal(sig, prev)
        prev = self._prev.get(self.signum)
        if self.flag and exc_type is None and callable(prev):
            prev(self.signum, None)


class LastStepKept:
    """The training loop's safety net: when an exception leaves the loop (a stop that surfaced as an error somewhere
    in a step, a failure in the next step's forward), the last finished step is saved before the exception goes on,
    unless a checkpoint of it exists, the weights are half-updated (inside the optimizer step), a second Ctrl-C asked
    to stop at once, or several processes train (their saves wait for each other at a barrier: no rank may save
    alone). `save` replaces the loop's own save calls, so it knows what is on disk."""

    def __init__(self, save: Callable[[int], None], step: int, stop: StopAtStepBoundary, alone: bool):
        self._save, self._stop, self._alone = save, stop, alone
        self.step = self.saved = step  # the last finished step; the last one on disk (a resume's, or none new)
        self.updating = False

    def save(self, step: int) -> None:
        self.saved = step  # first: a save that fails is not tried again on the way out
        self._save(step)

    def finished(self, step: int) -> None:
        self.step, self.updating = step, False

    def __enter__(self) -> LastStepKept:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None or self.updating or self.step == self.saved or self._stop.at_once or not self._alone:
            return False
        log.warning("%s after step %d: saving its checkpoint before stopping", exc_type.__name__, self.step)
        try:
            self.save(self.step)
        except Exception as err:  # noqa: BLE001 - the exception that ended the loop is the one to report
            log.warning("could not save step %d: %s", self.step, err)
        return False


def epoch_batches(n: int, cfg: TrainConfig, world: int, rank: int, epoch: int) -> list[list[int]]:
    """The micro-batches (dataset indices) rank `rank` of `world` reads in epoch `epoch` of a dataset of `n`
    samples: DistributedSampler's order (seed + epoch). The one definition of the data order: micro_batches
    reads it, and storage/retention.py computes from it when a training is done with each store unit."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    sampler.set_epoch(epoch)
    idx = list(sampler)
    return [idx[i : i + cfg.batch_size] for i in range(0, len(idx), cfg.batch_size)]


def micro_batches(ds, cfg: TrainConfig, d: Dist, start: int, stop: int, device: torch.device) -> Iterator[dict]:
    """Micro-batches `start` to `stop` (global micro indices), epoch after epoch, from one DataLoader for the run.

    One loader, not one per epoch: a new loader starts its workers afresh, and the training waits at every epoch's
    start while they open the store and read their first batches. (The likely cause of the 3.3% data wait of a
    28 s window that held an epoch's start, four samples packed per step on an H100: RESULTS.md, Training, 2026-12-06.)
    The order is the same: epoch_batches, epoch after epoch. It ends at `stop`, so the workers' read-ahead never
    reads past the training's last step (units a retention may have deleted by then)."""
    from torch.utils.data import DataLoader

    def order() -> Iterator[list[int]]:
        epoch = 0
        while True:
            batches = epoch_batches(len(ds), cfg, d.world, d.rank, epoch)
            yield from batches[min(max(start - epoch * len(batches), 0), len(batches)) :]
            epoch += 1

    yield from DataLoader(
        ds,
        batch_sampler=itertools.islice(order(), max(stop - start, 0)),
        collate_fn=pack if cfg.pack else collate,
        num_workers=cfg.num_workers,
        pin_memory=device.type == "cuda",
        prefetch_factor=4 if cfg.num_workers else None,
        worker_init_fn=_leave_stopping_to_the_trainer if cfg.num_workers else None,
    )


def _leave_stopping_to_the_trainer(worker_id: int) -> None:
    """A DataLoader worker leaves the run's process group. Prefect's cancel and a terminal's Ctrl-C signal the whole
    group: torch's workers died of it first, and the training failed with "DataLoader worker ... is killed by
    signal" instead of saving its checkpoint at the next step boundary. Out of the group they are stopped by the
    loader as always (directly), and exit within seconds of the training process's death (torch's watchdog).
    (Ignoring the signals instead would leave them unkillable by that shutdown: the process then hung at exit.)"""
    os.setpgid(0, 0)


def micro_per_epoch(n: int, world: int, batch_size: int) -> int:
    return math.ceil(math.ceil(n / world) / batch_size)


def total_steps(n: int, world: int, cfg: TrainConfig) -> int:
    """Optimizer steps of a training on `n` samples over `world` processes: train.epochs of micro-batches,
    grad_accum per step, capped by train.max_steps."""
    total = math.ceil(math.ceil(cfg.epochs * micro_per_epoch(n, world, cfg.batch_size)) / cfg.grad_accum)
    return min(total, cfg.max_steps) if cfg.max_steps else total


def lr_lambda(total: int, warmup_ratio: float, floor: float) -> Callable[[int], float]:
    warm = math.ceil(warmup_ratio * total)

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        t = (step - warm) / max(1, total - warm)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return f
