"""Retention (storage/retention.py, drafter/retention.py) on real stores of the embedded target: each mode deletes
what it should and nothing else, never what a reader holds a lease on, leaves a record that readers and `verify`
turn into a clear error, survives a crash mid-delete, and a re-extraction restores the data bit for bit; a
training resumed after `consumed` deleted units replays the uninterrupted one exactly; the default changes
nothing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_pipeline import stages
from dflash_pipeline.cli import main as cli
from dflash_pipeline.drafter.export import load_drafter
from dflash_pipeline.drafter.retention import schedule, unit_index
from dflash_pipeline.errors import StoreError
from dflash_pipeline.order import LocalRunner, run_pipeline
from dflash_pipeline.storage import leases, retention, retention_record
from dflash_pipeline.storage.reader import HiddenStateDataset
from dflash_pipeline.storage.snapshot import snapshot as new_snapshot
from dflash_pipeline.storage.store import Store
from tests.helpers import assert_same_store, config, extract_local, snapshot

ROOT = Path(__file__).resolve().parents[2]
# 40 samples in ~8 units of one shard each: units are the unit of deletion.
STORE = {
    "data.max_samples": 40,
    "layers.preset": "explicit",
    "layers.ids": [1, 3],
    "extract.unit_tokens": 500,
}
# A tiny drafter: 2 epochs of 10 micro-batches, a checkpoint after every step (a few seconds on one core).
TRAIN = {
    "train.block_size": 8,
    "train.num_draft_layers": 1,
    "train.batch_size": 4,
    "train.epochs": 2,
    "train.lr": 3e-3,
    "train.warmup_ratio": 0.1,
    "train.anchors_per_sample": 16,
    "train.checkpoint_every": 1,
    "train.num_workers": 0,
    "train.device": "cpu",
    "retention.poll_s": 0.05,
}


@pytest.fixture(scope="module")
def source(model_dir, tmp_path_factory):
    """An extracted, validated and published store (prepared dataset and store under one output dir), never
    modified: tests copy it."""
    out = tmp_path_factory.mktemp("retention_src")
    ex = extract_local(out, STORE, validate=True)
    assert ex.validation.ok and Store(ex.store).current() == ex.plan.version
    assert len(Store(ex.store).units(ex.plan.version)) >= 6
    return out, ex.plan.version


def copy_run(source, dest: Path) -> tuple[Path, Store, str]:
    """A private copy of the source run, its version CURRENT (validated by the source's run)."""
    src, version = source
    shutil.copytree(src, dest)
    store = Store(dest / "store")
    assert store.current() == version
    return dest, store, version


def run_cfg(out: Path, mode: str = "keep", **extra):
    return config(out, {**STORE, **TRAIN, "stages": ["train"], "retention.mode": mode, **extra})


def listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def verify(store: Store, capsys, version: str | None = None) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli(["verify", store.url, *(["--version", version] if version else [])])
    return rc, capsys.readouterr().out


def test_default_keep_changes_nothing(source, tmp_path):
    out, store, version = copy_run(source, tmp_path / "run")
    before_files, before = listing(store.loc.root), snapshot(store, version)
    runner = LocalRunner()
    summary = run_pipeline(run_cfg(out), runner)
    assert summary.drafter and summary.retention is None and summary.bytes_freed is None
    assert "retain" not in runner.results
    assert listing(store.loc.root) == before_files  # not even a record, a lease file or an empty lease directory
    assert_same_store(snapshot(store, version), before)


def test_after_export_deletes_the_trained_version_only(source, tmp_path, capsys):
    out, store, version = copy_run(source, tmp_path / "run")
    shutil.copytree(store.loc.root / version, store.loc.root / "v0002")  # another version: must stay as it is
    other, units = snapshot(store, "v0002"), store.units(version)
    summary = run_pipeline(run_cfg(out, "after_export"), LocalRunner())
    assert summary.retention.startswith(f"retention after_export: {version}: {len(units)} of {len(units)} units")
    assert summary.bytes_freed > 0

    vdir = store.loc.root / version
    assert store.units(version) == [] and sorted(p.name for p in (vdir / "units").iterdir()) == ["zarr.json"]
    for kept in ("zarr.json", "version.json", "batching.json", "plans"):  # what re-extraction and messages need
        assert (vdir / kept).exists(), kept
    assert store.planned_units(version) == units
    record = json.loads((vdir / retention_record.RECORD).read_text())
    entry = record["version"]
    assert entry["mode"] == "after_export" and entry["state"] == "deleted" and entry["units"] == len(units)
    assert entry["export"]["path"] == summary.drafter and entry["export"]["store_version"] == version
    assert entry["export"]["weights"]["size"] == (Path(summary.drafter) / "model.safetensors").stat().st_size
    assert entry["by"].endswith(f"pid {os.getpid()}") and entry["at"] and "exported" in entry["why"]
    assert record["bytes_freed"] == summary.bytes_freed == entry["bytes_freed"]
    assert not (vdir / leases.LEASES).exists()  # the training's lease went with it
    assert_same_store(snapshot(store, "v0002"), other)
    assert load_drafter(summary.drafter) is not None

    # Reading it: a clear error (who, when, why, the export, how to re-extract), never a missing file or zeros.
    with pytest.raises(StoreError, match=r"hidden states were deleted by retention.mode=after_export") as e:
        HiddenStateDataset(store.url)
    assert summary.drafter in str(e.value) and "re-extract" in str(e.value) and entry["at"] in str(e.value)
    assert len(HiddenStateDataset(store.url, "v0002")) == 40
    rc, text = verify(store, capsys)
    assert rc == 1 and "deleted by retention.mode=after_export" in text and "re-extract" in text
    assert "its data were deleted by retention" in text.splitlines()[-1]

    # The finished training needs none of it: a rerun of the train stage resumes at its last step, exports again
    # and deletes nothing more.
    again = run_pipeline(run_cfg(out, "after_export"), LocalRunner())
    assert again.drafter == summary.drafter and again.retention == summary.retention
    assert retention_record.read_record(store, version)["version"]["at"] == entry["at"]


def test_a_reader_lease_keeps_current_until_the_reader_is_gone(source, tmp_path):
    """A live reader (in this process, then in another one) blocks the deletion of CURRENT: the retention step
    skips it naming the reader and leaves a request; the next one deletes it once the reader is gone, also when
    the reader was killed (its lease file stays, its flock does not). A reader that exits without close() leaves
    no lease file."""
    out, store, version = copy_run(source, tmp_path / "run")
    before = snapshot(store, version)
    cfg = run_cfg(out, "after_export")
    reader = HiddenStateDataset(store.url)  # CURRENT
    summary = run_pipeline(cfg, LocalRunner())
    assert "not deleted now: 1 reader lease(s) held: reading by" in summary.retention
    assert f"pid {os.getpid()}" in summary.retention and "waits in" in summary.retention
    assert_same_store(snapshot(store, version), before)
    assert reader[0]["hidden"].abs().sum() > 0  # still readable, all of it
    requests = retention.pending_requests(store, version)
    assert len(requests) == 1 and next(iter(requests.values()))["mode"] == "after_export"
    assert "version" not in retention_record.read_record(store, version)  # the mark was never made or was undone

    # DataLoader workers forked from the reader share its lease and do not drop it when they exit.
    loader = torch.utils.data.DataLoader(reader, batch_size=None, num_workers=2, multiprocessing_context="fork")
    assert sum(1 for _ in loader) == len(reader)
    assert len(leases.live_leases(store, version)) == 1
    reader.close()

    # A reader in another process that ends without close(), as the README's snippet does: no lease file left.
    code = (
        "import sys; from dflash_pipeline.storage.reader import HiddenStateDataset; "
        "ds = HiddenStateDataset(sys.argv[1]); item = ds[0]; ds.layer_ids, ds.attrs['model_path']"
    )
    subprocess.run([sys.executable, "-c", code, store.url], check=True, cwd=ROOT)
    assert not list((store.loc.root / version / leases.LEASES).glob("*.lease"))

    # A reader in another process, SIGKILLed: its lease file stays behind, but not its lock.
    code = (
        "import sys; from dflash_pipeline.storage.reader import HiddenStateDataset; "
        "d = HiddenStateDataset(sys.argv[1]); print('ready', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, store.url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT
    )
    assert proc.stdout.readline().strip() == b"ready"
    held = leases.live_leases(store, version)
    assert [x["pid"] for x in held] == [proc.pid] and held[0]["purpose"] == "reading"
    blocked = stages.retain(cfg, version, summary.drafter)
    assert f"pid {proc.pid}" in blocked.swept[0] and len(retention.pending_requests(store, version)) == 1
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list((store.loc.root / version / leases.LEASES).glob("*.lease"))  # stale file left behind
    done = stages.retain(cfg, version, summary.drafter)
    assert leases.live_leases(store, version) == [] and retention.pending_requests(store, version) == {}
    assert store.units(version) == [] and done.bytes_freed > 0
    assert retention_record.read_record(store, version)["version"]["by_request"].startswith("requested at")


def test_consumed_deletes_covered_units_and_a_resumed_training_replays_exactly(source, tmp_path, capsys):
    # The uninterrupted reference, with nothing deleted.
    ref_out, ref_store, version = copy_run(source, tmp_path / "ref")
    ref = stages.train(run_cfg(ref_out), LocalRunner().probe(run_cfg(ref_out)), version)

    out, store, _ = copy_run(source, tmp_path / "run")
    cfg = run_cfg(out, "consumed")
    report = stages.probe(cfg)
    unit_of, _ = unit_index(store.url, None, version)
    sch = schedule(unit_of, cfg.train, 1)
    assert sch.total == 20 and not sch.unread
    dues = sorted(set(sch.due.values()))
    stop_after = next(s for s in dues if any(d > s for d in sch.due.values()))  # some units due, some not
    covered = {u for u, d in sch.due.items() if d <= stop_after}
    assert covered and covered != set(sch.due)

    def crash(step, total, loss, tps):  # a crash right after step `stop_after`: its checkpoint is saved on the way
        if step == stop_after:  # out (drafter/runtime.LastStepKept), and nothing later is
            raise KeyboardInterrupt("crash")

    with pytest.raises(KeyboardInterrupt):
        stages.train(cfg, report, version, progress=crash)
    assert set(store.units(version)) == set(sch.due) - covered  # exactly what the checkpoint covers, no more
    record = retention_record.read_record(store, version)
    assert set(record["units"]) == covered
    for u in covered:
        e = record["units"][u]
        assert e["state"] == "deleted" and e["consumed_at_step"] == sch.due[u] <= e["step"] <= stop_after
        assert e["checkpoint"].endswith(f"step-{e['step']:08d}") and e["bytes_freed"] > 0
    with pytest.raises(StoreError, match="deleted by retention.mode=consumed"):
        HiddenStateDataset(store.url)  # a plain reader refuses a version with deleted units
    rc, text = verify(store, capsys)
    assert rc == 1 and f"{len(covered)} deleted by retention" in text

    # Resumed from the checkpoint: the same samples in the same order (deleted units stay in the training's
    # index), none of the deleted ones read, the same losses and weights as the uninterrupted run.
    resumed = stages.train(cfg, report, version)
    assert resumed.start_step == stop_after and resumed.steps == sch.total
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in ref.history]
    a, b = load_drafter(resumed.export_dir).state_dict(), load_drafter(ref.export_dir).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert store.units(version) == []  # the last checkpoint covers every unit
    kept = stages.retain(cfg, version, resumed.export_dir)
    assert kept.so_far["units"] == kept.so_far["of"] == len(sch.due) and kept.bytes_freed > 0
    assert ref_store.units(version) == sorted(sch.due)  # the reference store kept everything

    # A new training on what is left (another output dir) would need deleted units: refused before it starts.
    fresh = run_cfg(out, "consumed", **{"train.output_dir": str(tmp_path / "fresh")})
    with pytest.raises(StoreError, match=r"this training \(steps 0 to 20.*reads \d+ units whose data retention"):
        stages.train(fresh, report, version)


