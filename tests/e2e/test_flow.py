"""The Prefect flow end to end (ephemeral harness): stages, artifacts, CURRENT, no recompute on rerun."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from dflash_pipeline.storage.store import Store
from dflash_pipeline.tasks.common import artifact_key

EXTRACT_STAGES = ["prepare", "probe", "extract", "validate"]


def _artifacts(flow_run_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async def go():
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
            )

    return asyncio.run(go())


def test_pipeline_flow_runs_and_reruns_without_recompute(prefect_harness, model_dir, tmp_path):
    from dflash_pipeline.flows.pipeline import dflash_pipeline

    overrides = {
        "output_dir": str(tmp_path),
        "data.max_samples": 30,
        "extract.devices": "cpu",
        "layers.num_draft_layers": 3,
        "validate.recompute_samples": 2,
        "train.max_steps": 4,
        "train.block_size": 4,
        "train.anchors_per_sample": 16,
        "train.num_workers": 0,
        "evaluate.num_prompts": 2,
        "evaluate.max_new_tokens": 8,
    }
    state = dflash_pipeline(overrides=overrides, return_state=True)  # every default stage, train included
    assert state.is_completed(), state
    summary = state.result()
    assert summary.validation == "PASS" and summary.new_samples == 30 and summary.forward_passes > 0
    assert 1.0 <= summary.acceptance_length <= 4 and (tmp_path / "drafter" / "export" / "config.json").exists()
    store = Store(tmp_path / "store")
    assert store.current() == summary.version == "v0001"
    keys = {a.key for a in _artifacts(state.state_details.flow_run_id)}
    assert {
        artifact_key(name, store=str(tmp_path / "store"))  # every key is this store's own
        for name in (
            "prepared-dataset",
            "compat-probe",
            "preflight-plan",
            "extract-throughput",
            "extract-progress-cpu",
            "validation",
            "store",
            "train-loss",
            "train-summary",
            "acceptance",
            "run-summary",
        )
    } <= keys

    again = dflash_pipeline(overrides={**overrides, "stages": EXTRACT_STAGES})
    assert again.forward_passes == 0 and again.new_samples == 0 and again.validation == "PASS"


def test_flow_fails_clearly_on_bad_config(prefect_harness):
    from dflash_pipeline.errors import ConfigError
    from dflash_pipeline.flows.pipeline import dflash_pipeline

    with pytest.raises(ConfigError, match="layers.ids"):
        dflash_pipeline(overrides={"layers.preset": "explicit"})


def test_failed_validation_leaves_current_untouched(prefect_harness, model_dir, tmp_path, monkeypatch):
    import dflash_pipeline.extraction.extract as extract_mod
    from dflash_pipeline.errors import ValidationFailed
    from dflash_pipeline.flows.pipeline import dflash_pipeline

    base = {
        "output_dir": str(tmp_path),
        "extract.devices": "cpu",
        "extract.isolation": "thread",
        "layers.num_draft_layers": 2,
        "stages": EXTRACT_STAGES,
        "validate.recompute_samples": 0,
        "extract.incremental": True,
        "extract.new_version": True,
    }
    assert dflash_pipeline(overrides={**base, "data.max_samples": 10}).current == "v0001"
    # The new rows come from a broken extractor that writes and commits all-zero states (what inference
    # servers wrote for hybrid models): the files verify, so only validation can catch it.
    real = extract_mod.to_storage
    monkeypatch.setattr(extract_mod, "to_storage", lambda t, logical: np.zeros_like(real(t, logical)))
    with pytest.raises(ValidationFailed, match="all-zero token row"):
        dflash_pipeline(overrides={**base, "data.max_samples": 14})
    assert Store(tmp_path / "store").current() == "v0001"  # readers still see the last good version


def test_two_worker_processes_one_killed_is_retried_and_resumes(prefect_harness, model_dir, tmp_path, monkeypatch):
    """Two CPU workers in their own processes; one is SIGKILLed after its second shard write. Prefect
    retries that task alone, it resumes from its commit record, and the store validates."""
    from dflash_pipeline.flows.pipeline import dflash_pipeline
    from dflash_pipeline.storage.reader import HiddenStateDataset

    monkeypatch.setenv("DFLASH_KILL_AT", "after_shard_write:2")
    monkeypatch.setenv("DFLASH_KILL_ONCE", str(tmp_path / "killed-once"))
    overrides = {
        "output_dir": str(tmp_path),
        "data.max_samples": 40,
        "extract.devices": "cpu:0,cpu:1",
        "extract.isolation": "process",
        "layers.num_draft_layers": 2,
        "extract.unit_tokens": 800,
        "extract.shard_mib": 0.05,
        "extract.chunk_mib": 0.02,
        "extract.token_budget": 256,
        "extract.task_retries": 1,
        "validate.recompute_samples": 2,
        "stages": EXTRACT_STAGES,
    }
    state = dflash_pipeline(overrides=overrides, return_state=True)
    assert state.is_completed(), state
    assert (tmp_path / "killed-once").exists()  # a worker really died
    summary = state.result()
    assert summary.validation == "PASS" and len(HiddenStateDataset(tmp_path / "store")) == 40

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def task_runs():
        async with get_client() as c:
            return await c.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
            )

    workers = [t for t in asyncio.run(task_runs()) if t.name.startswith("extract ")]
    assert sorted(t.name.split(" on ")[-1] for t in workers) == ["cpu:0", "cpu:1"]
    assert sorted(t.run_count for t in workers) == [1, 2]  # only the killed one ran again
