"""A store that cannot silently lie: each kind of damage to a copy of a validated store is caught by the
reader, by `dflash-pipeline verify` and by validation (as report lines), and a rerun of extract (after
`verify --repair` where only digests can see the damage) restores it bit for bit, recomputing only the
damaged units."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import zarr

from dflash_pipeline.cli import main as cli
from dflash_pipeline.errors import StoreError, ValidationFailed
from dflash_pipeline.extraction.batching import plan_batches
from dflash_pipeline.extraction.config import ValidateConfig
from dflash_pipeline.extraction.validate import raise_if_failed, validate_store
from dflash_pipeline.storage.reader import HiddenStateDataset
from dflash_pipeline.storage.store import Store
from tests.helpers import assert_same_store, extract_local, snapshot

# conftest.small_store's run: 60 samples in 2 units, layers [1, 2, 3] + last, float32
SMALL = {
    "data.max_samples": 60,
    "layers.preset": "explicit",
    "layers.ids": [1, 2, 3],
    "layers.capture_last": True,
    "extract.unit_tokens": 2500,
}


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _edit(group: Path, key: str, fn) -> None:
    g = zarr.open_group(str(group), mode="r+")
    g.attrs[key] = fn(g.attrs[key])


def _same_size_edit(path: Path, old: str, new: str) -> None:
    """An edit in place that keeps the file's size (a size check alone cannot see it)."""
    text = path.read_text()
    edited = text.replace(old, new.ljust(len(old)), 1)
    assert old in text and len(edited) == len(text)
    path.write_text(edited)


def _shape_minus_one(path: Path) -> None:
    meta = json.loads(path.read_text())
    n = meta["shape"][0]
    text, old = path.read_text(), f"\n    {n},"
    assert len(str(n - 1)) == len(str(n)) and old in text  # the same number of digits
    _same_size_edit(path, old, f"\n    {n - 1},")


def _swap_first_two(samples):
    (a, sa, na), (b, sb, nb) = samples[0], samples[1]
    return [[b, sa, na], [a, sb, nb]] + list(samples[2:])


def _edit_json(path: Path, fn) -> None:
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


def _null_entry(unit_dir: Path, f: str, copy_from: Path | None) -> None:
    """The commit record's entry for `f` edited to null ("zarr wrote no file"), the file then replaced by another
    (a shard the record no longer vouches for) or deleted (its rows read back as zeros)."""
    rec = json.loads((unit_dir / "commit.json").read_text())
    rec["files"][f] = None
    (unit_dir / "commit.json").write_text(json.dumps(rec))
    if copy_from is None:
        (unit_dir / f).unlink()
    else:
        shutil.copyfile(copy_from, unit_dir / f)


def _edit_plan(version_dir: Path, unit: str, fn) -> None:
    path = version_dir / "plans" / f"{unit}.json"
    plan = json.loads(path.read_text())
    plan["samples"] = fn(plan["samples"])
    path.write_text(json.dumps(plan))


