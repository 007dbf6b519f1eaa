"""A store version's retention record, `retention.json` (storage/retention.py deletes; this reads and writes the
record and says what it means): which units' hidden states retention deleted, or is deleting, when, by whom and
why, and the message readers, `verify` and validation give for them (docs/STORE.md, "Retention")."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from dflash_pipeline.errors import StoreError

if TYPE_CHECKING:
    from dflash_pipeline.storage.store import Store

RECORD = "retention.json"
PENDING, DELETING, DELETED = "pending", "deleting", "deleted"
RETIRED_STATES = (DELETING, DELETED)
HISTORY_KEPT = 50  # entries of the record's history kept

REEXTRACT = (
    "to read it again, re-extract it: run the pipeline on this store with the model, layers and dataset it was made "
    "from and stages that include extract and validate (e.g. `dflash-pipeline run --config <your config> --set "
    "'stages=[prepare,extract,validate]'`): the deleted units are recreated from their plan records and extracted "
    "again, bit for bit, then validated"
)


def read_record(store: Store, version: str) -> dict[str, Any]:
    """The version's retention record ({} when nothing was ever deleted from it)."""
    try:
        record = store.loc.read_json(f"{version}/{RECORD}")
    except ValueError as e:
        raise _damaged(store, version, str(e)) from e
    if record is None:
        return {}
    if problem := _record_problem(record):  # (a damage check: an edited record was an AttributeError)
        raise _damaged(store, version, problem)
    return record


def _record_problem(record: Any) -> str | None:
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    for k in ("version", "prune"):
        if record.get(k) is not None and not isinstance(record[k], dict):
            return f'"{k}" is {json.dumps(record[k])}, not an object'
    units = record.get("units")
    if units is not None and not isinstance(units, dict):
        return f'"units" is a JSON {type(units).__name__}, not an object of unit entries'
    bad = next((u for u, e in (units or {}).items() if not isinstance(e, dict)), None)
    return None if bad is None else f'"units"."{bad}" is {json.dumps(units[bad])}, not an object'


def _damaged(store: Store, version: str, problem: str) -> StoreError:
    return StoreError(
        f"retention record {store.loc.url_of(f'{version}/{RECORD}')} is damaged ({problem}): it says which units' "
        "data retention deleted, so nothing of this version is read until it is fixed. Restore it from a copy; "
        "without one, delete it: units whose data are gone are then reported missing by `dflash-pipeline verify` "
        "and readers (never read as zeros)"
    )


def write_record(store: Store, version: str, record: dict[str, Any]) -> None:
    record["format"] = 1
    record["bytes_deleted"] = sum(e.get("bytes_deleted", 0) for e in entries(record))
    record["bytes_freed"] = sum(e.get("bytes_freed", 0) for e in entries(record))
    record["history"] = record.get("history", [])[-HISTORY_KEPT:]
    store.loc.write_json_atomic(f"{version}/{RECORD}", record)


def entries(record: dict[str, Any]) -> list[dict[str, Any]]:
    whole = [record[k] for k in ("version", "prune") if record.get(k)]
    return whole + list((record.get("units") or {}).values())


def version_retired(record: dict[str, Any]) -> dict[str, Any] | None:
    """The version-wide entry when the whole version's data were deleted or are being deleted (retention after
    an export, or pruning under way)."""
    for k in ("prune", "version"):
        v = record.get(k)
        if v and v.get("state") in RETIRED_STATES:
            return v
    return None


def retired(record: dict[str, Any], units: list[str]) -> dict[str, dict[str, Any]]:
    """{unit: its retention entry} of the units among `units` whose data were deleted or are being deleted (a
    version-wide entry covers them all): never to be read."""
    v = version_retired(record)
    out = {}
    for u in units:
        e = (record.get("units") or {}).get(u)
        if v:
            out[u] = v
        elif e and e.get("state") in RETIRED_STATES:
            out[u] = e
    return out


def mib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def describe(
    store: Store, version: str, entry: dict[str, Any], units: list[str] | None = None, hint: bool = True
) -> str:
    """The message for a reader, `verify` or validation: what was deleted, when, by whom, why, and (`hint`) how
    to get it back. `units`: the units concerned (None: the whole version)."""
    where = store.loc.url_of(version)
    if units is None:
        what = f"store version {where}: its hidden states"
    elif len(units) == 1:
        what = f"store version {where}: unit {units[0]}'s hidden states"
    else:
        shown = ", ".join(units[:4]) + (", ..." if len(units) > 4 else "")
        what = f"store version {where}: the hidden states of {len(units)} units ({shown})"
    how = {
        "after_export": "after the export of a drafter trained from them",
        "consumed": "once the training had consumed them",
        "prune": "by extract.keep_versions",
    }.get(entry.get("mode"), "")
    if entry.get("state") == DELETED:
        state = "were deleted"
    else:
        state = "are being deleted (the deletion was interrupted or is under way; the next retention step finishes it)"
    export = entry.get("export") or {}
    after = f" (export {export['path']})" if export.get("path") else ""
    if entry.get("checkpoint"):
        after = f" (checkpoint {entry['checkpoint']})"
    by = "pruning" if entry.get("mode") == "prune" else f"retention.mode={entry.get('mode')}"
    return f"{what} {state} by {by} {how}{after} at {entry.get('at')} by {entry.get('by')}: {entry.get('why')}" + (
        f". Nothing of them can be read; {REEXTRACT}" if hint else ""
    )
