"""Deployments against a real Prefect server and a real process worker (loopback, SQLite).

Starts `dflash-pipeline serve` (server, work pool, deployments/prefect.yaml, a worker), triggers runs the way the
README does (`prefect deployment run ... -p overrides=...`, which replaces the whole `overrides` parameter), and
checks states, task runs, artifacts, processes and the store through the API and on disk. One server for the
module; the last tests kill its worker and SIGTERM `serve`, then start `serve` again on the same Prefect home and
SIGKILL it; everything is stopped even when a test fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from dflash_pipeline.deployments import PREFECT_FILE
from dflash_pipeline.embedded.build import CONVERSATIONS_MESSAGES
from dflash_pipeline.local_prefect import STOP_GRACE_S, LocalPrefect, check_api
from dflash_pipeline.storage.store import Store
from dflash_pipeline.tasks.common import artifact_key
from tests.proctree import descendants, wait_gone
from tests.serving import LOAD_SERVER_ENV, SMALL, TINY_TRAINING, api, logs, serve, stop_serve


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, wheel_env):
    """`dflash-pipeline serve` as a user starts it after `pip install .` (the wheel, not this checkout), from a
    directory of their own, with its own Prefect home: server, worker and flow runs all run the installed package.
    A handle for its API and CLI; everything it started is stopped even when a test fails. A run waiting for its
    deployment's slot asks again after 5 s (Prefect's default: 30), as on the load test's server."""
    home = tmp_path_factory.mktemp("prefect_home")
    user_dir = tmp_path_factory.mktemp("user_dir")
    env = {"PYTHONPATH": None, **LOAD_SERVER_ENV}
    with serve(home, python=wheel_env / "bin" / "python", workdir=user_dir, env=env) as lp:
        print(f"serve: up in {lp.startup_s:.0f} s")
        lp.startup_logs = "".join(logs(lp).values())
        yield lp


def _worker_pid(lp: LocalPrefect) -> int:
    """The Prefect worker `serve` started (it restarts one that dies)."""
    for _ in range(120):
        found = [p for p, cmd in descendants(lp.serve_proc.pid).items() if "worker start --pool" in cmd]
        if found:
            return found[0]
        time.sleep(0.5)
    raise AssertionError("no Prefect worker under serve")


def _wait(lp: LocalPrefect, run_id: str, timeout: float = 400):
    async def go(client):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fr = await client.read_flow_run(run_id)
            if fr.state and fr.state.is_final():
                return fr
            await asyncio.sleep(0.5)
        raise TimeoutError(f"flow run {run_id} not finished after {timeout} s")

    return api(lp, go)


def _task_runs_and_artifacts(lp: LocalPrefect, run_id: str):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId

    async def go(client):
        tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
        arts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
        )
        return tasks, arts

    return api(lp, go)


def _logs(lp: LocalPrefect, run_id: str) -> list:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async def go(client):
        return await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))

    return api(lp, go)


def _stages_run(tasks) -> set[str]:
    """Which stages ran, from the task runs' names."""
    prefixes = {"prepare ": "prepare", "probe ": "probe", "extract ": "extract", "validate ": "validate"}
    prefixes |= {"train drafter": "train", "acceptance": "evaluate"}
    return {stage for t in tasks for p, stage in prefixes.items() if t.name.startswith(p)}


@pytest.fixture(scope="module")
def shared_out(tmp_path_factory) -> Path:
    """The store extract-only writes and train-only (and the cancellation test) train from."""
    return tmp_path_factory.mktemp("deployed")


