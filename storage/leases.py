"""Reader leases: a store version cannot be deleted (retention, pruning: storage/retention.py) while a process
reads it. Each live reader holds `<version>/.leases/<name>.lease` with an exclusive flock; a killed reader's lock
dies with it, and its file is then removed as stale (docs/STORE.md, "Retention")."""

from __future__ import annotations

import atexit
import getpass
import itertools
import json
import logging
import os
import socket
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_pipeline.storage.location import LocalLocation

if TYPE_CHECKING:
    from dflash_pipeline.storage.store import Store

log = logging.getLogger(__name__)

LEASES = ".leases"


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def who() -> str:
    """This process, for records and lease files: user, host and pid."""
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name (a container without passwd entry)
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()} pid {os.getpid()}"


_counter = itertools.count()
_warned_no_lease: set[str] = set()
_held: weakref.WeakSet[ReaderLease] = weakref.WeakSet()  # released at the interpreter's exit


@atexit.register
def _release_held() -> None:
    """A reader still referenced when the interpreter exits (a script's module-level dataset) gives its lease back
    here: garbage collection at shutdown may never reach it, and the file would stay behind (the lock does not)."""
    for lease in list(_held):
        try:
            lease.release()
        except Exception:  # noqa: BLE001 - best effort at exit; a leftover unlocked file is removed as stale
            pass


def _no_lease(vdir: Path, e: OSError) -> None:
    if str(vdir) not in _warned_no_lease:
        _warned_no_lease.add(str(vdir))
        log.warning(
            "reading %s without a reader lease (%s): retention and pruning cannot see this reader", vdir, e.strerror
        )


class ReaderLease:
    """A reader's claim on a store version: `<version>/.leases/<name>.lease`, held with an exclusive flock for
    as long as the reader lives. Deletions (retention, pruning) skip a version, or the units of one, while
    another process holds a lease on it. The file appears under its final name only once locked, so a lease
    file nobody holds belongs to a reader that died (it is removed as stale).

    `purpose`: "reading", or "training" (a training's reader; the training's own retention ignores its leases,
    see `live_leases`). Object storage has no leases (retention refuses s3:// stores). A local store this process
    cannot write (read-only permissions) is read without a lease, with a warning: deletions cannot see it.
    A process forked from the holder (a DataLoader worker) shares the lock and never releases it."""

    def __init__(self, store: Store, version: str, purpose: str = "reading"):
        self.path: Path | None = None
        self._fd: int | None = None
        self._pid = os.getpid()
        if not isinstance(store.loc, LocalLocation):
            return
        vdir = store.loc.root / version
        d = vdir / LEASES
        host = socket.gethostname()
        name = f"{host}.{os.getpid()}.{next(_counter)}.{purpose}.lease"
        info = {"purpose": purpose, "by": who(), "host": host, "pid": os.getpid(), "since": now_utc()}
        for _ in range(5):
            if not vdir.is_dir():
                return  # no such version: the reader says so
            tmp = d / f".{name}.tmp"
            try:
                d.mkdir(exist_ok=True)
                fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:  # the empty lease directory was removed meanwhile: again
                continue
            except OSError as e:
                _no_lease(vdir, e)
                return
            import fcntl

            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.write(fd, json.dumps(info).encode())
                os.rename(tmp, d / name)
            except OSError as e:  # a full disk (found by a damage check: the reader crashed on it)
                os.close(fd)
                tmp.unlink(missing_ok=True)
                _no_lease(vdir, e)
                return
            self._fd, self.path = fd, d / name
            _held.add(self)
            return

    @classmethod
    def detached(cls) -> ReaderLease:
        """No lease (a pickled copy of a reader in another process: its parent holds the lease)."""
        lease = cls.__new__(cls)
        lease.path, lease._fd, lease._pid = None, None, -1
        return lease

    def release(self) -> None:
        if self._fd is None or os.getpid() != self._pid:  # a forked copy never touches its parent's lease
            return
        fd, path, self._fd = self._fd, self.path, None
        _held.discard(self)
        try:
            path.unlink(missing_ok=True)
        finally:
            os.close(fd)  # releases the flock
        try:
            path.parent.rmdir()  # the last lease leaves no directory behind
        except OSError:
            pass

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - at interpreter exit; the lock dies with the process anyway
            pass


def _ancestors(pid: int) -> set[int]:
    """Process ids above `pid` (Linux /proc; empty where unavailable)."""
    out: set[int] = set()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def live_leases(store: Store, version: str, ignore_own_training: bool = True) -> list[dict[str, Any]]:
    """The leases on `version` held by live readers, as their lease files describe them; removes stale ones.
    `ignore_own_training`: leave out the leases of a training run by this process or a process it started (the
    training whose consumed units or export this process's retention deletes: it is done with them)."""
    if not isinstance(store.loc, LocalLocation):
        return []
    import fcntl

    d = store.loc.root / version / LEASES
    if (d.exists() or d.is_symlink()) and not d.is_dir():  # (a damage check: retention deleted under a live reader)
        # no reader can record a lease there, so none can be seen: whoever asks must assume one reads
        why = f"{d} is not a directory, so no reader can record its lease there: move it aside"
        return [{"purpose": "reading", "by": f"an unknown reader ({why})", "since": "an unknown time", "file": LEASES}]
    live = []
    for f in sorted(d.glob("*.lease")) if d.is_dir() else []:
        try:
            fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    info = json.loads(os.read(fd, 1 << 16) or b"{}")
                except ValueError:
                    info = {}
                info.setdefault("by", f"unknown reader ({f.name})")
                info["file"] = f.name
                own = (
                    info.get("purpose") == "training"
                    and info.get("host") == socket.gethostname()
                    and os.getpid() in _ancestors(int(info.get("pid", 0)))
                )
                if not (own and ignore_own_training):
                    live.append(info)
                continue
            log.info("removing stale reader lease %s (its reader is gone)", f)
            f.unlink(missing_ok=True)
        finally:
            os.close(fd)
    return live


def held_here() -> set[str]:
    """The names of the lease files this process holds."""
    return {lease.path.name for lease in list(_held) if lease.path is not None and lease._pid == os.getpid()}


def leases_line(leases: list[dict[str, Any]]) -> str:
    shown = "; ".join(f"{x.get('purpose', 'reading')} by {x.get('by')} since {x.get('since')}" for x in leases[:3])
    return f"{len(leases)} reader lease(s) held: {shown}{' ...' if len(leases) > 3 else ''}"
