"""A nightly run's new version beside the published one: its complete units shared, not copied (docs/STORE.md,
"Versions"; storage/store.py's `open_version` makes one when an incremental run finds CURRENT)."""

from __future__ import annotations

import logging

from dflash_pipeline.errors import StoreError
from dflash_pipeline.storage import retention_record
from dflash_pipeline.storage.leases import now_utc
from dflash_pipeline.storage.store import Store

log = logging.getLogger(__name__)


def snapshot(store: Store, source: str) -> str:
    """A new version holding `source`'s complete units as hard links (no data copied; falls back to a
    copy across filesystems; server-side copies on object storage). Complete units are immutable, so
    sharing their files is safe. Units whose data retention deleted are not shared: their samples are
    planned (and extracted) again in the new version. A planned unit that is not shared otherwise (discarded
    by `verify --repair`, damaged, not complete) keeps its plan record in the new version, so the planner
    rebuilds it there from this run's dataset and, for rows changed or gone since, the prepared dataset it was made
    from; a snapshot never silently drops samples of the version it copies (a damage hunt found the nightly run
    publishing a version without a discarded unit's samples, which validation, checking this run's dataset, passed).
    Only a nightly run drops a unit that nothing on disk can rebuild, recorded in repairs.json (storage/planning.py),
    rather than stop every night the same way."""
    name = store.new_version_name()
    src_attrs = store.attrs(source)
    gone = retention_record.retired(retention_record.read_record(store, source), store.units(source))
    if gone:
        log.warning(
            "snapshot of %s: %d units' data were deleted by retention; their samples are extracted again",
            source,
            len(gone),
        )
    g = store.loc.open_group(name, mode="w-")
    g.attrs.update({**src_attrs, "created": now_utc(), "snapshot_of": source})
    g.create_group("units")
    store._write_version_record(name)
    shared = []
    for u in store.units(source):
        if u in gone:
            continue
        try:
            if store.commit_record(source, u).get("complete"):
                shared.append(u)
        except StoreError as e:  # not shared: rebuilt from its plan record in the snapshot (below)
            log.warning("snapshot of %s: unit %s not shared (%s)", source, u, e)
    for u in store.planned_units(source):  # every plan record but a retired unit's: the planner rebuilds from them
        if u in gone or (plan := store.loc.read_bytes(store._plan_rel(source, u))) is None:
            continue
        store.loc.write_atomic(store._plan_rel(name, u), plan)
        if u not in shared:
            log.warning("snapshot of %s: unit %s not shared (discarded or damaged): rebuilt from its plan", source, u)
    for u in shared:
        store.loc.copy_tree(store._unit_rel(source, u), store._unit_rel(name, u))
    log.info("snapshot %s -> %s (%d units shared)", source, name, len(shared))
    return name
