"""Store versions for the nightly run: published versions never change; snapshots share data; prune; lock."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from dflash_pipeline.errors import StoreError
from dflash_pipeline.storage.reader import HiddenStateDataset
from dflash_pipeline.storage.store import Store
from tests.helpers import extract_local

BASE = {"layers.preset": "explicit", "layers.ids": [1, 3], "extract.unit_tokens": 1500, "extract.incremental": True}


def test_incremental_run_snapshots_the_published_version(tmp_path, model_dir):
    first = extract_local(tmp_path, {**BASE, "data.max_samples": 30}, validate=True)  # validated and published
    store = Store(tmp_path / "store")
    assert store.current() == first.plan.version
    v1_units = store.units("v0001")

    second = extract_local(tmp_path, {**BASE, "data.max_samples": 40})
    assert second.plan.version == "v0002" and second.plan.new_samples == 10
    assert store.units("v0001") == v1_units  # the published version is untouched
    assert len(HiddenStateDataset(tmp_path / "store", "v0001")) == 30
    assert len(HiddenStateDataset(tmp_path / "store", "v0002", unvalidated="warn")) == 40  # extracted, not validated
    # only the new samples went through the model; the old units are shared, not copied
    assert second.result.tokens == sum(u.n_tokens for u in second.plan.new_units)
    shard = next(p for p in (tmp_path / "store/v0001/units" / v1_units[0] / "hidden").rglob("*") if p.is_file())
    twin = tmp_path / "store/v0002" / shard.relative_to(tmp_path / "store/v0001")
    assert os.stat(shard).st_ino == os.stat(twin).st_ino
    assert store.current() == "v0001"  # moves only after validation (the flow's job)

    again = extract_local(tmp_path, {**BASE, "data.max_samples": 45})  # v0002 unpublished: extended in place
    assert again.plan.version == "v0002" and again.plan.new_samples == 5


def test_a_snapshot_does_not_share_a_unit_whose_commit_record_is_malformed(tmp_path, model_dir):
    """Found by a review: a commit record with an edited type in the published version stopped the nightly run's
    snapshot halfway (a version without units, then every sample extracted again). The snapshot shares every other
    unit and extracts that one again from its plan record, under its own name."""
    extract_local(tmp_path, {**BASE, "data.max_samples": 30}, validate=True)
    store = Store(tmp_path / "store")
    units = store.units("v0001")
    assert len(units) > 1
    rec = tmp_path / "store/v0001/units" / units[0] / "commit.json"
    rec.write_text(json.dumps({**json.loads(rec.read_text()), "committed_tokens": "1500"}))
    second = extract_local(tmp_path, {**BASE, "data.max_samples": 40})
    assert second.plan.version == "v0002"
    redone = store.unit_attrs("v0001", units[0])["n_tokens"]
    assert second.plan.repaired_units == [units[0]] and second.plan.new_samples == 10
    assert second.result.tokens == redone + sum(u.n_tokens for u in second.plan.new_units)  # that unit, the new ones
    assert len(HiddenStateDataset(store.url, "v0002", unvalidated="warn")) == 40


def test_a_snapshot_keeps_the_samples_of_a_unit_repair_discarded(tmp_path, model_dir):
    """Found by a damage hunt: after `verify --repair` discarded a damaged unit of the published version, an
    incremental run whose dataset lacked that unit's samples published a snapshot without them (validation checks
    this run's dataset only). The snapshot keeps the unit's plan record, and the run rebuilds the unit, bit for bit,
    from the prepared dataset it was made from (issue 50: a nightly run stopped on it every night); with that dataset
    gone from the disk, a run that is not a nightly one stops naming the samples its dataset lacks."""
    extract_local(tmp_path, {**BASE, "data.max_samples": 30}, validate=True)
    store = Store(tmp_path / "store")
    last = store.units("v0001")[-1]  # the last rows of the prepared order
    before = HiddenStateDataset(store.url, "v0001")
    want = {before.samples[i].sample_id: before[i]["hidden"] for i in range(len(before))}
    shutil.move(tmp_path / "store/v0001/units" / last, tmp_path / "discarded")  # as verify --repair discards it
    made = tmp_path / "prepared" / store.attrs("v0001")["dataset_fingerprints"][0]
    shutil.move(made, tmp_path / "aside")
    with pytest.raises(StoreError, match=r"samples not in this run's prepared dataset .* is not on disk"):
        extract_local(tmp_path, {**BASE, "data.max_samples": 10})
    assert store.current() == "v0001"
    shutil.move(tmp_path / "aside", made)  # back on disk: the unit is rebuilt from it
    again = extract_local(tmp_path, {**BASE, "data.max_samples": 10})
    assert again.plan.version == "v0002" and again.plan.repaired_units == [last] and again.plan.new_samples == 0
    ds = HiddenStateDataset(store.url, "v0002", unvalidated="warn")
    assert len(ds) == 30
    got = {ds.samples[i].sample_id: ds[i]["hidden"] for i in range(len(ds))}
    assert all(torch.equal(got[sid], h) for sid, h in want.items())


def test_prune_keeps_newest_and_current(tmp_path, model_dir):
    store = Store(tmp_path / "store")
    for n in (10, 12, 14, 16):
        ex = extract_local(tmp_path, {**BASE, "data.max_samples": n})
        store.set_current(ex.plan.version)
    assert store.versions() == ["v0001", "v0002", "v0003", "v0004"]
    store.set_current("v0002")
    assert store.prune(keep=2) == ["v0001"]
    assert store.versions() == ["v0002", "v0003", "v0004"]


def test_a_backup_copy_beside_the_versions_is_no_version(tmp_path, model_dir):
    """`cp -a store/v0001 store/v0001.bak` (a damage hunt): a rerun published the copy as CURRENT, a nightly run
    crashed on its name, and a prune deleted a `v0000-backup`. Only v + digits is a version."""
    ex = extract_local(tmp_path, {**BASE, "data.max_samples": 10}, validate=True)
    root = tmp_path / "store"
    shutil.copytree(root / "v0001", root / "v0001.bak")
    shutil.copytree(root / "v0001", root / "v0000-backup")
    store = Store(root)
    assert store.versions() == ["v0001"] and store.new_version_name() == "v0002"
    again = extract_local(tmp_path, {**BASE, "data.max_samples": 12}, validate=True)  # snapshot, validate, publish
    assert again.plan.version == store.current() == "v0002" != ex.plan.version
    assert store.prune(keep=1) == ["v0001"]
    assert (root / "v0001.bak/zarr.json").exists() and (root / "v0000-backup/zarr.json").exists()


def test_store_lock_is_exclusive(tmp_path):
    store = Store(tmp_path / "store")
    with store.lock():
        with pytest.raises(StoreError, match=r"in use by another run \(pid \d+"):
            with Store(tmp_path / "store").lock():
                pass
    with store.lock():  # released
        pass


def test_a_run_waits_for_a_retention_deletion_but_not_for_another_run(tmp_path):
    """A nightly run that finds a training run's retention deleting units (the store lock, for seconds) waits for
    it instead of failing; a holder that is another run (or a deletion past the wait) fails it at once, named."""
    import threading
    import time

    store = Store(tmp_path / "store")
    held, done = threading.Event(), threading.Event()

    def delete_for(seconds: float) -> None:
        with Store(tmp_path / "store").lock(brief="deleting retired hidden states"):
            held.set()
            time.sleep(seconds)
        done.set()

    threading.Thread(target=delete_for, args=(1.5,)).start()
    held.wait(10)
    t0 = time.monotonic()
    with store.lock(wait_for_brief_s=30):
        assert done.is_set() and time.monotonic() - t0 > 1.0
    held.clear(), done.clear()
    threading.Thread(target=delete_for, args=(2.0,)).start()
    held.wait(10)
    with pytest.raises(StoreError, match=r"in use by another run \(pid \d+ .*deleting retired hidden states"):
        with store.lock(wait_for_brief_s=0.5):
            pass
    done.wait(10)
    with store.lock():  # another run: no waiting, whatever the run would wait for a brief holder
        with pytest.raises(StoreError, match=r"in use by another run \(pid \d+ on \S+ since [^,]*\)"):
            with Store(tmp_path / "store").lock(wait_for_brief_s=30):
                pass


def test_failed_run_with_broken_weights_does_not_block_the_next(tmp_path, model_dir):
    """A run that fails before committing anything (truncated weights) leaves a version nothing was ever
    committed to; the next run, with the weights repaired, must not be refused as 'another model'."""
    import shutil
    from pathlib import Path

    from dflash_pipeline.errors import CompatError

    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    overrides = {"data.max_samples": 8, "target.model_path": str(model)}
    with pytest.raises(CompatError, match="cannot load the target"):
        extract_local(tmp_path / "run", overrides)
    assert Store(tmp_path / "run/store").versions() == ["v0001"]  # stamped, with nothing committed

    shutil.copy2(Path(model_dir) / "model.safetensors", weights)
    ok = extract_local(tmp_path / "run", overrides)
    assert ok.plan.version == "v0001" and ok.result.forward_passes > 0
    assert len(HiddenStateDataset(tmp_path / "run/store", "v0001", unvalidated="warn")) == 8


def test_a_precision_the_store_does_not_hold_is_refused_before_the_run(small_store, tmp_path):
    """A version holds one precision: a run with another (without extract.new_version) is refused in the pre-run
    checks, not after probe, regenerate and prepare; `plan` notes it; a store that also holds that precision, or
    new_version, is no refusal."""
    from dflash_pipeline.errors import ConfigError
    from dflash_pipeline.preflight import preflight, store_precision_refusal
    from tests.helpers import config

    over = {"store_path": str(small_store.store), "stages": ["prepare", "extract"]}
    with pytest.raises(ConfigError, match=r"store_precision=int4: store .* holds full states \(version v0001\)"):
        preflight(config(tmp_path, {**over, "extract.store_precision": "int4"}))
    preflight(config(tmp_path, {**over, "extract.store_precision": "int4"}), what_if=True)  # plan: a note
    assert store_precision_refusal(config(tmp_path, {**over, "extract.store_precision": "full"})) is None
    assert (
        store_precision_refusal(
            config(tmp_path, {**over, "extract.store_precision": "int4", "extract.new_version": True})
        )
        is None
    )
    assert (
        store_precision_refusal(config(tmp_path, {**over, "stages": ["prepare"], "extract.store_precision": "int4"}))
        is None
    )
    # an int4 version a crash left without a commit (new_version once, then a rerun without it): the run resumes it
    root = tmp_path / "store"
    shutil.copytree(small_store.store, root)
    shutil.copytree(root / "v0001", root / "v0002")
    doc = json.loads((root / "v0002/zarr.json").read_text())
    doc["attributes"]["precision"] = "int4"
    (root / "v0002/zarr.json").write_text(json.dumps(doc))
    for rec in (root / "v0002/units").glob("*/commit.json"):
        rec.unlink()
    int4 = {"store_path": str(root), "stages": ["prepare", "extract"], "extract.store_precision": "int4"}
    assert store_precision_refusal(config(tmp_path, int4)) is None
    # a precision attribute edited in the store (found by a damage check: every rerun was refused): the version
    # record says full, and the run restores the attribute from its provenance
    shutil.rmtree(root / "v0002")
    doc = json.loads((root / "v0001/zarr.json").read_text())
    doc["attributes"]["precision"] = "fp8"
    (root / "v0001/zarr.json").write_text(json.dumps(doc))
    assert store_precision_refusal(config(tmp_path, {**int4, "extract.store_precision": "full"})) is None
