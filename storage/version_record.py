"""A version's record (digests of the attributes readers rely on) and restoring attributes altered on disk from it."""

from __future__ import annotations

import logging
from typing import Any

from dflash_pipeline.errors import StoreError
from dflash_pipeline.storage import digest
from dflash_pipeline.storage.identity import same_identity
from dflash_pipeline.storage.layout import FORMAT_VERSION, READER_ATTRS, VALIDATION, VERSION_RECORD

log = logging.getLogger(__name__)


class VersionRecords:
    """The records that make the store verifiable (docs/STORE.md, "Integrity"): methods of `Store`, which
    inherits them, on its `loc`, `attrs`, `current` and `open_version`."""

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
