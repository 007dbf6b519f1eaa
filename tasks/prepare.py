"""Prefect task: dataset preparation, with the quarantine report as a table artifact."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from dflash_pipeline import stages
from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataprep.prepare import PrepareResult, load_quarantine
from dflash_pipeline.extraction.probe import ProbeReport
from dflash_pipeline.tasks.common import artifact_key, ends_stopped, run_logger


@task(name="prepare-dataset", task_run_name="prepare {cfg.data.source}", cache_policy=NO_CACHE)
@ends_stopped
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
    create_markdown_artifact(
        key=artifact_key("prepared-dataset"), description="prepared dataset", markdown=summary_markdown(res)
    )
    return res


def summary_markdown(res: PrepareResult) -> str:
    """The prepare stage's summary: where every row went (by reason), the token-length histogram and the share
    of supervised tokens."""
    rows = [
        ("source", f"`{res.source}`" + (f" ({res.encoding})" if res.encoding else "")),
        ("output", f"`{res.path}`"),
        ("rows read", res.n_rows),
        ("kept (samples)", res.n_samples),
        ("quarantined", res.quarantined),
        *((f"quarantined: {k}", v) for k, v in res.quarantined_by_reason.items()),
        ("dropped", sum(res.dropped.values())),
        *((f"dropped: {k}", v) for k, v in res.dropped.items()),
        ("tokens", res.n_tokens),
        ("supervised tokens", f"{res.n_supervised_tokens} ({100 * res.supervised_share:.1f}%)"),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    most = max(res.length_histogram.values(), default=1)
    hist = "\n".join(f"| {k} | {v} | {'#' * max(1, round(30 * v / most))} |" for k, v in res.length_histogram.items())
    return f"""
# Prepared dataset {res.fingerprint}{" (reused)" if res.reused else ""}
| item | value |
| --- | --- |
{table}

## Token length (samples per bin)
| tokens | samples | |
| --- | --- | --- |
{hist}
"""
