"""Verify a store version: every committed file present, of its committed size and (with digests) content,
every attribute readers depend on equal to its record, every planned unit there and committed.

The records checked (docs/STORE.md, "Integrity"):
- `<version>/version.json`: XXH3-128 of each version attribute readers depend on (layout.READER_ATTRS);
- `<version>/plans/<unit>.json`: the unit's attributes as planned (samples, n_tokens, chunking, dtype);
- `<version>/units/<unit>/commit.json`: committed tokens and every committed file with size and XXH3-128
  (the unit's zarr.json, so its attributes, among them).

Each problem is one `Problem` (unit, array, file, what); nothing here raises on damaged data. `kind` tells
damage ("damaged": a rerun of extract discards the unit and extracts its samples again) from work not yet
done ("incomplete": a rerun resumes it) and from data that retention deleted on purpose ("retired": the
version's `retention.json` says when, by whom and why; a rerun of extract re-extracts it) and from a damaged
record whose data are intact ("record": a plan record the committed attributes contradict, a missing version
record; repaired by rewriting the record, never by deleting data).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from dflash_pipeline.errors import StoreError
from dflash_pipeline.progress import counted, short
from dflash_pipeline.storage import digest, discard, quant, retention_record
from dflash_pipeline.storage.layout import (
    ARRAYS,
    COMPRESSIONS,
    DTYPES,
    PLANS,
    READER_ATTRS,
    SHARDED_ARRAYS,
    VERSION_RECORD,
    chunks_per_shard,
    commit_record_problem,
    sharded_arrays,
)
from dflash_pipeline.storage.plan_records import check_sample_table, unusable_plan
from dflash_pipeline.storage.store import PLANNED_KEYS, Store

log = logging.getLogger(__name__)
DAMAGED, INCOMPLETE, RETIRED, RECORD = "damaged", "incomplete", "retired", "record"
DUPLICATE = "duplicate"  # a unit holding samples another unit holds: which one belongs is for a person to say
DISCARDED = "discarded"  # a unit `verify --repair` discarded (<version>/discarded.json): a rerun of extract rebuilds it
REBUILD_PLAN = "`dflash-pipeline verify <store> --repair`, or a rerun of extract, rewrites it from them"
REBUILD_VERSION_RECORD = (
    "a rerun of extract with the same run (same model, layers, dtype and dataset) rebuilds it from the run's "
    "provenance, where every attribute it covers equals the run's"
)
CANNOT_REBUILD = (
    "nothing records which samples it held, so it cannot be rebuilt: delete the unit's directory and its plan "
    "record, and a rerun of extract plans those samples again into a new unit"
)


@dataclass(frozen=True)
class Problem:
    unit: str  # "-" for the version itself
    array: str  # "-" when no array is concerned
    file: str  # relative to the version directory
    what: str
    kind: str = DAMAGED

    def line(self) -> str:
        return f"unit {self.unit}  array {self.array}  file {self.file}: {self.what}"


@dataclass
class VerifyReport:
    version: str
    url: str
    digests: bool
    problems: list[Problem] = field(default_factory=list)
    units: int = 0
    files: int = 0
    bytes: int = 0  # bytes of the committed files (read whole when digests are checked)
    seconds: float = 0.0
    # False when the version's own attributes are damaged or unrecorded: the units were checked against attributes
    # nothing vouches for, so their problems may be the attributes' (`verify --repair` then discards no unit)
    attributes_vouched: bool = True
    duplicated: set[str] = field(default_factory=set)  # units holding samples another holds: no repair touches them
    misplaced: dict[str, str] = field(default_factory=dict)  # intact unit directories under another unit's name

    @property
    def ok(self) -> bool:
        return not self.problems

    def damaged_units(self, kinds: tuple[str, ...] = (DAMAGED,)) -> dict[str, list[str]]:
        """{unit: its problems} of the units with problems of `kinds`, except units holding samples another unit
        holds: which of the two belongs is for a person to say, so no repair discards or rebuilds them (found by a
        damage check: a plan record copied in was rebuilt into a unit of duplicates)."""
        out: dict[str, list[str]] = {}
        for p in self.problems:
            if p.kind in kinds and p.unit != "-" and p.unit not in self.duplicated:
                out.setdefault(p.unit, []).append(f"{p.file}: {p.what}")
        return out

    def units_to_rebuild(self) -> dict[str, list[str]]:
        """What a run of extract creates again from the plan records: damaged units and those already discarded."""
        return self.damaged_units((DAMAGED, DISCARDED))

    def summary(self) -> str:
        how = "sizes and XXH3-128 digests" if self.digests else "presence and sizes"
        rate = f", {self.bytes / max(self.seconds, 1e-9) / 1e9:.2f} GB/s" if self.digests else ""
        unfinished = len({p.unit for p in self.problems if p.kind == INCOMPLETE})
        records = sum(p.kind == RECORD for p in self.problems)
        deleted = [p for p in self.problems if p.kind == RETIRED]
        if self.ok:
            verdict = "healthy"
        elif deleted and deleted[0].unit == "-":
            verdict = "its data were deleted by retention (see the line above)"
        else:
            verdict = (
                f"{counted(len(self.problems), 'problem')}: {counted(len(self.damaged_units()), 'damaged unit')}, "
                f"{unfinished} unfinished"
            )
            if records:
                verdict += f", {records} damaged records of intact data (`verify --repair` rewrites them, see above)"
            if any(p.kind == DAMAGED and p.unit == "-" for p in self.problems):
                verdict += ", the version's own records or attributes damaged (see above)"
            if not self.attributes_vouched and self.damaged_units():
                verdict += " (the units were checked against those attributes: a rerun of extract first)"
            if discarded := [p.unit for p in self.problems if p.kind == DISCARDED]:
                n = counted(len(discarded), "unit")
                verdict += f", {n} discarded by `verify --repair` (a rerun of extract rebuilds them)"
            if deleted:
                verdict += f", {len(deleted)} deleted by retention ({retention_record.REEXTRACT})"
            if dupes := [p.unit for p in self.problems if p.kind == DUPLICATE]:
                verdict += f", {counted(len(dupes), 'unit')} holding samples another holds too ({', '.join(dupes)})"
            if self.misplaced:
                verdict += f", {len(self.misplaced)} intact unit directories under another unit's name (see above)"
        return (
            f"{self.url}: {verdict}; checked {counted(self.units, 'unit')}, {counted(self.files, 'file')}, "
            f"{self.bytes / 2**20:.1f} MiB ({how}) in {self.seconds:.2f} s{rate}"
        )


def _array_of(rel: str) -> str:
    head = rel.split("/", 1)[0]
    return head if head in ARRAYS else "-"


def check_version_attrs(store: Store, version: str) -> list[Problem]:
    """The version's attributes against the digests of its version record."""
    try:
        record = store.version_record(version)
    except (ValueError, OSError) as e:
        return [Problem("-", "-", VERSION_RECORD, f"version record unreadable: {e}; {REBUILD_VERSION_RECORD}", RECORD)]
    try:
        attrs = store.attrs(version)
    except Exception as e:  # noqa: BLE001 - a damaged zarr.json is a finding, not a crash
        what = str(e) if isinstance(e, StoreError) else f"version attributes unreadable: {type(e).__name__}: {e}"
        return [Problem("-", "-", "zarr.json", what)]
    if record is not None and not isinstance(record.get("attrs") if isinstance(record, dict) else None, dict):
        what = f"version record unreadable: no attrs digests in {short(record)}; {REBUILD_VERSION_RECORD}"
        return [Problem("-", "-", VERSION_RECORD, what, RECORD)]
    if record is None:
        if attrs.get("format_version") == 1:
            what = (
                "store format 1: written before integrity records existed, so nothing in it can be verified. "
                "Extract it again (extract.new_version=true writes a format-2 version beside it)"
            )
            return [Problem("-", "-", VERSION_RECORD, what)]
        what = f"version record missing, so the version's attributes cannot be checked; {REBUILD_VERSION_RECORD}"
        return [Problem("-", "-", VERSION_RECORD, what, RECORD)]
    problems = []
    for k, d in sorted(record.get("attrs", {}).items()):
        if k not in READER_ATTRS:  # the record never covers another attribute: it is the edited file
            what = f"version record covers attribute {k}, which it never records (edited); {REBUILD_VERSION_RECORD}"
            problems.append(Problem("-", "-", VERSION_RECORD, what, RECORD))
        elif k not in attrs:
            problems.append(Problem("-", "-", "zarr.json", f"version attribute {k} is missing"))
        elif not digest.is_digest(d):  # the record holds no digest there: it is the edited file
            what = f"version record's digest of {k} is {short(d)}, not an XXH3-128 digest; {REBUILD_VERSION_RECORD}"
            problems.append(Problem("-", "-", VERSION_RECORD, what, RECORD))
        elif digest.of_attr(attrs[k]) != d:
            problems.append(
                Problem(
                    "-",
                    "-",
                    "zarr.json",
                    f"version attribute {k} was altered (now {short(attrs[k])}; its XXH3-128 "
                    f"{digest.of_attr(attrs[k])} differs from the version record's {d}); a rerun of extract with "
                    "the same run restores whichever of the two differs from the run's provenance",
                )
            )
    missing = [k for k in READER_ATTRS if k in attrs and k not in record.get("attrs", {})]
    if missing:
        problems.append(Problem("-", "-", VERSION_RECORD, f"version record does not cover attributes {missing}"))
    return problems


