"""Damage the default reader (training's), `verify` and a repair must see beyond a unit's committed bytes: the store's
own records (CURRENT, retention, repair records) in the wrong shape, intact chunks out of place in a shard, a forged
chunks entry, and files deleted or unleasable under a live reader. The damage table of the committed bytes and
records themselves is tests/integration/test_integrity.py's; these came from the damage checks of 2026-12-06."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from dflash_pipeline.cli import main as cli
from dflash_pipeline.errors import StoreError
from dflash_pipeline.storage.reader import HiddenStateDataset
from dflash_pipeline.storage.store import Store
from dflash_pipeline.storage.verify import verify_version
from tests.helpers import extract_local
from tests.integration.test_integrity import SMALL, U0, U1, _edit_json, _flip


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("current_a_directory", "CURRENT is a directory"),
        ("current_a_fifo", "CURRENT is not a regular file"),  # (every reader, verify and run hung on it)
        ("retention_unit_entry_a_string", '"units"."u00001" is "deleted", not an object'),
        ("retention_units_a_list", '"units" is a JSON list'),
        ("retention_version_a_string", '"version" is "deleted", not an object'),
    ],
)
def test_a_damaged_store_record_is_named_with_its_fix(small_store, tmp_path, capsys, damage, said):
    """A damage check: these were tracebacks (IsADirectoryError, AttributeError) in the reader and verify."""
    root, version = tmp_path / "store", small_store.plan.version
    shutil.copytree(small_store.store, root)
    if damage.startswith("current_a_"):
        (root / "CURRENT").unlink(missing_ok=True)
        if damage == "current_a_directory":
            (root / "CURRENT").mkdir()
        else:
            os.mkfifo(root / "CURRENT")
        args = []
    else:
        entry = {
            "retention_unit_entry_a_string": {"units": {"u00001": "deleted"}},
            "retention_units_a_list": {"units": ["u00001"]},
            "retention_version_a_string": {"version": "deleted"},
        }[damage]
        (root / version / "retention.json").write_text(json.dumps(entry))
        args = ["--version", version, "--unvalidated"]
    with pytest.raises(StoreError) as e:
        HiddenStateDataset(root, version if args else None, unvalidated="warn")
    assert said in str(e.value) and ("restore" in str(e.value).lower() or "replace" in str(e.value)), str(e.value)
    # no store to check (2, on stderr), or a problem of the version (1, its line)
    assert cli(["verify", str(root), *args]) == (1 if args else 2)
    assert said in (capsys.readouterr().out if args else capsys.readouterr().err)


UNCOMPRESSED = {**SMALL, "extract.compression": "none", "extract.shard_mib": 0.05, "extract.chunk_mib": 0.01}


@pytest.fixture(scope="module")
def uncompressed_store(tmp_path_factory):
    """Shards of several equal-sized chunks (compression none): intact chunks can trade places unseen by their
    CRC32Cs, and a shard of one unit has the size of another unit's."""
    out = tmp_path_factory.mktemp("uncompressed")
    return extract_local(out, UNCOMPRESSED, validate=True)


def _swap_chunks(array: Path, shard: str, a: int, b: int) -> None:
    """Exchange the bytes of chunks a and b (equal sizes) of shard file `shard` of the zarr array at `array`, its
    index untouched."""
    import numpy as np

    meta = json.loads((array / "zarr.json").read_text())
    n = meta["chunk_grid"]["configuration"]["chunk_shape"][0] // meta["codecs"][0]["configuration"]["chunk_shape"][0]
    data = bytearray((array / shard).read_bytes())
    index = np.frombuffer(bytes(data[-(16 * n + 4) : -4]), dtype="<u8").reshape(n, 2)
    (oa, na), (ob, nb) = index[a].tolist(), index[b].tolist()
    assert n >= 2 and na == nb, (n, na, nb)
    data[oa : oa + na], data[ob : ob + nb] = data[ob : ob + nb], data[oa : oa + na]
    (array / shard).write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["chunks_swapped_in_a_shard", "shard_replaced_by_another_units"])
