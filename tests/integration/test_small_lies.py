"""Four small lies a damage check of the store and the probe found (issue 50, item 5), each now told straight:
a target config.json without the model's dimensions, a hand-edited `committed_samples`, a reader that went on
reading after saying it read nothing, and a repair that counted directories as files it could not delete."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from dflash_pipeline.cli import main as cli
from dflash_pipeline.errors import CompatError, StoreError, ValidationFailed
from dflash_pipeline.extraction.config import ExtractConfig, LayersConfig, TargetConfig
from dflash_pipeline.extraction.probe import probe
from dflash_pipeline.order import LocalRunner, run_pipeline
from dflash_pipeline.storage.discard import discard_units
from dflash_pipeline.storage.reader import HiddenStateDataset
from dflash_pipeline.storage.store import Store
from tests.helpers import assert_same_store, config, snapshot
from tests.integration.test_integrity import SMALL, U0, U1, _edit_json, _edit_plan, _flip, _swap_first_two


@pytest.mark.parametrize(
    ("content", "missing"),
    [
        ({}, "num_hidden_layers, hidden_size, num_attention_heads, vocab_size"),
        ({"text_config": {"num_hidden_layers": 8}}, "hidden_size, num_attention_heads, vocab_size"),
        ({"num_hidden_layers": "eight", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 9}, "num_hidden"),
    ],
)
def test_a_config_json_without_the_models_dimensions_is_one_error_naming_the_file(
    model_dir, tmp_path, content, missing
):
    """Before: `KeyError: 'num_hidden_layers'` out of the probe (a traceback in the task and one in the flow)."""
    target = tmp_path / "target"
    shutil.copytree(model_dir, target)
    (target / "config.json").write_text(json.dumps(content))
    with pytest.raises(CompatError) as e:
        probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu"), str(target), str(target))
    said = str(e.value)
    assert f"{target}/config.json" in said and missing in said and "re-download" in said, said


def _published(small_store, tmp_path) -> tuple[Path, str]:
    """A copy of the small store, validated and published (CURRENT) by a run."""
    shutil.copytree(small_store.store, tmp_path / "store")
    _run(tmp_path, ["prepare", "extract", "validate"])
    assert Store(tmp_path / "store").current() == small_store.plan.version
    return tmp_path / "store", small_store.plan.version


def _run(out, stages):
    runner = LocalRunner()
    run_pipeline(config(out, {**SMALL, "stages": stages, "validate.recompute_samples": 0}), runner)
    return runner


def _committed_samples(root: Path, version: str) -> int:
    return json.loads((root / version / U0 / "commit.json").read_text())["committed_samples"]


@pytest.fixture
def edited_count(small_store, tmp_path):
    """A published store whose u00000 commit record says it holds 3 samples more than it does."""
    root, version = _published(small_store, tmp_path)
    right = _committed_samples(root, version)
    _edit_json(root / version / U0 / "commit.json", lambda r: {**r, "committed_samples": right + 3})
    return root, version, right


def test_a_hand_edited_committed_samples_is_named_and_rewritten_by_verify_repair(edited_count, capsys):
    """Before: verify printed "healthy" and exited 1 with advice naming nothing (the version changed since
    validation), and the next run validated and published the edited count."""
    root, version, right = edited_count
    assert cli(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "healthy" not in out, out
    line = next(x for x in out.splitlines() if "committed_samples" in x)
    assert f"{U0}/commit.json" in line and f"{right + 3}" in line and f"{right}" in line, line
    assert f"dflash-pipeline verify {root} --version {version} --repair" in line, line
    assert cli(["verify", str(root), "--repair"]) == 1  # (the report is of the version before the repair)
    out = capsys.readouterr().out
    assert f"rewrote {U0}/commit.json's committed_samples" in out, out
    assert _committed_samples(root, version) == right
    assert cli(["verify", str(root)]) == 0  # as validated again: the record is what validation checked
    assert "healthy" in capsys.readouterr().out


def test_a_hand_edited_committed_samples_is_rewritten_by_the_next_run_never_published(edited_count):
    root, version, right = edited_count
    # validation alone (no extract to rewrite it) refuses it, naming the file and the field
    with pytest.raises(ValidationFailed, match=rf"{U0}/commit.json: .*committed_samples"):
        _run(root.parent, ["prepare", "validate"])
    assert _committed_samples(root, version) == right + 3
    # a run with extract rewrites it from the unit's data first; validation then passes and publishes the true count
    runner = _run(root.parent, ["prepare", "extract", "validate"])
    assert runner.results["validate"].ok and Store(root).current() == version
    assert _committed_samples(root, version) == right
    assert sum(r.forward_passes for r in runner.results["extract"]) == 0  # nothing extracted again


def test_a_reader_that_found_damage_reads_nothing_more(small_store, tmp_path):
    """Before: the error said "Nothing of this version is read", and the same reader went on returning the other
    units' samples."""
    root, version = tmp_path / "store", small_store.plan.version
    shutil.copytree(small_store.store, root)
    (root / version / U1 / "last_hidden/c/0/0").unlink()
    ds = HiddenStateDataset(root, version, unvalidated="warn")
    first_of_u1 = next(i for i, s in enumerate(ds.samples) if s.unit == "u00001")
    with pytest.raises(StoreError, match=r"last_hidden/c/0/0: missing") as e:
        ds[first_of_u1]
    said = str(e.value)
    assert "Nothing of this version is read:" not in said and "reads nothing more of this version" in said, said
    for i in (0, first_of_u1 - 1, len(ds) - 1):  # u00000's samples, which are intact, are refused too
        with pytest.raises(StoreError, match=r"found store version .* damaged .*last_hidden/c/0/0: missing"):
            ds[i]
    # at construction (a damaged record) it still says nothing is read, and nothing is
    (root / version / U0 / "commit.json").write_text("{")
    with pytest.raises(StoreError, match="Nothing of this version is read"):
        HiddenStateDataset(root, version, unvalidated="warn")


