"""Prefect's server on a real PostgreSQL (the session's throwaway cluster, tests/pgserver.py): `dflash-pipeline
serve --database`, one representative deployment run, and the load of a team (20 runs on several workers)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from dflash_pipeline.cli import main as cli_main
from dflash_pipeline.storage.store import Store
from tests.serving import DB_ERRORS, STORE_BUSY, api, free_port, logs, run_load


def test_serve_names_an_unreachable_database_and_the_fix(tmp_path):
    url = f"postgresql://prefect:hunter2@127.0.0.1:{free_port()}/prefect"
    res = subprocess.run(
        [sys.executable, "-m", "dflash_pipeline.cli", "serve", "--database", url, "--home", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2, res
    err = res.stderr.strip()
    assert "\n" not in err and "hunter2" not in err, err
    assert err.startswith(f"error: the database {url.replace('postgresql:', 'postgresql+asyncpg:')}"[:30]), err
    assert "prefect:***@127.0.0.1" in err and "Start PostgreSQL" in err, err
    assert not (tmp_path / "logs").exists()  # no server was started


def _rows(url: str, sql: str) -> list:
    import asyncpg

    async def go():
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            return await conn.fetch(sql)
        finally:
            await conn.close()

    return asyncio.run(go())


def test_a_full_deployment_run_on_postgres(pg_full_run):
    """What test_deployments.py checks on SQLite, for one representative run: every stage, the artifacts, the
    absolute store link, a verified store, and the run itself in PostgreSQL (not in a SQLite file beside it)."""
    lp, fr, out = pg_full_run
    assert fr.state.is_completed(), fr.state
    assert fr.name.startswith("full 20"), fr.name

    async def read(client):
        from prefect.client.schemas.filters import (
            ArtifactFilter,
            ArtifactFilterFlowRunId,
            FlowRunFilter,
            FlowRunFilterId,
        )

        tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
        arts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr.id]))
        )
        return tasks, arts

    tasks, arts = api(lp, read)
    names = " | ".join(sorted(t.name for t in tasks))
    for stage in ("prepare ", "probe ", "extract ", "validate ", "train drafter", "acceptance"):
        assert stage in names, names
    assert all(t.state.is_completed() for t in tasks), [(t.name, t.state.name) for t in tasks]
    keys = {a.key for a in arts}
    published = {"compat-probe", "extract-throughput", "validation", "run-summary", "store", "train-loss-curve"}
    assert published <= keys, keys
    link = next(a for a in arts if a.key == "store").data
    assert f"({(out / 'store' / 'v0001').absolute().as_uri()})" in link, link  # absolute: it opens from the UI
    assert Store(out / "store").current() == "v0001"
    assert cli_main(["verify", str(out / "store")]) == 0
    assert (out / "drafter" / "export" / "config.json").exists()

    rows = _rows(lp.database_url, f"SELECT state_name FROM flow_run WHERE id = '{fr.id}'")
    assert [r["state_name"] for r in rows] == ["Completed"]
    assert not list(lp.home.glob("*.db")), list(lp.home.iterdir())  # no SQLite database was made
    bad = [line for line in logs(lp)["server.log"].splitlines() if DB_ERRORS.search(line)]
    assert not bad, bad[:20]


@pytest.mark.load
def test_twenty_runs_on_three_workers_against_postgres(pg_server, pg_full_run, tmp_path):
    """A team's load: 20 extract-only runs submitted at once, three concurrent Prefect workers, ten stores (two
    runs each). Every run ends, Completed or Failed on its store's lock with that reason; none is lost or left
    Running; every store is complete and verifies; the server logs no database lock or connection error.
    (bench/prefect_load_bench.py runs the same load against PostgreSQL and SQLite: bench/RESULTS.md.)"""
    lp = pg_server
    try:
        r = run_load(lp, tmp_path, runs=20, workers=3, stores=10)
    finally:
        lp.stop()  # the extra workers; serve's own stays

        async def restore(client):
            from prefect.client.schemas.actions import DeploymentUpdate

            d = await client.read_deployment_by_name("dflash-pipeline/extract-only")
            await client.update_deployment(d.id, DeploymentUpdate(concurrency_limit=1))

        api(lp, restore)
    print("load on PostgreSQL:", json.dumps(r.figures()))
    (tmp_path / "figures.json").write_text(json.dumps(r.figures(), indent=2))
    assert not r.not_final, r.not_final
    assert sum(r.states.values()) == 20
    unclear = {i: m for i, m in r.failures.items() if STORE_BUSY not in m}
    assert not unclear, unclear
    assert r.states.get("Completed", 0) >= 10, r.states  # at least one run per store did the work
    assert r.max_running <= 3, r.max_running  # the deployment's limit held under three workers
    for store in r.stores:
        assert Store(store / "store").current() == "v0001", store
        assert cli_main(["verify", str(store / "store")]) == 0, store
    assert not r.db_errors, r.db_errors[:20]
    assert not r.api_errors, r.api_errors[:20]
