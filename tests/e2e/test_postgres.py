"""Prefect's server on a real PostgreSQL (the session's throwaway cluster, tests/pgserver.py): `dflash-pipeline
serve --database`, one representative deployment run, and the load of a team (20 runs on several workers)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dflash_pipeline.cli import main as cli_main
from dflash_pipeline.storage.store import Store
from dflash_pipeline.tasks.common import artifact_key
from tests.e2e.conftest import FULL_TINY
from tests.proctree import alive, descendants, wait_gone
from tests.serving import DB_ERRORS, SMALL, STORE_BUSY, TINY_TRAINING, api, free_port, logs, run_load, wait_final
from tests.stops import assert_no_task_left, db_rows, db_state, final_picture


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


PREFECT_TERMINATION = "Execution was aborted by a termination signal."


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
    key = {  # every key is this store's own: the Artifacts page's latest is this store's
        name: artifact_key(name, store=str(out / "store"))
        for name in ("compat-probe", "extract-throughput", "validation", "run-summary", "store", "train-loss-curve")
    }
    assert set(key.values()) <= keys, keys
    link = next(a for a in arts if a.key == key["store"]).data
    assert f"({(out / 'store' / 'v0001').absolute().as_uri()})" in link, link  # absolute: it opens from the UI
    assert Store(out / "store").current() == "v0001"
    assert cli_main(["verify", str(out / "store")]) == 0
    assert (out / "drafter" / "export" / "config.json").exists()

    rows = db_rows(lp.database_url, f"SELECT state_name FROM flow_run WHERE id = '{fr.id}'")
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


# ---- the team server survives its operators (issue 27) ------------------------------------------------------------
# A `full` run that trains until it is killed: the tiny training of FULL_TINY with no end in sight.
LONG_TRAINING = {"data.max_samples": 4, **SMALL, **TINY_TRAINING, "train.max_steps": 10**7, "train.epochs": 10**5}
NEXT_RUN_BOUND_S = 60.0  # the claim: the next run of the same deployment takes the slot within this after the kill
# ... and is Running within this (its flow-run process imports torch and Prefect: 15-40 s on a loaded 2-core box)
NEXT_RUNNING_BOUND_S = 120.0
CRASHED_BOUND_S = 60.0  # ... and the killed run is Crashed in the database within this


def _pending_at(url: str, run_id) -> float | None:
    """Epoch seconds of the run's last Pending state: when a worker took it and it got its deployment's slot."""
    sql = f"SELECT extract(epoch from max(timestamp)) AS t FROM flow_run_state WHERE flow_run_id = '{run_id}' "
    t = db_rows(url, sql + "AND type = 'PENDING'")[0]["t"]
    return None if t is None else float(t)


def _slot(url: str) -> int:
    """Active slots of the `full` deployment's concurrency limit."""
    sql = (
        "SELECT c.active_slots FROM deployment d JOIN concurrency_limit_v2 c ON c.id = d.concurrency_limit_id "
        "WHERE d.name = 'full'"
    )
    return db_rows(url, sql)[0]["active_slots"]


def _training(lp, run_id, timeout: float = 400, stage: str = "train drafter"):
    """Wait until the run's task `stage...` has begun (training: runs now, every stage before it done); returns the
    flow run."""

    async def go(client):
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        deadline = time.monotonic() + timeout
        while True:
            fr = await client.read_flow_run(run_id)
            assert not fr.state.is_final(), fr.state
            tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
            # training: running now; a quick stage (prepare): begun (it may be over by the next look)
            begun = [t for t in tasks if t.name.startswith(stage)]
            training = any(t.state.is_running() or stage != "train drafter" for t in begun)
            if training and fr.infrastructure_pid:
                return fr
            assert time.monotonic() < deadline, f"no training after {timeout} s: {fr.state}"
            await asyncio.sleep(1)

    return api(lp, go)


def _started(lp, run_id, timeout: float):
    """Wait until the run is Running (or further); returns the flow run."""

    async def go(client):
        deadline = time.monotonic() + timeout
        while True:
            fr = await client.read_flow_run(run_id)
            if fr.start_time or fr.state.is_final():
                return fr
            if time.monotonic() > deadline:
                return fr
            await asyncio.sleep(0.5)

    return api(lp, go)


