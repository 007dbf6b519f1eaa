"""Issue 27's run records in the Prefect flow (ephemeral harness): a run started with a user's own YAML is named
after that file and the model and data it names (it showed 'embedded <- embedded'); a run that fails in a stage
publishes its run-summary saying FAILED, the stage and the error (a failed night published none); the artifact
keys are the store's own, so each store's "latest" comes from a run on that store."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import yaml

from dflash_pipeline.embedded.build import CONVERSATIONS_MESSAGES
from dflash_pipeline.tasks.common import artifact_key

PREPARE_ONLY = {"stages": ["prepare"], "data.max_samples": 4}


def _chats(path: Path, n: int = 4) -> Path:
    """A user's own JSONL of `n` conversations (the embedded ones)."""
    path.write_text("".join(CONVERSATIONS_MESSAGES.read_text().splitlines(keepends=True)[:n]))
    return path


def _api(go):
    from prefect.client.orchestration import get_client

    async def run():
        async with get_client() as client:
            return await go(client)

    return asyncio.run(run())


def _flow_run(flow_run_id):
    return _api(lambda client: client.read_flow_run(flow_run_id))


def _artifacts(flow_run_id) -> dict:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async def go(client):
        return await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )

    return {a.key: a for a in _api(go)}


def _latest(key: str):
    """The Artifacts page's entry of `key`: its latest artifact."""
    from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

    async def go(client):
        return await client.read_latest_artifacts(
            artifact_filter=ArtifactCollectionFilter(key=ArtifactCollectionFilterKey(any_=[key]))
        )

    (latest,) = _api(go)
    return latest


def test_a_run_of_a_users_yaml_is_named_after_that_file_its_model_and_data(prefect_harness, model_dir, tmp_path):
    """The README's nightly setup passes `config_path` alone: the name came from the overrides (none), so every
    run read 'embedded <- embedded'. It comes from the loaded config now, with the config file's name."""
    from dflash_pipeline.flows.pipeline import config_digest, dflash_pipeline

    config = tmp_path / "team-nightly.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "output_dir": str(tmp_path / "out"),
                "stages": ["prepare"],
                "target": {"model_path": model_dir},
                "data": {"source": str(_chats(tmp_path / "team-chats.jsonl")), "max_samples": 4},
            }
        )
    )
    state = dflash_pipeline(config_path=str(config), return_state=True)
    assert state.is_completed(), state
    name = _flow_run(state.state_details.flow_run_id).name
    model, digest = Path(model_dir).name, config_digest(str(config), None, None)
    assert re.fullmatch(
        rf"cli \d{{4}}-\d\d-\d\d \d\d:\d\d {re.escape(model)} <- team-chats\.jsonl cfg team-nightly\.yaml {digest}",
        name,
    ), name


def test_a_run_failing_in_a_stage_publishes_a_failed_run_summary(prefect_harness, model_dir, tmp_path):
    """A user error found inside the flow (the CLI's pre-flight reads rows, it does not tokenize them): every
    sample is longer than data.max_length, so prepare fails. The run-summary says FAILED, the stage and the error."""
    from dflash_pipeline.errors import DataError
    from dflash_pipeline.flows.pipeline import dflash_pipeline

    out = tmp_path / "out"
    overrides = {
        "output_dir": str(out),
        "stages": ["prepare", "probe", "extract", "validate"],
        "data.source": str(_chats(tmp_path / "long-chats.jsonl")),
        "data.max_length": 8,
    }
    state = dflash_pipeline(overrides=overrides, return_state=True)
    assert state.is_failed(), state
    error = state.result(raise_on_failure=False)
    assert isinstance(error, DataError) and "no usable samples" in str(error), error
    arts = _artifacts(state.state_details.flow_run_id)
    summary = arts.get(artifact_key("run-summary", store=str(out / "store")))
    assert summary is not None, sorted(map(str, arts))
    text = summary.data
    assert text.startswith("# Run summary: FAILED"), text
    outcome = next(line for line in text.splitlines() if line.startswith("| outcome |"))
    assert "**failed**: prepare-dataset: DataError: no usable samples in" in outcome, outcome
    assert "long-chats.jsonl" in outcome and "over max_length" in outcome, outcome
    assert f"| store | `{out / 'store'}` |" in text and "| validation | not run |" in text, text
    assert summary.description.startswith("FAILED: prepare-dataset: DataError"), summary.description


def test_two_stores_have_their_own_artifact_keys_and_latest(prefect_harness, model_dir, tmp_path):
    """Runs on two stores (both folders named `store`): each artifact key carries its store's suffix, and the
    latest artifact of each store's key comes from the run on that store, not from the run that came last."""
    from dflash_pipeline.flows.pipeline import dflash_pipeline

    runs = {}
    for name in ("a", "b"):
        out = tmp_path / name
        state = dflash_pipeline(overrides={**PREPARE_ONLY, "output_dir": str(out)}, return_state=True)
        assert state.is_completed(), state
        runs[str(out / "store")] = state.state_details.flow_run_id
    (store_a, run_a), (store_b, run_b) = runs.items()
    for stage_key in ("compat-probe", "prepared-dataset"):
        key_a, key_b = artifact_key(stage_key, store=store_a), artifact_key(stage_key, store=store_b)
        assert key_a != key_b and key_a.startswith(f"{stage_key}-store-") and key_b.startswith(f"{stage_key}-store-")
        assert key_a in _artifacts(run_a) and key_b in _artifacts(run_b)
        assert _latest(key_a).flow_run_id == run_a  # before: one key 'prepared-dataset', its latest from run b
        assert _latest(key_b).flow_run_id == run_b
