"""What the CLI's commands say when they are given something slightly wrong: `--version` without a command, `verify`
on a version's directory, `verify` on a store whose first version a run is still writing."""

from __future__ import annotations

import pytest

from dflash_pipeline import __version__
from dflash_pipeline.cli import main


def test_version_prints_the_package_version(capsys):
    # it failed: argparse required a command
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"dflash-pipeline {__version__}"


def test_verify_of_a_version_directory_names_the_store_and_the_version(tmp_path, capsys):
    version = tmp_path / "store" / "v0001"
    version.mkdir(parents=True)
    (version / "zarr.json").write_text("{}")  # what makes a directory a store version
    assert main(["verify", str(version)]) == 2
    err = capsys.readouterr().err.strip()
    store = tmp_path / "store"
    assert err == f"error: {version} is a store version, not a store: did you mean {store} --version v0001?"


def test_verify_while_a_run_writes_the_first_version_says_so(tmp_path, capsys):
    """Before: 'no published version: CURRENT is missing' (or 'no store version under ...'), as if the store were
    broken. The run's lock is found as `verify --repair` finds it."""
    import os

    from dflash_pipeline.storage.store import Store

    store = tmp_path / "store"
    with Store(store).lock():  # a run between planning and publishing its version
        assert main(["verify", str(store)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: store {store} has no published version yet: a run (pid {os.getpid()} on "), err
    assert "is writing it; verify it once that run has validated and published a version" in err
    assert main(["verify", str(store)]) == 2  # the run is gone: the store's own state, as before
    assert "a run (" not in capsys.readouterr().err
