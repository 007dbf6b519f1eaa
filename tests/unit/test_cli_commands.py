"""What the CLI's commands say when they are given something slightly wrong: `--version` without a command, `verify`
on a version's directory, `verify` on a store whose first version a run is still writing, `verify --threads 0`;
and `show-config` with a config."""

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


def test_show_config_prints_what_a_config_and_overrides_make(tmp_path, capsys):
    """A fresh-user check: `show-config --config FILE` was refused, so the configuration a run would use could not be
    seen. It prints every field as --config and --set make it; a bad key is one line, exit 2."""
    from dflash_pipeline.config import defaults_yaml

    cfg = tmp_path / "mine.yaml"
    cfg.write_text("data:\n  max_samples: 12\n")
    assert main(["show-config", "--config", str(cfg), "--set", "train.epochs=3"]) == 0
    out = capsys.readouterr().out
    assert "  max_samples: 12\n" in out and "  epochs: 3.0\n" in out and out != defaults_yaml()
    assert main(["show-config"]) == 0 and capsys.readouterr().out == defaults_yaml()
    assert main(["show-config", "--set", "data.max_sample=1"]) == 2
    assert "did you mean data.max_samples?" in capsys.readouterr().err


def test_verify_threads_must_be_positive(capsys):
    with pytest.raises(SystemExit) as e:  # it was accepted silently
        main(["verify", "/nonexistent", "--threads", "0"])
    assert e.value.code == 2 and "--threads: 0 is not a positive number" in capsys.readouterr().err
