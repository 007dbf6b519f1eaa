"""Read committed samples of a store version: a torch Dataset with random access by sample.

The index (which sample lives where) is built from unit attributes and commit records at construction;
Zarr arrays are opened lazily, per process, on first access, so the dataset is safe to use with
DataLoader worker processes (each worker opens its own handles after fork/spawn).

The reader never returns values that were not committed as they are: at construction it checks the
version's attributes against the version record, every unit's attributes against its plan record and its
commit record (present, complete), and raises StoreError naming the unit, array and file on a mismatch. When
a unit's arrays are first opened (in each process) every file its commit record lists is checked for
presence and size (a missing zarr shard would otherwise read back as zeros), and the content of its small
files (the arrays' metadata, token ids and loss mask: a shape, byte order or dtype edited in place keeps the
file's size); the first time a sample touches a shard (in each process), its chunk index and chunk CRCs against
the commit record's `chunks`, or with `verify="digests"` its whole content (every byte is then read once more,
once); after each read of a local store, that the files read are still there (each shard the very file checked).
storage/verify.py holds the checks.

A reader holds a lease on its version for as long as it lives (storage/leases.py): retention and pruning
never delete a version, or units of one, that another process reads. Units whose data retention deleted are
refused by name (with who, when, why and how to re-extract), never read as missing files or zeros.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_pipeline.errors import StoreError
from dflash_pipeline.storage import digest, leases, quant, retention_record
from dflash_pipeline.storage.duplicates import duplicate_samples
from dflash_pipeline.storage.layout import (
    ARRAYS,
    DTYPES,
    SHARDED_ARRAYS,
    chunks_per_shard,
    from_storage,
    sharded_arrays,
)
from dflash_pipeline.storage.location import LocalLocation
from dflash_pipeline.storage.store import Store
from dflash_pipeline.storage.validated import unvalidated_fix, validation_status
from dflash_pipeline.storage.verify import (
    INCOMPLETE,
    Problem,
    check_unit,
    check_version_attrs,
    layout_problems,
    null_entry_problem,
)

log = logging.getLogger(__name__)


class PassingReadError(StoreError):
    """A read that failed while every file it needs reads again intact (a network's or a busy disk's passing error):
    nothing is damaged, so the reader goes on serving; the same read may succeed again."""


@dataclass(frozen=True)
class SampleRef:
    sample_id: str
    unit: str
    start: int
    length: int


def _shard_of(f: str) -> int | None:
    """The shard index of a committed shard file (hidden/c/<i>/0/0, last_hidden/c/<i>/0), else None."""
    head, sep, rest = f.partition("/c/")
    return int(rest.split("/", 1)[0]) if sep and head in SHARDED_ARRAYS else None


def published_version(store: Store, unvalidated: str = "refuse", warn=None) -> str:
    """CURRENT: the version readers use. With none, StoreError saying so (and which versions exist, and whether
    they were validated); with `unvalidated="warn"` the newest version instead, with a warning (logged, or given to
    `warn(text)`: the verify command prints it among its own lines)."""
    current = store.current()
    if current is not None:
        if current not in store.versions():
            raise StoreError(
                f"store {store.url}: CURRENT names version {current!r}, which does not exist (a version is a "
                "directory named v and digits, e.g. v0001, holding a zarr.json)"
            )
        return current
    versions = store.versions()
    if not versions:
        there = (
            " (it does not exist)"
            if not store.loc.exists("")
            else f" (did you mean {store.loc.url_of('store')}?)"
            if store.loc.exists("store")
            else ""
        )
        raise StoreError(f"no store version under {store.url}{there}: give the store's path, <output_dir>/store")
    states = ", ".join(f"{v} ({validation_status(store, v) or 'validated'})" for v in versions)
    msg = f"store {store.url} has no published version: CURRENT is missing (versions: {states})"
    if unvalidated == "refuse":
        raise StoreError(
            f"{msg}. A run with the validate stage publishes the version it validates; to read one anyway, name it "
            "(`verify --version V`, HiddenStateDataset(version=V)); one that did not pass validation also needs "
            "`--unvalidated` / unvalidated='warn'"
        )
    if warn is None:
        log.warning("%s; reading the newest, %s, anyway (unvalidated='warn')", msg, versions[-1])
    else:
        warn(f"{msg}; checking the newest, {versions[-1]}")
    return versions[-1]


class HiddenStateDataset(torch.utils.data.Dataset):
    """Items: {'sample_id', 'input_ids' [T] long, 'loss_mask' [T] bool, 'hidden' [T, K, H],
    and 'last_hidden' [T, H] when captured}; hidden states in the store's logical dtype (the dtype training
    reads; a compact store's fp8 / int8 / int4 values are dequantized into it)."""

    def __init__(
        self,
        store_root: str | Path,
        version: str | None = None,
        store_options: dict | None = None,
        verify: str = "sizes",
        partial: bool = False,
        dequantize: bool = True,
        retired: str = "refuse",
        unvalidated: str = "refuse",
    ):
        """`store_root`: a local path or s3://bucket/prefix; `store_options`: its non-secret fsspec options
        (e.g. {"endpoint_url": ...}); credentials come from the standard AWS chain.
        `verify`: "sizes" (every committed file of a unit present with its committed size, and its small files'
        content: the arrays' metadata, ids and mask, a few bytes per token, checked when the unit is first opened,
        per process; each shard's chunk index and chunk CRCs against its commit entry at the shard's first touch,
        so a shard replaced by another of its size or chunks swapped within it is an error) or "digests" (each
        shard's whole content instead: read once more the first time a sample in it is read). Either way, after
        each read of a local store, the files it used must still be there with their committed sizes.
        `partial`: read the committed samples of units not yet complete (a version being extracted); by default
        every planned unit must be complete. `dequantize=False` (a compact store only): items hold the stored
        values as they are ('hidden' uint8 e4m3 bits or int8, [T, K, H]; int4: uint8 [T, K, H/2]) plus
        'hidden_scale' [T, K] float32 (int4: uint8 [T, K, 4 + groups]) and 'last_hidden_scale' likewise, for a
        consumer that dequantizes on its GPU (training does: a half or a quarter of the bytes to copy, no CPU decoding).
        `retired`: units whose data retention deleted (docs/STORE.md, "Retention") make the constructor raise
        ("refuse", the default) or, with "index" (a training's reader, so that a training resumed after its
        `consumed` units were deleted sees the same samples in the same order), stay in the index from their plan
        records, and reading one of their samples raises StoreError saying what was deleted and why.
        `unvalidated`: a version that did not pass validation (it failed, never ran, or the version changed since:
        storage.validated.validation_status) makes the constructor raise ("refuse", the default) or logs a warning and
        is read ("warn"). `version=None` reads CURRENT, the published version; with no CURRENT there is none, and the
        constructor raises (with "warn": reads the newest version, with a warning)."""
        if verify not in ("sizes", "digests"):
            raise ValueError(f"verify={verify!r}: use 'sizes' or 'digests'")
        if retired not in ("refuse", "index"):
            raise ValueError(f"retired={retired!r}: use 'refuse' or 'index'")
        if unvalidated not in ("refuse", "warn"):
            raise ValueError(f"unvalidated={unvalidated!r}: use 'refuse' or 'warn'")
        self.store = Store(store_root, store_options)
        self.store.check_readable()
        self.verify = verify
        self.version = version or published_version(self.store, unvalidated)
        # The lease first, then the records: a deletion either sees this reader or marks before it reads them.
        self._lease = leases.ReaderLease(self.store, self.version, "training" if retired == "index" else "reading")
        try:
            self._open(partial, dequantize, retired, unvalidated)
        except BaseException:
            self._lease.release()  # a reader that failed to open holds nothing (its traceback may live on)
            raise

    def _open(self, partial: bool, dequantize: bool, retired: str, unvalidated: str) -> None:
        self.store.attrs(self.version)  # unreadable: its own StoreError (no repair restores it)
        self._raise_on(check_version_attrs(self.store, self.version))
        if why := validation_status(self.store, self.version):
            msg = f"store version {self.store.loc.url_of(self.version)} is not validated: {why}"
            if unvalidated == "refuse":
                raise StoreError(f"{msg}. Refusing to read it: {unvalidated_fix(self.store, self.version, why)}")
            log.warning("%s; reading it anyway (unvalidated='warn')", msg)
        self.attrs = self.store.attrs(self.version)
        self.logical = self.attrs["logical_dtype"]
        self.precision = quant.scheme(self.attrs)  # fp8 / int8 / int4 (/ int8-row): dequantized on read
        self.dequantize = dequantize or self.precision == "full"
        self.logical_torch = DTYPES[self.logical][1]  # the dtype of the values this dataset stands for
        self.layer_ids: list[int] = self.attrs["layer_ids"]
        self.samples: list[SampleRef] = []
        self._files: dict[str, dict] = {}  # unit -> the files its commit record lists
        self._shard_tokens: dict[str, int] = {}
        self._file_index: dict[str, tuple[dict[int, list], list]] = {}  # unit -> _read_files' index
        self._local = isinstance(self.store.loc, LocalLocation)
        # (unit, shard file) this process checked (_check_shards) -> the file's identity then (Location.identity)
        self._verified: dict[tuple[str, str], tuple[int, ...] | None] = {}
        units = sorted(set(self.store.units(self.version)) | set(self.store.planned_units(self.version)))
        record = retention_record.read_record(self.store, self.version)
        gone = retention_record.retired(record, units)
        self.retired: dict[str, str] = {}  # unit -> why it cannot be read (its data were deleted by retention)
        if gone and retired == "refuse":
            entry = retention_record.version_retired(record)
            raise StoreError(
                retention_record.describe(self.store, self.version, entry, None)
                if entry
                else retention_record.describe(self.store, self.version, next(iter(gone.values())), sorted(gone))
            )
        for unit in units:
            if unit in gone:  # in the index as planned (it was complete when deleted); never read
                self.retired[unit] = retention_record.describe(self.store, self.version, gone[unit], [unit])
                plan = self.store.plan_record(self.version, unit)
                if plan is None:
                    raise StoreError(f"{self.retired[unit]} (and its plan record, which lists its samples, is missing)")
                self._shard_tokens[unit] = plan["shard_tokens"]
                self.samples += [SampleRef(sid, unit, start, length) for sid, start, length in plan["samples"]]
                continue
            problems = self._check_meta(unit)
            self._raise_on([p for p in problems if p.kind != INCOMPLETE or not partial])
            rec = self.store.commit_record(self.version, unit)
            self._files[unit] = rec.get("files") or {}
            committed = rec["committed_tokens"]
            if not committed:  # nothing of it committed yet (partial: a unit being planned may not have its
                continue  # attributes yet; a damage check's poll during a run met that as a KeyError)
            ua = self.store.unit_attrs(self.version, unit)
            self._shard_tokens[unit] = ua["shard_tokens"]
            for sid, start, length in ua["samples"]:
                if start + length <= committed:  # readers see committed samples only
                    self.samples.append(SampleRef(sid, unit, start, length))
        self._raise_on(duplicate_samples((s.sample_id, s.unit) for s in self.samples))
        self._by_id = {s.sample_id: i for i, s in enumerate(self.samples)}
        self._arrays: dict[str, dict] = {}
        self._pid: int | None = None
        # the damage a read found (in this process, or in its parent before the fork or spawn of a DataLoader
        # worker): every later read refuses, never serving the other units' samples as if nothing were wrong
        self._refused: str | None = None
        self._opened = True  # (an error from here on is found by a read: _error says what it means)

    def _check_meta(self, unit: str) -> list[Problem]:
        """The unit's records and attributes (no file reads beyond them): storage.verify.check_unit without
        the file checks, which run when the unit is first opened."""
        problems, _, _ = check_unit(
            self.store, self.version, unit, bool(self.attrs.get("capture_last")), None, self.precision
        )
        return problems

    def _raise_on(self, problems: list[Problem]) -> None:
        if problems:
            raise self._error(problems)

    def _error(self, problems: list[Problem]) -> StoreError:
        p = problems[0]
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        what = (
            "This reader reads nothing more of this version (every later read raises this error)"
            if getattr(self, "_opened", False)
            else "Nothing of this version is read"
        )
        return StoreError(
            f"store {self.store.loc.url_of(self.version)}: unit {p.unit}, array {p.array}, file {p.file}: "
            f"{p.what}{more}. {what}: `dflash-pipeline verify {self.store.url} "
            f"--version {self.version} --repair` lists every problem and discards what is damaged, and rerunning "
            "extract on this store then repairs it"
        )

    def _check_files(self, unit: str) -> None:
        """Every file the unit's commit record lists: present with its committed size, and the content of its
        small files (ids, mask, metadata); with "digests" each shard's when a sample first touches it."""
        rel = f"{self.version}/units/{unit}"
        listing = self.store.loc.list_files(rel)
        problems = []
        for f, want in sorted(self._files[unit].items()):
            array = f.split("/", 1)[0] if "/" in f else "-"
            if want is None:
                if what := null_entry_problem(f, f in listing):
                    problems.append(Problem(unit, array, f"units/{unit}/{f}", what))
                continue
            size = listing.get(f)
            if size is None:
                problems.append(
                    Problem(unit, array, f"units/{unit}/{f}", f"missing (committed with {want['size']} bytes)")
                )
            elif size != want["size"]:
                problems.append(
                    Problem(unit, array, f"units/{unit}/{f}", f"{size} bytes, committed with {want['size']}")
                )
            elif _shard_of(f) is None:
                self._check_digest(unit, f, want)
        self._raise_on(problems)

    def _check_digest(self, unit: str, f: str, want: dict) -> None:
        got = (self.store.loc.digest_of(f"{self.version}/units/{unit}/{f}") or {}).get(digest.ALGORITHM)
        if got != want.get(digest.ALGORITHM):
            array = f.split("/", 1)[0] if "/" in f else "-"
            self._raise_on(
                [Problem(unit, array, f"units/{unit}/{f}", "content differs from the commit record's digest")]
            )

    def _read_files(self, unit: str, start: int, end: int) -> list[tuple[str, dict]]:
        """The committed files a read of tokens [start, end) of the unit uses: its shards of each sharded array, and
        the chunks of input_ids and loss_mask (indexed once per unit: a unit may have hundreds of shards)."""
        if unit not in self._file_index:
            by_shard: dict[int, list] = {}
            always = []
            for f, want in self._files[unit].items():
                if want is None:
                    continue
                idx = _shard_of(f)
                if idx is not None:
                    by_shard.setdefault(idx, []).append((f, want))
                elif f.startswith(("input_ids/c/", "loss_mask/c/")):
                    always.append((f, want))
            self._file_index[unit] = (by_shard, always)
        by_shard, always = self._file_index[unit]
        shard = self._shard_tokens[unit]
        return [x for i in range(start // shard, (end - 1) // shard + 1) for x in by_shard.get(i, [])] + always

    def _check_shards(self, unit: str, files: list[tuple[str, dict]]) -> None:
        """The shards among `files` (_read_files) of the unit, each once per process: in "digests" mode their whole
        content; else their chunk index and each chunk's CRC32C (a few small reads: storage.digest.of_chunks), so
        intact chunks rearranged or a shard replaced by another intact one is an error too (commit records from
        before that entry have none: checked in "digests" mode only)."""
        for f, want in files:
            if _shard_of(f) is None or (unit, f) in self._verified:
                continue
            before = self.store.loc.identity(f"{self.version}/units/{unit}/{f}")
            if self.verify == "digests":
                self._check_digest(unit, f, want)
            elif digest.CHUNKS in want:
                rel = f"{self.version}/units/{unit}/{f}"
                try:
                    n = chunks_per_shard(self._unit_arrays(unit)[f.split("/", 1)[0]])
                    got = self.store.loc.chunks_of(rel, want["size"], n)
                except OSError as e:  # gone or unreadable since the unit was opened
                    got = f"the file cannot be read: {e.strerror or e}"
                if got != want[digest.CHUNKS]:
                    why = got if not digest.is_digest(got) else "rearranged, or the shard replaced by another"
                    problem = f"its chunks differ from the commit record ({why})"
                    self._raise_on([Problem(unit, f.split("/", 1)[0], f"units/{unit}/{f}", problem)])
            self._verified[(unit, f)] = before

    def _check_still_there(self, ref: SampleRef, files: list[tuple[str, dict]]) -> None:
        """After a read of a local store: every file it used is still there with its committed size. zarr reads a
        file deleted after the unit was checked as fill values (a damage check: a shard deleted by another tool
        under a live reader, or by retention where the reader could take no lease, came back as zeros); one stat
        per file per sample. (Object storage: not checked here; retention refuses an s3:// store.)"""
        for f, want in files:
            ident = self.store.loc.identity(f"{self.version}/units/{ref.unit}/{f}")
            checked = self._verified.get((ref.unit, f))
            # (a shard replaced by another of its size after it was checked: a damage check read the other's values)
            if ident is None or ident[0] != want["size"] or (checked is not None and ident != checked):
                now = (
                    "gone" if ident is None
                    else f"{ident[0]} bytes, committed with {want['size']}" if ident[0] != want["size"]
                    else "replaced by another file since this process checked it"
                )  # fmt: skip
                raise StoreError(
                    f"store version {self.store.loc.url_of(self.version)}: units/{ref.unit}/{f} changed while this "
                    f"process read sample {ref.sample_id} ({now}), so its values are not returned, and this reader "
                    "reads nothing more of this version (every later read raises this error): something deleted "
                    "or rewrote the store's files under a reader (retention and pruning wait for readers; other "
                    f"tools do not). Run `dflash-pipeline verify {self.store.url} --version {self.version}`"
                )

    def close(self) -> None:
        """Release the lease on the version (also when the dataset is garbage-collected or the process ends)."""
        self._lease.release()

    def __enter__(self) -> HiddenStateDataset:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self) -> dict:
        # A copy in another process (DataLoader workers under spawn) reads under its parent's lease.
        state = dict(self.__dict__)
        state["_lease"] = leases.ReaderLease.detached()
        state["_arrays"], state["_pid"] = {}, None
        return state

    def __len__(self) -> int:
        return len(self.samples)

    def index_of(self, sample_id: str) -> int:
        return self._by_id[sample_id]

    def _unit_arrays(self, unit: str) -> dict:
        if self._pid != os.getpid():  # new process (DataLoader worker): drop inherited handles
            self._arrays, self._pid, self._verified = {}, os.getpid(), {}
        if unit not in self._arrays:
            self._check_files(unit)
            g = self.store.open_unit(self.version, unit)
            expected = (*sharded_arrays(bool(self.attrs.get("capture_last")), self.precision), "input_ids", "loss_mask")
            arrays = {k: g[k] for k in ARRAYS if k in expected and k in g}  # never an array no record covers
            self._raise_on(layout_problems(unit, arrays, self.attrs))
            self._arrays[unit] = arrays
        return self._arrays[unit]

    def __getitem__(self, i: int) -> dict:
        ref = self.samples[i]
        if ref.unit in self.retired:
            raise StoreError(f"sample {ref.sample_id}: {self.retired[ref.unit]}")
        if self._refused is not None:
            raise StoreError(
                f"sample {ref.sample_id} is not read: this reader found store version "
                f"{self.store.loc.url_of(self.version)} damaged and reads nothing more of it ({self._refused})"
            )
        try:
            return self._read(ref)
        except PassingReadError:
            raise
        except StoreError as e:  # damage found by a read: no other unit's samples are served after it
            self._refused = str(e)
            raise

    def _read(self, ref: SampleRef) -> dict:
        a = self._unit_arrays(ref.unit)
        files = self._read_files(ref.unit, ref.start, ref.start + ref.length)
        self._check_shards(ref.unit, files)
        sl = slice(ref.start, ref.start + ref.length)
        try:
            item = {
                "sample_id": ref.sample_id,
                "input_ids": torch.from_numpy(a["input_ids"][sl].astype("int64")),
                "loss_mask": torch.from_numpy(a["loss_mask"][sl]).bool(),
            }
            for name in ("hidden", "last_hidden"):
                if name not in a:
                    continue
                if self.dequantize:
                    item[name] = read_rows(a, name, sl, self.logical, self.precision)
                else:  # as stored, with the rows' scales
                    item[name] = torch.from_numpy(a[name][sl])
                    item[quant.SCALE_OF[name]] = torch.from_numpy(a[quant.SCALE_OF[name]][sl])
        except Exception as e:  # noqa: BLE001 - zarr's decode errors name no file: say which unit, array and file
            raise self._read_error(ref, a, sl, e) from e
        if self._local:
            self._check_still_there(ref, files)
        return item

    def _read_error(self, ref: SampleRef, arrays: dict, sl: slice, e: Exception) -> StoreError:
        """The StoreError for a failed read of sample `ref`: each array is read again one stored file (shard or
        chunk) at a time to find the first that cannot be decoded."""
        for name, arr in arrays.items():
            step = arr.shards[0] if getattr(arr, "shards", None) else arr.chunks[0]
            for i in range(sl.start // step, (sl.stop - 1) // step + 1):
                try:
                    arr[max(sl.start, i * step) : min(sl.stop, (i + 1) * step)]
                except Exception as err:  # noqa: BLE001
                    f = f"units/{ref.unit}/{name}/c/" + "/".join([str(i)] + ["0"] * (arr.ndim - 1))
                    what = f"cannot be decoded ({type(err).__name__}: {err}) reading sample {ref.sample_id}"
                    return self._error([Problem(ref.unit, name, f, what)])
        # every file read again whole: the failure was passing (a network's, a busy disk's), not damage found
        return PassingReadError(
            f"store {self.store.loc.url_of(self.version)}: unit {ref.unit}: sample {ref.sample_id} could not be read "
            f"({type(e).__name__}: {e}), but each of its files reads again intact: read it again; if this repeats, "
            f"`dflash-pipeline verify {self.store.url} --version {self.version}` checks every file"
        )


def read_rows(arrays, name: str, sl: slice, logical: str, precision: str) -> torch.Tensor:
    """Rows `sl` of array `name` ("hidden" or "last_hidden") of one unit (`arrays`: its zarr group, or a dict of
    its arrays) as a tensor in the logical dtype: bit-exact for precision "full", dequantized with the rows'
    scales (array `<name>_scale`) for fp8 / int8 / int4."""
    if precision == "full":
        return from_storage(arrays[name][sl], logical)
    return quant.dequantize(arrays[name][sl], arrays[quant.SCALE_OF[name]][sl], precision, DTYPES[logical][1])
