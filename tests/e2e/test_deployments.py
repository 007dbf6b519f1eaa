"""Deployments against a real Prefect server and a real process worker (loopback, SQLite).

Starts `prefect server start`, creates the work pool, deploys deployments/prefect.yaml, starts a worker,
triggers runs with `prefect deployment run ... -p overrides=...`, and checks states, task runs, artifacts
and the store through the API and on disk. Server and worker are stopped even when a test fails.
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from dflash_pipeline.embedded.build import CONVERSATIONS_MESSAGES
from dflash_pipeline.serve import LocalPrefect
from dflash_pipeline.storage.store import Store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    lp = LocalPrefect(port=_free_port(), home=tmp_path_factory.mktemp("prefect_home"))
    try:
        lp.start_server()
        lp.apply_deployments()
        lp.start_worker()
        yield lp
    finally:
        lp.stop()


def _api(lp: LocalPrefect, fn):
    """Call `fn(client)` against this test's server, whatever else this pytest session has configured
    (the session's ephemeral harness sets PREFECT_API_URL in a settings context, above the environment)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def go():
        async with get_client() as client:
            return await fn(client)

    with temporary_settings(updates={PREFECT_API_URL: lp.api_url}):
        return asyncio.run(go())


def _wait(lp: LocalPrefect, run_id: str, timeout: float = 400):
    async def go(client):
        for _ in range(int(timeout / 2)):
            fr = await client.read_flow_run(run_id)
            if fr.state and fr.state.is_final():
                return fr
            await asyncio.sleep(2)
        raise TimeoutError(f"flow run {run_id} not finished after {timeout} s")

    return _api(lp, go)


def _task_runs_and_artifacts(lp: LocalPrefect, run_id: str):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId

    async def go(client):
        tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
        arts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
        )
        return tasks, arts

    return _api(lp, go)


def _logs(lp: LocalPrefect, run_id: str) -> list:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async def go(client):
        return await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))

    return _api(lp, go)


def test_extract_only_deployment_with_override(server, tmp_path):
    run_id = server.run_deployment(
        "extract-only",
        {
            "stages": ["prepare", "probe", "extract", "validate"],
            "output_dir": str(tmp_path),
            "data.max_samples": 16,
            "extract.devices": "cpu",
            "layers.num_draft_layers": 2,
        },
    )
    fr = _wait(server, run_id)
    assert fr.state.is_completed(), fr.state
    tasks, arts = _task_runs_and_artifacts(server, run_id)
    names = {t.name for t in tasks}
    assert {
        "prepare embedded",
        "probe embedded",
        "plan store units",
        "extract 1 units on cpu",
        "validate v0001",
    } <= names
    assert all(t.state.is_completed() for t in tasks)
    keys = {a.key for a in arts}
    assert {"compat-probe", "extract-throughput", "validation", "run-summary", "store"} <= keys
    assert Store(tmp_path / "store").current() == "v0001"
    # the logic packages' own loggers reach the UI, with rates
    logs = _logs(server, run_id)
    assert any(r.name == "dflash_pipeline.extraction.extract" and "tokens/s" in r.message for r in logs), {
        r.name for r in logs
    }


def test_nightly_adds_only_new_rows_and_moves_current_after_validation(server, tmp_path):
    rows = CONVERSATIONS_MESSAGES.read_text().splitlines()
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(rows[:20]) + "\n")
    overrides = {
        "output_dir": str(tmp_path),
        "data.source": str(data),
        "extract.devices": "cpu",
        "layers.num_draft_layers": 2,
        "stages": ["prepare", "probe", "extract", "validate"],
        "extract.incremental": True,
        "extract.new_version": True,
    }
    first = _wait(server, server.run_deployment("nightly", overrides))
    assert first.state.is_completed(), first.state
    store = Store(tmp_path / "store")
    assert store.current() == "v0001"

    data.write_text("\n".join(rows[:28]) + "\n")  # eight new conversations arrive
    run_id = server.run_deployment("nightly", overrides)
    second = _wait(server, run_id)
    assert second.state.is_completed(), second.state
    assert store.current() == "v0002" and store.versions() == ["v0001", "v0002"]
    new_units = [u for u in store.units("v0002") if u not in store.units("v0001")]
    new_samples = sum(len(store.unit_attrs("v0002", u)["samples"]) for u in new_units)
    assert new_samples == 8 - 0  # only the new rows went through the model
    tasks, arts = _task_runs_and_artifacts(server, run_id)
    validate = next(t for t in tasks if t.name.startswith("validate"))
    assert validate.state.is_completed()
    throughput = next(a for a in arts if a.key == "extract-throughput")
    table = throughput.data if isinstance(throughput.data, list) else json.loads(throughput.data)
    assert table[-1]["tokens"] == sum(store.unit_info("v0002", u).n_tokens for u in new_units)
    summary = next(a for a in arts if a.key == "run-summary").data
    assert "| new samples | 8 |" in summary and "v0001 / v0002 (promoted)" in summary