def test_crash_mid_delete_then_verify_finish_and_reextract(source, tmp_path, capsys):
    """SIGKILL after the first unit of an after_export deletion: the marked units read as deleted (reader,
    verify), the next retention step finishes the deletion, and rerunning extract restores every unit bit for
    bit from its plan record."""
    out, store, version = copy_run(source, tmp_path / "run")
    before = snapshot(store, version)
    code = (
        "import sys; from dflash_pipeline.storage import retention; from dflash_pipeline.storage.store import Store; "
        "retention.retire(Store(sys.argv[1]), sys.argv[2], None, {'mode': 'after_export', 'why': 'test'})"
    )
    env = {**os.environ, "DFLASH_KILL_AT": "retention_unit_deleted:1"}
    proc = subprocess.run([sys.executable, "-c", code, store.url, version], env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    entry = retention_record.read_record(store, version)["version"]
    assert entry["state"] == "deleting"
    assert 0 < len(store.units(version)) < len(before)  # half done
    with pytest.raises(StoreError, match="are being deleted"):
        HiddenStateDataset(store.url)
    rc, text = verify(store, capsys)
    assert rc == 1 and "are being deleted" in text

    done = retention.sweep(store)
    assert [o.whole_version for o in done] == [True] and done[0].deleted
    assert retention_record.read_record(store, version)["version"]["state"] == "deleted" and store.units(version) == []

    ex = extract_local(out, STORE)  # the same run again: the plan recreates the deleted units
    assert sorted(ex.plan.repaired_units) == sorted(before) and ex.result.tokens > 0
    assert_same_store(snapshot(store, version), before)
    record = retention_record.read_record(store, version)
    assert "version" not in record and "re-extracting" in record["history"][-1]
    assert verify(store, capsys)[0] == 0 and len(HiddenStateDataset(store.url)) == 40


def test_deleted_units_by_the_documented_rule_and_a_nightly_snapshot(source, tmp_path):
    """docs/STORE.md's rule with plain zarr (retention.json names the deleted units; the rest reads as before),
    and a nightly run's snapshot of the version, which shares only the units whose data are there."""
    import numpy as np
    import zarr

    out, store, version = copy_run(source, tmp_path / "run")
    units = store.units(version)
    full = HiddenStateDataset(store.url)
    want = {s.sample_id: full[i]["hidden"].numpy() for i, s in enumerate(full.samples) if s.unit not in units[:3]}
    full.close()
    gone = retention.retire(store, version, units[:3], {"mode": "consumed", "why": "test"})
    assert gone.deleted == units[:3] and gone.bytes_freed > 0

    root = store.url
    record = json.load(open(f"{root}/{version}/retention.json"))
    assert not any((record.get(k) or {}).get("state") in ("deleting", "deleted") for k in ("version", "prune"))
    deleted = {u for u, e in (record.get("units") or {}).items() if e["state"] in ("deleting", "deleted")}
    assert deleted == set(units[:3])
    seen = {}
    for name, unit in zarr.open_group(f"{root}/{version}", mode="r")["units"].groups():
        if name in deleted:
            continue
        for sid, start, length in unit.attrs["samples"]:
            seen[sid] = unit["hidden"][start : start + length]
    assert seen.keys() == want.keys() and all(np.array_equal(seen[k], want[k]) for k in want)

    new = new_snapshot(store, version)  # what a nightly run does to add new rows beside CURRENT
    assert store.units(new) == units[3:]
    assert retention_record.read_record(store, new) == {}


def test_prune_skips_a_version_with_a_reader(source, tmp_path):
    out, store, version = copy_run(source, tmp_path / "run")
    shutil.copytree(store.loc.root / version, store.loc.root / "v0002")
    store.set_current("v0002")
    with HiddenStateDataset(store.url, version):
        with store.lock():
            assert store.prune(1) == []
        assert store.units(version) and retention_record.read_record(store, version) == {}
    with store.lock():
        assert store.prune(1) == [version]
    assert store.versions() == ["v0002"]
