"""The store lock's holder text is written just after the flock is taken and cleared just before it is
released; a run that looks in those moments must neither name "unknown" nor miss a release."""

from __future__ import annotations

import fcntl
import threading
import time
from pathlib import Path

import pytest

from dflash_pipeline.storage.commit import exclusive_lock


class Busy(Exception):
    pass


def _hold_empty(path: Path, then) -> threading.Event:
    """Take the flock on `path` with no holder text (as a holder does for a moment), then after 0.2 s run
    `then(file)` in the holding thread."""
    taken = threading.Event()

    def run() -> None:
        with open(path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            taken.set()
            time.sleep(0.2)
            then(f)

    threading.Thread(target=run, daemon=True).start()
    assert taken.wait(5)
    return taken


def test_a_holder_that_names_itself_a_moment_late_is_named(tmp_path: Path) -> None:
    lock = tmp_path / ".lock"

    def name_then_hold(f) -> None:
        f.write("pid 7 on host (the other run)")
        f.flush()
        time.sleep(1.5)

    _hold_empty(lock, name_then_hold)
    with pytest.raises(Busy, match="the other run"), exclusive_lock(lock, "me", Busy):
        pass


def test_a_holder_releasing_after_clearing_its_name_is_waited_for(tmp_path: Path) -> None:
    lock = tmp_path / ".lock"
    _hold_empty(lock, lambda f: fcntl.flock(f, fcntl.LOCK_UN))
    with exclusive_lock(lock, "me", Busy):
        assert lock.read_text() == "me"
    assert lock.read_text() == ""
