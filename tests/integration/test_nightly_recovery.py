"""Nightly runs heal (issue 16): a failed night leaves CURRENT alone; the next night resumes a version that was
interrupted before validation, repairs one whose validation failed on damage (its intact units kept), and discards
one whose intact states failed validation, starting again from CURRENT."""

from __future__ import annotations

import json

import pytest

from dflash_pipeline import stages
from dflash_pipeline.errors import ValidationFailed
from dflash_pipeline.order import LocalRunner, run_pipeline
from dflash_pipeline.storage.reader import HiddenStateDataset
from dflash_pipeline.storage.store import Store
from tests.helpers import config
from tests.integration.test_integrity import _flip

NIGHTLY = {
    "stages": ["prepare", "probe", "extract", "validate"],
    "extract.incremental": True,
    "extract.new_version": True,
    "layers.num_draft_layers": 2,
    "validate.recompute_samples": 0,
}


class BadNight(LocalRunner):
    """Validation finds a problem that the store's own integrity checks cannot (what a broken extractor writes
    is committed with matching digests): the version is recorded as failed, on its stored states (in `units`, when
    given: as the values check names them)."""

    def __init__(self, units: list[str] | None = None):
        super().__init__()
        self.units = units

    def validate(self, cfg, report, prepared, version):
        result = stages.validate(cfg, report, prepared, version)
        result.add("injected", False, "wrong hidden states (test)", states=True, units=self.units)
        Store(cfg.store).loc.write_atomic(f"{version}/validation.json", json.dumps(result.to_dict()).encode())
        return result


def night(out, rows: int, runner=None, **extra):
    return run_pipeline(config(out, {**NIGHTLY, "data.max_samples": rows, **extra}), runner or LocalRunner())


def test_a_night_that_failed_validation_is_discarded_and_the_next_night_publishes(model_dir, tmp_path):
    assert night(tmp_path, 10).current == "v0001"
    with pytest.raises(ValidationFailed):  # night 2: new rows into v0002, which fails validation
        night(tmp_path, 14, BadNight())
    store = Store(tmp_path / "store")
    assert store.current() == "v0001" and store.versions() == [
        "v0001",
        "v0002",
    ]  # the failed night left the published version alone
    # night 3: the failed version is discarded, a new one starts from CURRENT and is published after validation
    summary = night(tmp_path, 16)
    assert summary.validation == "PASS" and summary.current == summary.version != "v0001"
    assert summary.new_samples == 6  # every row CURRENT lacks, none of the damaged ones kept
    attrs = [store.unit_attrs(summary.version, u)["samples"] for u in store.units(summary.version)]
    assert sum(len(s) for s in attrs) == 16


def test_an_interrupted_night_is_resumed_by_the_next_night(model_dir, tmp_path):
    assert night(tmp_path, 10).current == "v0001"
    night(tmp_path, 14, stages=["prepare", "probe", "extract"])  # stopped before validation
    store = Store(tmp_path / "store")
    assert store.current() == "v0001" and store.versions() == ["v0001", "v0002"]
    summary = night(tmp_path, 14)
    assert summary.version == summary.current == "v0002" and summary.validation == "PASS"
    assert summary.forward_passes == 0  # resumed: nothing extracted twice


def _inodes(root, version: str) -> dict[str, int]:
    units = root / version / "units"
    return {str(f.relative_to(units)): f.stat().st_ino for f in units.rglob("*") if f.is_file()}


def test_a_first_version_that_failed_validation_on_damage_is_repaired_not_deleted(model_dir, tmp_path):
    """Nothing published yet, one flipped byte: the nightly run repairs the version (its damaged unit extracted
    again, every other unit kept as it was) instead of deleting it whole (a damage hunt: every GPU-hour of the
    first extraction lost to one byte)."""
    night(tmp_path, 10, stages=["prepare", "probe", "extract"], **{"extract.unit_tokens": 300})  # several units
    root = tmp_path / "store"
    shard = root / "v0001/units/u00000/hidden/c/0/0/0"
    _flip(shard)
    with pytest.raises(ValidationFailed, match="content differs"):
        night(tmp_path, 10, stages=["prepare", "probe", "validate"])
    before = _inodes(root, "v0001")
    summary = night(tmp_path, 14)
    assert summary.version == summary.current == "v0001" and summary.validation == "PASS"
    after = _inodes(root, "v0001")
    kept = [f for f in before if not f.startswith("u00000/") and after.get(f) == before[f]]
    assert kept and all(after[f] == before[f] for f in before if not f.startswith("u00000/") and "/c/" in f)
    assert after["u00000/hidden/c/0/0/0"] != before["u00000/hidden/c/0/0/0"]  # extracted again
    assert len(HiddenStateDataset(root)) == 14