def _awaiting_slot(lp, run_id, timeout: float) -> bool:
    """Wait until a worker has tried the run and the deployment's limit made it wait (AwaitingConcurrencySlot)."""

    async def go(client):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (await client.read_flow_run(run_id)).state.name == "AwaitingConcurrencySlot":
                return True
            await asyncio.sleep(0.5)
        return False

    return api(lp, go)


def _end(lp, run_ids) -> None:
    """A failed test's runs of the shared server's `full` deployment: their processes killed and the runs set
    Crashed (which frees the slot), so that the next test does not wait behind a run training forever. Best effort
    (it runs in a `finally`, and the server may be what failed): it never hides the test's own failure."""
    import httpx
    from prefect.exceptions import PrefectException
    from prefect.states import Crashed

    async def go(client):
        for run_id in filter(None, run_ids):
            fr = await client.read_flow_run(run_id)
            if fr.state.is_final():
                continue
            if fr.infrastructure_pid:
                with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                    os.killpg(int(str(fr.infrastructure_pid).split(":")[-1]), signal.SIGKILL)
            await client.set_flow_run_state(run_id, Crashed(message="ended by the test that started it"), force=True)

    try:
        api(lp, go)
    except (OSError, httpx.HTTPError, PrefectException) as e:
        print(f"could not end the runs {run_ids}: {e!r}")


def _serve_worker(lp) -> int:
    (pid,) = [p for p, c in descendants(lp.serve_proc.pid).items() if "worker start" in c]
    return pid


@pytest.mark.load
def test_a_killed_worker_crashes_its_run_and_frees_the_slot(pg_server, tmp_path):
    """SIGKILL of serve's Prefect worker while its run trains: the flow-run process (in a session of its own) stops
    too, the run is Crashed in the database, and the next run of the deployment, already waiting for the slot,
    starts within NEXT_RUN_BOUND_S of the kill on the worker serve starts in its place.

    In `make test-load` (issue 32: ~50 s of `make test`): a failure of the team server's own process, not a command a
    user types; `make test` keeps the user's side of it (tests/e2e/test_deployments.py: a killed Prefect worker is
    restarted and serve stays up; the PostgreSQL deployment run the README shows)."""
    from prefect.states import Cancelling

    lp = pg_server
    killed = lp.run_deployment("full", {**LONG_TRAINING, "output_dir": str(tmp_path / "a")})
    run_procs, nxt = set(), None
    try:
        fr = _training(lp, killed)  # mid-run: training (issue 50: where a dead worker's run hung, its console broken)
        flow_proc = int(fr.infrastructure_pid)
        run_procs = {flow_proc, *descendants(flow_proc)}
        # submitted once the first holds the slot (submitted together, either may take it first)
        nxt = lp.run_deployment("full", {**LONG_TRAINING, "output_dir": str(tmp_path / "b")})
        assert _awaiting_slot(lp, nxt, timeout=60), "the second run did not wait for the deployment's slot"
        worker = _serve_worker(lp)
        t0, wall0 = time.monotonic(), time.time()
        os.kill(worker, signal.SIGKILL)
        left = wait_gone(run_procs, timeout=30)
        gone_s = time.monotonic() - t0
        assert not left, f"the killed worker's run is still running: {left}"
        started = _started(lp, nxt, timeout=NEXT_RUNNING_BOUND_S)
        assert started.start_time, f"the next run did not start: {started.state}"
        next_s = started.start_time.timestamp() - wall0
        slot_s = _pending_at(lp.database_url, nxt) - wall0
        name, at, message = db_state(lp.database_url, killed)
        print(
            f"worker SIGKILL: run processes gone {gone_s:.1f} s, Crashed {at - wall0:.1f} s ({message}); the next "
            f"run took the slot {slot_s:.1f} s and was Running {next_s:.1f} s after the kill"
        )
        assert name == "Crashed" and at - wall0 < CRASHED_BOUND_S, (name, at - wall0, message)
        # the run's own end, not serve's fallback. "(SIGKILL)" only while serve has not yet reaped the dead worker
        # (runguard.exit_of reads its zombie). A known race (about one run in three here): Prefect's engine ends the
        # run with its own words before the run's stop handling runs, and then no summary or stop checkpoint is
        # written (docs/OPERATIONS.md, "How a run stops"); the task runs are still final.
        raced = message == PREFECT_TERMINATION
        assert "the worker process died" in message or raced, message
        assert slot_s < NEXT_RUN_BOUND_S and next_s < NEXT_RUNNING_BOUND_S, (slot_s, next_s)
        # issue 50: no task run left Running, and the summary says what happened, in words, and what resumes it
        p = final_picture(lp.database_url, killed, wall0)
        print(f"worker SIGKILL: task runs final {p['tasks_after_flow_s']:+.1f} s from the flow run: {p['counts']}")
        assert_no_task_left(p)
        summary = p["summary"] or ""
        if not raced:
            assert summary.startswith("# Run summary: CRASHED at train-drafter"), summary
            assert "the worker process died" in summary and "dflash-pipeline/full" in summary, summary
            assert "SystemExit" not in summary, summary
            assert list((tmp_path / "a" / "drafter" / "checkpoints").glob("step-*")), "no checkpoint at the death"
        api(lp, lambda client: client.set_flow_run_state(nxt, Cancelling()))  # the new worker stops its run
        (done,) = wait_final(lp, [nxt], timeout=120)
        assert done.state.is_cancelled(), done.state
        out = (lp.home / "serve.out").read_text()
        assert f"the Prefect worker (pid {worker}) exited with -9" in out, out[-2000:]
        assert "its flow runs stop and end Crashed" in out, out[-2000:]
    finally:
        for p in alive(run_procs):
            os.kill(p, signal.SIGKILL)
        _end(lp, [killed, nxt])