def null_entry_problem(f: str, present: bool) -> str | None:
    """What is wrong with a commit record's `null` entry for file `f` of a unit (zarr wrote no file: every value is
    the fill value), `present`: whether the file exists. This package's writers write every file; a shard of
    stored states is never all fill values (hidden states are never all zero), so such an entry there is damage."""
    if f.split("/", 1)[0] in SHARDED_ARRAYS and "/c/" in f:
        return "recorded as no file (all fill values), but stored states are never all zero: the record was altered"
    if present:
        return "a file where the commit record says zarr wrote none (all fill values): the file or record was altered"
    return None


def committed_samples(attrs: dict, committed_tokens: int) -> int:
    """The number of a unit's samples its commit record's `committed_samples` holds: those with start + length <=
    committed_tokens (docs/STORE.md; the writer's count)."""
    return sum(1 for _, start, length in attrs["samples"] if start + length <= committed_tokens)


def committed_samples_problem(rec: dict, attrs: dict) -> str | None:
    """What is wrong with a commit record's `committed_samples` (informational: readers go by committed_tokens)
    against the unit's sample table, which the unit's commit record vouches for: a hand-edited count was published
    by the next run before (verify said "healthy", and exited 1 naming nothing). None: right, or not recorded."""
    n, committed = rec.get("committed_samples"), rec.get("committed_tokens", 0)
    try:
        want = committed_samples(attrs, committed)
    except (KeyError, TypeError, ValueError):  # a damaged sample table: check_sample_table names it
        return None
    if n is None or (type(n) is int and n == want):
        return None
    return (
        f"committed_samples is {short(n)}, but {want} of the unit's samples lie within its {committed} committed "
        "tokens (its sample table): the record was edited"
    )


