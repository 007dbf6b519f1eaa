"""A full or read-only filesystem under the store: one clear error naming the path and the space, no retries
that cannot help, a consistent store; with space again, a rerun completes it bit-identical to a clean run.

Runs on a real, small tmpfs (needs root or CAP_SYS_ADMIN to mount; skipped where mounting is not allowed)."""

from __future__ import annotations

import logging
import subprocess

import pytest

from dflash_pipeline.errors import StoreError
from dflash_pipeline.storage.store import Store
from dflash_pipeline.storage.verify import verify_version
from tests.helpers import assert_same_store, extract_local, snapshot
from tests.integration.test_integrity import SMALL  # the small_store fixture's run


@pytest.fixture
def tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2500k", "tmpfs", str(mnt)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a tmpfs here: {getattr(e, 'stderr', e)!r}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _remount(mnt, opts: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{opts}", str(mnt)], check=True)


def test_full_disk_stops_once_with_a_clear_message_and_resumes(small_store, tmpfs, tmp_path, caplog):
    """2.5 MB hold the first unit (1.7 MB of shards) but not the second. The pre-flight plan sees that and refuses
    to start (nothing written); with its documented override the extraction starts and the disk fills."""
    refused = {**SMALL, "store_path": str(tmpfs / "store")}
    with pytest.raises(StoreError, match=r"free space of the filesystem of .*plan.disk_check=false"):
        extract_local(tmp_path / "run", refused)
    assert not Store(tmpfs / "store").versions()
    overrides = {**refused, "extract.io_retries": 5, "plan.disk_check": False}
    with caplog.at_level(logging.WARNING), pytest.raises(StoreError) as exc:
        extract_local(tmp_path / "run", overrides)
    msg = str(exc.value)
    assert "no space left" in msg and str(tmpfs / "store") in msg, msg
    assert "MiB free there" in msg and "still needs up to" in msg, msg
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]  # no retry that cannot help
    store = Store(tmpfs / "store")
    version = store.versions()[0]
    assert not list((tmpfs / "store").rglob("*.partial"))  # no half-written temp file eats the space
    report = verify_version(store, version)
    assert report.damaged_units() == {}  # consistent: only unfinished work, nothing damaged
    assert any(p.kind == "incomplete" for p in report.problems)

    _remount(tmpfs, "size=8m")
    extract_local(tmp_path / "run", overrides)
    assert verify_version(store, version).ok
    assert_same_store(snapshot(Store(small_store.store), small_store.plan.version), snapshot(store, version))


def test_read_only_store_is_one_clear_error(tmpfs, tmp_path):
    _remount(tmpfs, "ro")
    with pytest.raises(StoreError, match=r"cannot be written \(Read-only file system\)"):
        extract_local(tmp_path / "run", {**SMALL, "data.max_samples": 4, "store_path": str(tmpfs / "store")})


def test_a_full_disk_under_a_finished_store_still_reads_and_verifies(small_store, tmpfs, capsys, caplog):
    """Found by a damage check: on a full disk the reader and `verify` crashed writing their lease (OSError, a
    leftover temp file), and `verify --repair` writing the lock's holder. They read without a lease (a warning, as
    on a read-only store) and hold the lock without its holder text."""
    import shutil

    from dflash_pipeline.cli import main as cli
    from dflash_pipeline.storage.reader import HiddenStateDataset

    _remount(tmpfs, "size=8m")
    root, version = tmpfs / "store", small_store.plan.version
    shutil.copytree(small_store.store, root)
    with open(tmpfs / "filler", "wb") as f:  # every free block
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError:
            pass
    with caplog.at_level(logging.WARNING):
        ds = HiddenStateDataset(root, version, unvalidated="warn")
        assert ds[0]["hidden"].abs().sum() > 0
    assert "without a reader lease (No space left on device)" in caplog.text
    assert not list((root / version).rglob("*.tmp"))  # no leftover temp lease file
    assert cli(["verify", str(root), "--version", version, "--unvalidated"]) == 0
    assert cli(["verify", str(root), "--version", version, "--unvalidated", "--repair"]) == 0
    assert "Traceback" not in capsys.readouterr().err
