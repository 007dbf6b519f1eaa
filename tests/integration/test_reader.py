"""The reader: committed samples only, random access, safe with DataLoader worker processes."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from dflash_pipeline.errors import StoreError
from dflash_pipeline.storage.reader import HiddenStateDataset
from dflash_pipeline.storage.store import Store


def test_reader_sees_only_committed_samples(clean_extraction, tmp_path):
    """A unit committed up to its first shard (as an interrupted extraction leaves it): with partial=True the
    reader sees exactly the samples inside; by default it refuses the unfinished version, naming the unit."""
    root = tmp_path / "store"
    shutil.copytree(clean_extraction.store, root)
    version = clean_extraction.plan.version
    store = Store(root)
    u = store.units(version)[0]
    attrs = store.unit_attrs(version, u)
    rec = store.commit_record(version, u)
    cut = attrs["shard_tokens"]
    assert cut < attrs["n_tokens"]
    files = {
        f: d
        for f, d in rec["files"].items()
        if "/c/" not in f or f.split("/c/")[0] not in ("hidden", "last_hidden") or f.split("/c/")[1].startswith("0/")
    }
    inside = sum(1 for _, start, length in attrs["samples"] if start + length <= cut)  # (as the writer counts)
    partial_rec = {**rec, "committed_tokens": cut, "complete": False, "committed_samples": inside, "files": files}
    (root / version / "units" / u / "commit.json").write_text(json.dumps(partial_rec))
    with pytest.raises(StoreError, match=f"unit {u}.*not complete: {cut} of"):
        HiddenStateDataset(root, version, unvalidated="warn")
    partial = HiddenStateDataset(root, version, partial=True, unvalidated="warn")
    visible = {s.sample_id for s in partial.samples if s.unit == u}
    assert visible == {sid for sid, start, length in attrs["samples"] if start + length <= cut}
    assert 0 < len(visible) < len(attrs["samples"])
    for i in range(len(partial)):
        partial[i]

    # a unit being planned (its group made, no attributes, commit or plan record yet), as a poll during a run can
    # find it: partial=True reads the others (a damage check met a KeyError here)
    (root / version / "units" / u / "commit.json").unlink()
    (root / version / "plans" / f"{u}.json").unlink()
    meta = root / version / "units" / u / "zarr.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "attributes": {}}))
    polled = HiddenStateDataset(root, version, partial=True, unvalidated="warn")
    assert {s.unit for s in polled.samples} == set(store.units(version)) - {u} and len(polled) > 0


def test_items_and_dataloader_workers(small_store):
    ds = HiddenStateDataset(small_store.store, unvalidated="warn")  # no CURRENT yet: the newest, with a warning
    item = ds[ds.index_of(ds.samples[5].sample_id)]
    t = len(item["input_ids"])
    assert item["hidden"].shape == (t, 3, 64) and item["last_hidden"].shape == (t, 64)
    assert item["loss_mask"].dtype == torch.bool and item["loss_mask"].any()
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, shuffle=False)
    seen = [x["sample_id"] for x in loader]
    assert seen == [s.sample_id for s in ds.samples]


def test_store_reads_with_plain_zarr_as_documented(small_store):
    """docs/STORE.md's recipe, with nothing of this package: committed samples and their states."""
    import json as _json

    import numpy as np
    import zarr

    root, version = small_store.store, small_store.plan.version
    g = zarr.open_group(f"{root}/{version}", mode="r")
    assert g.attrs["layer_ids"] == [1, 2, 3] and g.attrs["logical_dtype"] == "float32"
    # which forward computed the states (a CPU run: transformers' Gated DeltaNet forward and convolution)
    assert g.attrs["forward"] == {
        "gdn_forward": "transformers",
        "conv_kernel": "transformers",
        "attn_implementation": None,
    }
    ds = HiddenStateDataset(root, version, unvalidated="warn")
    n = 0
    for name, unit in g["units"].groups():
        commit = _json.load(open(f"{root}/{version}/units/{name}/commit.json"))
        for sid, start, length in unit.attrs["samples"]:
            assert start + length <= commit["committed_tokens"]
            h = unit["hidden"][start : start + length]
            assert np.array_equal(h, ds[ds.index_of(sid)]["hidden"].numpy())
            n += 1
    assert n == len(ds) == 60


