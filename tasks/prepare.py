"""Prefect task: dataset preparation, with the quarantine report as a table artifact."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from dflash_pipeline import stages
from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataprep.prepare import PrepareResult, load_quarantine
from dflash_pipeline.extraction.probe import ProbeReport
from dflash_pipeline.tasks.common import artifact_key, run_logger


@task(name="prepare-dataset", task_run_name="prepare {cfg.data.source}", cache_policy=NO_CACHE)
def prepare_task(cfg: RunConfig, report: ProbeReport) -> PrepareResult:
    log = run_logger()
    res = stages.prepare(cfg, report, progress=lambda n, rate: log.info("prepare: %d rows read (%.0f rows/s)", n, rate))
    quarantine = load_quarantine(res)
    if quarantine:
        create_table_artifact(
            key=artifact_key("quarantine"),
            table=quarantine[:1000],
            description=f"{len(quarantine)} quarantined rows of {res.source} "
            f"(first 1000 shown; all in {res.quarantine_path})",
        )
        log.warning("%d rows quarantined; see %s", len(quarantine), res.quarantine_path)
    dropped = "\n".join(f"| dropped: {k} | {v} |" for k, v in res.dropped.items())
    create_markdown_artifact(
        key=artifact_key("prepared-dataset"),
        description="prepared dataset",
        markdown=f"""
# Prepared dataset {res.fingerprint}{" (reused)" if res.reused else ""}
| item | value |
| --- | --- |
| source | `{res.source}` |
| output | `{res.path}` |
| rows read | {res.n_rows} |
| samples | {res.n_samples} |
| tokens / supervised | {res.n_tokens} / {res.n_supervised_tokens} |
| quarantined | {res.quarantined} |
{dropped}
""",
    )
    return res
