"""Whether a store version is validated: what a validation vouches for (`validated_state`, recorded in
`<version>/validation.json` as `state`) and whether the version still is what it vouched for (`validation_status`).
Readers refuse a version that is not (docs/STORE.md, "Only validated versions are read by default"); the files'
own integrity is storage/verify.py's."""

from __future__ import annotations

from dflash_pipeline.errors import StoreError
from dflash_pipeline.progress import short
from dflash_pipeline.storage import digest, retention_record
from dflash_pipeline.storage.layout import VALIDATION, VERSION_RECORD
from dflash_pipeline.storage.store import Store

FAILED = "its validation failed"  # validation_status's clause for a report that failed (unvalidated_fix reads it)


def validated_state(store: Store, version: str) -> dict[str, str]:
    """What a validation vouches for: XXH3-128 of the version record and of each unit's commit record (which
    covers every file of the unit), as canonical JSON. Recorded in validation.json as `state`."""
    state = {"-": digest.of_attr(store.loc.read_json(f"{version}/{VERSION_RECORD}"))}
    for u in store.units(version):
        state[u] = digest.of_attr(store.loc.read_json(f"{version}/units/{u}/commit.json"))
    return state


def validation_status(store: Store, version: str) -> str | None:
    """None when `version` passed validation and has not changed since; otherwise why it is not validated, as a
    clause ("its validation failed: ...", "validation never ran on it", ...). A CURRENT version without
    validation.json whose version record lacks `validated_before_publishing` was published by a run that validated
    it before that report existed: validated."""
    try:
        rec = store.loc.read_json(f"{version}/{VALIDATION}")
        if rec is not None and not isinstance(rec, dict):
            raise ValueError(f"not a JSON object: {short(rec)}")
    except (ValueError, OSError) as e:
        return f"its validation report {VALIDATION} is unreadable ({e})"
    if rec is None:
        if store.current() != version:
            return "validation never ran on it (it has no validation.json)"
        flag = _publish_flag(store, version)
        if flag is True:
            return (
                f"its validation report {VALIDATION} is missing (a version of this kind becomes CURRENT only after "
                "passing validation, so the report was deleted, or CURRENT was set by hand to a version that never "
                "passed)"
            )
        if flag is not None:  # only true is ever written
            return f"{VERSION_RECORD}'s validated_before_publishing is {short(flag)}, not true: the record was edited"
        return None  # published before validation.json existed
    checks = rec.get("checks") if isinstance(rec.get("checks"), list) else []
    failed = [c for c in checks if not isinstance(c, dict) or c.get("ok") is not True]
    if rec.get("ok") is not True:
        first = (
            f": {failed[0].get('check')}: {failed[0].get('detail')}" if failed and isinstance(failed[0], dict) else ""
        )
        return f"{FAILED}{first}"
    if failed:  # validation writes ok = every check's ok
        return (
            f"its validation report {VALIDATION} says ok but lists a check that did not pass ({short(failed[0])}): "
            "it was edited; rerun the pipeline's validate stage"
        )
    state = rec.get("state")
    if (state is None and _publish_flag(store, version) is True) or not isinstance(state, dict | None):
        # (reports without a state predate the version record's flag: versions made since always have one)
        return f"its validation report {VALIDATION} has state {short(state)}, not what validation wrote: it was edited"
    if state is not None:
        try:
            now = validated_state(store, version)
        except (ValueError, OSError) as e:
            return f"its records cannot be read to compare with what validation checked ({e})"
        try:  # units whose data retention deleted on purpose are not a change (readers refuse or index them)
            gone = set(
                retention_record.retired(retention_record.read_record(store, version), sorted(set(now) | set(state)))
            )
        except StoreError:
            gone = set()
        changed = sorted(u for u in set(now) | set(state) if u not in gone and now.get(u) != state.get(u))
        if changed:
            units = [u for u in changed if u != "-"]
            gone_now = [u for u in units if u not in now]  # discarded by `verify --repair`, or deleted
            added = [u for u in units if u not in state]
            rewritten = [u for u in units if u in now and u in state]
            what = (
                (["the version record rewritten"] if "-" in changed else [])
                + ([f"units {rewritten} rewritten, extended or renamed (`dflash-pipeline verify` tells which)"]
                   if rewritten else [])
                + ([f"units {gone_now} discarded (verify --repair) or deleted: the next extract rebuilds them"]
                   if gone_now else [])
                + ([f"units {added} added"] if added else [])
            )  # fmt: skip
            return f"it changed since it passed validation ({'; '.join(what)})"
    return None


def _publish_flag(store: Store, version: str):
    """The version record's `validated_before_publishing` (None: no record, or a version made before the flag)."""
    try:
        record = store.version_record(version)
    except (ValueError, OSError):
        record = None
    return record.get("validated_before_publishing") if isinstance(record, dict) else None


def unvalidated_fix(store: Store, version: str, why: str) -> str:
    """What to do about a version that `validation_status` gave `why` for. A failed validation is not rerun as it
    is: validating the same bytes again fails the same way (a damage check followed such advice in a loop)."""
    anyway = (
        f"or read it anyway: `HiddenStateDataset(..., version={version!r}, unvalidated='warn')`, "
        "`dflash-pipeline verify --unvalidated`"
    )
    if why.startswith(FAILED):
        return (
            f"validating it again fails the same way: first do what the failed check says (every check is in "
            f"{store.loc.url_of(f'{version}/{VALIDATION}')}; a unit it names can be deleted: its plan record stays, "
            f"and the rerun extracts it again), then rerun the pipeline on {store.url} (extract and validate); "
            + anyway
        )
    return f"run the pipeline's validate stage on {store.url} (a run with extract and validate), {anyway}"
