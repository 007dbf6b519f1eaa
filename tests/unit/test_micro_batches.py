"""drafter/runtime.py micro_batches: the training's data order over several epochs, resumed at any micro-batch, from
one DataLoader whose workers live through the whole run (a loader per epoch restarted them, and the training waited
at each epoch's start for new workers to open the store), and that reads nothing past the training's last step."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch

from dflash_pipeline.drafter import runtime
from dflash_pipeline.drafter.config import TrainConfig

torch.set_num_threads(1)
N = 10  # samples


class _Samples(torch.utils.data.Dataset):
    """Sample i is (i, the pid of the process that read it); `log`: every read appends i there (workers too)."""

    def __init__(self, log: Path | None = None):
        self.log = log

    def __len__(self):
        return N

    def __getitem__(self, i):
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(f"{i}\n")
        return i, os.getpid()


def _read(monkeypatch, cfg: TrainConfig, start: int, micro: int, ds=None) -> list[list[tuple[int, int]]]:
    monkeypatch.setattr(runtime, "collate", list)  # (the batches as read: the real collate needs store samples)
    d = runtime.Dist(rank=0, world=1, device=torch.device("cpu"))
    batches = runtime.micro_batches(ds or _Samples(), cfg, d, start, start + micro, d.device)
    return list(itertools.islice(batches, micro + 1))  # (+1: what comes past `stop`, if anything)


@pytest.mark.parametrize("start", [0, 3, 7, 12])
def test_micro_batches_follow_epoch_batches_across_epochs_from_any_start(monkeypatch, start):
    cfg = TrainConfig(batch_size=3, num_workers=0, seed=5)
    per_epoch = runtime.micro_per_epoch(N, 1, 3)
    want = [b for e in range(6) for b in runtime.epoch_batches(N, cfg, 1, 0, e)][start : start + 3 * per_epoch]
    got = _read(monkeypatch, cfg, start, 3 * per_epoch)
    assert [[i for i, _ in b] for b in got] == want


def test_the_loader_workers_serve_every_epoch(monkeypatch):
    cfg = TrainConfig(batch_size=2, num_workers=2, seed=5)
    got = _read(monkeypatch, cfg, 0, 4 * runtime.micro_per_epoch(N, 1, 2))  # four epochs
    assert [[i for i, _ in b] for b in got] == [b for e in range(4) for b in runtime.epoch_batches(N, cfg, 1, 0, e)]
    readers = {pid for b in got for _, pid in b}
    assert len(readers) == 2 and os.getpid() not in readers  # the same two workers all along


def test_the_workers_read_no_sample_past_the_last_step(monkeypatch, tmp_path):
    """The workers read ahead (prefetch); at the training's last micro-batch that read-ahead must stop, or it reads
    an epoch that is never trained (units a retention may have deleted by then)."""
    cfg = TrainConfig(batch_size=2, num_workers=2, seed=5)
    log = tmp_path / "reads"
    got = _read(monkeypatch, cfg, 3, 7, _Samples(log))
    want = [b for e in range(3) for b in runtime.epoch_batches(N, cfg, 1, 0, e)][3:10]
    assert [[i for i, _ in b] for b in got] == want
    assert sorted(int(x) for x in log.read_text().split()) == sorted(i for b in want for i in b)