def test_every_deployment_keeps_its_preset_under_user_overrides(server, shared_out, tmp_path):
    """The README's `-p overrides='{"data.max_samples": ...}'` adds to a deployment; it never replaces what the
    deployment fixes (its stages, its store policy). Every deployment in prefect.yaml is run this way (nightly in
    the test below); an override that contradicts a preset fails the run, naming the key. train-only trains from
    the store extract-only made, so extract-only, on the way, runs its worker in a thread (the full run keeps the
    default, a worker process)."""
    names = {d["name"] for d in yaml.safe_load(PREFECT_FILE.read_text())["deployments"]}
    assert names == {"full", "extract-only", "train-only", "nightly"}
    extract_only = server.run_deployment(
        "extract-only",
        {"output_dir": str(shared_out), "data.max_samples": 8, **SMALL, "extract.isolation": "thread"},
    )
    full = server.run_deployment("full", {"output_dir": str(tmp_path), "data.max_samples": 8, **SMALL, **TINY_TRAINING})
    conflict = server.run_deployment("extract-only", {"output_dir": str(tmp_path / "x"), "stages": ["train"]})

    fr = _wait(server, extract_only)
    assert fr.state.is_completed(), fr.state
    assert fr.name.startswith("extract-only 20") and " cfg " in fr.name  # deployment, date, config digest
    tasks, arts = _task_runs_and_artifacts(server, extract_only)
    assert _stages_run(tasks) == {"prepare", "probe", "extract", "validate"}
    assert all(t.state.is_completed() for t in tasks)
    keys = {a.key for a in arts}
    shared_store = str(shared_out / "store")
    published = ("compat-probe", "extract-throughput", "validation", "run-summary", "store")
    assert {artifact_key(name, store=shared_store) for name in published} <= keys  # the store's own keys
    link = next(a for a in arts if a.key == artifact_key("store", store=shared_store)).data
    assert f"(file://{shared_out}/store/v0001)" in link, link  # absolute: it opens from the UI
    assert Store(shared_out / "store").current() == "v0001"

    train_only = server.run_deployment("train-only", {"output_dir": str(shared_out), **SMALL, **TINY_TRAINING})

    fr = _wait(server, full)
    assert fr.state.is_completed(), fr.state
    assert _stages_run(_task_runs_and_artifacts(server, full)[0]) == {
        "prepare",
        "probe",
        "extract",
        "validate",
        "train",
        "evaluate",
    }
    assert (tmp_path / "drafter" / "export" / "config.json").exists()
    # the logic packages' own loggers reach the UI, with rates
    logs = _logs(server, full)
    assert any(r.name == "dflash_pipeline.extraction.extract" and "tokens/s" in r.message for r in logs), {
        r.name for r in logs
    }

    fr = _wait(server, conflict)
    assert fr.state.is_failed() and "extract-only deployment fixes stages" in fr.state.message, fr.state
    assert not (tmp_path / "x").exists()  # nothing was done
    said = [r.message for r in _logs(server, conflict)]  # the user's mistake is one line in the UI, no traceback
    assert any("fixes stages" in m for m in said) and not any("Traceback" in m for m in said), said

    fr = _wait(server, train_only)
    assert fr.state.is_completed(), fr.state
    tasks, arts = _task_runs_and_artifacts(server, train_only)
    stages = _stages_run(tasks)
    assert {"train", "evaluate"} <= stages and not stages & {"extract", "validate"}
    summary = next(a for a in arts if a.key == artifact_key("run-summary", store=shared_store)).data  # (had none)
    assert "| acceptance length |" in summary and "| drafter |" in summary, summary
    assert (shared_out / "drafter" / "export" / "config.json").exists()


