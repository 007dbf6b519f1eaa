"""Prefect task: dataset preparation, with the quarantine report as a table artifact."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataprep.prepare import PrepareResult, load_quarantine, prepare_dataset
from dflash_pipeline.embedded import resolve_model, resolve_source
from dflash_pipeline.extraction.tokenizer import load_tokenizer
from dflash_pipeline.tasks.common import artifact_key, run_logger


@task(name="prepare-dataset", task_run_name="prepare {cfg.data.source}", cache_policy=NO_CACHE)
def prepare_task(cfg: RunConfig) -> PrepareResult:
    log = run_logger()
    tokenizer = load_tokenizer(resolve_model(cfg.target.tokenizer_path or cfg.target.model_path))
    res = prepare_dataset(
        cfg.data,
        resolve_source(cfg.data.source),
        tokenizer,
        Path(cfg.output_dir) / "prepared",
        progress=lambda n, rate: log.info("prepare: %d rows read (%.0f rows/s)", n, rate),
    )
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