def test_damage_a_snapshot_shared_from_current_is_repaired_by_the_next_night(model_dir, tmp_path):
    """A flipped byte in the published version: the next night's snapshot shares the damaged unit and fails
    validation; the night after repairs the new version (the unit extracted again there, the other shared units
    kept as links) and publishes it, where the old policy deleted it and shared the same damage again, every night."""
    assert night(tmp_path, 10, **{"extract.unit_tokens": 300}).current == "v0001"  # several units
    root = tmp_path / "store"
    _flip(root / "v0001/units/u00000/hidden/c/0/0/0")
    with pytest.raises(ValidationFailed, match="content differs"):
        night(tmp_path, 14)
    store = Store(root)
    assert store.current() == "v0001" and store.versions() == ["v0001", "v0002"]
    summary = night(tmp_path, 14)
    assert summary.version == summary.current == "v0002" and summary.validation == "PASS"
    old, new = _inodes(root, "v0001"), _inodes(root, "v0002")
    assert new["u00000/hidden/c/0/0/0"] != old["u00000/hidden/c/0/0/0"]  # extracted again, in v0002 only
    shared = [f for f in old if not f.startswith("u00000/") and "/c/" in f]
    assert shared and all(new[f] == old[f] for f in shared)  # the intact units are still shared, not copied
    assert len(HiddenStateDataset(root)) == 14


def test_states_that_failed_in_named_units_cost_those_units_only(model_dir, tmp_path):
    """A values check that names its units (non-finite or all-zero rows, with intact bytes): the next night discards
    and extracts those units again, not the whole version (a damage hunt: one NaN cost a whole first version)."""
    root = tmp_path / "store"
    with pytest.raises(ValidationFailed):
        night(tmp_path, 10, BadNight(["u00001"]), **{"extract.unit_tokens": 300})
    before = _inodes(root, "v0001")
    summary = night(tmp_path, 12)
    assert summary.version == summary.current == "v0001" and summary.validation == "PASS"
    after = _inodes(root, "v0001")
    assert all(after[f] == before[f] for f in before if not f.startswith("u00001/") and "/c/" in f)
    assert after["u00001/hidden/c/0/0/0"] != before["u00001/hidden/c/0/0/0"]


@pytest.mark.parametrize("record", ['{"ok": false}', '{"ok": false, "checks": [', '{"ok": false, "checks": null}'])
def test_a_validation_record_that_says_nothing_usable_deletes_nothing(model_dir, tmp_path, record):
    """A record edited by hand, or cut by one damaged byte (a damage hunt: the whole first version deleted, or a
    traceback): nothing is deleted on it; the night extends the version and validation decides again."""
    night(tmp_path, 10, stages=["prepare", "probe", "extract"])
    root = tmp_path / "store"
    (root / "v0001/validation.json").write_text(record)
    before = _inodes(root, "v0001")
    summary = night(tmp_path, 12)
    assert summary.version == summary.current == "v0001" and summary.validation == "PASS"
    after = _inodes(root, "v0001")
    assert all(after[f] == before[f] for f in before)  # nothing extracted again


def test_damage_in_the_published_version_is_healed_on_a_night_without_new_rows(model_dir, tmp_path):
    """No new rows: the night validates CURRENT in place, which fails on the damage (its readers are refused from
    then on). The night after makes a new version from it, extracts the damaged unit again there and publishes it;
    before, every such night failed the same way (a fresh-user check of the nightly deployment)."""
    rows = {"extract.unit_tokens": 300}
    assert night(tmp_path, 10, **rows).current == "v0001"
    root = tmp_path / "store"
    _flip(root / "v0001/units/u00000/hidden/c/0/0/0")
    with pytest.raises(ValidationFailed, match="content differs"):
        night(tmp_path, 10, **rows)
    store = Store(root)
    assert store.current() == "v0001" and store.versions() == ["v0001"]
    damaged = _inodes(root, "v0001")
    summary = night(tmp_path, 10, **rows)
    assert summary.version == summary.current == "v0002" and summary.validation == "PASS"
    assert _inodes(root, "v0001") == damaged  # the published version's files never change
    new = _inodes(root, "v0002")
    assert new["u00000/hidden/c/0/0/0"] != damaged["u00000/hidden/c/0/0/0"]
    shared = [f for f in damaged if not f.startswith("u00000/") and "/c/" in f]
    assert shared and all(new[f] == damaged[f] for f in shared)
    assert len(HiddenStateDataset(root)) == 10
