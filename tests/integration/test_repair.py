"""Repair through the pipeline's own stage order (prepare -> plan -> extract -> validate -> promote, no
Prefect): damage that only a digest shows fails validation and leaves CURRENT where it was; after
`verify --repair` the rerun recomputes exactly the damaged unit and only then moves CURRENT."""

from __future__ import annotations

import json
import shutil

import pytest

from dflash_pipeline.cli import main as cli
from dflash_pipeline.errors import ValidationFailed
from dflash_pipeline.stages import LocalRunner, run_pipeline
from dflash_pipeline.storage.store import Store
from tests.helpers import assert_same_store, config, snapshot
from tests.integration.test_integrity import SMALL, U0, U1, _flip, snapshot_and_batches


@pytest.fixture(scope="module")
def original(small_store):
    return snapshot_and_batches(small_store)


def _run(out, runner=None):
    runner = runner or LocalRunner()
    run_pipeline(config(out, {**SMALL, "stages": ["prepare", "extract", "validate"]}), runner)
    return runner


def test_current_moves_only_after_a_repair_validates(small_store, original, tmp_path, capsys):
    before, batches = original
    root, version = tmp_path / "store", small_store.plan.version
    shutil.copytree(small_store.store, root)
    store = Store(root)
    assert store.current() is None
    _flip(root / version / U0 / "hidden/c/0/0/0")

    runner = LocalRunner()
    with pytest.raises(ValidationFailed, match=f"{U0}/hidden/c/0/0/0: content differs"):
        _run(tmp_path, runner)
    assert sum(r.forward_passes for r in runner.results["extract"]) == 0  # the cheap checks cannot see it
    assert store.current() is None  # a failed validation never moves CURRENT
    assert not json.loads((root / version / "validation.json").read_text())["ok"]

    assert cli(["verify", str(root), "--repair"]) == 1
    capsys.readouterr()
    runner = _run(tmp_path)
    assert runner.results["plan"].repaired_units == ["u00000"]  # discarded by verify --repair, rebuilt here
    assert sum(r.forward_passes for r in runner.results["extract"]) == batches["u00000"]
    assert store.current() == version and runner.results["validate"].ok
    assert_same_store(before, snapshot(store, version))

    # damage to the published version: the rerun rebuilds it, validates, and CURRENT stays on it
    (root / version / U1 / "last_hidden/c/0/0").unlink()
    runner = _run(tmp_path)
    assert runner.results["plan"].repaired_units == ["u00001"]
    assert sum(r.forward_passes for r in runner.results["extract"]) == batches["u00001"]
    assert store.current() == version
    assert_same_store(before, snapshot(store, version))
