"""What a nightly run (extract.new_version) does first with a version whose validation failed: heal it, so that the
run extends it, deleting only what cannot be trusted (docs/OPERATIONS.md, "The nightly run and its data")."""

from __future__ import annotations

import logging

from dflash_pipeline.progress import counted
from dflash_pipeline.storage.discard import discard_units
from dflash_pipeline.storage.plan_records import rebuild_plan_records
from dflash_pipeline.storage.store import Store
from dflash_pipeline.storage.verify import verify_version

log = logging.getLogger(__name__)


def heal_failed_versions(store: Store) -> list[str]:
    """Before a nightly run (extract.new_version) plans: the newest version of an identity, newer than CURRENT (any,
    while nothing is published), whose validation failed (or whose validation record cannot be read) is healed, so
    that this run extends it, never deleting what can be kept (damage hunts found a whole version deleted for one
    flipped byte, for one non-finite value, for a hand-edited record):
    - units whose bytes differ from their commit records (a disk's damage, or a unit a snapshot shared from a
      damaged CURRENT) are discarded as `verify --repair` would, and extracted again by this run;
    - with the bytes intact, units whose stored states failed a values check that names them (non-finite or
      all-zero rows) are discarded and extracted again too;
    - with the bytes intact, states that failed a check no unit is named by (unequal to a fresh forward, per-layer
      statistics out of range) are not to be trusted anywhere: the version is deleted and the night starts again
      from CURRENT;
    - any other failure (or none recorded) is left to this run's validation, which names it again.
    CURRENT, when it failed a later validation, is healed the same way in a new version made from it (CURRENT's own
    files never change). Older failed versions (a newer one of their identity exists) are left to pruning.
    Returns the versions deleted."""
    current, versions = store.current(), store.versions()
    newer = versions[versions.index(current) + 1 :] if current in versions else versions
    inherited: dict[str, list[dict]] = {}
    if current in versions and store.resumable(current) and (failed := _failed_checks(store, current)) is not None:
        # CURRENT itself failed a later validation (a night with no new rows validates it in place): its readers are
        # refused until a validated version replaces it. A new version made from it (its units shared) is healed
        # instead: CURRENT's files are never changed (a fresh-user check: every such night failed the same way).
        from dflash_pipeline.storage.snapshot import snapshot

        made = snapshot(store, current)
        log.warning(
            "the published version %s failed validation (%s): this run heals %s, a new version sharing its units",
            current, ", ".join(str(c.get("check")) for c in failed) or "no check recorded", made,
        )  # fmt: skip
        inherited[made] = failed
        newer = [*newer, made]
    deleted = []
    for v in newer:
        failed = inherited.get(v, _failed_checks(store, v))
        if failed is None or not store.resumable(v):
            continue
        report = verify_version(store, v)
        for line in rebuild_plan_records(store, report):
            log.warning("store version %s: %s", v, line)
        names = ", ".join(str(c.get("check")) for c in failed) or "no check recorded"
        then = "run the nightly run again: it repairs the version first"
        if report.damaged_units() and not report.attributes_vouched:
            log.warning(
                "store version %s failed validation (%s) and its version record is damaged: this run restores the "
                "record, and the next nightly run (or `dflash-pipeline verify --version %s --repair`) discards the "
                "damaged units %s",
                v, names, v, ", ".join(sorted(report.damaged_units())),
            )  # fmt: skip
            continue
        if damaged := report.damaged_units():
            discard_units(store, v, sorted(damaged), {u: why[0] for u, why in damaged.items()}, then)
            log.warning(
                "store version %s failed validation (%s): %s discarded (%s), extracted again by this run, which "
                "extends the version", v, names, counted(len(damaged), "damaged unit"), ", ".join(sorted(damaged)),
            )  # fmt: skip
            continue
        states = [c for c in failed if c.get("states")]
        named = sorted({u for c in states for u in c.get("units") or []} & set(store.units(v)))
        if states and all(c.get("units") for c in states) and named:
            discard_units(store, v, named, {u: f"its states failed validation ({names})" for u in named}, then)
            log.warning(
                "store version %s failed validation (%s): %s with such states discarded (%s), extracted again by "
                "this run, which extends the version", v, names, counted(len(named), "unit"), ", ".join(named),
            )  # fmt: skip
        elif states:
            log.warning(
                "discarding store version %s: its stored states failed validation (%s) with its bytes intact, so "
                "none of them is trusted; this run starts again from %s", v, names, current or "an empty store",
            )  # fmt: skip
            store.delete_version(v)
            deleted.append(v)
        else:
            log.warning(
                "store version %s failed validation (%s) with its bytes intact: this run extends it and validates it "
                "again", v, names,
            )  # fmt: skip
    return deleted


def _failed_checks(store: Store, version: str) -> list[dict] | None:
    """The failed checks of `version`'s validation record ([] when it failed naming none, or cannot be read: a
    record a byte or an editor damaged); None when it passed or never ran."""
    try:
        record = store.loc.read_json(f"{version}/validation.json")
    except (OSError, ValueError):
        return []
    if record is None or (isinstance(record, dict) and record.get("ok") is not False):
        return None
    checks = record.get("checks") if isinstance(record, dict) else None
    return [c for c in checks if isinstance(c, dict) and c.get("ok") is False] if isinstance(checks, list) else []
