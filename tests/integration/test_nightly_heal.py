"""The nightly run heals a failed night in one night, whatever changed in between (issue 50): a unit made from rows
that changed or disappeared since, and damaged in a shard hard-linked into CURRENT, is rebuilt from the prepared
dataset it was made from when that is on disk (its digests checked), else dropped from the new version with its
current rows extracted anew. Before, every later night failed the same way ("holds 1 samples that are not in this
run's prepared dataset"), and readers were refused CURRENT the whole time.

Each night runs as the nightly deployment does: `run_pipeline` with the deployment's own preset on a data file that
is appended to and edited."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from dflash_pipeline.config import load_config
from dflash_pipeline.deployments import PREFECT_FILE
from dflash_pipeline.embedded.build import CONVERSATIONS_MESSAGES
from dflash_pipeline.errors import StoreError, ValidationFailed
from dflash_pipeline.flows.pipeline import compose_overrides
from dflash_pipeline.order import LocalRunner, run_pipeline
from dflash_pipeline.storage.reader import HiddenStateDataset
from dflash_pipeline.storage.store import Store
from dflash_pipeline.storage.validated import validation_status
from tests.integration.test_integrity import _flip

SMALL = {"extract.unit_tokens": 300, "layers.num_draft_layers": 2, "validate.recompute_samples": 0}
SHARD = "u00000/hidden/c/0/0/0"  # the first unit's first shard: it holds row 0 (the row changed on night 2)


def _preset() -> dict:
    (nightly,) = [d for d in yaml.safe_load(PREFECT_FILE.read_text())["deployments"] if d["name"] == "nightly"]
    return nightly["parameters"]["preset"]


class Nights:
    def __init__(self, out: Path):
        self.out, self.data, self.root = out, out / "chats.jsonl", out / "store"
        self.rows = CONVERSATIONS_MESSAGES.read_text().splitlines()
        self.served: list[str] = []  # what readers of CURRENT got after each night

    def write(self, rows: list[str]) -> None:
        self.data.write_text("\n".join(rows) + "\n")

    def night(self):
        overrides = {"output_dir": str(self.out), "data.source": str(self.data), "extract.devices": "cpu"}
        cfg = load_config(None, compose_overrides(_preset(), {**overrides, "extract.isolation": "thread", **SMALL}))
        try:
            return run_pipeline(cfg, LocalRunner())
        finally:
            self.served.append(self.read())

    def read(self) -> str:
        """Readers are served by a validated version, every sample of it, or refused with one line."""
        store = Store(self.root)
        try:
            ds = HiddenStateDataset(self.root)
            for i in range(len(ds)):
                ds[i]
        except StoreError as e:
            refusal = str(e).strip()
        else:
            refusal = None
        if refusal is not None:
            assert "\n" not in refusal, refusal
            return f"refused: {refusal}"
        assert validation_status(store, store.current()) is None  # validated, unchanged since
        return f"served {store.current()}: {len(ds)} samples"


def _files(root: Path, version: str) -> dict[str, int]:
    units = root / version / "units"
    return {str(f.relative_to(units)): f.stat().st_ino for f in units.rglob("*") if f.is_file()}


def _states(root: Path, version: str) -> dict[str, torch.Tensor]:
    ds = HiddenStateDataset(root, version)
    return {ds.samples[i].sample_id: ds[i]["hidden"] for i in range(len(ds))}


def _scenario(tmp_path: Path, new_rows_on_night_4: bool) -> tuple[Nights, dict]:
    """Nights 1-4 of issue 50: append, change a row (and add 10), a quiet night, then a shard of the first unit,
    hard-linked into CURRENT, is damaged and night 4 fails validation, CURRENT kept."""
    n = Nights(tmp_path)
    n.write(n.rows[:10])
    assert n.night().current == "v0001"
    changed = json.loads(n.rows[0])
    changed["messages"][2]["content"] += " (edited)"
    rows = [json.dumps(changed), *n.rows[1:20]]  # night 2: row 0 changed, 10 rows added
    n.write(rows)
    second = n.night()
    assert second.current == "v0002" and second.new_samples == 11
    assert n.night().current == "v0002"  # night 3: nothing new
    store = Store(n.root)
    old = _states(n.root, "v0002")  # every sample CURRENT serves, before the damage
    assert len(old) == 21  # the old text of row 0 is kept, as every sample a snapshot shares
    assert os.stat(n.root / "v0001/units" / SHARD).st_ino == os.stat(n.root / "v0002/units" / SHARD).st_ino
    _flip(n.root / "v0001/units" / SHARD)  # shared by v0001 and CURRENT v0002
    if new_rows_on_night_4:
        n.write([*rows, *n.rows[20:22]])
    with pytest.raises(ValidationFailed, match="content differs"):
        n.night()
    assert store.current() == "v0002"
    return n, old


@pytest.mark.parametrize("new_rows_on_night_4", [True, False], ids=["new-rows", "no-new-rows"])
def test_damage_reaching_current_in_a_unit_of_changed_rows_is_healed_by_the_next_night(
    model_dir, tmp_path, new_rows_on_night_4
):
    n, old = _scenario(tmp_path, new_rows_on_night_4)
    before = {v: _files(n.root, v) for v in ("v0001", "v0002")}
    prepared = sorted(p.name for p in (tmp_path / "prepared").iterdir() if not p.name.startswith("."))
    fifth = n.night()  # night 5: healed and published
    assert fifth.validation == "PASS" and fifth.current == fifth.version == "v0003"
    healed = _states(n.root, "v0003")
    assert len(healed) == 21 + 2 * new_rows_on_night_4
    # the unit is rebuilt from the prepared dataset it was made from (night 1's), bit for bit as it was
    assert all(torch.equal(healed[sid], h) for sid, h in old.items())
    assert os.stat(n.root / "v0003/units" / SHARD).st_ino != os.stat(n.root / "v0002/units" / SHARD).st_ino
    sixth = n.night()
    assert sixth.validation == "PASS" and sixth.current == "v0003" and sixth.forward_passes == 0
    # nothing intact deleted: the older versions' files (the damaged one included) and every prepared dataset
    assert {v: _files(n.root, v) for v in ("v0001", "v0002")} == before
    assert sorted(p.name for p in (tmp_path / "prepared").iterdir() if not p.name.startswith(".")) == prepared
    assert [s.split(":")[0] for s in n.served] == [
        "served v0001",
        "served v0002",
        "served v0002",
        "refused",
        "served v0003",
        "served v0003",
    ], n.served


@pytest.mark.parametrize("gone", ["deleted", "damaged"])
def test_without_the_prepared_dataset_it_was_made_from_the_unit_is_dropped_and_its_rows_extracted_anew(
    model_dir, tmp_path, gone
):
    """Night 1's prepared dataset deleted, or changed since (its digests differ): the damaged unit cannot be rebuilt,
    so night 5 drops it from the new version and extracts its rows the data still has; the old text of the changed
    row is no longer in the published version (still in the older versions, which keep their files)."""
    n, old = _scenario(tmp_path, new_rows_on_night_4=True)
    store = Store(n.root)
    first = store.attrs("v0001")["dataset_fingerprints"][0]
    if gone == "deleted":
        shutil.rmtree(tmp_path / "prepared" / first)
    else:
        _flip(next((tmp_path / "prepared" / first / "dataset").glob("*.arrow")))
    before = {v: _files(n.root, v) for v in ("v0001", "v0002")}
    fifth = n.night()
    assert fifth.validation == "PASS" and fifth.current == fifth.version == "v0003"
    healed = _states(n.root, "v0003")
    stale = set(old) - set(healed)
    assert len(stale) == 1 and len(healed) == 22  # the 22 rows of the data; the old text of row 0 dropped
    assert all(torch.equal(healed[sid], h) for sid, h in old.items() if sid not in stale)
    repairs = json.loads((n.root / "v0003/repairs.json").read_text())
    assert any(r["unit"] == "u00000" and "dropped" in r["why"] for r in repairs), repairs
    sixth = n.night()
    assert sixth.validation == "PASS" and sixth.current == "v0003" and sixth.forward_passes == 0
    assert {v: _files(n.root, v) for v in ("v0001", "v0002")} == before
    assert [s.split(":")[0] for s in n.served][3:] == ["refused", "served v0003", "served v0003"], n.served


def test_a_unit_nothing_can_rebuild_is_dropped_by_the_next_night_not_every_night(model_dir, tmp_path):
    """The published version's first unit lost its plan record and its attributes were edited (nothing records which
    samples it held): a nightly run drops the unit from the new version and extracts its rows again, where every night
    stopped saying to delete it by hand. CURRENT's own files are never changed."""
    n = Nights(tmp_path)
    n.write(n.rows[:10])
    assert n.night().current == "v0001"
    (n.root / "v0001/plans/u00000.json").unlink()
    attrs = n.root / "v0001/units/u00000/zarr.json"
    attrs.write_text(attrs.read_text().replace('"planned": true', '"planned": true, "edited": 1'))
    before = _files(n.root, "v0001")
    n.write(n.rows[:12])
    second = n.night()
    assert second.validation == "PASS" and second.current == "v0002"
    assert len(HiddenStateDataset(n.root)) == 12 and _files(n.root, "v0001") == before
    repairs = json.loads((n.root / "v0002/repairs.json").read_text())
    assert [r["unit"] for r in repairs] == ["u00000"] and repairs[0]["why"].startswith("dropped:")
