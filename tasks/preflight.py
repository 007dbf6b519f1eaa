"""Prefect task: the pre-flight plan (core/planner.py) as a markdown artifact, before extraction starts."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from dflash_pipeline import stages
from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataprep.prepare import PrepareResult
from dflash_pipeline.extraction.probe import ProbeReport
from dflash_pipeline.tasks.common import artifact_key, ends_stopped, run_logger


@task(name="preflight-plan", task_run_name="plan store size and GPU-hours", cache_policy=NO_CACHE)
@ends_stopped
def estimate_task(cfg: RunConfig, report: ProbeReport, prepared: PrepareResult):
    est = stages.estimate(cfg, report, prepared)
    create_markdown_artifact(
        key=artifact_key("preflight-plan"), description="pre-flight plan", markdown=est.to_markdown()
    )
    log = run_logger()
    for line in est.lines():
        log.info("plan: %s", line)
    return est
