"""Retention in the Prefect flow: a run with retention.mode=after_export deletes the trained version's hidden states
after the export and shows it (a `store-retention` artifact with the bytes freed, the run summary)."""

from __future__ import annotations

import asyncio

from dflash_pipeline.storage import retention_record
from dflash_pipeline.storage.store import Store
from dflash_pipeline.tasks.common import artifact_key
from tests.serving import SMALL, TINY_TRAINING


def test_flow_deletes_after_export_and_publishes_it(prefect_harness, model_dir, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from dflash_pipeline.flows.pipeline import dflash_pipeline

    overrides = {
        "output_dir": str(tmp_path),
        "data.max_samples": 8,
        **SMALL,
        **TINY_TRAINING,
        "stages": ["prepare", "probe", "extract", "validate", "train"],
        "retention.mode": "after_export",
    }
    state = dflash_pipeline(overrides=overrides, return_state=True)
    assert state.is_completed(), state
    summary = state.result()
    store = Store(tmp_path / "store")
    assert summary.retention.startswith("retention after_export: v0001: ") and summary.bytes_freed > 0
    assert store.current() == "v0001" and store.units("v0001") == []
    assert retention_record.read_record(store, "v0001")["version"]["export"]["path"] == summary.drafter

    async def artifacts():
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(
                    flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])
                )
            )

    key = artifact_key("store-retention", store=summary.store)  # keys carry the store's suffix
    (art,) = [a for a in asyncio.run(artifacts()) if a.key == key]
    assert "freed" in art.data and "retention.mode=after_export" in art.data and "retention.json" in art.data
