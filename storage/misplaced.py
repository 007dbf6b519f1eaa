"""Unit directories renamed or swapped by hand (u00000 <-> u00001): each is intact, as committed, but under another
unit's name, so its attributes disagree with the plan record there. Rewriting those plan records from the attributes
(the repair of a damaged plan record) would keep every sample but change the version's sample order and unvalidate
it, with no record of why (a damage check found that); moving the directories back restores the version exactly as
it was validated. No repair moves them: `verify` names each directory and the commands that move them back, and a
rerun of extract refuses to touch the version until they are back."""

from __future__ import annotations

import json

from dflash_pipeline.storage.layout import PLANS
from dflash_pipeline.storage.store import Store
from dflash_pipeline.storage.verify import RECORD, Problem

MISPLACED = "misplaced"  # an intact unit directory under another unit's name (Problem.kind)


def misplaced_units(store: Store, version: str, problems: list[Problem]) -> dict[str, str]:
    """{directory name: the unit it belongs to} for the units whose intact, committed attributes (a "record"
    problem on their plan record) list exactly the samples another of them was planned with, where those moves form
    whole cycles: every destination's own directory moves away too, so moving them back overwrites nothing."""
    named = {p.unit for p in problems if p.kind == RECORD and p.file == f"{PLANS}/{p.unit}.json"}
    key = lambda samples: json.dumps(samples) if isinstance(samples, list) and samples else None  # noqa: E731
    planned: dict[str, str] = {}
    for u in named:
        try:
            plan = store.plan_record(version, u)
        except ValueError:
            continue
        if isinstance(plan, dict) and (k := key(plan.get("samples"))) is not None:
            planned[k] = u
    moves: dict[str, str] = {}
    for u in named:
        try:
            home = planned.get(key(store.unit_attrs(version, u).get("samples")))
        except Exception:  # noqa: BLE001 - unreadable attributes: not a misplaced unit (check_unit names them)
            continue
        if home is not None and home != u:
            moves[u] = home
    while stuck := [u for u, home in moves.items() if home not in moves]:  # (its destination is taken by a unit
        for u in stuck:  # that belongs there, or by damage: not a cycle, left to the other checks)
            del moves[u]
    return moves


def misplaced_problems(store: Store, version: str, moves: dict[str, str]) -> list[Problem]:
    """One problem per misplaced directory, with the commands that move them all back."""
    fix = move_back_commands(store, version, moves)
    return [
        Problem(
            u,
            "-",
            f"units/{u}",
            f"intact, but it holds the samples planned for unit {home} ({PLANS}/{home}.json): the unit directories "
            f"were renamed or swapped. Move them back (nothing is recomputed, and the version is as validated "
            f"again): {fix}",
            MISPLACED,
        )
        for u, home in sorted(moves.items())
    ]


def move_back_commands(store: Store, version: str, moves: dict[str, str]) -> str:
    """Shell commands that move every misplaced directory to its unit's name, through one spare name per cycle."""
    units = store.loc.url_of(f"{version}/units")
    cmds, left = [f"cd {units}"], dict(moves)
    while left:
        start = min(left)
        cmds.append(f"mv {start} {start}.moving")
        # walk the cycle backwards: the directory that belongs at `start` moves in once `start` is free
        free = start
        while (src := next(u for u, home in left.items() if home == free)) != start:
            cmds.append(f"mv {src} {free}")
            del left[src]
            free = src
        cmds.append(f"mv {start}.moving {free}")
        del left[start]
    return " && ".join(cmds)