def test_a_passing_read_error_is_not_damage_and_the_reader_goes_on(small_store, monkeypatch):
    """A read that fails while each of its files reads again intact (an object store's timeout, a busy disk) names
    itself as passing; the reader is not turned off for good, and the same read then succeeds."""
    import dflash_pipeline.storage.reader as reader

    ds = HiddenStateDataset(small_store.store, small_store.plan.version, unvalidated="warn")
    want = ds[0]["hidden"].clone()
    real, calls = reader.read_rows, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("Connection reset by peer")
        return real(*a, **k)

    monkeypatch.setattr(reader, "read_rows", flaky)
    with pytest.raises(reader.PassingReadError, match="reads again intact: read it again"):
        ds[0]
    assert torch.equal(ds[0]["hidden"], want) and ds[len(ds) - 1]["hidden"].numel() > 0


def test_a_discard_that_cannot_delete_one_file_counts_and_names_that_file(small_store, tmp_path):
    """Before: one immutable shard was reported as "6 of its files could not be deleted" (its five parent
    directories, left because they were not empty, counted as files)."""
    root, version = tmp_path / "store", small_store.plan.version
    shutil.copytree(small_store.store, root)
    shard = root / version / U1 / "hidden/c/0/0/0"
    _flip(shard)
    if subprocess.run(["chattr", "+i", str(shard)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (needs root and a filesystem with the immutable flag)")
    try:
        with pytest.raises(StoreError) as e:
            discard_units(Store(root), version, ["u00001"], {"u00001": "damaged"})
        said = str(e.value)
        assert "1 of its files could not be deleted" in said and "hidden/c/0/0/0" in said, said
        assert "Operation not permitted" in said, said
    finally:
        for p in (root / version / ".discarded").rglob("*"):
            subprocess.run(["chattr", "-i", str(p)], capture_output=True)


def test_a_damaged_plan_record_of_a_damaged_unit_is_still_rewritten_before_the_unit_is_rebuilt(
    small_store, tmp_path, capsys
):
    """The rewrite of records of intact data leaves a damaged unit's commit record alone (the unit goes), never its
    plan record: the unit is rebuilt from it, so a record its attributes contradict is rewritten first."""
    root, version = tmp_path / "store", small_store.plan.version
    shutil.copytree(small_store.store, root)
    before = snapshot(Store(root), version)
    _edit_plan(root / version, "u00001", _swap_first_two)
    _flip(root / version / U1 / "hidden/c/0/0/0")
    assert cli(["verify", str(root), "--version", version, "--unvalidated", "--repair"]) == 1
    out = capsys.readouterr().out
    assert "rewrote plans/u00001.json" in out and "discarded 1 damaged unit of v0001 (u00001)" in out, out
    _run(tmp_path, ["prepare", "extract", "validate"])
    assert_same_store(before, snapshot(Store(root), version))
