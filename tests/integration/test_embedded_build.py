"""The embedded target is built once per machine, also when several runs start at once on a fresh one."""

from __future__ import annotations

import fcntl
import threading
import time

from dflash_pipeline.embedded.build import BUILD_VERSION, ensure_built


def test_a_run_that_finds_the_build_under_way_waits_and_reuses_it(tmp_path):
    """Before, a second run on a fresh machine built again and deleted the first run's finished build (which
    that run was already reading) to put its own in place."""
    root = tmp_path / "embedded" / BUILD_VERSION
    root.parent.mkdir(parents=True)
    got = []
    with open(root.parent / f".{root.name}.lock", "a") as held:  # another run is building
        fcntl.flock(held, fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: got.append(ensure_built(root)))
        waiter.start()
        time.sleep(1.0)
        assert waiter.is_alive() and not root.exists() and not list(root.parent.glob(".build-*"))
        root.mkdir()  # that run finishes: its build is in place
        (root / "marker").write_text("the first run's build")
        (root / "BUILD_OK").write_text(BUILD_VERSION)
    waiter.join(30)
    assert got == [root] and (root / "marker").read_text() == "the first run's build"
