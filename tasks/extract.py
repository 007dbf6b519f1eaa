"""Prefect tasks: plan the store's units, and one extraction worker per device."""

from __future__ import annotations

from dataclasses import replace

from prefect import task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE

from dflash_pipeline import stages
from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataprep.prepare import PrepareResult
from dflash_pipeline.extraction.extract import Progress, WorkerResult
from dflash_pipeline.extraction.probe import ProbeReport
from dflash_pipeline.extraction.spec import WorkerSpec
from dflash_pipeline.storage.store import PlanResult
from dflash_pipeline.summary import RunSummary, StopReport
from dflash_pipeline.tasks.common import artifact_key, ends_stopped, percent, retry_unless_user_error, run_logger


@task(name="plan-extraction", task_run_name="plan store units", cache_policy=NO_CACHE)
@ends_stopped
def plan_task(cfg: RunConfig, report: ProbeReport, prepared: PrepareResult) -> PlanResult:
    plan = stages.plan(cfg, report, prepared)
    run_logger().info(
        "store %s: %d units, %d new samples in %d new units, %d units pending",
        plan.version_path,
        plan.n_units,
        plan.new_samples,
        len(plan.new_units),
        len(plan.pending_units),
    )
    return plan


def _worker_name() -> str:
    from prefect.runtime import task_run

    spec = task_run.parameters["spec"]
    return f"extract {len(spec.units)} units on {spec.name}"


@task(
    name="extract-hidden-states",
    task_run_name=_worker_name,
    cache_policy=NO_CACHE,
    retry_condition_fn=retry_unless_user_error,
    retry_delay_seconds=5,
)
@ends_stopped
def extract_worker_task(spec: WorkerSpec) -> WorkerResult:
    """Runs on one device (in its own process by default); a retry resumes from the units' commit records."""
    log = run_logger()
    artifact_id = create_progress_artifact(
        progress=0.0, key=artifact_key("extract-progress", spec.name), description=f"extraction on {spec.name}"
    )

    def progress(p: Progress) -> None:
        pct = percent(p.tokens_done, p.tokens_total)
        update_progress_artifact(artifact_id=artifact_id, progress=pct)
        log.info(
            "%s: %s %d/%d tokens (%.1f%%), %.0f tokens/s, ETA %.0f s",
            p.device,
            p.unit,
            p.tokens_done,
            p.tokens_total,
            pct,
            p.tokens_per_s,
            p.eta_s,
        )

    if spec.device.startswith("ray:"):  # a Ray worker process: Ray chose the node and pinned its GPUs
        import torch

        n_gpus = torch.cuda.device_count()  # Ray set CUDA_VISIBLE_DEVICES to this task's GPUs
        local = "+".join(f"cuda:{i}" for i in range(n_gpus)) if n_gpus else "cpu"
        spec = replace(spec, device=local, label=spec.device)
    result = stages.extract(spec, progress)
    update_progress_artifact(artifact_id=artifact_id, progress=100.0)
    return result


def publish_throughput(results: list[WorkerResult], store_path: str) -> None:
    rows = [
        {
            "device": r.device,
            "units": len(r.units),
            "skipped (complete)": r.units_skipped,
            "tokens": r.tokens,
            "forward passes": r.forward_passes,
            "OOM splits": r.oom_splits,
            "seconds": round(r.seconds, 2),
            "tokens/s": round(r.tokens_per_s, 1),
            "peak GPU GiB": round(r.peak_gpu_gib, 2),
        }
        for r in results
    ]
    total_tokens = sum(r.tokens for r in results)
    wall = max((r.seconds for r in results), default=0.0)
    rows.append(
        {
            "device": "total (all workers)",
            "units": sum(len(r.units) for r in results),
            "tokens": total_tokens,
            "seconds": round(wall, 2),
            "tokens/s": round(total_tokens / wall, 1) if wall else 0.0,
        }
    )
    create_table_artifact(
        key=artifact_key("extract-throughput"), table=rows, description=f"extraction into {store_path}"
    )


def run_summary_markdown(summary: RunSummary, failure: str | None = None, stop: StopReport | None = None) -> str:
    """The run-summary artifact's text: what the run did; for a failed run which stage failed and why; for a stopped
    one (cancelled, crashed) its state and stage in the title, the cause in words, where it stopped and what
    resumes it."""
    s = summary
    promoted = s.current == s.version != s.previous_current
    rows = [
        ("store", f"`{s.store}`"),
        ("version extracted into (or checked)", s.version),
        ("CURRENT before / after", f"{s.previous_current} / {s.current}" + (" (promoted)" if promoted else "")),
        ("new samples", s.new_samples),
        ("new units", s.new_units),
        ("tokens extracted", s.tokens_extracted),
        ("forward passes", s.forward_passes),
        ("validation", s.validation or "not run"),
        ("pruned versions", ", ".join(s.pruned) or "none"),
    ]
    if s.drafter or s.final_loss is not None:
        rows += [("drafter", s.drafter), ("final loss", s.final_loss)]
    if s.retention:
        rows += [("retention", s.retention)]
    if s.acceptance_length is not None:
        rows += [("acceptance length", s.acceptance_length), ("untrained drafter", s.untrained_acceptance_length)]
    title = "# Run summary"
    if stop is not None:
        title = f"# Run summary: {stop.state.upper()} at {stop.stage}"
        said = [
            ("outcome", f"**{stop.state.lower()}**: {stop.cause}"),
            ("stopped at", stop.where),
            ("resume", stop.resume),
        ]
        rows = [(k, v.replace("|", "\\|").replace("\n", " ")) for k, v in said] + rows
    elif failure is not None:
        title = f"# Run summary: FAILED at {failure.split(': ', 1)[0]}"
        rows = [("outcome", f"**failed**: {failure}".replace("|", "\\|").replace("\n", " "))] + rows
    table = "\n".join(f"| {k} | {v if v is not None else '-'} |" for k, v in rows)
    return f"{title}\n\n| item | value |\n| --- | --- |\n{table}\n"


def publish_run_summary(summary: RunSummary, failure: str | None = None, stop: StopReport | None = None) -> None:
    """What this run added to the store, for the UI (the nightly run's report); `failure` ("<stage>: <error>")
    for a run that failed, so a failed night says what it did and where it stopped; `stop` for a run that was
    stopped (cancelled, crashed)."""
    if stop is not None:
        description = stop.line()[:250]
    else:
        description = "what this run added" if failure is None else "FAILED: " + failure[:200]
    create_markdown_artifact(
        key=artifact_key("run-summary", store=summary.store),
        description=description,
        markdown=run_summary_markdown(summary, failure, stop),
    )
