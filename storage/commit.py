"""Atomic small-file writes on a local filesystem (the commit records and the CURRENT pointer), the
local store lock, the turn-taking lock of work that several runs may start at once, and the crash points
of the kill tests. storage/location.py uses these for local stores and has the object-storage counterparts.

A record is written to a temp file, fsynced, renamed over the old one and the directory fsynced: a
reader (or a process restarted after SIGKILL or power loss) sees either the old record or the new one,
never a torn one.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Test-only fault injection: "point:n" SIGKILLs this process at the n-th time `point` is reached.
# Used by the kill tests to crash at exact places (inside a forward, after a shard write, mid-commit).
# With DFLASH_KILL_ONCE=<file>, only the first process to get there dies (it creates the file), so a
# retried worker survives.
_KILL_ENV = "DFLASH_KILL_AT"
_hits: dict[str, int] = {}
_paused = 0


@contextmanager
def crash_points_off() -> Iterator[None]:
    """Crash points are neither counted nor fired inside (in every thread): the pre-flight plan's calibration
    runs the extraction code into a scratch store, which must not move a kill test's count."""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1


def crash_point(point: str) -> None:
    spec = os.environ.get(_KILL_ENV)
    if not spec or _paused:
        return
    name, _, n = spec.partition(":")
    if name != point:
        return
    _hits[point] = _hits.get(point, 0) + 1
    if _hits[point] == int(n or 1):
        import signal

        once = os.environ.get("DFLASH_KILL_ONCE")
        if once:
            try:
                open(once, "x").close()
            except FileExistsError:
                return

        os.kill(os.getpid(), signal.SIGKILL)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, before_rename: Callable[[], None] | None = None) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk keeps no half-written temp file (the caller reports the error)
        raise
    if before_rename:
        before_rename()
    os.replace(tmp, path)
    fsync_dir(path.parent)


def encode_json(obj: Any) -> bytes:
    """The bytes of a JSON record (commit.json)."""
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def remove_partials(directory: Path) -> int:
    """Delete orphan temp files left by a killed writer (ours and zarr's). Returns how many."""
    n = 0
    for p in Path(directory).rglob("*.partial"):
        p.unlink(missing_ok=True)
        n += 1
    return n


@contextmanager
def taking_turns(path: Path, waiting: str) -> Iterator[None]:
    """Hold an exclusive flock on `path`, waiting for whoever holds it (logging `waiting` once): for work that
    several runs may start at once and only one should do, the others then finding it done. flock dies with its
    process, so a killed holder never blocks the next."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s", waiting)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


@contextmanager
def exclusive_lock(path: Path, holder: str, busy: Callable[[str], Exception]) -> Iterator[None]:
    """Hold an exclusive flock on `path` (non-blocking), recording `holder` in the file for whoever finds
    it taken; `busy(recorded_holder)` is raised then. flock dies with its process: no stale locks."""
    import fcntl

    with open(path, "a+") as f:
        # An empty file under a taken lock is a holder between its flock and its write, or between its
        # truncate and its unlock: moments, so look again before naming no one (or missing a release).
        deadline = time.monotonic() + 1.0
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                f.seek(0)
                recorded = f.read().strip()
                if recorded or time.monotonic() >= deadline:
                    raise busy(recorded or "unknown") from None
                time.sleep(0.01)
        f.seek(0)
        f.truncate()
        try:
            os.write(f.fileno(), holder.encode())
        except OSError as e:  # a full disk: the flock is the lock, the text only names its holder
            log.warning("holding %s without naming the holder in it (%s)", path, e.strerror)
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()
            fcntl.flock(f, fcntl.LOCK_UN)