def check_unit(
    store: Store, version: str, unit: str, capture_last: bool, digests: bool, precision: str = "full"
) -> tuple[list[Problem], int, int]:
    """(problems, files checked, bytes of the committed files) of one unit. `precision`: the version's
    (a compact one adds the scale arrays, whose shards are committed like the data's).

    The records are checked against each other before a unit is blamed: when the unit's attributes and its
    plan record disagree (or the plan record is missing or unreadable), the unit's zarr.json is compared with
    the digest its commit record holds; if they match, the attributes are as committed and the plan record is
    the damaged one (kind "record": repaired by rewriting it, never by touching the unit)."""
    rel = f"units/{unit}"
    unit_rel = f"{version}/{rel}"
    plan_rel = f"{PLANS}/{unit}.json"
    P = lambda file, what, kind=DAMAGED, array=None: Problem(  # noqa: E731
        unit, array or _array_of(file), f"{rel}/{file}" if file else rel, what, kind
    )
    plan_problem = None  # why the plan record does not vouch for the unit's attributes
    try:
        plan = store.plan_record(version, unit)
        if plan is not None and not isinstance(plan, dict):
            raise ValueError(f"not a JSON object: {short(plan)}")
    except (ValueError, OSError) as e:
        plan, plan_problem = None, f"plan record unreadable: {e}"
    if not store.loc.exists(f"{unit_rel}/zarr.json"):
        if plan is None:
            what = f"unit directory missing or not a zarr group, and its {plan_problem or 'plan record is missing'}"
            return [P("", what + f": {CANNOT_REBUILD}")], 0, 0
        n = len(plan.get("samples") or [])
        if entry := discard.record(store, version).get(unit):
            what = (
                f"discarded by `dflash-pipeline verify --repair` at {entry.get('at')} ({entry.get('why')}); a rerun "
                f"of extract on this store extracts its {n} samples again"
            )
            return [P("", what, DISCARDED)], 0, 0
        try:
            logical = store.attrs(version).get("logical_dtype")
        except Exception:  # noqa: BLE001 - the version's attributes: check_version_attrs names them
            logical = None
        if why := unusable_plan(plan, logical):
            what = (
                f"unit directory missing or not a zarr group, and its plan record cannot rebuild it ({why}): delete "
                f"{plan_rel}, and a rerun of extract plans its samples again into a new unit"
            )
            return [P("", what)], 0, 0
        return [P("", f"unit directory missing or not a zarr group (planned with {n} samples)")], 0, 0
    try:
        attrs = store.unit_attrs(version, unit)
    except Exception as e:  # noqa: BLE001
        return [P("zarr.json", f"unit attributes unreadable: {type(e).__name__}: {e}")], 0, 0
    if not attrs.get("planned"):
        if store.loc.exists(f"{unit_rel}/commit.json"):  # only a planned unit is ever committed: an edit
            what = f"attribute planned is {short(attrs.get('planned'))} in a unit with a commit record (it was altered)"
            return [P("zarr.json", what)], 0, 0
        return (
            [P("zarr.json", "half-planned (the planner was interrupted); the next extract plans it again", INCOMPLETE)],
            0,
            0,
        )
    problems: list[Problem] = []
    if plan is None:
        plan_problem = plan_problem or "plan record missing"
    else:
        diffs = [k for k in PLANNED_KEYS if attrs.get(k) != plan.get(k)]
        if plan.get("compression", "zstd") not in COMPRESSIONS:  # a rebuild would create the unit with it
            plan_problem = (
                f"the plan record's compression {short(plan.get('compression'))} is unknown (one of "
                f"{', '.join(COMPRESSIONS)})"
            )
        elif diffs:
            k = diffs[0]
            plan_problem = (
                f"attribute {k} differs from the plan record ({short(attrs.get(k))} != {short(plan.get(k))})"
                + (f" (and {diffs[1:]})" if len(diffs) > 1 else "")
            )
    try:
        rec = store.loc.read_json(f"{unit_rel}/commit.json")
    except ValueError as e:
        rec, commit_problem = None, f"commit record unreadable: {e}"
    else:
        commit_problem = (why := commit_record_problem(rec)) and f"commit record malformed: {why}"
        rec = None if commit_problem else rec
    if plan_problem:
        want = ((rec or {}).get("files") or {}).get("zarr.json") if isinstance(rec, dict) else None
        got = (store.loc.digest_of(f"{unit_rel}/zarr.json") or {}).get(digest.ALGORITHM) if want else None
        if want and got == want.get(digest.ALGORITHM) and not check_sample_table(attrs, P):
            what = (
                f"{plan_problem}; the unit's zarr.json equals its commit record's digest, so its attributes are as "
                f"committed and the plan record is the damaged one ({REBUILD_PLAN})"
            )
            problems.append(Problem(unit, "-", plan_rel, what, RECORD))
        elif plan is None:
            what = f"{plan_problem}, and the unit's attributes do not match its commit record: {CANNOT_REBUILD}"
            problems.append(Problem(unit, "-", plan_rel, what))
        else:
            problems.append(P("zarr.json", plan_problem))
    if commit_problem:
        return problems + [P("commit.json", commit_problem)], 0, 0
    problems += check_sample_table(attrs, P)
    listing = store.loc.list_files(unit_rel) if digests is not None or rec is None else {}
    if rec is None:
        shards = [
            f for f in listing if f.split("/", 1)[0] in SHARDED_ARRAYS and "/c/" in f and not f.endswith(".partial")
        ]
        if shards:  # a crash (or a full disk) before the unit's first commit leaves the same: nothing counts
            what = (
                f"no commit record, but {len(shards)} shard files exist: nothing of this unit counts as committed "
                "(interrupted before its first commit, or the record was deleted); a rerun extracts it again"
            )
            problems.append(P("commit.json", what, INCOMPLETE))
        else:
            problems.append(P("commit.json", "nothing committed yet (no commit record)", INCOMPLETE))
        return problems, 0, 0
    files: dict[str, dict | None] = rec.get("files") or {}
    if not files:
        return problems + [P("commit.json", "commit record lists no files (written before store format 2)")], 0, 0
    committed, n_tokens, shard = rec.get("committed_tokens", 0), attrs.get("n_tokens"), attrs.get("shard_tokens") or 1
    if not (committed % shard == 0 or committed == n_tokens) or bool(rec.get("complete")) != (committed == n_tokens):
        problems.append(
            P(
                "commit.json",
                f"commit record inconsistent: {committed} of {n_tokens} tokens, complete={rec.get('complete')}",
            )
        )
    elif not rec.get("complete"):
        problems.append(P("commit.json", f"not complete: {committed} of {n_tokens} tokens committed", INCOMPLETE))
    if not any(p.kind == DAMAGED for p in problems) and (count := committed_samples_problem(rec, attrs)):
        fix = f"`dflash-pipeline verify {store.url} --version {version} --repair`, or a rerun of extract, rewrites it"
        problems.append(P("commit.json", f"{count}; {fix} from the unit's data", RECORD))
    n_shards = -(-committed // shard)
    for array in sharded_arrays(capture_last, precision):
        listed = sum(1 for f in files if f.startswith(f"{array}/c/"))
        if listed != n_shards:
            problems.append(P(f"{array}/c", f"commit record lists {listed} shard files, {n_shards} are committed"))
    arrays = sharded_arrays(capture_last, precision)
    for f in ("zarr.json", *(f"{a}/zarr.json" for a in arrays), "input_ids/zarr.json", "loss_mask/zarr.json"):
        if f not in files:
            problems.append(P(f, "not covered by the commit record"))
    if digests is None:
        return problems, 0, 0
    n_bytes, per_shard, edited = 0, {}, []  # per_shard: array -> chunks per shard (its metadata, read once)
    for f, want in sorted(files.items()):
        if want is None:  # zarr wrote no file: every value is the fill value
            if what := null_entry_problem(f, f in listing):
                problems.append(P(f, what))
            continue
        n_bytes += want["size"]
        size = listing.get(f)
        if size is None:
            problems.append(P(f, f"missing (committed with {want['size']} bytes)"))
        elif size != want["size"]:
            problems.append(
                P(f, f"{size} bytes, committed with {want['size']} ({'truncated' if size < want['size'] else 'grown'})")
            )
        elif digests:
            got = (store.loc.digest_of(f"{unit_rel}/{f}") or {}).get(digest.ALGORITHM)
            if got != want.get(digest.ALGORITHM):
                what = (
                    f"content differs from the commit record (XXH3-128 {got}, committed {want.get(digest.ALGORITHM)})"
                )
                problems.append(P(f, what))
            elif digest.CHUNKS in want and _chunks_of(store, unit_rel, f, size, per_shard) != want[digest.CHUNKS]:
                # the file is as committed, its record's `chunks` is not: the default reader would refuse the shard
                # for good (a damage check), so the unit is rebuilt, with a true record
                edited.append(P(f, "the commit record's chunks entry differs from the file (the record was edited)"))
    # ... unless the array's own zarr.json is damaged: the shard's chunks were then read with a wrong layout (or
    # none), and the record is not to blame (a damage check saw it blamed)
    bad_meta = {p.array for p in problems if p.file == f"{rel}/{p.array}/zarr.json"}
    return problems + [p for p in edited if p.array not in bad_meta], len(files), n_bytes


def _chunks_of(store: Store, unit_rel: str, f: str, size: int, per_shard: dict[str, int | None]) -> str | None:
    """storage.digest.of_chunks of shard file `f` of a unit, laid out as its array's metadata says (None: that
    metadata cannot be read, which the array's own zarr.json digest reports). `per_shard` caches each array's
    chunks per shard across the unit's shards."""
    import zarr

    array = f.split("/", 1)[0]
    if array not in per_shard:
        try:
            per_shard[array] = chunks_per_shard(
                zarr.open_array(store=store.loc.zarr_store(f"{unit_rel}/{array}", read_only=True))
            )
        except Exception:  # noqa: BLE001 - damaged metadata is reported by its digest, not here
            per_shard[array] = None
    n = per_shard[array]
    return None if n is None else store.loc.chunks_of(f"{unit_rel}/{f}", size, n)


def layout_problems(unit: str, arrays: dict, attrs: dict, n_tokens: int | None = None) -> list[Problem]:
    """Each stored array's data type and per-token shape against what the version's attributes say it holds
    (precision and int8_scales, logical_dtype, layer_ids, hidden_size, capture_last), and with `n_tokens` (the
    unit's) its length too: attributes edited consistently with their records would otherwise decode another
    layout's bytes as their own (found by a damage check: a bare broadcast error, or an int8 store read with
    another scheme). The reader and verify check this; validation too, with the unit's token count."""
    try:
        scheme = quant.scheme(attrs)
        logical, k, hidden = DTYPES[attrs["logical_dtype"]][0], len(attrs["layer_ids"]), attrs["hidden_size"]
        want = {
            **quant.row_shapes(scheme, logical, k, hidden),
            "input_ids": ((), np.dtype("int32")),
            "loss_mask": ((), np.dtype("uint8")),
        }
        names = (*sharded_arrays(bool(attrs.get("capture_last")), scheme), "input_ids", "loss_mask")
    except (StoreError, KeyError, TypeError, ValueError) as e:  # damaged attributes: check_version_attrs says which
        return [Problem(unit, "-", "zarr.json", f"the version's attributes do not describe a layout: {e}")]
    problems = []
    for name in names:
        a = arrays.get(name)
        row, dtype = want[name]
        if a is None:
            problems.append(Problem(unit, name, f"units/{unit}/{name}", "missing: the version's attributes need it"))
        elif tuple(a.shape[1:]) != row or a.dtype != dtype:
            what = (
                f"stored as {a.dtype} {list(a.shape[1:])} per token, but the version's attributes (precision "
                f"{scheme}, logical_dtype {attrs['logical_dtype']}, hidden_size {attrs['hidden_size']}) say {dtype} "
                f"{list(row)}: the unit's array metadata and the version's attributes disagree. If `verify` reports "
                "no damaged version attribute, the unit is damaged: `verify --repair` discards it and a rerun "
                "rebuilds it"
            )
            problems.append(Problem(unit, name, f"units/{unit}/{name}/zarr.json", what))
        elif n_tokens is not None and a.shape[0] != n_tokens:
            what = f"holds {a.shape[0]} tokens, the unit's attributes {n_tokens}"
            problems.append(Problem(unit, name, f"units/{unit}/{name}/zarr.json", what))
    return problems


def verify_version(store: Store, version: str, digests: bool = True, threads: int = 4) -> VerifyReport:
    """Check everything of `version`; never raises on damaged data (problems are in the report)."""
    from dflash_pipeline.storage.duplicates import duplicate_problems  # (these build on this module's Problem)
    from dflash_pipeline.storage.misplaced import misplaced_problems, misplaced_units

    t0 = time.monotonic()
    report = VerifyReport(version, store.loc.url_of(version), digests)
    attr_problems = check_version_attrs(store, version)
    report.problems += attr_problems
    report.attributes_vouched = not attr_problems
    try:
        attrs = store.attrs(version)
        capture_last, precision = bool(attrs.get("capture_last")), quant.scheme(attrs)
    except Exception:  # noqa: BLE001 - reported above
        attrs, capture_last, precision = None, False, "full"
    units = sorted(set(store.units(version)) | set(store.planned_units(version)))
    report.units = len(units)
    try:
        record = retention_record.read_record(store, version)
    except StoreError as e:
        report.problems.append(Problem("-", "-", retention_record.RECORD, str(e)))
        record = {}
    gone = retention_record.retired(record, units)
    if entry := retention_record.version_retired(record):
        report.problems.append(
            Problem("-", "-", retention_record.RECORD, retention_record.describe(store, version, entry), RETIRED)
        )
    else:
        for u in sorted(gone):
            what = retention_record.describe(store, version, gone[u], [u], hint=False)
            report.problems.append(Problem(u, "-", f"units/{u}", what, RETIRED))
    units = [u for u in units if u not in gone]

    def check(u: str) -> tuple[list[Problem], int, int]:
        problems, n_files, n_bytes = check_unit(store, version, u, capture_last, digests, precision)
        # (against attributes nothing vouches for, every unit would disagree with an edited one: found by a damage
        # check, where `verify --repair` then discarded every intact unit of the version)
        if attrs is not None and report.attributes_vouched and store.loc.exists(f"{version}/units/{u}/zarr.json"):
            try:
                g = store.open_unit(version, u)
                problems += layout_problems(u, {k: g[k] for k in ARRAYS if k in g}, attrs)
            except Exception as e:  # noqa: BLE001 - unreadable array metadata: check_unit names the file
                log.debug("unit %s: arrays not opened for the layout check: %s", u, e)
        return problems, n_files, n_bytes

    with ThreadPoolExecutor(max(1, threads)) as pool:
        for problems, n_files, n_bytes in pool.map(check, units):
            report.problems += problems
            report.files += n_files
            report.bytes += n_bytes
    dupes, report.duplicated = duplicate_problems(store, version, units)
    # a duplicated unit's records cannot vouch for each other (its "damaged plan record" is a copy's attributes)
    report.problems = [p for p in report.problems if not (p.kind == RECORD and p.unit in report.duplicated)] + dupes
    # plan records that disagree with intact units because the directories were swapped are not the damaged ones
    report.misplaced = misplaced_units(store, version, report.problems)
    report.problems = [p for p in report.problems if not (p.kind == RECORD and p.unit in report.misplaced)]
    report.problems += misplaced_problems(store, version, report.misplaced)
    if not units and not gone:
        report.problems.append(Problem("-", "-", "units", "no units: nothing was ever planned", INCOMPLETE))
    report.seconds = time.monotonic() - t0
    return report


def damaged_units(store: Store, version: str, digests: bool = False) -> dict[str, list[str]]:
    """{unit: its problems} of the units that fail verification (damage, not unfinished work)."""
    return verify_version(store, version, digests).damaged_units()
