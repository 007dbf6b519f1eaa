"""When a training is done with each store unit: the `consumed` retention mode (storage/retention.py deletes,
this module says when), and the check that a training never needs data that retention deleted.

A training's data order is fixed before it starts (drafter/runtime.epoch_batches: DistributedSampler with the
seed and the epoch, over the reader's index), so for every unit the last micro-batch that reads one of its
samples is known in advance: the unit is *consumed* after optimizer step `due` = that micro-batch's step + 1.
Once a checkpoint at a step >= `due` is saved, neither the rest of the training nor a resume from that
checkpoint (or a later one) reads the unit again, so it can be deleted. The reader keeps a deleted unit's
samples in its index (`retired="index"`), so a resumed training has the same samples in the same order and
replays the uninterrupted run exactly.

What this frees, and when: with the default order (every epoch shuffles all samples) a unit's last read falls
in the last epoch, close to its end for a unit of many samples, so `consumed` frees the space during the last
epoch (a one-epoch training: progressively, but most units go in its final part). The store's peak size is the
same as with `keep`: extraction finishes before training starts. Units the training never reads (a
`train.max_steps` that stops it early) are kept.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from dflash_pipeline.drafter.checkpoint import list_checkpoints
from dflash_pipeline.drafter.config import TrainConfig
from dflash_pipeline.drafter.runtime import epoch_batches, micro_per_epoch, total_steps
from dflash_pipeline.errors import StoreError
from dflash_pipeline.storage import retention, retention_record
from dflash_pipeline.storage.store import Store

log = logging.getLogger(__name__)


@dataclass
class Schedule:
    """The training's use of each unit: `last[u]` the last global micro-batch that reads one of its samples,
    `due[u]` the optimizer step from which on no micro-batch reads it (a checkpoint at >= due covers it)."""

    total: int  # optimizer steps of the training
    grad_accum: int
    last: dict[str, int] = field(default_factory=dict)
    due: dict[str, int] = field(default_factory=dict)
    unread: list[str] = field(default_factory=list)  # units the training never reads


def schedule(unit_of: list[str], cfg: TrainConfig, world: int) -> Schedule:
    """The Schedule of a training on a dataset whose sample i lives in unit `unit_of[i]`, over `world` ranks
    (every rank reads its micro-batch m at the same optimizer step m // grad_accum). Only the last epochs are
    scanned: from the last one backwards until every unit read at all has been seen."""
    n = len(unit_of)
    total = total_steps(n, world, cfg)
    end = total * cfg.grad_accum  # micro-batches read: [0, end)
    per_epoch = micro_per_epoch(n, world, cfg.batch_size)
    sch = Schedule(total, cfg.grad_accum)
    units = set(unit_of)
    epoch = (end - 1) // per_epoch if end else -1
    while epoch >= 0 and len(sch.last) < len(units):
        base = epoch * per_epoch
        for rank in range(world):
            for j, batch in enumerate(epoch_batches(n, cfg, world, rank, epoch)):
                m = base + j
                if m >= end:
                    break
                for i in batch:
                    if m > sch.last.get(unit_of[i], -1):
                        sch.last[unit_of[i]] = m
        epoch -= 1
    sch.due = {u: m // cfg.grad_accum + 1 for u, m in sch.last.items()}
    sch.unread = sorted(units - set(sch.last))
    return sch


def latest_step(out_dir: str | Path) -> tuple[int, Path | None]:
    """(step, directory) of the checkpoint a resumed training starts from ((0, None) when there is none)."""
    cks = list_checkpoints(out_dir)
    return cks[-1] if cks else (0, None)


class Consumer:
    """Deletes the units of `version` that the training writing `out_dir` has consumed: at each new checkpoint
    (a thread polling every `poll_s`, so it works for a torchrun training in other processes too) and once more
    at the end (`finish`). Only units that were present when the training started (its own) are deleted."""

    def __init__(self, store: Store, version: str, sch: Schedule, owned: set[str], out_dir: str | Path, poll_s: float):
        self.store, self.version, self.sch, self.out_dir, self.poll_s = store, version, sch, Path(out_dir), poll_s
        self.owned, self.done = owned, set()
        self.outcomes: list[retention.Outcome] = []
        self._seen, self._last_skip = -1, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="retention-consumed", daemon=True)

    def start(self) -> Consumer:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.step()
            except Exception:  # noqa: BLE001 - a failed deletion must not stop the training; logged, retried
                log.exception("retention (consumed): deleting consumed units failed; retried at the next checkpoint")

    def due_units(self, step: int) -> list[str]:
        return sorted(u for u in self.owned - self.done if self.sch.due.get(u, self.sch.total + 1) <= step)

    def step(self) -> retention.Outcome | None:
        """Delete what the latest checkpoint covers (nothing when no new checkpoint or nothing due)."""
        step, path = latest_step(self.out_dir)
        if path is None or step <= self._seen:
            return None
        due = self.due_units(step)
        if not due:
            self._seen = step
            return None
        entry = {"mode": "consumed", "checkpoint": str(path), "step": step, "training": str(self.out_dir)}
        why = (
            "the training writing {out} read it for the last time in its step {due} of {total}, and its checkpoint at "
            "step {step} covers that: neither the rest of the training nor a resume from that checkpoint reads it"
        )
        per_unit = {
            u: {
                "consumed_at_step": self.sch.due[u],
                "why": why.format(out=self.out_dir, due=self.sch.due[u], total=self.sch.total, step=step),
            }
            for u in due
        }
        out = retention.retire(
            self.store, self.version, due, {**entry, "why": per_unit[due[0]]["why"]}, per_unit=per_unit
        )
        self.outcomes.append(out)
        if out.skipped:
            if out.skipped != self._last_skip:
                log.warning("retention (consumed): not deleting %d consumed units now: %s", len(due), out.skipped)
            self._last_skip = out.skipped
            return out
        self.done |= set(out.deleted) | set(due)
        self._seen, self._last_skip = step, None
        if out.deleted:
            log.info(
                "retention (consumed): checkpoint step %d: deleted %d units of %s (%s), %.1f MiB freed; %d of %d "
                "units left",
                step,
                len(out.deleted),
                self.version,
                ", ".join(out.deleted[:6]) + (" ..." if len(out.deleted) > 6 else ""),
                out.bytes_freed / 2**20,
                len(self.owned - self.done),
                len(self.owned),
            )
        return out

    def finish(self) -> retention.Outcome | None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._seen = -1  # look once more, even at a checkpoint seen already (a skipped deletion is retried)
        return self.step()

    def left(self) -> list[str]:
        """Units due by the latest checkpoint whose deletion has not happened (skipped)."""
        return self.due_units(latest_step(self.out_dir)[0])


def unit_index(store_root: str, store_options: dict | None, version: str) -> tuple[list[str], dict[str, str]]:
    """(the unit of each sample, in the training reader's order; {retired unit: why}) as the training's reader
    (retired="index") sees the version."""
    from dflash_pipeline.storage.reader import HiddenStateDataset

    with HiddenStateDataset(store_root, version, store_options, retired="index") as ds:
        return [s.unit for s in ds.samples], dict(ds.retired)


@contextmanager
def training(
    store_root: str,
    store_options: dict | None,
    version: str,
    cfg: TrainConfig,
    world: int,
    out_dir: str | Path,
    mode: str,
    poll_s: float,
) -> Iterator[Consumer | None]:
    """Around a training of `version` into `out_dir`: refuse it at once when it would read a unit whose data
    retention deleted (any mode), and with mode "consumed" delete units as checkpoints cover them. Costs one
    small file read when nothing of the version was ever deleted and the mode is not "consumed"."""
    store = Store(store_root, store_options)
    if mode != "consumed" and not retention_record.read_record(store, version):
        yield None
        return
    unit_of, gone = unit_index(store_root, store_options, version)
    sch = schedule(unit_of, cfg, world)
    start, _ = latest_step(out_dir)
    needed = sorted(u for u in gone if sch.last.get(u, -1) >= start * cfg.grad_accum)
    if needed:
        raise StoreError(
            f"this training (steps {start} to {sch.total}, into {out_dir}) reads {len(needed)} units whose data "
            f"retention deleted ({', '.join(needed[:4])}{' ...' if len(needed) > 4 else ''}): {gone[needed[0]]}. "
            "Or resume the training that consumed them (its train.output_dir and settings)"
        )
    if mode != "consumed":
        yield None
        return
    owned = set(unit_of) - set(gone)
    if sch.unread:
        log.info(
            "retention (consumed): %d units of %s are never read by this training (train.max_steps): they are kept",
            len(sch.unread),
            version,
        )
    dues = sorted(sch.due[u] for u in owned if u in sch.due)
    if dues:
        log.info(
            "retention (consumed): %d units of %s are deleted as checkpoints cover their last use: the first at "
            "step %d, half by step %d, the last at step %d of %d (train.checkpoint_every=%d)",
            len(dues),
            version,
            dues[0],
            dues[len(dues) // 2],
            dues[-1],
            sch.total,
            cfg.checkpoint_every,
        )
    consumer = Consumer(store, version, sch, owned, out_dir, poll_s).start()
    try:
        yield consumer
    finally:
        try:
            consumer.finish()
        except Exception:  # noqa: BLE001 - never hides how the training ended; the retention stage retries
            log.exception("retention (consumed): deleting the consumed units failed")


def final_pass(
    store_root: str, store_options: dict | None, version: str, cfg: TrainConfig, world: int, out_dir: str | Path
) -> tuple[retention.Outcome | None, list[str]]:
    """After the training: delete every unit its latest checkpoint covers (all it read, once it finished).
    Returns (what was done, the units due but not deleted)."""
    store = Store(store_root, store_options)
    unit_of, gone = unit_index(store_root, store_options, version)
    consumer = Consumer(store, version, schedule(unit_of, cfg, world), set(unit_of) - set(gone), out_dir, 0.0)
    out = consumer.finish()
    return out, consumer.left()