U0, U1 = "units/u00000", "units/u00001"
# name: (damage(version dir), what the reader / verify / validation must name, damaged units, content damage: found
# by digests, repaired through `verify --repair`)
DAMAGES = {
    "delete_shard": (lambda v: (v / U0 / "hidden/c/0/0/0").unlink(), f"{U0}/hidden/c/0/0/0", ["u00000"], False),
    "truncate_shard": (lambda v: _truncate(v / U1 / "last_hidden/c/0/0"), f"{U1}/last_hidden/c/0/0", ["u00001"], False),
    "flip_hidden": (lambda v: _flip(v / U0 / "hidden/c/0/0/0"), f"{U0}/hidden/c/0/0/0", ["u00000"], True),
    "flip_last_hidden": (lambda v: _flip(v / U1 / "last_hidden/c/0/0"), f"{U1}/last_hidden/c/0/0", ["u00001"], True),
    "flip_input_ids": (lambda v: _flip(v / U1 / "input_ids/c/0"), f"{U1}/input_ids/c/0", ["u00001"], True),
    # an array's metadata edited in place, its size kept: the default reader read byte-swapped or fewer rows before
    "big_endian_hidden": (
        lambda v: _same_size_edit(v / U0 / "hidden/zarr.json", '"little"', '"big"'),
        f"{U0}/hidden/zarr.json",
        ["u00000"],
        True,
    ),
    "shorter_last_hidden": (
        lambda v: _shape_minus_one(v / U1 / "last_hidden/zarr.json"),
        f"{U1}/last_hidden/zarr.json",
        ["u00001"],
        True,
    ),
    # found by a damage check: a null entry ("zarr wrote no file") vouched for a replaced shard, or for zeros
    "null_entry_replaced_shard": (
        lambda v: _null_entry(v / U0, "hidden/c/0/0/0", v / U1 / "hidden/c/0/0/0"),
        f"{U0}/hidden/c/0/0/0",
        ["u00000"],
        False,
    ),
    "null_entry_deleted_shard": (
        lambda v: _null_entry(v / U1, "last_hidden/c/0/0", None),
        f"{U1}/last_hidden/c/0/0",
        ["u00001"],
        False,
    ),
    # a unit's metadata unreadable (a damage check: the rerun crashed in the half-planned check), or its `planned`
    # altered in a committed unit (the rerun removed its plan record and planned its samples into a new unit)
    "truncate_unit_metadata": (
        lambda v: (v / U1 / "zarr.json").write_bytes((v / U1 / "zarr.json").read_bytes()[:100]),
        f"{U1}/zarr.json",
        ["u00001"],
        False,
    ),
    "unit_planned_false": (
        lambda v: _edit(v / U0, "planned", lambda _: False),
        f"{U0}/zarr.json",
        ["u00000"],
        False,
    ),
    # a commit record's JSON types edited (a damage check: tracebacks in the reader, verify and the rerun)
    "commit_tokens_as_string": (
        lambda v: _edit_json(v / U0 / "commit.json", lambda r: {**r, "committed_tokens": str(r["committed_tokens"])}),
        f"{U0}/commit.json",
        ["u00000"],
        False,
    ),
    "commit_files_as_list": (
        lambda v: _edit_json(v / U1 / "commit.json", lambda r: {**r, "files": sorted(r["files"])}),
        f"{U1}/commit.json",
        ["u00001"],
        False,
    ),
    "delete_commit": (lambda v: (v / U0 / "commit.json").unlink(), f"{U0}/commit.json", ["u00000"], False),
    "edit_version_dtype": (lambda v: _edit(v, "logical_dtype", lambda _: "bfloat16"), "logical_dtype", [], False),
    "edit_unit_dtype": (
        lambda v: _edit(v / U1, "logical_dtype", lambda _: "float16"),
        "logical_dtype",
        ["u00001"],
        False,
    ),
    "edit_sample_table": (lambda v: _edit(v / U0, "samples", _swap_first_two), "samples", ["u00000"], False),
    # a damaged plan record of an intact unit (its zarr.json equals its commit digest): the record is rewritten
    "garble_plan_record": (lambda v: (v / "plans/u00000.json").write_text("{"), "plans/u00000.json", [], False),
    "swap_plan_samples": (lambda v: _edit_plan(v, "u00001", _swap_first_two), "plans/u00001.json", [], False),
    "plan_compression_unknown": (  # never checked before: a rebuild from the record crashed on it
        lambda v: _edit_json(v / "plans/u00000.json", lambda p: {**p, "compression": "ZSTD"}),
        "plans/u00000.json",
        [],
        False,
    ),
    "delete_plan_record": (lambda v: (v / "plans/u00000.json").unlink(), "plans/u00000.json", [], False),
    # a damaged version record: the rerun rebuilds it from the run's provenance (every attribute equals it)
    "delete_version_record": (lambda v: (v / "version.json").unlink(), "version.json", [], False),
    "garble_version_record": (lambda v: (v / "version.json").write_text("[1"), "version.json", [], False),
    "version_record_extra_attr": (  # named zarr.json before (a damage check): the record is the edited file
        lambda v: _edit_json(v / "version.json", lambda r: {**r, "attrs": {**r["attrs"], "run_config": "0" * 32}}),
        "version.json",
        [],
        False,
    ),
    "edit_layer_ids": (lambda v: _edit(v, "layer_ids", lambda ids: ids[:-1] + [ids[-1] + 1]), "layer_ids", [], False),
    # a damage check: a shard turned into a link to itself was a bare OSError (ELOOP) in the reader, verify and rerun
    "shard_link_loop": (lambda v: _link_loop(v / U0 / "hidden/c/0/0/0"), f"{U0}/hidden/c/0/0/0", ["u00000"], False),
    # a damage check: a digest in the version record replaced by a number was blamed on zarr.json
    "version_record_digest_not_hex": (
        lambda v: _edit_json(v / "version.json", lambda r: {**r, "attrs": {**r["attrs"], "layer_ids": 5}}),
        "version.json",
        [],
        False,
    ),
}


