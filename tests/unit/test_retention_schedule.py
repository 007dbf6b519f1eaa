"""Retention's pure parts: the setting (off by default, validated, local stores only) and the consumption
schedule (drafter/retention.schedule), checked against a plain walk over every micro-batch of the training's
data order, on one and on several ranks, with gradient accumulation and a step cap."""

from __future__ import annotations

import random

import pytest

from dflash_pipeline.config import load_config
from dflash_pipeline.drafter.config import TrainConfig
from dflash_pipeline.drafter.retention import schedule
from dflash_pipeline.drafter.runtime import epoch_batches, micro_per_epoch, total_steps
from dflash_pipeline.errors import ConfigError


def test_retention_is_off_by_default_and_validated():
    assert load_config().retention.mode == "keep"
    assert load_config(None, ["retention.mode=consumed"]).retention.mode == "consumed"
    with pytest.raises(ConfigError, match=r"retention.mode.*got 'delete'"):
        load_config(None, ["retention.mode=delete"])
    with pytest.raises(ConfigError, match="needs a local store_path.*reader leases"):
        load_config(None, ["retention.mode=after_export", "store_path=s3://bucket/store"])
    assert load_config(None, ["store_path=s3://bucket/store"]).retention.mode == "keep"


def brute_force(unit_of: list[str], cfg: TrainConfig, world: int) -> dict[str, int]:
    """{unit: the optimizer step after which no micro-batch reads it}, by reading every micro-batch."""
    n = len(unit_of)
    per_epoch = micro_per_epoch(n, world, cfg.batch_size)
    last: dict[str, int] = {}
    for m in range(total_steps(n, world, cfg) * cfg.grad_accum):
        for rank in range(world):
            for i in epoch_batches(n, cfg, world, rank, m // per_epoch)[m % per_epoch]:
                last[unit_of[i]] = m
    return {u: m // cfg.grad_accum + 1 for u, m in last.items()}


@pytest.mark.parametrize(
    ("n", "world", "settings"),
    [
        (40, 1, {"batch_size": 4, "epochs": 2}),
        (37, 2, {"batch_size": 3, "epochs": 3, "grad_accum": 2}),
        (50, 3, {"batch_size": 2, "epochs": 1.5, "seed": 7}),
        (60, 1, {"batch_size": 4, "epochs": 6, "max_steps": 5}),  # stops in the first epoch: some units unread
    ],
)
def test_schedule_matches_every_micro_batch(n, world, settings):
    rng = random.Random(n)
    sizes = [rng.randint(1, 9) for _ in range(n)]  # units of 1-9 samples, in storage order
    unit_of = [f"u{j:05d}" for j, k in enumerate(sizes) for _ in range(k)][:n]
    cfg = TrainConfig(**settings)
    sch = schedule(unit_of, cfg, world)
    want = brute_force(unit_of, cfg, world)
    assert sch.due == want
    assert sch.total == total_steps(n, world, cfg) and sorted(set(unit_of) - set(want)) == sch.unread
    if "max_steps" in settings:
        assert sch.unread  # never read before the cap: kept, not "consumed"
