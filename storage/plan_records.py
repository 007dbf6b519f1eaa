"""Plan records (`<version>/plans/<unit>.json`, docs/STORE.md): what one must hold to rebuild its unit from, and
rewriting the damaged ones from the unit's committed attributes. storage/verify.py checks units against them."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from dflash_pipeline.progress import short
from dflash_pipeline.storage.layout import PLANS
from dflash_pipeline.storage.store import PLANNED_KEYS, Store

if TYPE_CHECKING:
    from dflash_pipeline.storage.verify import Problem, VerifyReport


def check_sample_table(attrs: dict, P) -> list[Problem]:
    """Whether `samples` ([id, start, length] ...) lay end to end from 0 over `n_tokens` (a unit's attributes or
    its plan record); problems made by `P(file, detail)`."""
    samples, n = attrs.get("samples"), attrs.get("n_tokens")
    try:
        if not samples:
            return [P("zarr.json", "sample table empty: a unit is planned with at least one sample")]
        if twice := [sid for sid, k in Counter(s[0] for s in samples).items() if k > 1]:
            return [P("zarr.json", f"sample table lists sample {twice[0]} more than once")]  # (a rebuild stored it so)
        pos = 0
        for sid, start, length in samples:
            if start != pos or length <= 0:
                return [P("zarr.json", f"sample table broken at sample {sid}: starts at {start}, expected {pos}")]
            pos += length
        if pos != n:
            return [P("zarr.json", f"sample table covers {pos} tokens, the unit has {n}")]
    except (TypeError, ValueError) as e:
        return [P("zarr.json", f"sample table unreadable: {e}")]
    return []


def unusable_plan(plan: dict, logical_dtype: str | None) -> str | None:
    """Why a plan record cannot rebuild its unit (None: it can): its sample table, its chunking, or its logical
    dtype against the version's. A damage check rebuilt units from edited plan records in a loop (a unit of the
    wrong dtype failing validation after every rebuild) or into a traceback (a chunking zarr refuses)."""
    if table := check_sample_table(plan, lambda _file, detail: detail):
        return table[0]
    chunk, shard = plan.get("chunk_tokens"), plan.get("shard_tokens")
    if not (type(chunk) is int and type(shard) is int and 0 < chunk <= shard and shard % chunk == 0):
        return f"chunk_tokens {short(chunk)}, shard_tokens {short(shard)}: no chunking (a shard is whole chunks)"
    if logical_dtype is not None and plan.get("logical_dtype") != logical_dtype:
        return f"logical_dtype {short(plan.get('logical_dtype'))} is not the version's {logical_dtype}"
    return None


def compression_of(store: Store, version: str, unit: str) -> str:
    """The `compression` of a unit's arrays (zstd, lz4 or none), read from its `hidden` array's zarr.json (a file
    its commit record covers)."""
    meta = store.loc.read_json(f"{version}/units/{unit}/hidden/zarr.json") or {}
    codecs = meta.get("codecs") or []
    inner = codecs[0].get("configuration", {}).get("codecs", []) if codecs else []
    for c in inner:
        if c.get("name") == "blosc":
            return c["configuration"]["cname"]
    return "none"


def rebuild_plan_records(store: Store, report: VerifyReport) -> list[str]:
    """Rewrite every plan record that `report` found damaged while the unit's attributes are as committed
    (problem kind "record" on plans/<unit>.json), from those attributes, and every commit record whose
    `committed_samples` alone is wrong (kind "record" on units/<unit>/commit.json), from the unit's sample table and
    committed tokens; the unit's data are not touched. Returns one line per record rewritten. (`verify --repair`,
    a nightly run's heal and the planner of every run with extract call it.)"""
    from dflash_pipeline.storage.verify import RECORD

    done = []
    damaged = report.damaged_units()  # (their commit records go with them; their plan records rebuild them)
    for p in report.problems:
        if p.kind != RECORD or p.unit in report.duplicated:
            continue
        if p.file == f"units/{p.unit}/commit.json":
            done += [] if p.unit in damaged else _rewrite_committed_samples(store, report.version, p.unit)
            continue
        if not p.file.startswith(f"{PLANS}/"):
            continue
        attrs = store.unit_attrs(report.version, p.unit)
        plan = {k: attrs[k] for k in PLANNED_KEYS}
        plan["compression"] = compression_of(store, report.version, p.unit)
        store.loc.write_json_atomic(f"{report.version}/{p.file}", plan)
        done.append(
            f"rewrote {p.file} from unit {p.unit}'s committed attributes ({len(plan['samples'])} samples); "
            "its data were not touched"
        )
    return done


def _rewrite_committed_samples(store: Store, version: str, unit: str) -> list[str]:
    """The unit's commit record with its `committed_samples` counted again from the unit's sample table (nothing
    else of it changes: a validation that vouched for the record as it was written vouches for it again)."""
    from dflash_pipeline.storage.verify import committed_samples

    rel = f"{version}/units/{unit}/commit.json"
    rec = store.loc.read_json(rel)
    was = rec.get("committed_samples")
    rec["committed_samples"] = committed_samples(store.unit_attrs(version, unit), rec.get("committed_tokens", 0))
    store.loc.write_json_atomic(rel, rec)
    return [
        f"rewrote units/{unit}/commit.json's committed_samples ({short(was)} -> {rec['committed_samples']}) from the "
        "unit's sample table and committed_tokens; its data were not touched"
    ]