def _link_loop(path: Path) -> None:
    path.unlink()
    path.symlink_to(path.name)


# Content damage the default reader sees too: the small files (metadata, ids, mask) are checked against their digests
SMALL_FILES = {"flip_input_ids", "big_endian_hidden", "shorter_last_hidden"}


def snapshot_and_batches(small_store):
    """The small store's snapshot, and each unit's number of forward passes (batches) when extracted."""
    store = Store(small_store.store)
    version = small_store.plan.version
    batches = {
        u: len(plan_batches([s[2] for s in store.unit_attrs(version, u)["samples"]], small_store.report.token_budget))
        for u in store.units(version)
    }
    return snapshot(store, version), batches


@pytest.fixture(scope="module")
def original(small_store):
    return snapshot_and_batches(small_store)


def test_original_store_verifies_and_validates(small_store, capsys):
    assert cli(["verify", small_store.store, "--unvalidated"]) == 0
    out = capsys.readouterr().out
    assert "healthy" in out and "2 units" in out
    r = validate_store(
        small_store.store, small_store.plan.version, small_store.prepared, ValidateConfig(recompute_samples=0)
    )
    assert r.ok, r.failures


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damage_is_caught_and_repaired(small_store, original, tmp_path, capsys, damage):
    damage_fn, name, damaged, digests_only = DAMAGES[damage]
    before, batches = original
    root, version = tmp_path / "store", small_store.plan.version
    shutil.copytree(small_store.store, root)
    damage_fn(root / version)

    # the reader: raises naming the file or attribute (content damage needs its digest mode)
    with pytest.raises(StoreError, match=name):
        ds = HiddenStateDataset(root, version, verify="digests", unvalidated="warn")
        for i in range(len(ds)):
            ds[i]
    if not digests_only or damage in SMALL_FILES:  # the default mode sees everything but the shards' content
        with pytest.raises(StoreError, match=name):
            ds = HiddenStateDataset(root, version, unvalidated="warn")
            for i in range(len(ds)):
                ds[i]

    # verify: non-zero, one line naming it
    assert cli(["verify", str(root), "--version", version, "--unvalidated"]) == 1
    out = capsys.readouterr().out
    assert name in out and " problem" in out.splitlines()[-1], out

    # validation: a failed report naming it, no exception
    r = validate_store(str(root), version, small_store.prepared, ValidateConfig(recompute_samples=2))
    assert not r.ok and name in " ".join(r.failures), r.failures
    with pytest.raises(ValidationFailed, match="rerun extract"):
        raise_if_failed(r)

    # repair: content damage is found by verify --repair; the rest by the rerun of extract itself
    if digests_only:
        assert cli(["verify", str(root), "--repair", "--unvalidated"]) == 1
        assert "discarded 1 damaged unit of" in capsys.readouterr().out
    rerun = extract_local(tmp_path, SMALL)
    # a unit without commit record is unfinished work to the planner (as after a crash before its first
    # commit): its writer starts it over; the others are rebuilt from their plan records
    assert sorted(rerun.plan.repaired_units) == ([] if damage == "delete_commit" else damaged)
    assert rerun.result.forward_passes == sum(batches[u] for u in damaged)  # only the damaged units
    assert_same_store(before, snapshot(Store(root), version))
    for rec in ["version.json", *(f"plans/{u}.json" for u in before)]:  # records rebuilt byte for byte
        assert (root / version / rec).read_bytes() == (Path(small_store.store) / version / rec).read_bytes(), rec
    assert cli(["verify", str(root), "--unvalidated"]) == 0
    r = validate_store(str(root), version, small_store.prepared, ValidateConfig(recompute_samples=0))
    assert r.ok, r.failures


