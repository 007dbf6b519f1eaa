"""Work that several runs may start at once and only one should do (storage/commit.py `taking_turns`): the
embedded target built once per machine, one dataset prepared once per output_dir."""

from __future__ import annotations

import fcntl
import json
import threading
import time

from dflash_pipeline.dataprep.config import DataConfig
from dflash_pipeline.dataprep.prepare import fingerprint, load_prepared, prepare_dataset
from dflash_pipeline.embedded.build import BUILD_VERSION, ensure_built
from tests.integration.test_dataprep import CONV


def test_a_run_that_finds_the_build_under_way_waits_and_reuses_it(tmp_path):
    """Before, a second run on a fresh machine built again and deleted the first run's finished build (which
    that run was already reading) to put its own in place."""
    root = tmp_path / "embedded" / BUILD_VERSION
    root.parent.mkdir(parents=True)
    got = []
    with open(root.parent / f".{root.name}.lock", "a") as held:  # another run is building
        fcntl.flock(held, fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: got.append(ensure_built(root)))
        waiter.start()
        time.sleep(1.0)
        assert waiter.is_alive() and not root.exists() and not list(root.parent.glob(".build-*"))
        root.mkdir()  # that run finishes: its build is in place
        (root / "marker").write_text("the first run's build")
        (root / "BUILD_OK").write_text(BUILD_VERSION)
    waiter.join(30)
    assert got == [root] and (root / "marker").read_text() == "the first run's build"


def test_runs_preparing_the_same_dataset_at_once_take_turns(tmp_path, tokenizer):
    """Two runs on one output_dir preparing the same data at once (seen in the PostgreSQL load test: the second
    run's publish failed with 'Directory not empty'): the one that waits reuses what the other built."""
    rows = [{"messages": CONV[:2] + [{"role": "assistant", "content": f"{i}."}]} for i in range(200)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = str(tmp_path / "chat.jsonl")
    cfg, out = DataConfig(source=src), tmp_path / "prepared"
    out.mkdir()
    results, errors = [], []

    def one_run():
        try:
            results.append(prepare_dataset(cfg, src, tokenizer, out))
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    fp = fingerprint(cfg, src, tokenizer)
    with open(out / f".{fp}.lock", "a") as held:  # a third run is mid-prepare: both must wait for it
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        runs = [threading.Thread(target=one_run) for _ in range(2)]
        for t in runs:
            t.start()
        time.sleep(1.0)
        assert all(t.is_alive() for t in runs) and not (out / fp).exists()
    for t in runs:
        t.join(60)
    assert not errors, errors
    assert sorted(r.reused for r in results) == [False, True]
    assert results[0].fingerprint == results[1].fingerprint and results[0].n_samples == 200
    assert len(load_prepared(results[0].path)) == 200
