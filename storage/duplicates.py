"""Units of one version that hold the same samples (a unit directory copied into the version, or planned twice):
found by the reader in the samples it indexes, and by `verify`, which says which unit does not belong when the
records show it. No repair touches either unit of such a pair (docs/STORE.md, "Integrity (format 2)")."""

from __future__ import annotations

from collections.abc import Iterable

from dflash_pipeline.progress import counted
from dflash_pipeline.storage.layout import PLANS
from dflash_pipeline.storage.store import Store
from dflash_pipeline.storage.verify import DUPLICATE, Problem


def _duplicates(samples: Iterable[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """(sample_id, unit) pairs, in reading order -> {unit: [(sample_id, the earlier unit holding it too)]}."""
    first: dict[str, str] = {}
    dupes: dict[str, list[tuple[str, str]]] = {}
    for sid, unit in samples:
        other = first.setdefault(sid, unit)
        if other != unit:
            dupes.setdefault(unit, []).append((sid, other))
    return dupes


def _duplicate_line(pairs: list[tuple[str, str]]) -> str:
    return f"holds {counted(len(pairs), 'sample')} that unit {pairs[0][1]} holds too (e.g. sample {pairs[0][0]})"


def duplicate_samples(samples: Iterable[tuple[str, str]]) -> list[Problem]:
    """(sample_id, unit) pairs, in reading order -> one problem per unit that holds samples an earlier unit holds
    too (a unit directory copied into the version, or planned twice). Not repaired automatically: either copy may
    be the one that belongs; `verify` says which, when the records show it (`duplicate_problems`)."""
    return [
        Problem(
            unit,
            "-",
            f"units/{unit}",
            f"{_duplicate_line(pairs)}: a version stores each sample once; `dflash-pipeline verify` says which "
            "of the two does not belong and what to delete",
            DUPLICATE,
        )
        for unit, pairs in _duplicates(samples).items()
    ]


def duplicate_problems(store: Store, version: str, units: list[str]) -> tuple[list[Problem], set[str]]:
    """verify's problems for units holding the same samples, and every unit involved (no repair touches them). A
    unit whose plan record lists other samples than its attributes had its directory replaced by a copy of the
    other unit (found by a damage check, either way round): it is named, with its fix; otherwise the later unit
    is, with both possible fixes."""
    problems, involved = [], set()
    for unit, pairs in _duplicates(pair for u in units for pair in _sample_ids(store, version, u)).items():
        other = pairs[0][1]
        involved |= {unit, other}
        replaced = next((u for u in (unit, other) if _replaced_by_copy(store, version, u)), None)
        if replaced is not None:
            what = (
                f"holds the samples of unit {unit if replaced == other else other} (e.g. sample {pairs[0][0]}), "
                f"while its plan record {PLANS}/{replaced}.json lists others: its directory was replaced by a copy of "
                f"that unit. Delete units/{replaced} only (not its plan record): a rerun of extract rebuilds it from "
                "the plan record"
            )
            problems.append(Problem(replaced, "-", f"units/{replaced}", what, DUPLICATE))
        else:
            plan = (
                f" and {PLANS}/{unit}.json"
                if store.loc.exists(store._plan_rel(version, unit))
                else " (it has no plan record)"
            )
            what = (
                f"{_duplicate_line(pairs)}: a version stores each sample once. If this unit was copied in, "
                f"delete its directory{plan}; if the other one was, delete that one's; then verify again"
            )
            problems.append(Problem(unit, "-", f"units/{unit}", what, DUPLICATE))
    return problems, involved


def _sample_ids(store: Store, version: str, unit: str) -> list[tuple[str, str]]:
    """The unit's (sample_id, unit) pairs from its attributes, else its plan record; none when both are unreadable
    (reported by check_unit)."""
    for read in (store.unit_attrs, store.plan_record):
        try:
            return [(str(sid), unit) for sid, _, _ in (read(version, unit) or {}).get("samples") or []]
        except Exception:  # noqa: BLE001 - damaged: check_unit names it
            continue
    return []


def _replaced_by_copy(store: Store, version: str, unit: str) -> bool:
    """Whether the unit's directory holds other samples than its plan record lists (both readable)."""
    try:
        planned = {str(s[0]) for s in (store.plan_record(version, unit) or {}).get("samples") or []}
        held = {str(s[0]) for s in store.unit_attrs(version, unit).get("samples") or []}
    except Exception:  # noqa: BLE001 - unreadable records: check_unit names them
        return False
    return bool(planned) and bool(held) and planned != held