def test_a_unit_copied_into_the_version_is_named_not_read_twice(small_store, original, tmp_path, capsys):
    """A unit directory copied in with its plan record (found by an independent check: with validation.json gone too,
    verify said healthy and the reader returned 3 samples twice). Its samples are another unit's: verify names both
    and the fix, the reader refuses, and after the documented fix (delete the copy) the store is as before."""
    root, version = tmp_path / "store", small_store.plan.version
    shutil.copytree(small_store.store, root)
    v = root / version
    (v / "validation.json").unlink(missing_ok=True)
    shutil.copytree(v / U0, v / "units/u00007")
    shutil.copy(v / "plans/u00000.json", v / "plans/u00007.json")

    assert cli(["verify", str(root), "--version", version, "--unvalidated"]) == 1
    out = capsys.readouterr().out
    assert "unit u00007" in out and "that unit u00000 holds too" in out and "plans/u00007.json" in out, out
    assert "1 unit holding samples another holds too (u00007)" in out.splitlines()[-1], out
    with pytest.raises(StoreError, match="units/u00007.*that unit u00000 holds too"):
        HiddenStateDataset(root, version, unvalidated="warn")
    assert cli(["verify", str(root), "--repair", "--unvalidated"]) == 1  # not for --repair to guess which
    assert (v / "units/u00007").is_dir()
    capsys.readouterr()

    (v / "plans/u00007.json").unlink()  # a unit directory copied in alone (`cp -r u00000 "u00000 copy"`)
    assert cli(["verify", str(root), "--version", version, "--unvalidated"]) == 1
    out = capsys.readouterr().out
    assert "delete its directory (it has no plan record)" in out and "plans/u00007.json" not in out, out
    shutil.rmtree(v / "units/u00007")
    assert cli(["verify", str(root), "--version", version, "--unvalidated"]) == 0
    assert_same_store(original[0], snapshot(Store(root), version))


@pytest.mark.parametrize(("replaced", "copied"), [(U1, U0), (U0, U1)])
def test_a_unit_replaced_by_a_copy_of_another_is_not_repaired_into_duplicates(
    small_store, original, tmp_path, capsys, replaced, copied
):
    """Found by damage checks: a unit's directory replaced by a copy of another unit (its records included). verify
    blamed the replaced unit's plan record, `--repair` (and a plain rerun) rewrote it from the copy, and the rerun
    extracted the lost samples into a new unit, then failed validation on the duplicates; with the copy sorting
    first, verify told the user to delete the intact unit. Now no repair touches either unit, verify names the
    replaced one whichever way round and says to delete its directory only; then the rerun rebuilds exactly it. A
    plan record copied in alone (no unit) is not rebuilt into a unit of duplicates."""
    before, batches = original
    root, version = tmp_path / "store", small_store.plan.version
    shutil.copytree(small_store.store, root)
    v = root / version
    name, other = replaced.rsplit("/", 1)[-1], copied.rsplit("/", 1)[-1]
    plan = (v / f"plans/{name}.json").read_bytes()
    shutil.rmtree(v / replaced)
    shutil.copytree(v / copied, v / replaced)
    with pytest.raises(StoreError, match="unit u0000[01]"):  # refused: its records disagree, or a duplicate
        HiddenStateDataset(root, version, unvalidated="warn")
    assert cli(["verify", str(root), "--version", version, "--repair", "--unvalidated"]) == 1
    out = capsys.readouterr().out
    assert (
        f"unit {name}" in out and f"its directory was replaced by a copy of that unit. Delete units/{name} only" in out
    )
    assert f"plans/{other}.json" not in out and "rewrote" not in out and "discarded" not in out, out
    assert (v / f"plans/{name}.json").read_bytes() == plan and (v / replaced).is_dir() and (v / copied).is_dir()
    # a rerun before the fix extracts nothing: the lost samples are still the replaced unit's (its plan record)
    assert extract_local(tmp_path, SMALL).result.forward_passes == 0 and not (v / "units/u00002").exists()
    shutil.rmtree(v / replaced)  # the documented fix
    rerun = extract_local(tmp_path, SMALL)
    assert rerun.result.forward_passes == batches[name]
    assert_same_store(before, snapshot(Store(root), version))

    shutil.copy(v / "plans/u00000.json", v / "plans/u00009.json")  # a plan record alone, copied in
    assert cli(["verify", str(root), "--version", version, "--repair", "--unvalidated"]) == 1
    assert "delete its directory and plans/u00009.json" in capsys.readouterr().out
    rerun = extract_local(tmp_path, SMALL)
    assert rerun.result.forward_passes == 0 and not (v / "units/u00009").exists()