def test_intact_chunks_out_of_place_are_an_error_in_the_default_reader(uncompressed_store, tmp_path, capsys, damage):
    """A damage check read these as other rows without an error in the default mode (training's): each chunk and the
    index pass their CRC32C. The commit record now holds a digest of each shard's index and chunk CRCs, which the
    default reader checks with a few small reads per shard; `verify` finds it by the shard's digest."""
    root, version = tmp_path / "store", uncompressed_store.plan.version
    shutil.copytree(uncompressed_store.store, root)
    v = root / version
    if damage == "chunks_swapped_in_a_shard":
        _swap_chunks(v / U1 / "hidden", "c/0/0/0", 0, 1)
    else:
        src, dst = v / U0 / "hidden/c/1/0/0", v / U1 / "hidden/c/0/0/0"
        assert src.stat().st_size == dst.stat().st_size
        shutil.copyfile(src, dst)
    with pytest.raises(StoreError, match=f"{U1}/hidden/c/0/0/0.*its chunks differ from the commit record"):
        ds = HiddenStateDataset(root)
        for i in range(len(ds)):
            ds[i]
    assert cli(["verify", str(root)]) == 1
    assert "content differs from the commit record" in capsys.readouterr().out


def test_a_forged_chunks_entry_is_found_by_verify_and_repaired(uncompressed_store, tmp_path, capsys):
    """A damage check: a commit record's `chunks` entry replaced by another well-formed digest passed validation and
    `verify` (which compared only the file's digest), while the default reader refused the shard for good. `verify`
    now checks the entry against the file, so `verify --repair` discards the unit and a rerun rebuilds it."""
    root, version = tmp_path / "store", uncompressed_store.plan.version
    shutil.copytree(uncompressed_store.store, root)
    _edit_json(
        root / version / U0 / "commit.json",
        lambda r: {
            **r,
            "files": {**r["files"], "hidden/c/0/0/0": {**r["files"]["hidden/c/0/0/0"], "chunks": "0" * 32}},
        },
    )
    with pytest.raises(StoreError, match="its chunks differ from the commit record"):
        ds = HiddenStateDataset(root, version, unvalidated="warn")
        for i in range(len(ds)):
            ds[i]
    assert cli(["verify", str(root), "--version", version, "--unvalidated"]) == 1
    assert f"{U0}/hidden/c/0/0/0: the commit record's chunks entry differs from the file" in capsys.readouterr().out
    assert cli(["verify", str(root), "--version", version, "--unvalidated", "--repair"]) == 1
    assert "discarded 1 damaged unit" in capsys.readouterr().out
    extract_local(
        tmp_path, {**SMALL, "extract.compression": "none", "extract.shard_mib": 0.05, "extract.chunk_mib": 0.01}
    )
    ds = HiddenStateDataset(root, version, unvalidated="warn")
    assert len([ds[i] for i in range(len(ds))]) == 60
    assert cli(["verify", str(root), "--version", version, "--unvalidated"]) == 0


def test_a_file_deleted_under_a_live_reader_is_an_error_not_zeros(small_store, tmp_path):
    """A damage check: a shard deleted by another tool after the reader had checked its unit read back as zeros
    (zarr's fill value). The reader checks, after each read, that the files it used are still there."""
    root, version = tmp_path / "store", small_store.plan.version
    shutil.copytree(small_store.store, root)
    ds = HiddenStateDataset(root, version, unvalidated="warn")
    first = ds.samples[0]
    same = next(
        i for i, s in enumerate(ds.samples) if s.unit == first.unit and i > 0 and s.start < ds._shard_tokens[s.unit]
    )
    ds[0]  # the unit is opened and checked
    (root / version / "units" / first.unit / "hidden/c/0/0/0").unlink()
    with pytest.raises(StoreError, match=r"hidden/c/0/0/0 changed while this process read sample .* \(gone\)"):
        ds[same]


def test_a_shard_replaced_by_another_of_its_size_under_a_live_reader_is_an_error(uncompressed_store, tmp_path):
    """A damage check: after the reader had checked a shard, another intact shard of the same size put in its place
    (copy, then rename over it) was read as the sample's states: the after-read check compared sizes only. Each shard
    is now the very file that was checked (inode and modification time)."""
    import os

    root, version = tmp_path / "store", uncompressed_store.plan.version
    shutil.copytree(uncompressed_store.store, root)
    ds = HiddenStateDataset(root)
    unit = root / version / "units" / ds.samples[0].unit
    shard = unit / "hidden/c/0/0/0"
    ds[0]  # checked and read
    twin = next(
        p
        for p in (root / version / "units").glob("*/hidden/c/*/0/0")
        if p != shard and p.stat().st_size == shard.stat().st_size
    )
    shutil.copyfile(twin, tmp_path / "twin")
    os.replace(tmp_path / "twin", shard)
    with pytest.raises(
        StoreError, match=r"hidden/c/0/0/0 changed while this process read sample .* \(replaced by another"
    ):
        ds[0]


