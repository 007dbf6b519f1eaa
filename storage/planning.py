"""Planning a store version's units: each new sample is assigned to a unit (a consecutive run of the prepared
order, stored longest-first), and each unit is created empty from its plan: arrays, ids, mask, attributes and the
plan record, marked `planned` last. Before that the planner removes what an interrupted planner left (half-planned
units) and rebuilds damaged units from their plan records under their names (docs/STORE.md, "Repair"). Only the
flow's driver plans (extraction/plan.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from dflash_pipeline.errors import StoreError
from dflash_pipeline.progress import counted
from dflash_pipeline.storage import discard, quant, retention
from dflash_pipeline.storage.layout import COMPRESSIONS, DTYPES, chunking, compressors, sharded_arrays
from dflash_pipeline.storage.leases import now_utc
from dflash_pipeline.storage.location import resource_error
from dflash_pipeline.storage.store import PLANNED_KEYS, PlanResult, Store, UnitInfo

log = logging.getLogger(__name__)


def plan_units(
    store: Store,
    version: str,
    sample_ids: list[str],
    lengths: list[int],
    fetch: Callable[[list[int]], tuple[list, list]],
    unit_tokens: int,
    chunk_mib: float,
    shard_mib: float,
    compression: str,
    made_from: Callable[[list[str]], tuple[dict[str, tuple[list, list]], list[str]]] | None = None,
    drop_lost: bool = False,
) -> PlanResult:
    """Create unit groups for samples not yet in any unit of this version.

    `fetch(rows)` returns (input_ids, loss_masks) of those prepared rows. A unit to be rebuilt that holds samples
    this run's prepared dataset lacks (their rows changed or disappeared since) is rebuilt from `made_from(ids)`:
    ({sample id: (ids, mask)} found in the prepared datasets the version was made from, digests and content hashes
    checked; why the others could not be used); failing that, with `drop_lost` (a nightly run), the unit is dropped
    from the version and the samples of it this run's dataset holds are planned again into new units; otherwise the
    run stops, naming them.
    A unit is planned only once its `planned` attribute is written (last); a unit group without it
    (the planner was killed) is removed and planned again. Units are consecutive runs of the
    prepared order, stored longest-first (batches of similar length; OOM shows up at once).
    """
    attrs = store.attrs(version)
    restored = retention.restore_for_extraction(store, version)  # units whose data retention deleted: planned again
    discard.empty_trash(store, version)  # what a killed `verify --repair` left half-deleted
    if not store.loc.exists(f"{version}/units/zarr.json"):  # readers using plain zarr list units through it
        store.loc.open_group(f"{version}/units", mode="a")
        log.warning("store version %s: restored units/zarr.json (the units group's metadata was missing)", version)
    for u in store.units(version):
        if not _half_planned(store, version, u):
            continue
        log.warning("removing half-planned unit %s", u)
        store.loc.rmtree(store._unit_rel(version, u))
        store.loc.rmtree(store._plan_rel(version, u))
    row_of = {sid: i for i, sid in enumerate(sample_ids)}
    repaired = _repair_units(
        store, version, attrs, row_of, lengths, fetch, compression, set(restored), made_from, drop_lost
    )
    assigned: set[str] = set()
    for u in store.units(version):
        assigned.update(s[0] for s in store.unit_attrs(version, u)["samples"])
    for u in store.planned_units(version):  # a unit no repair touches (a duplicate pair) keeps its samples
        try:
            assigned.update(s[0] for s in (store.plan_record(version, u) or {}).get("samples") or [])
        except ValueError:  # an unreadable plan record: verify and validation name it
            pass
    todo = [i for i, s in enumerate(sample_ids) if s not in assigned]
    groups: list[list[int]] = []
    cur, cur_tokens = [], 0
    for i in todo:
        if cur and cur_tokens + lengths[i] > unit_tokens:
            groups.append(cur)
            cur, cur_tokens = [], 0
        cur.append(i)
        cur_tokens += lengths[i]
    if cur:
        groups.append(cur)

    existing = store.units(version)
    next_no = int(existing[-1][1:]) + 1 if existing else 0
    k, hidden, logical = len(attrs["layer_ids"]), attrs["hidden_size"], attrs["logical_dtype"]
    precision = quant.scheme(attrs)
    new_units = []
    row, stored = quant.row_shapes(precision, DTYPES[logical][0], k, hidden)["hidden"]
    for gi, members in enumerate(groups):
        order = sorted(members, key=lambda i: (-lengths[i], i))
        name = f"u{next_no + gi:05d}"
        n_tokens = sum(lengths[i] for i in order)
        chunk, shard = chunking(int(np.prod(row)) * stored.itemsize, chunk_mib, shard_mib, n_tokens)
        starts = np.cumsum([0] + [lengths[i] for i in order])[:-1]
        plan = {
            "samples": [[sample_ids[i], int(st), int(lengths[i])] for i, st in zip(order, starts)],
            "n_tokens": n_tokens,
            "shard_tokens": shard,
            "chunk_tokens": chunk,
            "logical_dtype": logical,
            "compression": compression,
        }
        _create_unit(store, version, name, plan, order, fetch, k, hidden, attrs.get("capture_last", False), precision)
        new_units.append(UnitInfo(name, len(order), n_tokens))
    pending = [
        store.unit_info(version, u) for u in store.units(version) if not store.commit_record(version, u).get("complete")
    ]
    return PlanResult(
        version, store.loc.url_of(version), new_units, pending, len(store.units(version)), len(todo), repaired
    )


def _half_planned(store: Store, version: str, unit: str) -> bool:
    """The planner was killed before it marked the unit planned (its last step): no commit record, and its
    attributes readable without `planned`. An unreadable zarr.json, or `planned` altered in a unit with a
    commit record, is damage instead: `_repair_units` rebuilds the unit from its plan record."""
    if store.loc.exists(f"{store._unit_rel(version, unit)}/commit.json"):
        return False
    try:
        return not store.unit_attrs(version, unit).get("planned")
    except Exception:  # noqa: BLE001 - unreadable metadata: the repair rebuilds it from its plan record, if any
        return not store.loc.exists(store._plan_rel(version, unit))


def _repair_units(
    store: Store,
    version,
    attrs,
    row_of,
    lengths,
    fetch,
    compression,
    restored=frozenset(),
    made_from=None,
    drop_lost=False,
) -> list[str]:
    """Units that fail the cheap verification (a committed file missing or of the wrong size, attributes
    that differ from the plan record, a unit directory missing) are discarded and created again from their
    plan record: same name, same samples in the same order, same chunking, so their extraction recomputes
    exactly those samples, bit for bit. A plan record that the unit's committed attributes contradict (their
    zarr.json equals its commit record's digest) is the damaged one: it is rewritten from them and the unit
    is not touched. Units that verify are not touched; a unit without commit record is unfinished work, which
    its writer starts over. Content digests are checked by `dflash-pipeline verify --repair`, which discards
    units whose bytes differ; this then recreates them too, as the units whose data retention deleted
    (`restored`). A unit holding samples this run's dataset lacks is rebuilt from the prepared datasets it was made
    from, else dropped (`drop_lost`), else the run stops naming them (plan_units)."""
    from dflash_pipeline.storage.misplaced import move_back_commands
    from dflash_pipeline.storage.plan_records import rebuild_plan_records, unusable_plan
    from dflash_pipeline.storage.verify import verify_version

    report = verify_version(store, version, digests=False)
    if report.misplaced:  # (rewriting their plan records would reorder the version: storage/misplaced.py)
        raise StoreError(
            f"store version {store.loc.url_of(version)}: {len(report.misplaced)} intact unit directories are under "
            f"another unit's name ({', '.join(f'{u} holds {h}' for u, h in sorted(report.misplaced.items()))}): "
            f"move them back, then rerun: {move_back_commands(store, version, report.misplaced)}"
        )
    for line in rebuild_plan_records(store, report):
        log.warning("store version %s: %s", store.loc.url_of(version), line)
    damaged = report.units_to_rebuild()
    discarded = discard.record(store, version)
    if present := [u for u in sorted(damaged) if store.loc.exists(store._unit_rel(version, u))]:
        discard.refuse_while_read(store, version, present, "rerun to rebuild them")
    dropped: set[str] = set()
    for u, problems in damaged.items():
        unit_url = store.loc.url_of(store._unit_rel(version, u))
        try:
            plan = store.plan_record(version, u)
        except ValueError:
            plan = None
        if not isinstance(plan, dict) or not all(k in plan for k in PLANNED_KEYS):
            if drop_lost:
                _drop_unit(store, version, u, problems[0], "it has no intact plan record to rebuild it from")
                dropped.add(u)
                continue
            raise StoreError(
                f"unit {unit_url} is damaged ({problems[0]}) and has no intact plan record to rebuild it from: "
                "delete its directory and its plan record, and rerun to plan its samples again into a new unit"
            )
        if why := unusable_plan(plan, attrs.get("logical_dtype")):
            if drop_lost:
                _drop_unit(store, version, u, problems[0], f"its plan record cannot rebuild it ({why})", plan, row_of)
                dropped.add(u)
                continue
            raise StoreError(
                f"unit {unit_url} needs rebuilding, and its plan record {store._plan_rel(version, u)} cannot rebuild "
                f"it ({why}): it was edited or damaged. Delete the plan record (and the unit's directory, if any) "
                "and rerun: its samples are planned again into a new unit"
            )
        foreign = [sid for sid, _, _ in plan["samples"] if sid not in row_of]
        rows, length, unit_fetch = row_of, lengths.__getitem__, fetch
        if foreign:
            found, why = made_from(foreign) if made_from is not None else ({}, [])
            lost = [sid for sid in foreign if sid not in found]
            if lost and drop_lost:
                lost_why = (
                    f"{counted(len(lost), 'sample')} of it {'is' if len(lost) == 1 else 'are'} of rows changed or "
                    f"gone since, in no prepared dataset on disk it was made from ({'; '.join(why) or 'none recorded'})"
                )
                _drop_unit(store, version, u, problems[0], lost_why, plan, row_of)
                dropped.add(u)
                continue
            if lost:
                fps = attrs.get("dataset_fingerprints") or []
                raise StoreError(
                    f"unit {unit_url} is damaged ({problems[0]}) and holds {counted(len(lost), 'sample')} not in this "
                    f"run's prepared dataset (e.g. {lost[0]}), nor in a prepared dataset it was made from "
                    f"({'; '.join(why) or 'none looked at'}); rerun with the dataset it was made from "
                    f"(one of the version's dataset_fingerprints: {', '.join(fps)}) to repair it"
                )
            log.info(
                "unit %s holds %s of rows changed or gone since: rebuilt from the prepared dataset it was made from",
                unit_url,
                counted(len(foreign), "sample"),
            )
            rows, length, unit_fetch = _with_rows(row_of, lengths, fetch, found)
        wrong = [(sid, n, length(rows[sid])) for sid, _, n in plan["samples"] if length(rows[sid]) != n]
        if wrong:
            sid, n, m = wrong[0]
            if drop_lost:
                differs = f"its plan record contradicts the prepared dataset (sample {sid}: {n} tokens, {m} prepared)"
                _drop_unit(store, version, u, problems[0], differs, plan, row_of)
                dropped.add(u)
                continue
            raise StoreError(
                f"unit {unit_url} is damaged ({problems[0]}) and its plan record {store._plan_rel(version, u)} "
                f"contradicts the prepared dataset (sample {sid}: {n} tokens in the record, {m} prepared; "
                f"{len(wrong)} such samples), so it cannot be rebuilt from it: delete the unit's directory and "
                "its plan record, and rerun to plan those samples again into a new unit"
            )
        if u in restored:  # (said once for all of them by restore_for_extraction)
            log.info("unit %s: its data were deleted by retention: extracting its samples again", unit_url)
        elif u in discarded and not store.loc.exists(f"{store._unit_rel(version, u)}/zarr.json"):
            log.info(
                "unit %s was discarded as damaged (by verify --repair or a nightly run's healing): extracting its "
                "%d samples again",
                unit_url,
                len(plan["samples"]),
            )
        else:
            log.warning(
                "unit %s failed verification (%s); discarding it and extracting its %d samples again",
                unit_url,
                "; ".join(problems[:3]),
                len(plan["samples"]),
            )
        order = [rows[sid] for sid, _, _ in plan["samples"]]
        if (packing := plan.get("compression", "zstd")) not in COMPRESSIONS:  # an edited record: the run's
            packing = compression
        _create_unit(
            store,
            version,
            u,
            {**plan, "compression": packing},
            order,
            unit_fetch,
            len(attrs["layer_ids"]),
            attrs["hidden_size"],
            attrs.get("capture_last", False),
            quant.scheme(attrs),
        )
        discard.forget(store, version, u)  # planned again: no longer discarded
    return sorted(set(damaged) - dropped)


def _with_rows(row_of, lengths, fetch, found: dict[str, tuple[list, list]]):
    """(row_of, lengths, fetch) of this run's prepared rows followed by the samples `found` elsewhere (numbered after
    them), for a unit rebuilt from the prepared dataset it was made from."""
    n, extra = len(lengths), list(found.items())
    rows = {**row_of, **{sid: n + j for j, (sid, _) in enumerate(extra)}}
    more = [len(ids) for _, (ids, _) in extra]

    def length(i: int) -> int:
        return more[i - n] if i >= n else lengths[i]

    def both(order):
        mine = [i for i in order if i < n]
        got = dict(zip(mine, zip(*fetch(mine)))) if mine else {}
        pairs = [got[i] if i < n else extra[i - n][1] for i in order]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    return rows, length, both


def _drop_unit(store: Store, version, unit, problem, cannot, plan=None, row_of=None) -> None:
    """A nightly run's damaged unit that cannot be rebuilt (`cannot`: why; some of its rows changed or gone since
    with no prepared dataset on disk it was made from holding them, or no usable plan record): out of the version (its
    directory and its plan record; a snapshot's files are links, so the versions it was shared from keep theirs),
    recorded in repairs.json. The samples of it this run's dataset holds are in no unit then, so this run plans them
    again into new units: the night heals, where every later night stopped the same way."""
    samples = (plan or {}).get("samples") or []
    kept = sum(isinstance(s, list) and bool(s) and s[0] in (row_of or {}) for s in samples)
    note = f"dropped: damaged ({problem}) and {cannot}; " + (
        f"{kept} of its {len(samples)} samples extracted again into new units"
        if samples
        else "its samples this run's dataset holds extracted again into new units"
    )
    if store.loc.exists(store._unit_rel(version, unit)):
        discard.discard_units(store, version, [unit], {unit: note}, "rerun the nightly run")
    else:
        entry = {"at": now_utc(), "unit": unit, "why": note}
        store.loc.write_json_atomic(f"{version}/{discard.REPAIRS}", [*discard.repairs(store, version), entry])
    store.loc.rmtree(store._plan_rel(version, unit))
    discard.forget(store, version, unit)
    log.warning("store version %s: unit %s %s", store.loc.url_of(version), unit, note)


def _create_unit(store: Store, version, name, plan, order, fetch, k, hidden, capture_last, precision="full") -> None:
    """Create unit `name` as `plan` says (its attributes: samples in storage order, n_tokens, shard and
    chunk tokens, logical dtype, compression); `order` are the prepared rows of its samples, in that
    order. The plan record is written before the unit is marked planned (its last step)."""
    try:
        _create_unit_files(store, version, name, plan, order, fetch, k, hidden, capture_last, precision)
    except OSError as e:
        err = resource_error(e, store.loc.url_of(store._unit_rel(version, name)))
        if err is None:
            raise
        raise err from e


def _create_unit_files(store: Store, version, name, plan, order, fetch, k, hidden, capture_last, precision) -> None:
    logical, n_tokens = plan["logical_dtype"], plan["n_tokens"]
    chunk, shard = plan["chunk_tokens"], plan["shard_tokens"]
    row_shapes = quant.row_shapes(precision, DTYPES[logical][0], k, hidden)
    rel = store._unit_rel(version, name)
    store.loc.rmtree(rel)
    g = store.loc.open_group(rel, mode="w")
    for array in sharded_arrays(capture_last, precision):
        # Every sharded array has the same shard length along tokens as `hidden`, so one commit covers all.
        row, dtype = row_shapes[array]
        g.create_array(
            array,
            shape=(n_tokens, *row),
            chunks=(chunk, *row),
            shards=(shard, *row),
            dtype=dtype,
            compressors=compressors(plan["compression"], dtype.itemsize),
            fill_value=0,
        )
    input_ids, loss_masks = fetch(order)
    ids = np.concatenate([np.asarray(x, dtype=np.int32) for x in input_ids])
    mask = np.concatenate([np.asarray(x, dtype=np.uint8) for x in loss_masks])
    g.create_array("input_ids", data=ids, chunks=(max(1, min(n_tokens, 1 << 20)),), compressors=compressors("zstd", 4))
    g.create_array("loss_mask", data=mask, chunks=(max(1, min(n_tokens, 1 << 20)),), compressors=compressors("zstd", 1))
    unit_attrs = {key: plan[key] for key in ("samples", "n_tokens", "shard_tokens", "chunk_tokens", "logical_dtype")}
    g.attrs.update(unit_attrs)
    store.loc.write_json_atomic(store._plan_rel(version, name), {**unit_attrs, "compression": plan["compression"]})
    g.attrs["planned"] = True  # last: from here on the unit exists