def test_missing_unit_directory_is_named_and_rebuilt(small_store, original, tmp_path, capsys):
    before, batches = original
    root, version = tmp_path / "store", small_store.plan.version
    shutil.copytree(small_store.store, root)
    shutil.rmtree(root / version / U1)
    with pytest.raises(StoreError, match="u00001.*unit directory missing"):
        HiddenStateDataset(root, version, unvalidated="warn")
    assert cli(["verify", str(root), "--unvalidated"]) == 1
    assert "unit directory missing" in capsys.readouterr().out
    rerun = extract_local(tmp_path, SMALL)
    assert rerun.result.forward_passes == batches["u00001"]
    assert_same_store(before, snapshot(Store(root), version))


def test_a_missing_unit_with_a_plan_record_that_contradicts_itself_is_not_rebuilt_from_it(small_store, tmp_path):
    """A unit directory gone and its plan record edited (n_tokens lowered, a sample dropped: a damage hunt): the
    rerun rebuilt the unit from it, validation failed, `verify --repair` discarded it, the rerun rebuilt the same,
    for good. The record is checked first; the error names it and the fix, which works."""
    root, version = tmp_path / "store", small_store.plan.version
    shutil.copytree(small_store.store, root)
    shutil.rmtree(root / version / U1)
    plan_path = root / version / "plans/u00001.json"
    plan = json.loads(plan_path.read_text())
    plan["n_tokens"] -= 50
    plan["samples"] = plan["samples"][:-1]
    plan_path.write_text(json.dumps(plan))
    with pytest.raises(StoreError, match="plans/u00001.json cannot rebuild it .sample table covers") as e:
        extract_local(tmp_path, SMALL)
    assert "Delete the plan record" in str(e.value)
    plan_path.unlink()
    rerun = extract_local(tmp_path, SMALL, validate=True)  # its samples planned again, into a new unit
    assert rerun.validation.ok and len(HiddenStateDataset(root)) == SMALL["data.max_samples"]