def test_a_failed_night_leaves_current_and_the_next_night_publishes(server, tmp_path):
    """Night 2's extraction worker is killed (no retries): the run fails naming the worker and its signal,
    CURRENT stays. Night 3 resumes the unfinished version and publishes it after validation. (A version whose
    validation failed is repaired or discarded instead: tests/integration/test_nightly_recovery.py, which also runs
    a first night on an empty store.) Night 1, the published version the failed night must leave alone, is made in this
    process from the nightly deployment's own preset (the flow's compose_overrides): only nights 2 and 3 need the
    deployment."""
    from dflash_pipeline.config import load_config
    from dflash_pipeline.flows.pipeline import compose_overrides
    from dflash_pipeline.order import LocalRunner, run_pipeline

    rows = CONVERSATIONS_MESSAGES.read_text().splitlines()
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(rows[:20]) + "\n")
    # nights 1 and 3 run the worker in a thread (night 2's is a process, to be killed)
    overrides = {"output_dir": str(tmp_path), "data.source": str(data), **SMALL, "extract.isolation": "thread"}
    (nightly,) = [d for d in yaml.safe_load(PREFECT_FILE.read_text())["deployments"] if d["name"] == "nightly"]
    preset = nightly["parameters"]["preset"]
    assert preset["extract.incremental"] and preset["extract.new_version"]
    first = run_pipeline(load_config(None, compose_overrides(preset, overrides)), LocalRunner())
    assert first.current == "v0001" and first.validation == "PASS"
    store = Store(tmp_path / "store")
    assert store.current() == "v0001"

    data.write_text("\n".join(rows[:28]) + "\n")  # eight new conversations arrive ...
    failed = _wait(
        server,
        server.run_deployment(
            "nightly",
            {**overrides, "extract.isolation": "process", "extract.task_retries": 0},
            job_env={"DFLASH_KILL_AT": "after_shard_write:1"},  # ... and the night's worker dies
        ),
    )
    assert failed.state.is_failed(), failed.state
    assert "extraction worker on cpu (pid" in failed.state.message and "SIGKILL" in failed.state.message
    assert store.current() == "v0001" and store.versions() == ["v0001", "v0002"]
    store_path = str(tmp_path / "store")  # the artifact keys' scope
    failed_arts = _task_runs_and_artifacts(server, failed.id)[1]  # a failed night publishes what it did, and why
    failed_summary = next(a for a in failed_arts if a.key == artifact_key("run-summary", store=store_path)).data
    assert "FAILED" in failed_summary and "extract-hidden-states: " in failed_summary, failed_summary

    run_id = server.run_deployment("nightly", overrides)
    good = _wait(server, run_id)
    assert good.state.is_completed(), good.state
    assert store.current() == "v0002" and store.versions() == ["v0001", "v0002"]
    new_units = [u for u in store.units("v0002") if u not in store.units("v0001")]
    # only the new rows went through the model: the published unit is shared, unchanged
    assert store.units("v0001") == ["u00000"] and new_units
    assert store.unit_attrs("v0002", "u00000")["samples"] == store.unit_attrs("v0001", "u00000")["samples"]
    assert all(store.commit_record("v0002", u)["complete"] for u in store.units("v0002"))
    tasks, arts = _task_runs_and_artifacts(server, run_id)
    assert _stages_run(tasks) == {"prepare", "probe", "extract", "validate"}
    throughput = next(a for a in arts if a.key == artifact_key("extract-throughput", store=store_path))
    table = throughput.data if isinstance(throughput.data, list) else json.loads(throughput.data)
    assert table[-1]["device"].startswith("total")
    summary = next(a for a in arts if a.key == artifact_key("run-summary", store=store_path)).data
    assert "v0001 / v0002 (promoted)" in summary


def test_cancelling_a_run_in_training_stops_it_without_retry(server, shared_out, tmp_path):
    """What the UI's Cancel does (set the flow run's state to CANCELLING): the worker stops the flow-run process
    during training (with DataLoader workers, as by default); the training saves a checkpoint, the run ends
    Cancelled, the training task ran once, and no process of the run is left."""
    from prefect.states import Cancelling

    if Store(shared_out / "store").current() is None:  # made by the extract-only run above, unless run alone
        extracted = _wait(server, server.run_deployment("extract-only", {"output_dir": str(shared_out), **SMALL}))
        assert extracted.state.is_completed(), extracted.state
    long = {**TINY_TRAINING, "train.max_steps": 100000, "train.epochs": 100000.0, "train.output_dir": str(tmp_path)}
    long["train.num_workers"] = 2  # the default: its DataLoader workers get the group's SIGTERM too
    run_id = server.run_deployment("train-only", {"output_dir": str(shared_out), **SMALL, **long})

    async def training_started(client):
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        for _ in range(300):
            trs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
            fr = await client.read_flow_run(run_id)
            assert not fr.state.is_final(), fr.state
            if any(t.name.startswith("train drafter") and t.state.is_running() for t in trs):
                return
            await asyncio.sleep(1)
        raise TimeoutError("training never started")

    api(server, training_started)
    deadline = time.monotonic() + 120
    while not any("train step" in log.message for log in _logs(server, run_id)):  # steps done: a checkpoint to save
        assert time.monotonic() < deadline, "no training step logged"
        time.sleep(0.5)
    run_procs = descendants(_worker_pid(server))
    assert run_procs, "the flow-run process is not a child of the worker"
    t0 = time.monotonic()
    api(server, lambda c: c.set_flow_run_state(run_id, Cancelling(message="cancelled from the UI"), force=True))
    fr = _wait(server, run_id, timeout=120)
    assert fr.state.is_cancelled(), fr.state
    left = wait_gone(run_procs, timeout=30)
    assert not left, left
    print(f"cancelled in {time.monotonic() - t0:.1f} s")
    tasks, _ = _task_runs_and_artifacts(server, run_id)
    train = [t for t in tasks if t.name.startswith("train drafter")]
    assert len(train) == 1 and train[0].run_count <= 1 and not train[0].state.is_completed(), train
    if not list((tmp_path / "checkpoints").glob("step-*")):  # what a CI log needs to tell why
        tail = "\n".join(f"{log.level} {log.message}" for log in _logs(server, run_id)[-25:])
        pytest.fail(f"no checkpoint saved on cancel; training task {train[0].state!r}; the run's last logs:\n{tail}")
    assert not (tmp_path / "export").exists()  # and no evaluation ran after it
    assert not any(t.name.startswith("acceptance") for t in tasks)


