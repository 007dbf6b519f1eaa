"""Prefect task: compatibility probe, published as a markdown artifact."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from dflash_pipeline import stages
from dflash_pipeline.config import RunConfig
from dflash_pipeline.extraction.probe import ProbeReport, save_report
from dflash_pipeline.tasks.common import artifact_key, ends_stopped, run_logger


@task(name="probe-compatibility", task_run_name="probe {cfg.target.model_path}", cache_policy=NO_CACHE)
@ends_stopped
def probe_task(cfg: RunConfig) -> ProbeReport:
    report = stages.probe(cfg)
    out = Path(cfg.output_dir)
    with stages.writing_output(out, out / "probe.json"):  # a full disk: one line naming the file and the fix
        out.mkdir(parents=True, exist_ok=True)
        save_report(report, out / "probe.json")
    create_markdown_artifact(
        key=artifact_key("compat-probe"),
        markdown=report.to_markdown(),
        description="libraries, kernels, model layers, placement",
    )
    for w in report.warnings:
        run_logger().warning(w)
    return report
