"""Nightly runs heal (issue 16): a failed night leaves CURRENT alone; the next night resumes a version that was
interrupted before validation, and discards one whose validation failed, starting again from CURRENT."""

from __future__ import annotations

import json

import pytest

from dflash_pipeline import stages
from dflash_pipeline.errors import ValidationFailed
from dflash_pipeline.stages import LocalRunner, run_pipeline
from dflash_pipeline.storage.store import Store
from tests.helpers import config

NIGHTLY = {
    "stages": ["prepare", "probe", "extract", "validate"],
    "extract.incremental": True,
    "extract.new_version": True,
    "layers.num_draft_layers": 2,
    "validate.recompute_samples": 0,
}


class BadNight(LocalRunner):
    """Validation finds a problem that the store's own integrity checks cannot (what a broken extractor writes
    is committed with matching digests): the version is recorded as failed."""

    def validate(self, cfg, report, prepared, version):
        result = stages.validate(cfg, report, prepared, version)
        result.add("injected", False, "wrong hidden states (test)")
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