def test_a_killed_prefect_worker_is_restarted_and_the_server_stays_up(server):
    worker = _worker_pid(server)
    os.kill(worker, signal.SIGKILL)
    assert not wait_gone([worker], timeout=10)
    deadline = time.monotonic() + 60
    while _worker_pid(server) == worker:
        assert time.monotonic() < deadline, "serve did not start a new worker"
        time.sleep(0.5)
    assert server.serve_proc.poll() is None
    check_api(server.api_url)
    assert "starting a new one" in (server.home / "serve.out").read_text()


def test_sigterm_stops_serve_and_everything_it_started(server):
    started = descendants(server.serve_proc.pid)
    assert any("server start" in c for c in started.values()) and any("worker start" in c for c in started.values())
    t0 = time.monotonic()
    server.serve_proc.send_signal(signal.SIGTERM)
    assert server.serve_proc.wait(timeout=60) == 0
    left = wait_gone(started, timeout=30)
    elapsed = time.monotonic() - t0
    print(f"serve: every process gone {elapsed:.1f} s after SIGTERM")
    assert not left, left
    assert elapsed < STOP_GRACE_S, "a process of serve needed the SIGKILL after the grace"
    # start-up without SQLite lock errors (under concurrent runs on a loaded 2-core machine the server can still
    # log some: SQLite answers a read-then-write conflict at once, busy_timeout or not; Prefect retries them)
    assert "database is locked" not in server.startup_logs


def test_sigint_stops_serve_started_in_the_background(server):
    """`serve &` in a script starts it with SIGINT ignored, so Python installs no KeyboardInterrupt handler: a
    fresh-user check's `kill -INT` then did nothing for ten minutes. serve handles SIGINT itself."""
    if server.serve_proc.poll() is None:  # the SIGTERM test above did not run (this test alone)
        stop_serve(server)
    with serve(server.home, sigint_ignored=True) as lp:
        started = descendants(lp.serve_proc.pid)
        lp.serve_proc.send_signal(signal.SIGINT)
        assert lp.serve_proc.wait(timeout=60) == 0
        assert not wait_gone(started, timeout=30)
        assert "Ctrl-C: stopping the server" in (server.home / "serve.out").read_text()


def test_sigkill_of_serve_leaves_no_process(server, model_dir):
    """`serve` started again on the Prefect home of the one stopped above (a user restarting it: its database and
    work pool are found, not made again; the deployments are applied again), then SIGKILLed. SIGKILL runs no handler
    in serve: its guard process stops the server and worker it started."""
    if server.serve_proc.poll() is None:  # the SIGTERM test above did not run (this test alone)
        stop_serve(server)
    with serve(server.home) as lp:
        started = descendants(lp.serve_proc.pid)
        assert any("server start" in c for c in started.values()), started
        lp.serve_proc.kill()
        lp.serve_proc.wait()
        left = wait_gone(started, timeout=30)  # the guard's grace is 5 s after it notices (0.5 s)
        assert not left, left
