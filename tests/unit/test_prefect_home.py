"""Prefect's home is made ready before the run's temporary server starts: a HOME that does not exist yet used to
fail inside the server's own process and surface only at its start-up timeout (two minutes); an impossible one is a
one-line error naming it at once."""

from __future__ import annotations

import time

import pytest

from dflash_pipeline.errors import ConfigError
from dflash_pipeline.preflight import prefect_home


def test_a_home_that_does_not_exist_yet_is_created(tmp_path, monkeypatch):
    home = tmp_path / "new-home" / ".prefect"
    monkeypatch.setenv("PREFECT_HOME", str(home))
    prefect_home()
    assert home.is_dir() and not list(home.iterdir())  # the write test leaves nothing behind


def test_an_impossible_home_is_one_error_naming_it_in_a_second(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PREFECT_HOME", str(blocker / ".prefect"))  # under a regular file: fails as root too
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"a-file/\.prefect .*cannot be written.*set PREFECT_HOME"):
        prefect_home()
    assert time.monotonic() - t0 < 1
