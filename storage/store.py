"""The versioned hidden-state store: identity checks, unit planning, completeness.

Only the flow's driver (one process, before fan-out) creates versions and plans units; each unit is
then written by exactly one worker (storage.writer). So no two processes ever write the same zarr.json.
The store is a local directory or an s3:// prefix; storage/location.py hides the difference.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash_pipeline.errors import StoreError
from dflash_pipeline.storage.layout import DTYPES, FORMAT_VERSION, NOTHING_COMMITTED, chunking, compressors
from dflash_pipeline.storage.location import Location, open_location

log = logging.getLogger(__name__)

# Attributes that must match for two runs to share one store version.
IDENTITY_KEYS = (
    "model_config_hash",
    "weights_fingerprint",
    "layer_ids",
    "capture_last",
    "logical_dtype",
    "hidden_size",
    "format_version",
)


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


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Store:
    """Store versions plus a CURRENT pointer, in a local directory or under an s3:// prefix.

    `options`: non-secret fsspec/s3fs options of an s3:// store (endpoint_url, ...); credentials come
    from the standard AWS chain only."""

    def __init__(self, root: str | Path, options: dict[str, Any] | None = None):
        self.loc: Location = open_location(root, options)
        self.url = self.loc.url  # path or URL, for messages

    # ---- versions -------------------------------------------------------------------------------
    def versions(self) -> list[str]:
        return [v for v in self.loc.list_dirs() if v.startswith("v") and self.loc.exists(f"{v}/zarr.json")]

    def current(self) -> str | None:
        data = self.loc.read_bytes("CURRENT")
        return data.decode().strip() if data is not None else None

    def set_current(self, version: str) -> None:
        assert self.loc.exists(f"{version}/zarr.json"), version
        self.loc.write_atomic("CURRENT", version.encode())

    def open_version(self, version: str, mode: str = "r"):
        return self.loc.open_group(version, mode)

    def attrs(self, version: str) -> dict[str, Any]:
        return dict(self.open_version(version).attrs)

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
        versions = self.versions()
        for v in reversed(versions):
            attrs = self.attrs(v)
            if not all(attrs.get(k) == provenance.get(k) for k in IDENTITY_KEYS):
                continue
            if dataset_fp in attrs.get("dataset_fingerprints", []):
                return v
            if not incremental:
                raise StoreError(
                    f"store {self.loc.url_of(v)} was made from dataset(s) {attrs['dataset_fingerprints']}, "
                    f"this run's prepared dataset is {dataset_fp}. Set extract.incremental=true to add "
                    "its new rows to this store, or use another store_path"
                )
            target = self._snapshot(v) if v == self.current() else v
            g = self.open_version(target, mode="r+")
            g.attrs["dataset_fingerprints"] = list(g.attrs["dataset_fingerprints"]) + [dataset_fp]
            return target
        if versions and not new_version:
            last = self.attrs(versions[-1])
            diffs = {k: (last.get(k), provenance.get(k)) for k in IDENTITY_KEYS if last.get(k) != provenance.get(k)}
            shown = "; ".join(f"{k}: store has {a!r}, this run has {b!r}" for k, (a, b) in diffs.items())
            raise StoreError(
                f"store {self.url} was made with another model or layer set ({shown}). "
                "Refusing to mix them. Set extract.new_version=true to start a new store "
                "version beside it, or use another store_path"
            )
        name = self._new_version_name()
        g = self.loc.open_group(name, mode="w-")
        g.attrs.update(
            {**provenance, "dataset_fingerprints": [dataset_fp], "format_version": FORMAT_VERSION, "created": _now()}
        )
        g.create_group("units")
        log.info("created store version %s", self.loc.url_of(name))
        return name

    def _new_version_name(self) -> str:
        versions = self.versions()
        return f"v{int(versions[-1][1:]) + 1:04d}" if versions else "v0001"

    def _snapshot(self, source: str) -> str:
        """A new version holding `source`'s complete units as hard links (no data copied; falls back to a
        copy across filesystems; server-side copies on object storage). Complete units are immutable, so
        sharing their files is safe."""
        name = self._new_version_name()
        src_attrs = self.attrs(source)
        g = self.loc.open_group(name, mode="w-")
        g.attrs.update({**src_attrs, "created": _now(), "snapshot_of": source})
        g.create_group("units")
        for u in self.units(source):
            if not self.commit_record(source, u).get("complete"):
                continue
            self.loc.copy_tree(self._unit_rel(source, u), self._unit_rel(name, u))
        log.info("snapshot %s -> %s (%d units shared)", source, name, len(self.units(name)))
        return name

    def prune(self, keep: int) -> list[str]:
        """Delete all but the newest `keep` versions; never CURRENT. Returns the deleted names."""
        current, versions = self.current(), self.versions()
        doomed = [v for v in versions[: max(len(versions) - keep, 0)] if v != current]
        for v in doomed:
            self.loc.rmtree(v)
            log.info("pruned store version %s", v)
        return doomed

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Exclusive use of this store by one run (plan, extract, validate, promote)."""
        self.check_writable()
        with self.loc.lock(
            ".lock",
            f"pid {os.getpid()} on {socket.gethostname()} since {_now()}",
            lambda holder: StoreError(
                f"store {self.url} is in use by another run ({holder}); wait for it to finish or use another store_path"
            ),
        ):
            yield

    # ---- units ----------------------------------------------------------------------------------
    @staticmethod
    def _unit_rel(version: str, unit: str) -> str:
        return f"{version}/units/{unit}"

    def unit_location(self, version: str, unit: str) -> Location:
        """Where one unit lives (what storage.writer.UnitWriter writes through)."""
        return self.loc.child(self._unit_rel(version, unit))

    def open_unit(self, version: str, unit: str, mode: str = "r"):
        """The unit's zarr group (arrays hidden, last_hidden?, input_ids, loss_mask)."""
        return self.loc.open_group(self._unit_rel(version, unit), mode)

    def units(self, version: str) -> list[str]:
        return [
            u
            for u in self.loc.list_dirs(f"{version}/units")
            if self.loc.exists(f"{self._unit_rel(version, u)}/zarr.json")
        ]

    def unit_attrs(self, version: str, unit: str) -> dict[str, Any]:
        return dict(self.open_unit(version, unit).attrs)

    def commit_record(self, version: str, unit: str) -> dict[str, Any]:
        return self.loc.read_json(f"{self._unit_rel(version, unit)}/commit.json", dict(NOTHING_COMMITTED))

    def plan_units(
        self,
        version: str,
        sample_ids: list[str],
        lengths: list[int],
        fetch: Callable[[list[int]], tuple[list, list]],
        unit_tokens: int,
        chunk_mib: float,
        shard_mib: float,
        compression: str,
    ) -> PlanResult:
        """Create unit groups for samples not yet in any unit of this version.

        `fetch(rows)` returns (input_ids, loss_masks) of those prepared rows.
        A unit is planned only once its `planned` attribute is written (last); a unit group without it
        (the planner was killed) is removed and planned again. Units are consecutive runs of the
        prepared order, stored longest-first (batches of similar length; OOM shows up at once).
        """
        attrs = self.attrs(version)
        assigned: set[str] = set()
        for u in self.units(version):
            ua = self.unit_attrs(version, u)
            if not ua.get("planned"):
                log.warning("removing half-planned unit %s", u)
                self.loc.rmtree(self._unit_rel(version, u))
                continue
            assigned.update(s[0] for s in ua["samples"])
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

        existing = self.units(version)
        next_no = int(existing[-1][1:]) + 1 if existing else 0
        k, hidden, logical = len(attrs["layer_ids"]), attrs["hidden_size"], attrs["logical_dtype"]
        new_units = []
        for gi, members in enumerate(groups):
            order = sorted(members, key=lambda i: (-lengths[i], i))
            name = f"u{next_no + gi:05d}"
            self._create_unit(
                version,
                name,
                order,
                sample_ids,
                lengths,
                fetch,
                k,
                hidden,
                logical,
                attrs.get("capture_last", False),
                chunk_mib,
                shard_mib,
                compression,
            )
            new_units.append(UnitInfo(name, len(order), sum(lengths[i] for i in order)))
        pending = [
            self.unit_info(version, u)
            for u in self.units(version)
            if not self.commit_record(version, u).get("complete")
        ]
        return PlanResult(version, self.loc.url_of(version), new_units, pending, len(self.units(version)), len(todo))

    def unit_info(self, version: str, unit: str) -> UnitInfo:
        samples = self.unit_attrs(version, unit)["samples"]
        return UnitInfo(unit, len(samples), sum(s[2] for s in samples))

    def _create_unit(
        self,
        version,
        name,
        order,
        sample_ids,
        lengths,
        fetch,
        k,
        hidden,
        logical,
        capture_last,
        chunk_mib,
        shard_mib,
        compression,
    ) -> None:
        stored = DTYPES[logical][0]
        n_tokens = sum(lengths[i] for i in order)
        rel = self._unit_rel(version, name)
        self.loc.rmtree(rel)
        g = self.loc.open_group(rel, mode="w")
        chunk, shard = chunking(k * hidden * stored.itemsize, chunk_mib, shard_mib, n_tokens)
        codecs = compressors(compression, stored.itemsize)
        g.create_array(
            "hidden",
            shape=(n_tokens, k, hidden),
            chunks=(chunk, k, hidden),
            shards=(shard, k, hidden),
            dtype=stored,
            compressors=codecs,
            fill_value=0,
        )
        if capture_last:
            # Same shard length along tokens as `hidden`, so one commit covers both.
            g.create_array(
                "last_hidden",
                shape=(n_tokens, hidden),
                chunks=(chunk, hidden),
                shards=(shard, hidden),
                dtype=stored,
                compressors=codecs,
                fill_value=0,
            )
        input_ids, loss_masks = fetch(order)
        ids = np.concatenate([np.asarray(x, dtype=np.int32) for x in input_ids])
        mask = np.concatenate([np.asarray(x, dtype=np.uint8) for x in loss_masks])
        g.create_array(
            "input_ids", data=ids, chunks=(max(1, min(n_tokens, 1 << 20)),), compressors=compressors("zstd", 4)
        )
        g.create_array(
            "loss_mask", data=mask, chunks=(max(1, min(n_tokens, 1 << 20)),), compressors=compressors("zstd", 1)
        )
        starts = np.cumsum([0] + [lengths[i] for i in order])[:-1]
        samples = [[sample_ids[i], int(s), int(lengths[i])] for i, s in zip(order, starts)]
        g.attrs.update(
            {
                "samples": samples,
                "n_tokens": n_tokens,
                "shard_tokens": shard,
                "chunk_tokens": chunk,
                "logical_dtype": logical,
            }
        )
        g.attrs["planned"] = True  # last: from here on the unit exists

    def delete_version(self, version: str) -> None:
        assert version != self.current(), "refusing to delete the CURRENT version"
        self.loc.rmtree(version)
