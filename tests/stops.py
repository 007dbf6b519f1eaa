"""What a stopped run leaves, read from PostgreSQL itself (the server may be down): its flow run's and task runs'
final states, its run-summary artifact, its logs (issue 50; tests/e2e/test_stops.py, tests/e2e/test_postgres.py)."""

from __future__ import annotations

import asyncio
import json
import time


def db_rows(url: str, sql: str) -> list:
    import asyncpg

    async def go():
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            return await conn.fetch(sql)
        finally:
            await conn.close()

    return asyncio.run(go())


def db_state(url: str, run_id) -> tuple[str, float, str]:
    """(state name, epoch seconds of that state, its message) of a flow run, read from PostgreSQL itself (the server
    may be down)."""
    sql = (
        "SELECT s.name, extract(epoch from s.timestamp) AS t, s.message FROM flow_run f JOIN flow_run_state s "
        f"ON s.id = f.state_id WHERE f.id = '{run_id}'"
    )
    (row,) = db_rows(url, sql)
    return row["name"], float(row["t"]), row["message"] or ""


# Every task run of a stopped run is final within this of its flow run's final state (the flow run's own process
# sets them just before its own state; for a killed process `serve` does, on its next look, every second or so).
TASKS_FINAL_BOUND_S = 10.0

ACTIVE = ("PENDING", "RUNNING", "SCHEDULED", "CANCELLING", "PAUSED")


def task_runs(url: str, run_id) -> list[dict]:
    """The run's task runs as PostgreSQL holds them: name, state name and type, epoch seconds of the state, message."""
    sql = (
        "SELECT t.name, t.state_type::text AS type, t.state_name AS state, extract(epoch from t.state_timestamp) AS t, "
        "s.message FROM task_run t LEFT JOIN task_run_state s ON s.id = t.state_id "
        f"WHERE t.flow_run_id = '{run_id}' ORDER BY t.state_timestamp"
    )
    return [{**dict(r), "t": float(r["t"])} for r in db_rows(url, sql)]


def final_picture(url: str, run_id, wall0: float, bound_s: float = TASKS_FINAL_BOUND_S) -> dict:
    """Wait until the flow run and every task run of it are final (up to `bound_s` after the flow run's final state),
    then: the flow run's state, message and seconds from `wall0`, the task runs, their state counts, the seconds from
    the flow run's final state to the last task run's, and the run-summary artifact (its markdown)."""
    deadline = time.monotonic() + 300
    while (flow := db_state(url, run_id))[0] not in ("Completed", "Failed", "Cancelled", "Crashed"):
        assert time.monotonic() < deadline, flow
        time.sleep(0.5)
    name, at, message = flow
    deadline = time.time() + bound_s
    while True:
        tasks = task_runs(url, run_id)
        active = [t for t in tasks if t["type"] in ACTIVE]
        if not active or time.time() > deadline:
            break
        time.sleep(0.5)
    counts: dict[str, int] = {}
    for t in tasks:
        counts[t["state"]] = counts.get(t["state"], 0) + 1
    summary = db_rows(
        url,
        "SELECT data, description FROM artifact WHERE key LIKE 'run-summary-%' "
        f"AND flow_run_id = '{run_id}' ORDER BY created DESC LIMIT 1",
    )
    first = db_rows(
        url,
        "SELECT extract(epoch from min(timestamp)) AS t FROM flow_run_state WHERE type IN "
        f"('COMPLETED', 'FAILED', 'CANCELLED', 'CRASHED') AND flow_run_id = '{run_id}'",
    )[0]["t"]
    return {
        "state": name,
        "message": message,
        "final_s": at - wall0,
        "first_final_s": float(first) - wall0,  # the first final state (a worker may set one again later)
        "tasks": tasks,
        "active": active,
        "counts": counts,
        "tasks_after_flow_s": max((t["t"] for t in tasks), default=at) - at,
        "summary": _markdown(summary[0]["data"]) if summary else None,
    }


def run_logs(url: str, run_id) -> list[dict]:
    sql = f"SELECT level, name, message FROM log WHERE flow_run_id = '{run_id}' ORDER BY timestamp, id"
    return [dict(r) for r in db_rows(url, sql)]


def assert_no_task_left(p: dict) -> None:
    """Item 1 of issue 50: nothing Running beside a final flow run, and the task counts add up."""
    assert not p["active"], (p["state"], p["active"])
    assert sum(p["counts"].values()) == len(p["tasks"]), p["counts"]
    assert p["tasks_after_flow_s"] < TASKS_FINAL_BOUND_S, p


def _markdown(data) -> str:
    """A markdown artifact's data column: its text (a JSON string in PostgreSQL's json column)."""
    if isinstance(data, str) and data.startswith('"'):
        return json.loads(data)
    return str(data)
