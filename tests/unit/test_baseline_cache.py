"""The untrained-baseline cache stays bounded: it keeps the most recently used results (read or written) and drops
the rest, so $DFLASH_HOME/baselines does not grow with every (target, prompts, settings) ever evaluated."""

from __future__ import annotations

import os

from dflash_pipeline.drafter.eval_cache import prune_baselines, read_baseline, write_baseline


def test_the_cache_keeps_the_most_recently_used_results(tmp_path):
    d = tmp_path / "baselines"
    for i in range(5):
        write_baseline(d / f"k{i}.json", {"k": i}, [{"id": i, "steps": [1]}], 0.1)
        os.utime(d / f"k{i}.json", (1000 + i, 1000 + i))  # k0 oldest ... k4 newest
    assert read_baseline(d / "k0.json", {"k": 0}) == [{"id": 0, "steps": [1]}]  # a hit makes k0 recent
    assert read_baseline(d / "k1.json", {"k": "other"}) is None  # another key: a miss, not refreshed
    gone = prune_baselines(d, keep=3)
    assert sorted(f.name for f in gone) == ["k1.json", "k2.json"]
    assert sorted(f.name for f in d.iterdir()) == ["k0.json", "k3.json", "k4.json"]
    assert read_baseline(d / "k0.json", {"k": 0}) is not None


def test_writing_prunes_past_the_limit(tmp_path, monkeypatch):
    import dflash_pipeline.drafter.eval_cache as ec

    monkeypatch.setattr(ec.prune_baselines, "__defaults__", (2,))
    d = tmp_path / "baselines"
    for i in range(4):
        write_baseline(d / f"k{i}.json", {"k": i}, [], 0.0)
        os.utime(d / f"k{i}.json", (1000 + i, 1000 + i))
    assert sorted(f.name for f in d.glob("*.json")) == ["k2.json", "k3.json"]
