"""Retention: deleting a store version's hidden states once training no longer needs them, never while a reader
holds a lease on it (storage/leases.py; docs/STORE.md, "Retention").

`retention.mode` (core/config.py): `keep` (the default: nothing is deleted), `after_export` (the version a
drafter was trained from, once that drafter is exported), `consumed` (each unit as soon as a saved training
checkpoint covers the last time the training reads it: drafter/retention.py decides when).

On disk, in the version directory:
- `retention.json`, the record (storage/retention_record.py reads and writes it): which units' data were deleted
  (or are being deleted), when, by whom, why,
  after which export or checkpoint, and how many bytes. Written only under the store lock. The version's
  attributes, version record and plan records stay, so readers and `verify` can say what happened, and a
  rerun of extract recreates exactly the deleted units from their plan records.
- `retention.pending/*.json`: deletions that are due but not done yet (a reader held a lease, or another run
  held the store lock); one file per request, so writing one needs no lock. The next retention step retries.
- `.leases/*.lease`: one file per live reader, locked with an exclusive flock for as long as the reader lives
  (a killed reader's lock dies with it, and its file is then removed as stale).

Deleting is crash-safe: (1) take the store lock, (2) no live lease of another reader, (3) mark the units
`deleting` in the record, (4) check the leases again (a reader that registered before the mark may still read:
undo the mark and keep the request), (5) delete each unit's directory, (6) mark them `deleted` with the bytes
freed. A reader registers its lease before it reads the record, so it either blocks the deletion or sees the
mark; a unit marked `deleting` or `deleted` is never read. A crash in (5) leaves `deleting`, which readers and
`verify` report as deleted and the next retention step (or a re-extraction) finishes.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from dflash_pipeline.errors import StoreError
from dflash_pipeline.storage.commit import crash_point
from dflash_pipeline.storage.leases import leases_line, live_leases, now_utc, who
from dflash_pipeline.storage.location import LocalLocation
from dflash_pipeline.storage.retention_record import (
    DELETED,
    DELETING,
    REEXTRACT,
    entries,
    mib,
    read_record,
    retired,
    version_retired,
    write_record,
)

if TYPE_CHECKING:
    from dflash_pipeline.storage.store import Store

log = logging.getLogger(__name__)
_requests = itertools.count()

PENDING_DIR = "retention.pending"
MODES = ("after_export", "consumed", "prune")


# ---- deleting ---------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one deletion attempt did."""

    version: str
    mode: str
    deleted: list[str] = field(default_factory=list)  # units whose directories were deleted now
    whole_version: bool = False
    bytes_deleted: int = 0
    bytes_freed: int = 0  # of those, bytes no other hard link still holds (a nightly snapshot shares files)
    skipped: str | None = None  # why the deletion that is due was not done
    note: str | None = None  # why nothing was due

    def line(self) -> str:
        if self.skipped:
            return f"{self.version}: deletion ({self.mode}) skipped: {self.skipped}"
        if self.note:
            return f"{self.version}: nothing deleted ({self.mode}): {self.note}"
        what = "all units" if self.whole_version else f"{len(self.deleted)} units"
        return (
            f"{self.version}: deleted {what} ({self.mode}): {mib(self.bytes_deleted)} deleted, "
            f"{mib(self.bytes_freed)} freed"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@contextmanager
def _store_lock(store: Store, held: bool) -> Iterator[str | None]:
    """The store lock (one writer per store), taken without waiting; yields None when held, else why not."""
    if held:
        yield None
        return
    stack = ExitStack()
    try:
        stack.enter_context(store.lock(brief="deleting retired hidden states"))
    except StoreError as e:
        if "in use by another run" not in str(e):
            raise
        yield str(e)
        return
    with stack:
        yield None


def _sizes(store: Store, rel: str) -> tuple[int, int]:
    """(bytes of the files below `rel`, bytes of those no other hard link holds)."""
    if not isinstance(store.loc, LocalLocation):
        n = sum(store.loc.list_files(rel).values())
        return n, n
    total = freed = 0
    for dirpath, _, names in os.walk(store.loc.root / rel):
        for name in names:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            total += st.st_size
            freed += st.st_size if st.st_nlink == 1 else 0
    return total, freed


def _delete_unit(store: Store, version: str, unit: str) -> tuple[int, int]:
    rel = f"{version}/units/{unit}"
    sizes = _sizes(store, rel)
    if isinstance(store.loc, LocalLocation) and not (store.loc.root / rel).is_symlink():
        # The group's zarr.json first: from then on nothing takes the leftovers for a unit. (A unit that is a link
        # to another disk: the link goes, in one step, and nothing it points to.)
        (store.loc.root / rel / "zarr.json").unlink(missing_ok=True)
    store.loc.rmtree(rel)
    crash_point("retention_unit_deleted")
    return sizes


def retire(
    store: Store,
    version: str,
    units: list[str] | None,
    entry: dict[str, Any],
    *,
    lock_held: bool = False,
    per_unit: dict[str, dict[str, Any]] | None = None,
) -> Outcome:
    """Delete the data of `units` of `version` (None: the whole version's) as the module docstring says, leaving
    the record. `entry`: {'mode', 'why', and what it was after: 'export' or 'checkpoint'/'step'}; `per_unit`:
    fields added to each unit's entry. Never deletes while another process holds a reader lease on the version
    or (unless `lock_held`, the caller holds it) the store lock: then returns an Outcome saying why."""
    mode = entry["mode"]
    out = Outcome(version, mode, whole_version=units is None)
    with _store_lock(store, lock_held) as busy:
        if busy:
            out.skipped = busy
            return out
        leases = live_leases(store, version)
        if leases:
            out.skipped = leases_line(leases)
            return out
        record = read_record(store, version)
        all_units = sorted(set(store.units(version)) | set(store.planned_units(version)))
        already = retired(record, all_units)
        doomed = all_units if units is None else [u for u in units if u not in already]
        if (units is None and (v := version_retired(record)) and v.get("state") == DELETED) or not doomed:
            out.note = "its data were deleted already" if already else "no units"
            return out
        stamp = {**entry, "state": DELETING, "at": now_utc(), "by": who()}
        if units is None:
            record["version"] = {**stamp, "units": len(doomed)}
        else:
            record.setdefault("units", {})
            for u in doomed:
                record["units"][u] = {**stamp, **(per_unit or {}).get(u, {})}
        write_record(store, version, record)
        crash_point("retention_marked")
        leases = live_leases(store, version)
        if leases:  # registered before the mark: it may read them. Nothing is deleted yet: undo the mark
            _unmark(store, version, units is None, doomed)
            out.skipped = leases_line(leases)
            return out
        out.deleted, out.bytes_deleted, out.bytes_freed = _finish(store, version, record, doomed, units is None)
    log.info("retention: %s", out.line())
    return out


def _unmark(store: Store, version: str, whole: bool, doomed: list[str], key: str = "version") -> None:
    record = read_record(store, version)
    if whole:
        record.pop(key, None)
    for u in doomed:
        (record.get("units") or {}).pop(u, None)
    write_record(store, version, record)


def _finish(
    store: Store, version: str, record: dict[str, Any], doomed: list[str], whole: bool
) -> tuple[list[str], int, int]:
    """Delete the marked units' directories and record them deleted; returns (units, bytes, bytes freed)."""
    total = freed = 0
    for u in doomed:
        t, f = _delete_unit(store, version, u)
        total, freed = total + t, freed + f
        if not whole:
            e = record["units"][u]
            e.update(
                state=DELETED, bytes_deleted=e.get("bytes_deleted", 0) + t, bytes_freed=e.get("bytes_freed", 0) + f
            )
    if whole:
        if isinstance(store.loc, LocalLocation):  # leftovers of units no plan record names
            for u in store.loc.list_dirs(f"{version}/units"):
                t, f = _delete_unit(store, version, u)
                total, freed = total + t, freed + f
        v = record["version"]
        v.update(
            state=DELETED, bytes_deleted=v.get("bytes_deleted", 0) + total, bytes_freed=v.get("bytes_freed", 0) + freed
        )
    record.setdefault("history", []).append(
        f"{now_utc()} {who()}: deleted {'the version' if whole else f'{len(doomed)} units'} ({mib(total)}, "
        f"{mib(freed)} freed)"
    )
    write_record(store, version, record)
    return doomed, total, freed


def retire_whole_version(store: Store, version: str, entry: dict[str, Any], lock_held: bool) -> Outcome:
    """Delete `version` entirely (pruning): marked first, like any retention deletion, so a reader that starts
    meanwhile sees the mark, and never while another process holds a lease on it."""
    out = Outcome(version, entry["mode"], whole_version=True)
    with _store_lock(store, lock_held) as busy:
        if busy:
            out.skipped = busy
            return out
        if leases := live_leases(store, version):
            out.skipped = leases_line(leases)
            return out
        record = read_record(store, version)
        record["prune"] = {**entry, "state": DELETING, "at": now_utc(), "by": who()}
        write_record(store, version, record)
        if leases := live_leases(store, version):
            _unmark(store, version, True, [], "prune")
            out.skipped = leases_line(leases)
            return out
        out.bytes_deleted, out.bytes_freed = _sizes(store, version)
        for u in store.loc.list_dirs(f"{version}/units"):  # the data first, the records last
            _delete_unit(store, version, u)
        store.loc.rmtree(version)
    return out


# ---- requests that wait, interrupted deletions ------------------------------------------------------------
def request(store: Store, version: str, units: list[str] | None, entry: dict[str, Any], blocked_by: str) -> str:
    """Record a deletion that is due but could not be done now (one file, no lock needed; the same deletion
    requested again updates its file); returns its path."""
    body = {**entry, "units": units, "requested_at": now_utc(), "by": who(), "blocked_by": blocked_by}
    same = ("mode", "units", "export", "training")
    existing = [
        n for n, req in pending_requests(store, version).items() if all(req.get(k) == body.get(k) for k in same)
    ]
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    name = existing[0] if existing else f"{stamp}-{socket.gethostname()}-{os.getpid()}-{next(_requests)}.json"
    rel = f"{version}/{PENDING_DIR}/{name}"
    store.loc.write_json_atomic(rel, body)
    return store.loc.url_of(rel)


def pending_requests(store: Store, version: str) -> dict[str, dict[str, Any]]:
    out = {}
    for f in sorted(store.loc.list_files(f"{version}/{PENDING_DIR}")):
        if f.endswith(".json") and "/" not in f and not f.startswith("."):
            try:
                out[f] = store.loc.read_json(f"{version}/{PENDING_DIR}/{f}")
            except ValueError:
                log.warning("ignoring unreadable retention request %s", f)
    return out


def sweep(store: Store, *, lock_held: bool = False, versions: list[str] | None = None) -> list[Outcome]:
    """Carry out what is due: finish interrupted deletions (`deleting` in a record) and the waiting requests of
    every version (or of `versions`). Never raises for a busy lock or a live lease: the Outcome says so."""
    outcomes = []
    with _store_lock(store, lock_held) as busy:
        for v in versions if versions is not None else store.versions():
            record = read_record(store, v)
            reqs = pending_requests(store, v)
            interrupted = [e for e in entries(record) if e.get("state") == DELETING]
            if not (reqs or interrupted):
                continue
            if busy:
                outcomes.append(Outcome(v, "sweep", skipped=busy))
                continue
            if interrupted:
                outcomes.append(_finish_interrupted(store, v, record))
            for name, req in reqs.items():
                units = req.pop("units", None)
                entry = {k: req[k] for k in req if k not in ("requested_at", "blocked_by")}
                entry["by_request"] = f"requested at {req.get('requested_at')} by {req.get('by')}"
                o = retire(store, v, units, entry, lock_held=True)
                outcomes.append(o)
                if o.skipped:
                    store.loc.write_json_atomic(
                        f"{v}/{PENDING_DIR}/{name}", {**req, "units": units, "blocked_by": o.skipped}
                    )
                else:
                    _remove_request(store, v, name)
    return outcomes


def _remove_request(store: Store, version: str, name: str) -> None:
    if isinstance(store.loc, LocalLocation):
        (store.loc.root / version / PENDING_DIR / name).unlink(missing_ok=True)
        try:
            (store.loc.root / version / PENDING_DIR).rmdir()
        except OSError:
            pass
    else:
        store.loc.rmtree(f"{version}/{PENDING_DIR}/{name}")


def _finish_interrupted(store: Store, version: str, record: dict[str, Any]) -> Outcome:
    """A deletion that stopped after its mark: its units are retired already; delete what is left of them once
    no other reader holds a lease (one that started before the mark may still read them)."""
    pruning = (record.get("prune") or {}).get("state") == DELETING
    whole = pruning or (record.get("version") or {}).get("state") == DELETING
    mode = "prune" if pruning else record["version"]["mode"] if whole else "interrupted"
    out = Outcome(version, mode, whole_version=whole)
    if leases := live_leases(store, version):
        out.skipped = leases_line(leases)
        return out
    if pruning:
        out.bytes_deleted, out.bytes_freed = _sizes(store, version)
        for u in store.loc.list_dirs(f"{version}/units"):
            _delete_unit(store, version, u)
        store.loc.rmtree(version)
        log.info("retention: finished pruning %s", version)
        return out
    doomed = [u for u, e in (record.get("units") or {}).items() if e.get("state") == DELETING]
    if whole:
        doomed = sorted(set(store.units(version)) | set(store.planned_units(version)))
    out.deleted, out.bytes_deleted, out.bytes_freed = _finish(store, version, record, doomed, whole)
    log.info("retention: finished an interrupted deletion: %s", out.line())
    return out


def restore_for_extraction(store: Store, version: str) -> list[str]:
    """Before the planner extracts `version` again (the caller holds the store lock): what is left of its retired
    units is removed and they leave the record (its history says so), so that the planner recreates them from
    their plan records. Returns those units."""
    record = read_record(store, version)
    all_units = sorted(set(store.units(version)) | set(store.planned_units(version)))
    gone = sorted(retired(record, all_units))
    if not gone:
        return []
    for u in gone:
        store.loc.rmtree(f"{version}/units/{u}")
    if version_retired(record):
        record.pop("version", None)
        record.pop("prune", None)
    for u in gone:
        (record.get("units") or {}).pop(u, None)
    record.setdefault("history", []).append(
        f"{now_utc()} {who()}: re-extracting {len(gone)} units whose data retention had deleted"
    )
    write_record(store, version, record)
    log.warning(
        "store version %s: %d units' data had been deleted by retention; extracting them again from their plan records",
        store.loc.url_of(version),
        len(gone),
    )
    return gone


def summary(store: Store, version: str) -> dict[str, Any]:
    """What retention deleted from `version` so far: {'units': deleted or being deleted, 'of': planned units,
    'bytes_deleted', 'bytes_freed', 'whole_version': bool, 'pending': waiting requests}."""
    record = read_record(store, version)
    all_units = sorted(set(store.units(version)) | set(store.planned_units(version)))
    return {
        "units": len(retired(record, all_units)),
        "of": len(all_units),
        "bytes_deleted": record.get("bytes_deleted", 0),
        "bytes_freed": record.get("bytes_freed", 0),
        "whole_version": version_retired(record) is not None,
        "pending": len(pending_requests(store, version)),
    }


@dataclass
class Report:
    """What the retention step of a run did (the `store-retention` artifact, a line of the run summary)."""

    mode: str
    version: str
    record: str  # where the version's record is
    outcome: Outcome | None = None
    request: str | None = None  # a deletion that waits, recorded here
    note: str | None = None  # why nothing was due
    swept: list[str] = field(default_factory=list)  # what waiting or interrupted deletions of any version did
    so_far: dict[str, Any] = field(default_factory=dict)  # summary() of the version afterwards

    @property
    def bytes_freed(self) -> int:
        return int(self.so_far.get("bytes_freed", 0))

    def line(self) -> str:
        head = f"retention {self.mode}: {self.version}"
        if self.outcome is not None and self.outcome.skipped:
            return (
                f"{head}: not deleted now: {self.outcome.skipped}; the deletion waits in {self.request} (the next "
                "run's retention step retries)"
            )
        s = self.so_far
        return (
            f"{head}: {s.get('units', 0)} of {s.get('of', 0)} units' data deleted so far "
            f"({mib(s.get('bytes_freed', 0))} freed)" + (f"; {self.note}" if self.note else "")
        )

    def to_markdown(self) -> str:
        s = self.so_far
        rows = [
            ("mode", f"`retention.mode={self.mode}`"),
            ("version", f"`{self.version}`"),
            ("this step", self.outcome.line() if self.outcome else self.note or "-"),
            (
                "the version so far",
                f"{s.get('units', 0)} of {s.get('of', 0)} units' data deleted; {mib(s.get('bytes_deleted', 0))} "
                f"deleted, {mib(s.get('bytes_freed', 0))} freed",
            ),
            ("record", f"`{self.record}`"),
        ]
        if self.request:
            rows.append(("waiting deletion", f"`{self.request}` (the next run's retention step retries)"))
        for line in self.swept:
            rows.append(("waiting / interrupted deletions", line))
        if s.get("units"):
            rows.append(("re-extract", REEXTRACT))
        body = "\n".join(f"| {k} | {v} |" for k, v in rows)
        return f"# Store retention\n\n| item | value |\n| --- | --- |\n{body}\n"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
