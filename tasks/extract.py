"""Prefect tasks: plan the store's units, and one extraction worker per device."""

from __future__ import annotations

import os

from prefect import task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE

from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataprep.prepare import PrepareResult, template_fingerprint, tokenizer_fingerprint
from dflash_pipeline.embedded import resolve_model
from dflash_pipeline.extraction.extract import Progress, WorkerResult, run_worker
from dflash_pipeline.extraction.plan import plan_extraction, store_dtype
from dflash_pipeline.extraction.probe import ProbeReport
from dflash_pipeline.extraction.procs import run_in_process
from dflash_pipeline.extraction.tokenizer import load_tokenizer
from dflash_pipeline.storage.store import PlanResult
from dflash_pipeline.tasks.common import artifact_key, retry_unless_user_error, run_logger


@task(name="plan-extraction", task_run_name="plan store units", cache_policy=NO_CACHE)
def plan_task(cfg: RunConfig, report: ProbeReport, prepared: PrepareResult) -> PlanResult:
    tok = load_tokenizer(resolve_model(cfg.target.tokenizer_path or cfg.target.model_path))
    plan = plan_extraction(cfg, report, prepared, tokenizer_fingerprint(tok), template_fingerprint(tok))
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

    p = task_run.parameters
    return f"extract {len(p['units'])} units on {p['device']}"


@task(
    name="extract-hidden-states",
    task_run_name=_worker_name,
    cache_policy=NO_CACHE,
    retry_condition_fn=retry_unless_user_error,
    retry_delay_seconds=5,
)
def extract_worker_task(
    cfg: RunConfig, report: ProbeReport, version: str, units: list[str], device: str, pad_id: int
) -> WorkerResult:
    """Runs on one device (in its own process by default); a retry resumes from the units' commit records."""
    log = run_logger()
    key = artifact_key("extract-progress", device)
    artifact_id = create_progress_artifact(progress=0.0, key=key, description=f"extraction on {device}")

    def progress(p: Progress) -> None:
        pct = 100.0 * p.tokens_done / max(p.tokens_total, 1)
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

    on_ray = device.startswith("ray:")  # a Ray worker process: Ray chose the node and pinned its GPUs
    if cfg.extract.isolation == "process" and not on_ray:
        n_cpu = sum(d.name.startswith("cpu") for d in report.devices)
        spec = {
            "store_root": cfg.store,
            "store_options": cfg.store_options,
            "version": version,
            "units": units,
            "report": report.to_dict(),
            "extract": cfg.extract.model_dump(mode="json"),
            "store_dtype": store_dtype(cfg, report),
            "pad_id": pad_id,
            "attn_implementation": cfg.target.attn_implementation,
            "threads": max(1, (os.cpu_count() or 1) // max(n_cpu, 1)),
        }
        result = run_in_process(spec, device, progress, cfg.extract.worker_timeout_s)
    else:
        if on_ray:
            import torch

            n_gpus = torch.cuda.device_count()  # Ray set CUDA_VISIBLE_DEVICES to this task's GPUs
            device = "+".join(f"cuda:{i}" for i in range(n_gpus)) if n_gpus else "cpu"
        result = run_worker(
            str(cfg.store),
            version,
            units,
            report,
            device,
            cfg.extract,
            store_dtype(cfg, report),
            pad_id,
            progress=progress,
            attn_implementation=cfg.target.attn_implementation,
            store_options=cfg.store_options,
        )
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
            "device": "all",
            "units": sum(len(r.units) for r in results),
            "tokens": total_tokens,
            "seconds": round(wall, 2),
            "tokens/s": round(total_tokens / wall, 1) if wall else 0.0,
        }
    )
    create_table_artifact(
        key=artifact_key("extract-throughput"), table=rows, description=f"extraction into {store_path}"
    )


def publish_run_summary(summary: dict) -> None:
    """What this run added to the store, for the UI (the nightly run's report)."""
    promoted = summary.get("current") == summary.get("version") != summary.get("previous_current")
    rows = [
        ("store", f"`{summary['store']}`"),
        ("version written", summary.get("version")),
        (
            "CURRENT before / after",
            f"{summary.get('previous_current')} / {summary.get('current')}" + (" (promoted)" if promoted else ""),
        ),
        ("new samples", summary.get("new_samples")),
        ("new units", summary.get("new_units")),
        ("tokens extracted", summary.get("tokens_extracted")),
        ("forward passes", summary.get("forward_passes")),
        ("validation", summary.get("validation", "not run")),
        ("pruned versions", summary.get("pruned") or "none"),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    create_markdown_artifact(
        key=artifact_key("run-summary"),
        description="what this run added",
        markdown=f"# Extraction run summary\n\n| item | value |\n| --- | --- |\n{table}\n",
    )