@pytest.mark.load
def test_serve_killed_or_stopped_mid_run_leaves_nothing_stuck(postgres, model_dir, tmp_path):
    """SIGTERM of `serve` while its run trains: every process stops and the run ends Crashed in the database
    before the server goes (its slot free). A restarted serve runs the next run of the deployment at once; SIGKILL
    of that serve: every process stops (parent-death signals, the guard), nothing can write the database, and the
    next serve sets the run Crashed before its worker starts; the run after that starts within NEXT_RUN_BOUND_S."""
    from tests.serving import serve

    url = postgres.create_database("recovery")
    home = tmp_path / "home"
    home.mkdir()
    timings = {}
    with serve(home, database=url) as lp:
        lp.database_url = url
        first = lp.run_deployment("full", {**LONG_TRAINING, "output_dir": str(tmp_path / "a")})
        _training(lp, first)
        procs = descendants(lp.serve_proc.pid)
        wall0 = time.time()
        lp.serve_proc.send_signal(signal.SIGTERM)
        assert lp.serve_proc.wait(timeout=60) == 0
        left = wait_gone(procs, timeout=30)
        timings["sigterm: every process gone"] = time.time() - wall0
        assert not left, left
    name, at, message = db_state(url, first)
    timings["sigterm: Crashed"] = at - wall0
    assert name == "Crashed" and at - wall0 < CRASHED_BOUND_S, (name, at - wall0, message)
    assert _slot(url) == 0
    # issue 50: the stopped run ended its task runs itself, saved a checkpoint and published its summary
    p = final_picture(url, first, wall0)
    timings["sigterm: task runs final after the flow run"] = p["tasks_after_flow_s"]
    assert_no_task_left(p)
    train = [t for t in p["tasks"] if t["name"].startswith("train drafter")]
    assert [t["state"] for t in train] == ["Crashed"] and "serve was stopped" in (train[0]["message"] or ""), train
    assert "serve was stopped" in message, message
    summary = p["summary"] or ""
    assert summary.startswith("# Run summary: CRASHED at train-drafter"), summary
    assert "serve was stopped" in summary and "prefect deployment run 'dflash-pipeline/full'" in summary, summary
    assert list((tmp_path / "a" / "drafter" / "checkpoints").glob("step-*")), "no checkpoint at serve's SIGTERM"
    out = (home / "serve.out").read_text()
    assert "SIGTERM: stopping" in out and "Traceback" not in out, out[-3000:]

    with serve(home, database=url) as lp:
        lp.database_url = url
        ready = time.time()
        second = lp.run_deployment("full", {**LONG_TRAINING, "output_dir": str(tmp_path / "b")})
        fr = _training(lp, second)
        timings["restart: next run took the slot"] = _pending_at(url, second) - ready
        timings["restart: next run Running"] = fr.start_time.timestamp() - ready
        procs = descendants(lp.serve_proc.pid)
        wall0 = time.time()
        lp.serve_proc.send_signal(signal.SIGKILL)
        lp.serve_proc.wait(timeout=10)
        left = wait_gone(procs, timeout=30)
        timings["sigkill: every process gone"] = time.time() - wall0
        assert not left, left

    with serve(home, database=url) as lp:
        lp.database_url = url
        ready = time.time()
        name, at, message = db_state(url, second)
        timings["sigkill: Crashed, from the next serve's ready banner (<0: before)"] = at - ready
        assert name == "Crashed" and "killed" in message, (name, message)
        p = final_picture(url, second, at)  # issue 50: its task runs too, with the flow run
        timings["sigkill: task runs final after the flow run"] = p["tasks_after_flow_s"]
        assert_no_task_left(p)
        (row,) = db_rows(url, f"SELECT name FROM flow_run WHERE id = '{second}'")
        assert f"flow run {row['name']} ({second}) was left RUNNING" in (home / "serve.out").read_text()
        third = lp.run_deployment("full", {**FULL_TINY, "output_dir": str(tmp_path / "c")})
        fr = _started(lp, third, timeout=NEXT_RUNNING_BOUND_S)
        assert fr.start_time, fr.state
        timings["sigkill: next run took the slot, from the next serve's banner"] = _pending_at(url, third) - ready
        timings["sigkill: next run Running, from the next serve's banner"] = fr.start_time.timestamp() - ready
        (done,) = wait_final(lp, [third], timeout=400)
        assert done.state.is_completed(), done.state
    print("serve stopped / killed mid-run:", json.dumps({k: round(v, 1) for k, v in timings.items()}))
    assert timings["restart: next run took the slot"] < NEXT_RUN_BOUND_S, timings
    assert timings["sigkill: next run took the slot, from the next serve's banner"] < NEXT_RUN_BOUND_S, timings
    assert timings["sigkill: next run Running, from the next serve's banner"] < NEXT_RUNNING_BOUND_S, timings


