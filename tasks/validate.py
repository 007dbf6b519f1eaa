"""Prefect task: store validation. A failure fails the flow and is never retried."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from dflash_pipeline import stages
from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataprep.prepare import PrepareResult
from dflash_pipeline.extraction.probe import ProbeReport
from dflash_pipeline.extraction.validate import ValidationReport, raise_if_failed
from dflash_pipeline.tasks.common import artifact_key, ends_stopped


@task(name="validate-store", task_run_name="validate {version}", cache_policy=NO_CACHE, retries=0)
@ends_stopped
def validate_task(cfg: RunConfig, report: ProbeReport, prepared: PrepareResult, version: str) -> ValidationReport:
    result = stages.validate(cfg, report, prepared, version)
    create_markdown_artifact(
        key=artifact_key("validation"),
        markdown=result.to_markdown(),
        description=f"validation of {cfg.store}/{version}",
    )
    create_table_artifact(key=artifact_key("validation-checks"), table=result.checks, description="validation checks")
    raise_if_failed(result)
    return result
