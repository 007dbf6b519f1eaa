"""Prefect task of the retention step (retention.mode after_export / consumed): deletes what training no
longer needs and publishes what it deleted, freed or had to leave for later."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from dflash_pipeline import stages
from dflash_pipeline.config import RunConfig
from dflash_pipeline.tasks.common import artifact_key, ends_stopped, run_logger


@task(name="store-retention", task_run_name="retention {cfg.retention.mode} of {version}", cache_policy=NO_CACHE)
@ends_stopped
def retain_task(cfg: RunConfig, version: str, export_dir: str | None):
    """Never retried: a deletion that cannot happen now waits in a request file for the next run."""
    result = stages.retain(cfg, version, export_dir)
    create_markdown_artifact(
        key=artifact_key("store-retention"),
        markdown=result.to_markdown(),
        description=f"hidden states deleted by retention.mode={cfg.retention.mode}",
    )
    log = run_logger()
    log.info("%s", result.line())
    for line in result.swept:
        log.info("retention: %s", line)
    return result
