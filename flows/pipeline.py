"""The pipeline flow: the stages of dflash_pipeline.stages.run_pipeline (the one place that orders them),
each run as a Prefect task, extraction fanned out to one task per device.

    probe -> [regenerate] -> prepare -> plan -> extract (one task per device) -> validate -> promote CURRENT
    -> prune -> train -> evaluate

Every stage is resumable from its own durable record, so rerunning the flow after a crash (or on a finished
store) redoes no finished work.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.artifacts import create_link_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from dflash_pipeline import stages
from dflash_pipeline.config import RunConfig, load_config
from dflash_pipeline.extraction.extract import WorkerResult
from dflash_pipeline.extraction.probe import ProbeReport
from dflash_pipeline.stages import RunSummary
from dflash_pipeline.storage.store import PlanResult
from dflash_pipeline.tasks.common import artifact_key, run_logger
from dflash_pipeline.tasks.drafter import evaluate_task, regenerate_task, train_task
from dflash_pipeline.tasks.extract import extract_worker_task, plan_task, publish_run_summary, publish_throughput
from dflash_pipeline.tasks.prepare import prepare_task
from dflash_pipeline.tasks.probe import probe_task
from dflash_pipeline.tasks.validate import validate_task


def _run_name() -> str:
    from prefect.runtime import flow_run

    overrides = flow_run.parameters.get("overrides") or {}
    model = str(overrides.get("target.model_path", "embedded")).rstrip("/").split("/")[-1]
    return f"dflash {model} <- {str(overrides.get('data.source', 'embedded')).split('/')[-1]}"


@flow(
    name="dflash-pipeline", flow_run_name=_run_name, task_runner=ThreadPoolTaskRunner(max_workers=16), log_prints=True
)
def dflash_pipeline(config_path: str | None = None, overrides: dict[str, Any] | None = None) -> RunSummary:
    """Run the configured stages. `overrides` are dotted keys, e.g. {"data.max_samples": 100}."""
    cfg = load_config(config_path, overrides or {})
    summary = stages.run_pipeline(cfg, PrefectRunner())
    run_logger().info("pipeline done: %s", summary.to_dict())
    return summary


class PrefectRunner:
    """Each stage as its Prefect task (artifacts, retries); extraction one task per device."""

    probe = staticmethod(probe_task)
    prepare = staticmethod(prepare_task)
    plan = staticmethod(plan_task)
    validate = staticmethod(validate_task)
    train = staticmethod(train_task)
    evaluate = staticmethod(evaluate_task)
    regenerate = staticmethod(regenerate_task)

    @staticmethod
    def extract(cfg: RunConfig, report: ProbeReport, plan: PlanResult) -> list[WorkerResult]:
        """Fan out: one worker task per device, units balanced by tokens; a crashed worker is retried and
        resumes from its units' commit records."""
        if cfg.extract.engine == "ray":
            from dflash_pipeline.flows.ray_extract import run_on_ray

            results = run_on_ray(cfg, report, plan)
        else:
            worker = extract_worker_task.with_options(retries=cfg.extract.task_retries)
            futures = [worker.submit(spec) for spec in stages.worker_specs(cfg, report, plan)]
            results = [f.result() for f in futures]
        publish_throughput(results, plan.version_path)
        link = plan.version_path if "://" in plan.version_path else f"file://{plan.version_path}"
        create_link_artifact(
            key=artifact_key("store"), link=link, description="the hidden-state store version written by this run"
        )
        return results

    @staticmethod
    def extracted(summary: RunSummary) -> None:
        publish_run_summary(summary)