def test_a_leases_directory_that_is_not_one_stops_deletions(small_store, tmp_path):
    """A damage check: with `<version>/.leases` a file, readers could take no lease and retention saw none, deleting
    under a live reader. Now a deletion assumes an unknown reader and refuses."""
    from dflash_pipeline.storage.discard import discard_units
    from dflash_pipeline.storage.leases import live_leases

    root, version = tmp_path / "store", small_store.plan.version
    shutil.copytree(small_store.store, root)
    shutil.rmtree(root / version / ".leases", ignore_errors=True)
    (root / version / ".leases").write_text("x")
    store = Store(root)
    (lease,) = live_leases(store, version)
    assert "is not a directory" in lease["by"]
    with pytest.raises(StoreError, match=r"\.leases is not a directory.*nothing was deleted"):
        discard_units(store, version, ["u00000"], {"u00000": "test"})
    assert (root / version / U0).is_dir()


@pytest.mark.parametrize("place", ["discarded_json_a_directory", "trash_a_file", "unit_a_file"])
def test_a_repair_with_a_record_or_unit_in_the_wrong_shape_names_it(small_store, tmp_path, capsys, place):
    """A damage check: these stopped `verify --repair` midway with a raw errno or a permission's fix."""
    root, version = tmp_path / "store", small_store.plan.version
    shutil.copytree(small_store.store, root)
    v = root / version
    _flip(v / U1 / "hidden/c/0/0/0")  # something to discard
    if place == "discarded_json_a_directory":
        (v / "discarded.json").mkdir()
    elif place == "trash_a_file":
        (v / ".discarded").write_text("x")
    else:
        shutil.rmtree(v / U0)
        (v / U0).write_text("x")
    rc = cli(["verify", str(root), "--version", version, "--unvalidated", "--repair"])
    out, err = capsys.readouterr()
    if place == "unit_a_file":  # discarded like any damaged unit: the file goes, the rerun rebuilds it
        assert rc == 1 and "discarded 2 damaged units" in out and not (v / U0).exists(), out + err
    else:
        name = "discarded.json should be a file" if place == "discarded_json_a_directory" else ".discarded should be a"
        assert rc == 3 and name in err and "move it aside" in err, err
        assert (v / U1).is_dir()  # nothing was discarded


@pytest.mark.parametrize("damage", ["truncated", "chunk_shape_edited"])
def test_a_damaged_array_metadata_is_blamed_not_the_commit_records(uncompressed_store, tmp_path, capsys, damage):
    """A damage check: with an array's zarr.json damaged, `verify` also blamed the intact commit record of every
    shard of that array ("the record was edited"), since their chunks were read with a wrong layout or none. Only
    the array's zarr.json is named now."""
    root, version = tmp_path / "store", uncompressed_store.plan.version
    shutil.copytree(uncompressed_store.store, root)
    meta = root / version / U0 / "hidden" / "zarr.json"
    if damage == "truncated":
        meta.write_bytes(meta.read_bytes()[:200])
    else:  # a layout that parses: shards of other chunks, same size
        text = meta.read_text()
        i = text.index('"chunk_shape"', text.index("sharding_indexed"))
        j = text.index("]", i)
        first = text[i:j].split("[")[1].split(",")[0].strip()
        other = str(int(first) - 1).rjust(len(first))  # (JSON allows the space: the file keeps its size)
        meta.write_text(text[:i] + text[i:j].replace(first, other, 1) + text[j:])
        assert meta.stat().st_size == len(text.encode())
    assert cli(["verify", str(root), "--version", version, "--unvalidated"]) == 1
    out = capsys.readouterr().out
    assert f"{U0}/hidden/zarr.json: " in out and "chunks entry" not in out, out