def test_store_recipes_in_the_docs_recompute(small_store, model_dir):
    """What docs/STORE.md says a reader can recompute: sample ids from the stored ids and mask, the model config
    hash from config.json, the chunking and Blosc settings from the plan record (zarr's own metadata agrees)."""
    import hashlib
    import json as _json

    import zarr

    root, version = small_store.store, small_store.plan.version
    g = zarr.open_group(f"{root}/{version}", mode="r")
    config = _json.loads((Path(model_dir) / "config.json").read_text())
    config.pop("transformers_version", None)
    assert g.attrs["model_config_hash"] == hashlib.sha256(_json.dumps(config, sort_keys=True).encode()).hexdigest()
    for name, unit in g["units"].groups():
        plan = _json.load(open(f"{root}/{version}/plans/{name}.json"))
        assert plan["compression"] == "zstd" and unit.attrs["shard_tokens"] == plan["shard_tokens"]
        ids, mask = unit["input_ids"][:], unit["loss_mask"][:]
        for sid, start, length in unit.attrs["samples"]:
            span = slice(start, start + length)
            recomputed = hashlib.sha256(_json.dumps([ids[span].tolist(), mask[span].tolist()]).encode()).hexdigest()
            assert sid == recomputed[:20]
        for arr in ("hidden", "last_hidden"):
            a = unit[arr]
            assert (a.shards[0], a.chunks[0]) == (unit.attrs["shard_tokens"], unit.attrs["chunk_tokens"])
            inner = a.metadata.codecs[0].codecs  # the sharding codec's chain: bytes, blosc, crc32c
            blosc = next(c for c in inner if type(c).__name__ == "BloscCodec")
            cname, shuffle = (getattr(x, "value", x) for x in (blosc.cname, blosc.shuffle))  # enums in zarr 3.1
            assert (cname, blosc.clevel, blosc.typesize) == ("zstd", 1, a.dtype.itemsize)
            assert (shuffle, blosc.blocksize) == ("shuffle", 1 << 20)
        # chunk_tokens = floor(4 MiB / bytes per token of hidden); the unit is smaller than one 128 MiB shard, so
        # its single shard is its token count rounded up to whole chunks
        h = unit["hidden"]
        chunk = 4 * 2**20 // (h.shape[1] * h.shape[2] * h.dtype.itemsize)
        assert unit.attrs["chunk_tokens"] == min(chunk, unit.attrs["shard_tokens"])
        assert unit.attrs["shard_tokens"] == max(chunk, -(-unit.attrs["n_tokens"] // chunk) * chunk)


def test_digest_mode_checks_each_shard_when_first_read(clean_extraction, tmp_path):
    """verify="digests" reads a shard's digest when a sample first touches it: samples in intact shards read,
    the first sample in the altered shard raises naming it; the default mode (sizes) does not read content."""
    root = tmp_path / "store"
    shutil.copytree(clean_extraction.store, root)
    version = clean_extraction.plan.version
    store = Store(root)
    u = store.units(version)[0]
    shard_tokens = store.unit_attrs(version, u)["shard_tokens"]
    shard = root / version / "units" / u / "hidden" / "c" / "1" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    ds = HiddenStateDataset(root, version, verify="digests", unvalidated="warn")
    mine = [i for i, s in enumerate(ds.samples) if s.unit == u]
    in_first = [i for i in mine if ds.samples[i].start + ds.samples[i].length <= shard_tokens]
    in_second = [i for i in mine if ds.samples[i].start >= shard_tokens]
    assert in_first and in_second
    for i in in_first:
        ds[i]
    with pytest.raises(StoreError, match=f"units/{u}/hidden/c/1/0/0: content differs"):
        ds[in_second[0]]
    ds = HiddenStateDataset(root, version, unvalidated="warn")  # sizes mode: same size, not noticed at first open
    for i in in_first:
        ds[i]
    # zarr's CRC32C catches it when read: one StoreError naming unit, array and file (zarr's own ValueError names none)
    with pytest.raises(StoreError, match=f"unit {u}, array hidden, file units/{u}/hidden/c/1/0/0: cannot be decoded"):
        ds[in_second[0]]


@pytest.fixture(scope="module")
def validated(small_store, tmp_path_factory):
    """A copy of the small store whose version passed validation and is CURRENT (as a run with validate leaves
    it), and its prepared dataset."""
    from dflash_pipeline.extraction.config import ValidateConfig
    from dflash_pipeline.extraction.validate import validate_store

    root = tmp_path_factory.mktemp("validated") / "store"
    shutil.copytree(small_store.store, root)
    version = small_store.plan.version
    r = validate_store(str(root), version, small_store.prepared, ValidateConfig(recompute_samples=0))
    assert r.ok, r.failures
    (root / version / "validation.json").write_text(json.dumps(r.to_dict()))
    Store(root).set_current(version)
    return root, version


def test_only_validated_versions_are_read_by_default(validated, tmp_path, capsys, caplog):
    """The reader and verify refuse a version whose validation failed, never ran, or that changed since it passed
    (or warn with unvalidated='warn' / --unvalidated); no CURRENT is said plainly, never the newest version."""
    from dflash_pipeline.cli import main as cli

    src, version = validated
    root = tmp_path / "store"
    shutil.copytree(src, root)
    assert len(HiddenStateDataset(root)) == 60 and cli(["verify", str(root)]) == 0
    report = root / version / "validation.json"
    passed = report.read_text()

    (root / "CURRENT").unlink()  # no CURRENT: no published version, whatever validation.json says
    with pytest.raises(StoreError, match="no published version: CURRENT is missing"):
        HiddenStateDataset(root)
    capsys.readouterr()
    assert cli(["verify", str(root)]) == 2
    assert "no published version" in capsys.readouterr().err
    assert len(HiddenStateDataset(root, version)) == 60  # named, and validated: read

    failed = {**json.loads(passed), "ok": False}
    failed["checks"][0] = {"check": "integrity", "ok": False, "detail": "unit u00001 ... damaged"}
    report.write_text(json.dumps(failed))
    Store(root).set_current(version)
    with pytest.raises(StoreError, match="is not validated: its validation failed: integrity: unit u00001") as e:
        HiddenStateDataset(root)
    # (not "run validate": a damage check followed that advice in a loop, the same bytes failing the same way)
    assert "validating it again fails the same way: first do what the failed check says" in str(e.value)
    assert "run the pipeline's validate stage" not in str(e.value)
    assert cli(["verify", str(root)]) == 1
    assert "is not validated: its validation failed" in capsys.readouterr().out
    assert cli(["verify", str(root), "--unvalidated"]) == 0
    assert len(HiddenStateDataset(root, unvalidated="warn")) == 60
    assert "reading it anyway" in caplog.text

    report.unlink()  # deleted from a version published validated: refused, by name (a damage check found it read)
    with pytest.raises(StoreError, match="validation.json is missing .a version of this kind becomes CURRENT"):
        HiddenStateDataset(root)
    assert cli(["verify", str(root)]) == 1
    assert "validation.json is missing" in capsys.readouterr().out
    record = root / version / "version.json"  # a version from before the flag: its CURRENT is trusted without it
    flagged = record.read_text()
    record.write_text(json.dumps({k: v for k, v in json.loads(flagged).items() if k != "validated_before_publishing"}))
    assert len(HiddenStateDataset(root)) == 60
    record.write_text(flagged.replace('"validated_before_publishing": true', '"validated_before_publishing": "true"'))
    with pytest.raises(StoreError, match='validated_before_publishing is "true", not true: the record was edited'):
        HiddenStateDataset(root)  # only true is written: any other value is an edit, not an older version
    record.write_text(flagged)
    (root / "CURRENT").unlink()  # not published: never ran
    with pytest.raises(StoreError, match="validation never ran"):
        HiddenStateDataset(root, version)

    for state in ("null", "[]"):  # found by a damage check: a report without its state vouched for any change
        report.write_text(passed.replace('"state": {', f'"state": {state}, "was": {{', 1))
        with pytest.raises(
            StoreError, match=re.escape(f"validation.json has state {state}, not what validation wrote")
        ):
            HiddenStateDataset(root, version)
    report.write_text(json.dumps({**failed, "ok": True}))  # a failed report with only "ok" set to true: a damage
    with pytest.raises(StoreError, match="says ok but lists a check that did not pass .*it was edited"):
        HiddenStateDataset(root, version)  # check found it read (the wrong states it had refused, served)
    bad = {**json.loads(passed), "ok": False, "checks": "none"}  # an edited failed report: named, no traceback
    report.write_text(json.dumps(bad))
    with pytest.raises(StoreError, match="its validation failed"):
        HiddenStateDataset(root, version)

    report.write_text(passed)  # passed, but a unit changed since (e.g. rebuilt by an extract without validate)
    commit = root / version / "units/u00000/commit.json"
    commit.write_text(json.dumps({**json.loads(commit.read_text()), "by": "someone else"}))
    with pytest.raises(StoreError, match=r"changed since it passed validation \(units \['u00000'\] rewritten"):
        HiddenStateDataset(root, version)
    # a unit `verify --repair` discarded is named as such, not as rewritten (a fresh-user check read it so)
    (root / version / "units/u00000").rename(tmp_path / "discarded")
    with pytest.raises(StoreError, match=r"units \['u00000'\] discarded \(verify --repair\) or deleted: the next"):
        HiddenStateDataset(root, version)


def test_a_path_that_is_not_a_store_says_what_to_give(tmp_path):
    """The commonest slip: the run's output directory (or a typo) instead of its store."""
    (tmp_path / "run" / "store" / "v0001").mkdir(parents=True)
    with pytest.raises(StoreError, match=r"under .*/run \(did you mean .*/run/store\?\): give the store's path"):
        HiddenStateDataset(tmp_path / "run")
    with pytest.raises(StoreError, match=r"under .*/nope \(it does not exist\)"):
        HiddenStateDataset(tmp_path / "nope")


def test_an_array_no_record_covers_is_never_read(tmp_path):
    """Found by a damage check: in a version without `last_hidden`, a copy of a unit's `hidden` directory under
    that name appeared in the unit's items, bytes no commit record covers. The reader opens only the version's
    arrays."""
    from tests.helpers import extract_local

    ex = extract_local(tmp_path, {"data.max_samples": 6, "layers.capture_last": False}, validate=True)
    root = Path(ex.cfg.store)
    ds = HiddenStateDataset(root)
    keys = set(ds[0])
    unit = root / ex.plan.version / "units" / ds.samples[0].unit
    shutil.copytree(unit / "hidden", unit / "last_hidden")
    item = HiddenStateDataset(root)[0]
    assert "last_hidden" not in keys and set(item) == keys


def test_stray_files_beside_the_units_are_ignored_and_named(small_store, tmp_path, caplog):
    """Found by a damage check: a note left in plans/ read as the plan of a unit whose directory was missing, so
    readers and verify refused an intact store. Only the planner's names (u00000, ...) are units; a stray plan file
    or a backup copy of a unit directory is named in a warning and never read."""
    from dflash_pipeline.storage.verify import verify_version

    root = tmp_path / "store"
    shutil.copytree(small_store.store, root)
    version = small_store.plan.version
    want = [s.sample_id for s in HiddenStateDataset(root, version, unvalidated="warn").samples]
    unit = Store(root).units(version)[0]
    (root / version / "plans" / "notes.json").write_text('{"samples": [["x", 0, 5]]}')
    shutil.copytree(root / version / "units" / unit, root / version / "units" / f"{unit}.bak")
    with caplog.at_level("WARNING"):
        ds = HiddenStateDataset(root, version, unvalidated="warn")
    assert [s.sample_id for s in ds.samples] == want
    assert verify_version(Store(root), version).ok
    assert "plans/notes.json is not part of the store" in caplog.text and f"{unit}.bak is not part" in caplog.text
