"""The versioned hidden-state store: identity checks, unit planning, completeness.

Only the flow's driver (one process, before fan-out) creates versions and plans units; each unit is
then written by exactly one worker (storage.writer). So no two processes ever write the same zarr.json.
The store is a local directory or an s3:// prefix; storage/location.py hides the difference.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_pipeline.errors import StoreError
from dflash_pipeline.storage import digest, quant, retention, retention_record
from dflash_pipeline.storage.layout import (
    FORMAT_VERSION,
    NOTHING_COMMITTED,
    PLANS,
    READER_ATTRS,
    UNIT_NAME,
    VALIDATION,
    VERSION_RECORD,
    commit_record_problem,
)
from dflash_pipeline.storage.leases import now_utc
from dflash_pipeline.storage.location import Location, open_location

log = logging.getLogger(__name__)

# Attributes that must match for two runs to share one store version.
IDENTITY_KEYS = (
    "model_config_hash",
    "weights_fingerprint",
    "layer_ids",
    "capture_last",
    "logical_dtype",
    "precision",
    "int8_scales",
    "hidden_size",
    "format_version",
    "target_quantization",
)
VERSION_NAME = re.compile(r"v[0-9]+")  # v0001, v0002, ... (new_version_name)
# The unit attributes a plan record holds (plus `compression`), in the order the planner writes them.
PLANNED_KEYS = ("samples", "n_tokens", "shard_tokens", "chunk_tokens", "logical_dtype")
# Identity attributes that versions written before they existed lack, and the value those versions have.
IDENTITY_DEFAULTS = {"precision": "full", "target_quantization": None}  # None: an unquantized target


def _identity(attrs: dict[str, Any], key: str) -> Any:
    return attrs.get(key, IDENTITY_DEFAULTS.get(key))


def _difference(key: str, a: Any, b: Any) -> str:
    """One identity key that differs, briefly: of two dicts (a quantized target's record) only the entries that
    differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        sub = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        return "; ".join(f"{key}.{k}: store has {a.get(k)!r}, this run has {b.get(k)!r}" for k in sub)
    return f"{key}: store has {a!r}, this run has {b!r}"


def other_dataset(version_url: str, fingerprints: list[str], dataset_fp: str) -> str:
    """Why a run that is not incremental is refused a version made from other prepared datasets."""
    return (
        f"store {version_url} was made from prepared dataset(s) {fingerprints}, this run's is {dataset_fp}: its "
        "rows differ, or a setting that makes them (data.source, data.max_samples or another data.* setting, the "
        "tokenizer or chat template, regenerate). Set extract.incremental=true to add the rows the store lacks (the "
        "samples it holds are kept, not extracted again), or use another store_path"
    )


def same_identity(attrs: dict[str, Any], provenance: dict[str, Any]) -> bool:
    """Whether a version with root attributes `attrs` holds states of the run with this `provenance`."""
    return all(_identity(attrs, k) == _identity(provenance, k) for k in IDENTITY_KEYS)


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


BRIEF = "(brief)"  # in a store lock's holder: the holder will let go soon; a run may wait for it


class _Busy(Exception):
    """The store lock is taken; `holder` is what its holder recorded."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


class StoreBusy(StoreError):
    """Another run holds the store's lock; `holder`: what it recorded ('pid N on HOST since T[, brief ...]')."""

    def __init__(self, message: str, holder: str):
        super().__init__(message)
        self.holder = holder


class Store:
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
            last = self.attrs(versions[-1])
            diffs = {
                k: (_identity(last, k), _identity(provenance, k))
                for k in IDENTITY_KEYS
                if _identity(last, k) != _identity(provenance, k)
            }
            shown = "; ".join(_difference(k, a, b) for k, (a, b) in diffs.items())
            raise StoreError(
                f"store {self.url} holds states of another target, layer set or forward ({shown}). "
                "Refusing to mix them. Set extract.new_version=true to start a new store "
                "version beside it, or use another store_path"
            )
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

    # ---- records that make the store verifiable (docs/STORE.md, "Integrity") ----------------------------
    def version_record(self, version: str) -> dict[str, Any] | None:
        return self.loc.read_json(f"{version}/{VERSION_RECORD}")

    def _write_version_record(self, version: str, validated_before_publishing: bool = True) -> None:
        """`validated_before_publishing`: this code makes a version CURRENT only once a passing validation.json is
        written, so a CURRENT version without that file lost it (versions whose record predates the flag lack it,
        and their CURRENT counts as validated: storage/validated.py validation_status)."""
        record = {"format_version": FORMAT_VERSION, "algorithm": digest.ALGORITHM}
        if validated_before_publishing:
            record["validated_before_publishing"] = True
        record["attrs"] = digest.of_attrs(self.attrs(version), READER_ATTRS)
        self.loc.write_json_atomic(f"{version}/{VERSION_RECORD}", record)

    def _rebuilt_record_flag(self, version: str, record: Any) -> bool:
        """validated_before_publishing for a rebuilt version record: the old record's where it is readable; else
        true unless the version is CURRENT without a validation.json (published before the flag existed: a record
        rebuilt with the flag would make its readers refuse it for a report it never had)."""
        if isinstance(record, dict) and isinstance(record.get("attrs"), dict):
            return record.get("validated_before_publishing") is True
        return self.current() != version or self.loc.exists(f"{version}/{VALIDATION}")

    def _repair_attrs(self, version: str, provenance: dict[str, Any], write: bool = True) -> dict[str, Any]:
        """The version's attributes, after restoring those that were altered on disk (their digest no longer
        matches the version record) from this run's provenance, where that matches the record: the values
        the version was created with. A version record that is missing, unreadable or contradicted while every
        attribute it covers equals this run's provenance is the damaged one: it is rebuilt from those attributes.
        Returns the attributes as they are then (`write=False`: as they would be, changing nothing)."""
        attrs, prov = self.attrs(version), provenance
        try:
            record = self.version_record(version)
        except ValueError:
            record = None
        recorded = record.get("attrs") if isinstance(record, dict) else None
        if not isinstance(recorded, dict):
            recorded = {}
        fixes = {
            k: provenance[k]
            for k, d in recorded.items()
            if k in provenance and digest.of_attr(attrs.get(k)) != d and digest.of_attr(provenance[k]) == d
        }
        if fixes and write:
            log.warning(
                "store version %s: attributes %s were altered on disk; restored from the version record",
                self.loc.url_of(version),
                sorted(fixes),
            )
            self.open_version(version, mode="r+").attrs.update(fixes)
        attrs.update(fixes)
        want = digest.of_attrs(attrs, READER_ATTRS)
        added = sorted(set(want) - set(recorded)) if recorded else []
        if added and write:  # a rebuilt record would vouch for them (found by a damage check: an old int8 version
            # given int8_scales was then extended with group-step units)
            raise StoreError(
                f"store version {self.loc.url_of(version)}: attributes {added} are in its zarr.json but not covered by "
                f"its version record {VERSION_RECORD}, so they were added after the version was made (an int8 "
                "version from before group steps has no int8_scales). Remove them from "
                f"{self.loc.url_of(version)}/zarr.json to restore the version as it was, or extract a new version "
                "(extract.new_version=true)"
            )

        def provenance_agrees(k: str) -> bool:  # (an attribute only some versions have, int8_scales: absent in both)
            return digest.of_attr(provenance[k]) == want.get(k) if k in provenance else k not in want

        if (
            write
            and attrs.get("format_version") == FORMAT_VERSION
            and recorded != want
            and all(provenance_agrees(k) for k in READER_ATTRS)
        ):
            log.warning(
                "store version %s: its version record %s was %s; every attribute it covers equals this run's "
                "provenance, so it is rebuilt from them",
                self.loc.url_of(version),
                VERSION_RECORD,
                "missing or unreadable" if not recorded else "contradicted by them",
            )
            self._write_version_record(version, self._rebuilt_record_flag(version, record))
        elif write and not recorded and attrs.get("format_version") == FORMAT_VERSION and same_identity(attrs, prov):
            differ = [k for k in READER_ATTRS if k in provenance and digest.of_attr(provenance[k]) != want.get(k)]
            raise StoreError(
                f"store version {self.loc.url_of(version)}: its version record {VERSION_RECORD} is missing or "
                f"unreadable, and attributes {differ} differ from this run's, so nothing says which are right and "
                "the record cannot be rebuilt: rerun with the run that made the version (its run_config attribute), "
                "or extract a new version (extract.new_version=true)"
            )
        return attrs

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
        if not kept or any(all(_identity(self.attrs(v), k) == want.get(k) for k in keys) for v in versions):
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

    @contextmanager
    def lock(self, brief: str | None = None, wait_for_brief_s: float = 0.0) -> Iterator[None]:
        """Exclusive use of this store by one run (plan, extract, validate, promote), taken without waiting for
        another run. A holder that says it is `brief` (retention deleting data: seconds to minutes) is waited
        for, up to `wait_for_brief_s`, so that a nightly run does not fail because a training run was deleting
        the units its checkpoint had covered at that moment."""
        self.check_writable()
        holder = f"pid {os.getpid()} on {socket.gethostname()} since {now_utc()}" + (
            f", {brief} {BRIEF}" if brief else ""
        )
        deadline, waited, held = time.monotonic() + wait_for_brief_s, False, ExitStack()
        while True:
            try:
                held.enter_context(self.loc.lock(".lock", holder, _Busy))
                break
            except _Busy as e:
                if BRIEF not in e.holder or time.monotonic() >= deadline:
                    raise StoreBusy(
                        f"store {self.url} is in use by another run ({e.holder}); wait for it to finish or use "
                        "another store_path",
                        e.holder,
                    ) from None
                if not waited:
                    log.info("store %s: waiting for %s", self.url, e.holder)
                waited = True
                time.sleep(0.5)
        with held:
            yield

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
