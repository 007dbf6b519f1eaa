"""The regenerate stage in the Prefect flow with the server backend: the task's progress artifact, its summary
artifact (counts by outcome, output lengths), and the regenerated file handed to prepare. The server is
bench/fake_openai_server.py (instant replies, a real HTTP server in its own process): this test is about the flow's
wiring; tests/integration/test_regenerate_server.py runs a real model server."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dflash_pipeline.tasks.common import artifact_key

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.server


@pytest.fixture
def fake_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "fake_openai_server.py"), "--port", str(port), "--model", "m"]
        + ["--reply-tokens", "6", "--fail", "503:1"],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.time() + 30
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            break
        except httpx.HTTPError:
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/v1"
    proc.terminate()
    proc.wait(timeout=10)


def _artifacts(flow_run_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async def go():
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
            )

    return asyncio.run(go())


def test_regenerate_through_a_server_in_the_flow(prefect_harness, model_dir, fake_server, tmp_path):
    from dflash_pipeline.flows.pipeline import dflash_pipeline

    overrides = {
        "output_dir": str(tmp_path),
        "data.max_samples": 12,
        "extract.devices": "cpu",
        "stages": ["regenerate", "prepare"],
        "regenerate.backend": "openai",
        "regenerate.base_url": fake_server,
        "regenerate.model": "m",
        "regenerate.server_wait_s": 5,
    }
    state = dflash_pipeline(overrides=overrides, return_state=True)
    assert state.is_completed(), state
    summary = state.result()
    out = tmp_path / "regenerated" / "conversations.jsonl"
    assert summary.regenerated == str(out) and summary.prepared
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 12 and all(r["regen"]["outcome"] == "ok" for r in rows)
    arts = {a.key: a for a in _artifacts(state.state_details.flow_run_id)}
    store = str(tmp_path / "store")  # every artifact key is scoped to the run's store
    assert arts[artifact_key("regenerate-progress", store=store)].data == 100.0
    md = arts[artifact_key("regenerated", store=store)].data
    assert "| ok | 12 | 12 |" in md and "1 retried requests" in md and "p50 6" in md and "model `m`" in md