def test_on_object_storage_damage_is_named_and_repaired(s3, small_store, original, capsys, tmp_path):
    """The same checks through S3 (listing sizes, reading objects for digests): a deleted shard object and a
    flipped byte in another are named by the reader and verify; verify --repair and a rerun restore the store
    bit-identical to the local one."""
    import json

    before, batches = original
    overrides = s3.overrides("integrity", SMALL)
    ex = extract_local(tmp_path, overrides)
    url, opts = s3.url("integrity"), ["--store-options", json.dumps(s3.options)]
    store = Store(url, s3.options)
    assert_same_store(before, snapshot(store, ex.plan.version))
    assert cli(["verify", url, "--unvalidated", *opts]) == 0
    fs, root = store.loc.fs, f"{url[len('s3://') :]}/{ex.plan.version}"
    fs.rm(f"{root}/{U0}/hidden/c/0/0/0")
    data = bytearray(fs.cat_file(f"{root}/{U1}/last_hidden/c/0/0"))
    data[len(data) // 3] ^= 0xFF
    fs.pipe_file(f"{root}/{U1}/last_hidden/c/0/0", bytes(data))
    with pytest.raises(StoreError, match=f"{U0}/hidden/c/0/0/0.*missing"):
        ds = HiddenStateDataset(url, store_options=s3.options, unvalidated="warn")
        for i in range(len(ds)):
            ds[i]
    capsys.readouterr()
    assert cli(["verify", url, "--repair", "--unvalidated", *opts]) == 1
    out = capsys.readouterr().out
    assert f"{U0}/hidden/c/0/0/0: missing" in out and f"{U1}/last_hidden/c/0/0: content differs" in out, out
    rerun = extract_local(tmp_path, overrides)
    assert rerun.result.forward_passes == batches["u00000"] + batches["u00001"]
    assert_same_store(before, snapshot(store, ex.plan.version))
    assert cli(["verify", url, "--unvalidated", *opts]) == 0


def test_a_unit_linked_from_another_disk_is_read_through_and_its_target_never_deleted(
    small_store, original, tmp_path, capsys
):
    """docs/STORE.md: a unit directory may be a symbolic link; it reads as any other, and discarding it (here after a
    flipped byte) removes the link only, never the files it points to; the rerun rebuilds the unit in the store."""
    before, batches = original
    root, version = tmp_path / "store", small_store.plan.version
    shutil.copytree(small_store.store, root)
    elsewhere = tmp_path / "other-disk" / "u00001"
    elsewhere.parent.mkdir()
    shutil.move(root / version / U1, elsewhere)
    (root / version / U1).symlink_to(elsewhere, target_is_directory=True)
    assert cli(["verify", str(root), "--unvalidated"]) == 0
    assert_same_store(before, snapshot(Store(root), version))

    _flip(elsewhere / "hidden/c/0/0/0")
    kept = sorted(p.relative_to(elsewhere) for p in elsewhere.rglob("*"))
    assert cli(["verify", str(root), "--repair", "--unvalidated"]) == 1
    assert "discarded 1 damaged unit of v0001 (u00001)" in capsys.readouterr().out
    assert not (root / version / U1).exists() and sorted(p.relative_to(elsewhere) for p in elsewhere.rglob("*")) == kept
    rerun = extract_local(tmp_path, SMALL)
    assert rerun.result.forward_passes == batches["u00001"]
    assert_same_store(before, snapshot(Store(root), version))


def test_a_damaged_batching_record_or_lock_file_is_named_not_a_traceback(small_store, tmp_path):
    """Found by a damage check: NUL bytes appended to <version>/batching.json, and a directory where the store's
    .lock file goes, each ended the rerun (and verify --repair) in a traceback."""
    from dflash_pipeline.errors import StoreError
    from dflash_pipeline.extraction.plan import pin_token_budget

    root = tmp_path / "store"
    shutil.copytree(small_store.store, root)
    version = small_store.plan.version
    record = root / version / "batching.json"
    assert pin_token_budget(Store(root), version, small_store.report).token_budget > 0
    for damage in (b"\0", b""):
        record.write_bytes(record.read_bytes() + damage if damage else b'{"token_budget": 0}')
        with pytest.raises(StoreError, match=rf"{record} is damaged .*restore it, or write"):
            pin_token_budget(Store(root), version, small_store.report)
    lock = root / ".lock"
    lock.unlink(missing_ok=True)
    lock.mkdir()
    with pytest.raises(StoreError, match=rf"{lock} is the store's lock file, but it is not a file: remove it"):
        with Store(root).loc.lock(".lock", "test", StoreError):
            pass


def test_a_version_without_its_zarr_json_is_left_and_a_rerun_extracts_beside_it(small_store, tmp_path, caplog):
    """Found by a damage check: with <version>/zarr.json deleted the directory is no version, and the rerun tried
    to create a version of that same name over it (FileExistsError). Now the new version is made beside it and the
    old directory, with its units, is left untouched (named in a warning)."""
    root = tmp_path / "store"
    shutil.copytree(small_store.store, root)
    version = small_store.plan.version
    (root / version / "zarr.json").unlink()
    files = {p.relative_to(root): p.read_bytes() for p in (root / version).rglob("*") if p.is_file()}
    with caplog.at_level(logging.WARNING):
        ex = extract_local(tmp_path / "run", {**SMALL, "store_path": str(root)})
    assert ex.plan.version != version and f"{version} is not a version (no zarr.json" in caplog.text
    assert {p.relative_to(root): p.read_bytes() for p in (root / version).rglob("*") if p.is_file()} == files
    assert_same_store(snapshot(Store(root), ex.plan.version), snapshot(Store(small_store.store), version))