@pytest.mark.load
def test_a_run_without_heartbeats_is_crashed_by_the_zombie_automation(pg_server, tmp_path):
    """Prefect's zombie detection, as serve sets it up on PostgreSQL: a run training for longer than the window
    stays Running (its heartbeats, every HEARTBEAT_S s, keep it alive); frozen (SIGSTOP: no heartbeat, no report,
    what a dead machine looks like to the server), it is set Crashed by the automation within ZOMBIE_WITHIN_S plus
    one heartbeat period and the triggers service's 5 s evaluation, and the deployment's slot is freed."""
    from dflash_pipeline.local_prefect import HEARTBEAT_S, ZOMBIE_WITHIN_S

    lp = pg_server
    run_id = lp.run_deployment("full", {**LONG_TRAINING, "output_dir": str(tmp_path / "a")})
    fr = _training(lp, run_id)
    pid = int(fr.infrastructure_pid)
    try:
        time.sleep(ZOMBIE_WITHIN_S + HEARTBEAT_S)
        name, _, _ = db_state(lp.database_url, run_id)
        assert name == "Running", name  # a live run is never taken for a zombie
        wall0 = time.time()
        os.killpg(pid, signal.SIGSTOP)
        deadline = time.monotonic() + ZOMBIE_WITHIN_S + HEARTBEAT_S + 60
        while (state := db_state(lp.database_url, run_id))[0] != "Crashed":
            assert time.monotonic() < deadline, state
            time.sleep(2)
        print(f"zombie automation: Crashed {state[1] - wall0:.1f} s after the run froze ({state[2]})")
        assert "no heartbeat" in state[2], state
        assert _slot(lp.database_url) == 0
    finally:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _end(lp, [run_id])
