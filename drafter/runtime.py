"""Process plumbing of training: device and torch.distributed setup, SIGTERM handling, the resumable
data order and the learning-rate schedule. Kept apart from the training step so train.py reads as
the recipe."""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from dflash_pipeline.drafter.batching import collate
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


class StopOnSigterm:
    """SIGTERM -> flag (checked at step boundaries). Only the main thread may install handlers.

    Once the checkpoint is saved (the with-block ends), a SIGTERM that arrived is handed to the handler that was
    there before, if it was Python's: Prefect's (a cancelled flow run: the task then ends as stopped, not as a
    finished training that evaluation would follow, and is not retried) or the CLI's (a stop). With the default
    handler (`python -m dflash_pipeline.drafter.train`, torchrun) train() returns `interrupted` and main exits 143.
    """

    def __init__(self):
        self.flag, self._prev = False, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._prev = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        log.warning("SIGTERM: saving a checkpoint at the next step boundary")
        self.flag = True

    def __exit__(self, exc_type, *exc):
        if self._prev is not None:
            signal.signal(signal.SIGTERM, self._prev)
            if self.flag and exc_type is None and callable(self._prev):
                self._prev(signal.SIGTERM, None)


def epoch_batches(n: int, cfg: TrainConfig, world: int, rank: int, epoch: int) -> list[list[int]]:
    """The micro-batches (dataset indices) rank `rank` of `world` reads in epoch `epoch` of a dataset of `n`
    samples: DistributedSampler's order (seed + epoch). The one definition of the data order: micro_batches
    reads it, and storage/retention.py computes from it when a training is done with each store unit."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    sampler.set_epoch(epoch)
    idx = list(sampler)
    return [idx[i : i + cfg.batch_size] for i in range(0, len(idx), cfg.batch_size)]


def micro_batches(ds, cfg: TrainConfig, d: Dist, start: int, device: torch.device) -> Iterator[dict]:
    """Micro-batches from global micro index `start` on, epoch after epoch."""
    from torch.utils.data import DataLoader

    epoch = 0
    while True:
        batches = epoch_batches(len(ds), cfg, d.world, d.rank, epoch)
        skip = min(max(start - epoch * len(batches), 0), len(batches))
        if skip < len(batches):
            yield from DataLoader(
                ds,
                batch_sampler=batches[skip:],
                collate_fn=collate,
                num_workers=cfg.num_workers,
                pin_memory=device.type == "cuda",
                prefetch_factor=4 if cfg.num_workers else None,
            )
        epoch += 1


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