def test_unit_directories_swapped_by_hand_are_moved_back_not_reordered(tmp_path, capsys):
    """A damage check: with two unit directories swapped, `verify --repair` (and a rerun of extract) rewrote their
    plan records from the units' intact attributes: the version kept every sample but in another order, unvalidated,
    with no record of why. Now verify names each directory and the commands that move them all back (here a cycle
    of three), no repair rewrites their plan records, extract refuses with the same commands, and once they are run
    the version is exactly as validated: read by default, equal to before."""
    import subprocess

    import torch

    ex = extract_local(tmp_path, {**SMALL, "extract.unit_tokens": 1500}, validate=True)
    root, version = Path(ex.cfg.store), ex.plan.version
    ds = HiddenStateDataset(root)
    before = {s.sample_id: ds[i]["hidden"] for i, s in enumerate(ds.samples)}
    order = [s.sample_id for s in ds.samples]
    units = root / version / "units"
    a, b, c = sorted(p.name for p in units.iterdir() if p.is_dir())[:3]
    plans = {p.name: p.read_bytes() for p in (root / version / "plans").iterdir()}
    (units / a).rename(units / "x")  # a <- b <- c <- a
    (units / b).rename(units / a)
    (units / c).rename(units / b)
    (units / "x").rename(units / c)

    assert cli(["verify", str(root), "--repair"]) == 1
    out = capsys.readouterr().out
    assert f"units/{a}: intact, but it holds the samples planned for unit {b}" in out
    assert "move the unit directories back (above)" in out and "run the pipeline's validate stage" not in out
    assert {p.name: p.read_bytes() for p in (root / version / "plans").iterdir()} == plans  # nothing rewritten
    with pytest.raises(StoreError, match="intact unit directories are under another unit's name") as e:
        extract_local(tmp_path, {**SMALL, "extract.unit_tokens": 1500}, validate=True)
    commands = str(e.value).split("move them back, then rerun: ")[1]
    assert commands in out
    subprocess.run(commands, shell=True, check=True)

    assert cli(["verify", str(root)]) == 0
    again = HiddenStateDataset(root)  # as validated: read by default
    assert [s.sample_id for s in again.samples] == order
    assert all(torch.equal(again[i]["hidden"], before[s.sample_id]) for i, s in enumerate(again.samples))


THREE_UNITS = {**SMALL, "extract.unit_tokens": 1500}


@pytest.fixture(scope="module")
def three_units(tmp_path_factory):
    return extract_local(tmp_path_factory.mktemp("three_units"), THREE_UNITS, validate=True)


def _duplicate_first_sample(plan: dict) -> None:
    plan["samples"][1][0] = plan["samples"][0][0]


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda p: p.update(logical_dtype="bfloat16"), 'logical_dtype "bfloat16" is not the version\'s float32'),
        (lambda p: p.update(shard_tokens=0), "no chunking"),
        (lambda p: p.update(chunk_tokens=p["shard_tokens"] - 1), "no chunking"),
        (lambda p: p.update(samples=[], n_tokens=0), "sample table empty"),
        (_duplicate_first_sample, "more than once"),
    ],
    ids=["dtype", "shard-0", "chunk-not-dividing", "no-samples", "sample-twice"],
)
def test_a_plan_record_that_cannot_rebuild_its_unit_is_named_before_any_rebuild(three_units, tmp_path, edit, said):
    """A damage check: a missing unit was rebuilt from an edited plan record as it stood, into a unit of the wrong
    dtype that failed validation after every repair and rerun (a loop), a traceback from zarr (chunking), or a unit
    holding one sample twice that verify called healthy. The plan record is now checked first: verify and extract
    name it and say to delete it; then the rerun plans those samples into a new unit, and the version is whole."""
    src = Path(three_units.cfg.store)
    root = tmp_path / "store"
    shutil.copytree(src, root)
    version = three_units.plan.version
    want = sorted(s.sample_id for s in HiddenStateDataset(src).samples)
    u = "u00001"
    shutil.rmtree(root / version / "units" / u)
    _edit_json(root / version / "plans" / f"{u}.json", lambda p: (edit(p), p)[1])
    report = verify_version(Store(root), version)
    assert any(
        p.unit == u and "its plan record cannot rebuild it" in p.what and said in p.what for p in report.problems
    )
    cfg = {**THREE_UNITS, "store_path": str(root)}
    with pytest.raises(StoreError, match=f"its plan record {version}/plans/{u}.json cannot rebuild it"):
        extract_local(tmp_path, cfg, validate=True)
    (root / version / "plans" / f"{u}.json").unlink()
    extract_local(tmp_path, cfg, validate=True)
    assert verify_version(Store(root), version).ok
    assert sorted(s.sample_id for s in HiddenStateDataset(root).samples) == want
