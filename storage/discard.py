"""Units `dflash-pipeline verify --repair` discards: taken out of the store in one step, and recorded in
`<version>/discarded.json` until a run rebuilds them from their plan records (so verify, readers and the run name
the repair, when and why, instead of calling the unit's directory missing). docs/STORE.md describes both."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_pipeline.errors import StoreError
from dflash_pipeline.storage.leases import held_here, leases_line, live_leases
from dflash_pipeline.storage.location import LocalLocation

if TYPE_CHECKING:
    from dflash_pipeline.storage.store import Store

log = logging.getLogger(__name__)
TRASH = ".discarded"  # <version>/.discarded/: units moved out of the store, until deleted
RECORD = "discarded.json"  # <version>/discarded.json: {unit: {"at", "why"}}
REPAIRS = "repairs.json"  # <version>/repairs.json: [{"at", "unit", "why"}], every discard as damaged, kept for good


def record(store: Store, version: str) -> dict[str, dict]:
    """{unit: {"at": UTC time, "why": the first problem}} of the units `verify --repair` discarded and no run has
    rebuilt yet ({} when none, or when the record is unreadable: it only explains a missing unit)."""
    try:
        rec = store.loc.read_json(f"{version}/{RECORD}", {})
    except (ValueError, OSError):  # (a directory in its place, unreadable: it explains nothing then)
        return {}
    return {u: e for u, e in rec.items() if isinstance(e, dict)} if isinstance(rec, dict) else {}


def repairs(store: Store, version: str) -> list[dict]:
    """Every unit discarded from `version` as damaged since it was made, oldest first ([] when none): unlike
    discarded.json, entries stay after the unit is rebuilt. A training compares their number with what it started
    from (drafter/train.py): data it may have read damaged were replaced since. An unreadable record raises
    StoreError naming it."""
    try:
        rec = store.loc.read_json(f"{version}/{REPAIRS}", [])
    except (ValueError, OSError) as e:
        rec = e
    if not isinstance(rec, list):
        raise StoreError(
            f"repair record {store.loc.url_of(f'{version}/{REPAIRS}')} is damaged ({rec}): it lists the units "
            "`verify --repair` discarded; restore it from a copy. Without one, delete it: a training of this "
            "version from before a repair is then resumed or reused as if none happened, so move such drafter "
            "directories aside by hand"
        )
    return rec


def note(store: Store, version: str, unit: str, why: str) -> None:
    rec = record(store, version)
    rec[unit] = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "why": why}
    store.loc.write_json_atomic(f"{version}/{RECORD}", rec)


def _repaired(store: Store, version: str, unit: str, why: str) -> None:
    """The unit is out of the store: kept in repairs.json for good (only then: a discard that failed discarded
    nothing, and must not move a training aside)."""
    entry = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "unit": unit, "why": why}
    store.loc.write_json_atomic(f"{version}/{REPAIRS}", [*repairs(store, version), entry])


def forget(store: Store, version: str, unit: str) -> None:
    """The unit is no longer discarded (rebuilt, or never moved out): its entry goes, well-formed or not (record()
    leaves out an edited one, which would otherwise stay for good)."""
    try:
        raw = store.loc.read_json(f"{version}/{RECORD}", {})
    except (ValueError, OSError):
        return
    if isinstance(raw, dict) and unit in raw:
        del raw[unit]
        store.loc.write_json_atomic(f"{version}/{RECORD}", {u: e for u, e in raw.items() if isinstance(e, dict)})


def refuse_while_read(store: Store, version: str, units: list[str], then: str) -> None:
    """Raise StoreError when another process holds a reader lease on `version`: deleting `units` would pull data
    from under it (a reader checks a unit's files when it first opens the unit, and zarr reads a file deleted
    since then as fill values). This process's own readers are the caller's to manage. `then`: what to run once
    the readers are gone."""
    own = held_here()  # (a training this process started counts: it may still read what would go)
    others = [x for x in live_leases(store, version, ignore_own_training=False) if x.get("file") not in own]
    if others:
        raise StoreError(
            f"unit(s) {', '.join(units)} of {store.loc.url_of(version)} must be deleted and rebuilt, but "
            f"{leases_line(others)}: nothing was deleted. Stop those readers (or let them finish), then {then}"
        )


def _rmtree(path: Path) -> list[str]:
    """Delete a directory tree as far as possible; 'file (error)' for each file that could not be deleted. A
    directory left only because something in it could not be deleted is not one more (a damage check: one
    immutable shard was "6 of its files", its five parent directories counted with it)."""
    errors: list[str] = []

    def failed(fn, p, exc) -> None:
        e = exc[1]
        if fn is os.rmdir and isinstance(e, OSError) and e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return  # (what it still holds is named)
        errors.append(f"{p} ({e!r})")

    shutil.rmtree(path, onerror=failed)
    return errors


def empty_trash(store: Store, version: str) -> None:
    """Delete what an earlier discard left in `<version>/.discarded/` (a repair killed while deleting a unit it had
    moved there, or files it could not delete then). Those units are out of the store already and never read, so
    their files only take space; one that still cannot be deleted is logged and left. Local stores only (object
    storage deletes in place)."""
    if not isinstance(store.loc, LocalLocation):
        return
    trash = Path(store.loc.url_of(f"{version}/{TRASH}"))
    if not trash.is_dir():
        return
    for entry in sorted(trash.iterdir()):
        if entry.is_symlink() or not entry.is_dir():
            entry.unlink(missing_ok=True)
        if errors := ([] if not entry.exists() else _rmtree(entry)):
            log.warning("could not delete %s, left by an earlier discard (%s): delete it by hand", entry, errors[0])
        else:
            log.info("deleted %s, left by an interrupted discard (its unit was out of the store already)", entry)
    with contextlib.suppress(OSError):
        trash.rmdir()  # empty now (else what could not be deleted stays, logged above)


def _check_places(store: Store, version: str, then: str) -> None:
    """Before anything is discarded: the records and the trash directory a discard writes are what they should be
    (a damage check: a directory in a record's place, or a file in the trash's, stopped a repair midway with a raw
    error or a permission's fix)."""
    if not isinstance(store.loc, LocalLocation):
        return
    for rel, should in ((RECORD, "a file"), (REPAIRS, "a file"), (TRASH, "a directory")):
        p = Path(store.loc.url_of(f"{version}/{rel}"))
        if (p.exists() or p.is_symlink()) and (p.is_dir() != (should == "a directory") or p.is_symlink()):
            raise StoreError(
                f"{p} should be {should} (a discard writes it); nothing was discarded: move it aside, then {then}"
            )


def discard_units(
    store: Store,
    version: str,
    units: list[str],
    why: dict[str, str] | None = None,
    then: str = "run `dflash-pipeline verify --repair` again",
) -> None:
    """Delete these units' directories, keeping their plan records: the next extraction of this version creates
    them again from the records and recomputes exactly their samples. `why` ({unit: problem}, from `verify
    --repair`): each unit is recorded in `<version>/discarded.json` until a run rebuilds it.

    A unit leaves the store in one step, so it is never half-deleted: a local unit directory is first renamed out
    of `units/` (to `<version>/.discarded/<unit>.<n>`), then deleted. A failure raises StoreError (one line: the
    file, the error, what state the unit is in). Nothing is discarded while another process reads the version
    (`refuse_while_read`; `then`: what to run once they are gone)."""
    refuse_while_read(store, version, units, then)
    _check_places(store, version, then)
    empty_trash(store, version)
    for u in units:
        rel = f"{version}/units/{u}"
        log.debug("discarding unit %s", store.loc.url_of(rel))
        if why is not None:  # recorded first: a unit out of the store is never unexplained
            note(store, version, u, why.get(u) or "damaged")
        if not isinstance(store.loc, LocalLocation):
            try:
                store.loc.rmtree(rel)
            except OSError as e:
                raise StoreError(
                    f"could not delete unit {store.loc.url_of(rel)} ({type(e).__name__}: {e}); delete it by hand, "
                    "then rerun extract to rebuild it from its plan record"
                ) from e
            if why is not None:
                _repaired(store, version, u, why.get(u) or "damaged")
            continue
        src = Path(store.loc.url_of(rel))
        if not src.exists() and not src.is_symlink():
            continue
        trash = Path(store.loc.url_of(f"{version}/{TRASH}"))
        dst = trash / f"{u}.{time.time_ns()}"
        try:
            trash.mkdir(exist_ok=True)
            os.rename(src, dst)
        except OSError as e:
            if why is not None:  # still in the store: not discarded
                forget(store, version, u)
            raise StoreError(
                f"could not discard unit {src}: {type(e).__name__}: {e}; nothing of it was deleted (fix the "
                "permission, e.g. `chattr -i` / `chmod u+w`, and run `dflash-pipeline verify --repair` again)"
            ) from e
        if why is not None:  # out of the store from here on
            _repaired(store, version, u, why.get(u) or "damaged")
        if dst.is_symlink() or not dst.is_dir():  # a unit linked from another disk: the link goes, never what it
            dst.unlink()  # points to; a file where the unit's directory was (damage) goes too
            continue
        errors = _rmtree(dst)
        if errors:
            raise StoreError(
                f"unit {u} was discarded (moved out of the store to {dst}, so a rerun of extract rebuilds it from "
                f"its plan record), but {len(errors)} of its files could not be deleted"
                f"{': ' if len(errors) == 1 else ', e.g. '}{errors[0]}: delete {dst} once they can be (e.g. after "
                "`chattr -i`)"
            )
