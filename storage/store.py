"""The versioned hidden-state store: its versions and CURRENT, which version a run writes into, its units and
their records. A version's identity is in storage/identity.py, its version record in storage/version_record.py,
the store lock in storage/store_lock.py, planning units in storage/planning.py.

Only the flow's driver (one process, before fan-out) creates versions and plans units; each unit is
then written by exactly one worker (storage.writer). So no two processes ever write the same zarr.json.
The store is a local directory or an s3:// prefix; storage/location.py hides the difference.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_pipeline.errors import StoreError
from dflash_pipeline.storage import digest, quant, retention, retention_record, store_lock
from dflash_pipeline.storage.identity import VERSION_NAME, identity_value, other_dataset, other_target, same_identity
from dflash_pipeline.storage.layout import FORMAT_VERSION, NOTHING_COMMITTED, PLANS, UNIT_NAME, commit_record_problem
from dflash_pipeline.storage.leases import now_utc
from dflash_pipeline.storage.location import Location, open_location
from dflash_pipeline.storage.version_record import VersionRecords

log = logging.getLogger(__name__)

# The unit attributes a plan record holds (plus `compression`), in the order the planner writes them.
PLANNED_KEYS = ("samples", "n_tokens", "shard_tokens", "chunk_tokens", "logical_dtype")


@dataclass(frozen=True)
class UnitInfo:
    name: str
    n_samples: int
    n_tokens: int


@dataclass(frozen=True)
class PlanResult:
    version: str
    version_path: str
    new_units: list[UnitInfo]
    pending_units: list[UnitInfo]  # not yet complete (new ones included)
    n_units: int
    new_samples: int
    repaired_units: list[str] = ()  # units that failed verification: discarded and planned again, as before


class Store(VersionRecords):
    """Store versions plus a CURRENT pointer, in a local directory or under an s3:// prefix.

    `options`: non-secret fsspec/s3fs options of an s3:// store (endpoint_url, ...); credentials come
    from the standard AWS chain only."""

    def __init__(self, root: str | Path, options: dict[str, Any] | None = None):
        self.loc: Location = open_location(root, options)
        self.url = self.loc.url  # path or URL, for messages
        self._strays: set[str] = set()  # what _unit_names has warned of

    # ---- versions -------------------------------------------------------------------------------
    def versions(self) -> list[str]:
        """The store's versions, oldest first: directories named v + digits (v0001, ...) that hold a zarr.json.
        Anything else in the store's root is not a version (a backup copy `v0001.bak`, `v0000-old`): no run,
        prune, verify or reader looks at it."""
        names = [v for v in self.loc.list_dirs() if VERSION_NAME.fullmatch(v) and self.loc.exists(f"{v}/zarr.json")]
        return sorted(names, key=lambda v: int(v[1:]))

    def current(self) -> str | None:
        try:
            data = self.loc.read_bytes("CURRENT")
            return data.decode().strip() if data is not None else None
        except (IsADirectoryError, UnicodeDecodeError, ValueError) as e:  # (damage checks: a traceback; a hang)
            what = {IsADirectoryError: "is a directory", UnicodeDecodeError: "is not text"}.get(
                type(e), "is not a regular file"
            )
            raise StoreError(
                f"{self.loc.url_of('CURRENT')} {what}: it should be a text file naming the published version; "
                f"replace it with the name of a version that `dflash-pipeline verify {self.url} --version V` finds "
                f"healthy and validated (versions: {', '.join(self.versions()) or 'none'})"
            ) from None

    def set_current(self, version: str) -> None:
        assert self.loc.exists(f"{version}/zarr.json"), version
        self.loc.write_atomic("CURRENT", version.encode())

    def open_version(self, version: str, mode: str = "r"):
        return self.loc.open_group(version, mode)

    def attrs(self, version: str) -> dict[str, Any]:
        try:
            return dict(self.open_version(version).attrs)
        except Exception as e:
            # (an OSError is the disk's or the network's, possibly transient: never "unreadable for good")
            if isinstance(e, StoreError | OSError) or not self.loc.exists(f"{version}/zarr.json"):
                raise
            raise StoreError(
                f"store version {self.loc.url_of(version)}: its zarr.json (the version's attributes: provenance, "
                f"layers, precision) is unreadable ({type(e).__name__}: {e}). No run can rebuild it: restore that "
                "file from a copy of the store, or move the version aside and extract into a new one"
            ) from e

    def check_readable(self) -> None:
        """Fail fast, naming the fix, when the store cannot be reached (object storage)."""
        self.loc.check(write=False)

    def check_writable(self) -> None:
        """Fail fast, naming the fix, when the store cannot be written (permissions, unreachable endpoint,
        missing credentials or bucket)."""
        self.loc.check(write=True)

    def resolve_version(self, provenance: dict[str, Any], dataset_fp: str, new_version: bool, incremental: bool) -> str:
        """The version this run writes into.

        - the newest version with the same identity, if it already holds this dataset (resume / no-op);
        - for a new dataset with `incremental`: that version if it is unpublished (not CURRENT), else a
          snapshot of it (a new version sharing its complete units through hard links), so the
          published version never changes under its readers;
        - a new version if no version has this identity (only with `new_version`, or for an empty store).
        """
        self.check_writable()
        provenance = {**provenance, "format_version": FORMAT_VERSION}
        versions = [
            v for v in self.versions() if not retention_record.read_record(self, v).get("prune")
        ]  # not half-pruned
        for v in reversed(versions):
            attrs = self._repair_attrs(v, provenance)
            if not same_identity(attrs, provenance):
                continue
            if dataset_fp in attrs.get("dataset_fingerprints", []):
                return v
            if not incremental:
                raise StoreError(other_dataset(self.loc.url_of(v), attrs["dataset_fingerprints"], dataset_fp))
            from dflash_pipeline.storage.snapshot import snapshot  # (it uses this module)

            target = snapshot(self, v) if v == self.current() else v
            g = self.open_version(target, mode="r+")
            g.attrs["dataset_fingerprints"] = list(g.attrs["dataset_fingerprints"]) + [dataset_fp]
            return target
        versions = self._drop_empty_versions(versions)
        if versions and not new_version:
            raise StoreError(other_target(self.url, self.attrs(versions[-1]), provenance))
        name = self.new_version_name()
        g = self.loc.open_group(name, mode="w-")
        g.attrs.update({**provenance, "dataset_fingerprints": [dataset_fp], "created": now_utc()})
        g.create_group("units")
        self._write_version_record(name)
        log.info("created store version %s", self.loc.url_of(name))
        return name

    def survey(self, provenance: dict[str, Any], dataset_fp: str, sample_ids: list[str]) -> PlanResult:
        """What `resolve_version` + `plan_units` would find, changing nothing: for a run that validates without
        extracting (only a run that extracts may repair, plan or delete). The version of this run's identity
        that holds `dataset_fp`, its units not yet complete, and how many of `sample_ids` no unit holds. Damage
        is not looked at here: validation reports it."""
        provenance = {**provenance, "format_version": FORMAT_VERSION}
        for v in reversed([v for v in self.versions() if not retention_record.read_record(self, v).get("prune")]):
            attrs = self._repair_attrs(v, provenance, write=False)
            if same_identity(attrs, provenance) and dataset_fp in attrs.get("dataset_fingerprints", []):
                break
        else:
            raise StoreError(
                f"no version of store {self.url} holds this run's prepared dataset {dataset_fp} extracted with this "
                "run's model, layers, dtype and precision: add extract to stages to extract it"
            )
        assigned, pending = set(), []
        for u in self.units(v):
            try:
                samples = self.unit_attrs(v, u)["samples"]
                assigned.update(sid for sid, _, _ in samples)
                complete = self.commit_record(v, u).get("complete")
            except Exception:  # noqa: BLE001 - a damaged unit: validation reports it
                continue
            if not complete:
                pending.append(UnitInfo(u, len(samples), sum(n for _, _, n in samples)))
        for u in set(self.planned_units(v)) - set(self.units(v)):  # a unit directory gone: damage, not new samples
            try:
                assigned.update(sid for sid, _, _ in (self.plan_record(v, u) or {}).get("samples", []))
            except Exception:  # noqa: BLE001
                continue
        new = sum(sid not in assigned for sid in sample_ids)
        return PlanResult(v, self.loc.url_of(v), [], pending, len(self.units(v)), new)

    def _drop_empty_versions(self, versions: list[str]) -> list[str]:
        """Delete versions that are not CURRENT and hold no committed token (a run that failed before its
        first commit, e.g. on broken weights): they must not block the next run. Returns those left."""
        current, kept = self.current(), []
        for v in versions:
            if not self._held(v, current):
                log.warning("removing store version %s: nothing was ever committed to it", self.loc.url_of(v))
                self.loc.rmtree(v)
                continue
            kept.append(v)
        return kept

    def _held(self, version: str, current: str | None) -> bool:
        """CURRENT, or a version that holds committed tokens, or whose data retention deleted (it keeps its
        record): a version a run keeps."""
        if version == current or retention_record.read_record(self, version):
            return True
        return any(self._committed_or_damaged(version, u) for u in self.units(version))

    def _committed_or_damaged(self, version: str, unit: str) -> bool:
        try:
            return self.commit_record(version, unit).get("committed_tokens", 0) > 0
        except ValueError:  # a damaged record: the repair's to judge, never a reason to drop the version
            return True

    def resumable(self, version: str) -> bool:
        """Whether a run can write into `version` again: only the newest version of its identity (a run resumes
        or extends the newest version of its identity; an older one, CURRENT or not, is only read, then pruned)."""
        attrs, later = self.attrs(version), [v for v in self.versions() if int(v[1:]) > int(version[1:])]
        return not any(same_identity(self.attrs(v), attrs) for v in later)

    def precision_refusal(self, precision: str) -> str | None:
        """Why a run writing `precision` into this store without extract.new_version will be refused (as
        resolve_version refuses it, after the probe), when no version the run would keep holds that precision;
        None when one does, or the store holds none. Reads the versions' attributes only, changes nothing."""
        current = self.current()
        versions = [v for v in self.versions() if not retention_record.read_record(self, v).get("prune")]
        kept = [v for v in versions if self._held(v, current)]
        want = quant.precision_attrs(precision)
        keys = ("precision", quant.INT8_SCALES_ATTR)
        # any version of that precision is one the run may resume (even one a crash left empty); only kept versions
        # of other precisions refuse it (an empty one is removed by the run)
        if not kept or any(all(identity_value(self.attrs(v), k) == want.get(k) for k in keys) for v in versions):
            return None
        last = kept[-1]
        record = (self.version_record(last) or {}).get("attrs") or {}
        if any(digest.of_attr(self.attrs(last).get(k)) != record.get(k) for k in keys if k in record):
            return None  # its precision attributes were edited: the run restores them from its provenance first
        return (
            f"extract.store_precision={precision}: store {self.url} holds {quant.scheme(self.attrs(last))} states "
            f"(version {last}), and a version holds one precision. Set extract.new_version=true to write a new "
            f"version in {precision} beside it, or use another store_path"
        )

    def new_version_name(self) -> str:
        """Past every v + digits directory, a version or not: one whose zarr.json was deleted still holds its units
        (a damage check's rerun crashed creating its name again); it is left as it is, for its owner to restore."""
        names = [v for v in self.loc.list_dirs() if VERSION_NAME.fullmatch(v)]
        versions = set(self.versions())
        stray = sorted(v for v in names if v not in versions)
        if stray:
            log.warning(
                "%s: %s not a version (no zarr.json, e.g. deleted): left untouched; a new version is made beside it",
                self.url,
                ", ".join(stray) + (" is" if len(stray) == 1 else " are"),
            )
        return f"v{max((int(v[1:]) for v in names), default=0) + 1:04d}"

    def prune(self, keep: int) -> list[str]:
        """Delete all but the newest `keep` versions; never CURRENT, never a version another process reads (holds
        a reader lease on: it is pruned by a later run). The caller holds the store lock. Returns the deleted
        names."""
        current, versions = self.current(), self.versions()
        doomed = [v for v in versions[: max(len(versions) - keep, 0)] if v != current]
        pruned = []
        for v in doomed:
            out = retention.retire_whole_version(
                self, v, {"mode": "prune", "why": f"extract.keep_versions={keep}"}, True
            )
            if out.skipped:
                log.warning("not pruning store version %s now: %s", self.loc.url_of(v), out.skipped)
                continue
            pruned.append(v)
            log.info("pruned store version %s", v)
        return pruned

    def lock(self, brief: str | None = None, wait_for_brief_s: float = 0.0) -> AbstractContextManager[None]:
        """Exclusive use of this store by one run, waiting only for a `brief` holder (storage/store_lock.py)."""
        return store_lock.hold(self, brief, wait_for_brief_s)

    # ---- units ----------------------------------------------------------------------------------
    @staticmethod
    def _unit_rel(version: str, unit: str) -> str:
        return f"{version}/units/{unit}"

    @staticmethod
    def _plan_rel(version: str, unit: str) -> str:
        return f"{version}/{PLANS}/{unit}.json"

    def plan_record(self, version: str, unit: str) -> dict[str, Any] | None:
        """The unit's attributes as planned (None for a unit planned before format 2, or if deleted)."""
        return self.loc.read_json(self._plan_rel(version, unit))

    def planned_units(self, version: str) -> list[str]:
        """Units with a plan record (whether or not their directory still exists)."""
        files = [r for r in self.loc.list_files(f"{version}/{PLANS}") if "/" not in r and r[0] != "."]
        return sorted(self._unit_names(f"{version}/{PLANS}", files, ".json"))

    def unit_location(self, version: str, unit: str) -> Location:
        """Where one unit lives (what storage.writer.UnitWriter writes through)."""
        return self.loc.child(self._unit_rel(version, unit))

    def open_unit(self, version: str, unit: str, mode: str = "r"):
        """The unit's zarr group (arrays hidden, last_hidden?, input_ids, loss_mask)."""
        return self.loc.open_group(self._unit_rel(version, unit), mode)

    def units(self, version: str) -> list[str]:
        return [
            u
            for u in self._unit_names(f"{version}/units", self.loc.list_dirs(f"{version}/units"), "")
            if self.loc.exists(f"{self._unit_rel(version, u)}/zarr.json")
        ]

    def _unit_names(self, folder: str, entries: list[str], suffix: str) -> list[str]:
        """The unit names (layout.UNIT_NAME) of `folder`'s `entries`, each a unit name + `suffix`; every other entry
        is named in a warning, once."""
        units = [e.removesuffix(suffix) for e in entries if e.endswith(suffix)]
        units = [u for u in units if UNIT_NAME.fullmatch(u)]
        for e in set(entries) - {u + suffix for u in units}:
            if (where := f"{folder}/{e}") not in self._strays:
                self._strays.add(where)
                log.warning(
                    "%s is not part of the store (units are named u00000, u00001, ...): ignored; move it out of %s",
                    self.loc.url_of(where), self.loc.url_of(folder),
                )  # fmt: skip
        return units

    def unit_attrs(self, version: str, unit: str) -> dict[str, Any]:
        return dict(self.open_unit(version, unit).attrs)

    def commit_record(self, version: str, unit: str) -> dict[str, Any]:
        rel = f"{self._unit_rel(version, unit)}/commit.json"
        rec = self.loc.read_json(rel, dict(NOTHING_COMMITTED))
        if why := commit_record_problem(rec):
            raise StoreError(
                f"commit record {self.loc.url_of(rel)} is malformed ({why}): a rerun of extract rebuilds the unit "
                "from its plan record (`dflash-pipeline verify` lists every problem)"
            )
        return dict(NOTHING_COMMITTED) if rec is None else rec

    def unit_info(self, version: str, unit: str) -> UnitInfo:
        samples = self.unit_attrs(version, unit)["samples"]
        return UnitInfo(unit, len(samples), sum(s[2] for s in samples))

    def delete_version(self, version: str) -> None:
        assert version != self.current(), "refusing to delete the CURRENT version"
        self.loc.rmtree(version)
