"""The end-to-end pipeline flow: [regenerate] -> prepare -> probe -> plan -> extract (one task per device)
-> validate -> promote CURRENT -> prune old versions -> train -> evaluate.

Reads like the diagram in docs/ARCHITECTURE.md. Every stage is resumable from its own durable record, so rerunning
the flow after a crash (or on a finished store) redoes no finished work.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.artifacts import create_link_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from dflash_pipeline.config import RunConfig, load_config
from dflash_pipeline.embedded import resolve_model
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.extraction.extract import WorkerResult
from dflash_pipeline.extraction.plan import assign_units
from dflash_pipeline.extraction.probe import ProbeReport
from dflash_pipeline.extraction.tokenizer import load_tokenizer
from dflash_pipeline.storage.store import PlanResult, Store
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
def dflash_pipeline(config_path: str | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the configured stages. `overrides` are dotted keys, e.g. {"data.max_samples": 100}."""
    cfg = load_config(config_path, overrides or {})
    return run_stages(cfg)


def run_stages(cfg: RunConfig) -> dict[str, Any]:
    summary: dict[str, Any] = {"output_dir": cfg.output_dir, "store": str(cfg.store)}
    if "extract" in cfg.stages:  # an unwritable or unreachable store fails now, not after the first stages
        Store(cfg.store, cfg.store_options).check_writable()
    if "regenerate" in cfg.stages or cfg.regenerate.enabled:
        regenerated = regenerate_task(cfg)  # the target's own answers replace the dataset's
        cfg = cfg.model_copy(
            update={"data": cfg.data.model_copy(update={"source": regenerated.path, "format": "messages"})}
        )
        summary["regenerated"] = regenerated.path
    prepared = prepare_task(cfg)
    report = probe_task(cfg)
    summary.update(prepared=prepared.path, layer_ids=report.layer_ids)
    if "extract" in cfg.stages:
        store = Store(cfg.store, cfg.store_options)
        with store.lock():  # one run per store at a time, whichever deployment started it
            summary["previous_current"] = store.current()
            plan = plan_task(cfg, report, prepared)
            results = extract_on_devices(cfg, report, plan)
            summary.update(
                version=plan.version,
                units=plan.n_units,
                new_units=len(plan.new_units),
                new_samples=plan.new_samples,
                tokens_extracted=sum(r.tokens for r in results),
                forward_passes=sum(r.forward_passes for r in results),
            )
            if "validate" in cfg.stages:
                validation = validate_task(cfg, report, prepared, plan.version)  # moves CURRENT on success
                summary["validation"] = "PASS" if validation.ok else "FAIL"
                summary["pruned"] = store.prune(cfg.extract.keep_versions)
            summary["current"] = store.current()
        publish_run_summary(summary)
    if "train" in cfg.stages:
        version = summary.get("current") or Store(cfg.store, cfg.store_options).current()
        if version is None:
            raise PipelineError(
                f"no validated store version under {cfg.store} to train on: run the extract and validate stages first"
            )
        trained = train_task(cfg, version)
        summary.update(drafter=trained.export_dir, final_loss=trained.final_loss)
    if "evaluate" in cfg.stages:
        export = summary.get("drafter") or str(cfg.drafter_dir / "export")
        acceptance = evaluate_task(cfg, export)
        summary.update(
            acceptance_length=round(acceptance.acceptance_length, 3),
            untrained_acceptance_length=acceptance.untrained_acceptance_length,
        )
    run_logger().info("pipeline done: %s", summary)
    return summary


def extract_on_devices(cfg: RunConfig, report: ProbeReport, plan: PlanResult) -> list[WorkerResult]:
    """Fan out: one worker task per device, units balanced by tokens; a crashed worker is retried and
    resumes from its units' commit records."""
    pad_id = _pad_id(cfg)
    if cfg.extract.engine == "ray":
        from dflash_pipeline.flows.ray_extract import run_on_ray

        results = run_on_ray(cfg, report, plan, pad_id)
    else:
        assignment = assign_units(plan.pending_units, report.replicas)  # a device or a split replica's GPUs
        worker = extract_worker_task.with_options(retries=cfg.extract.task_retries)
        futures = [
            worker.submit(cfg, report, plan.version, units, device, pad_id) for device, units in assignment.items()
        ]
        results = [f.result() for f in futures]
    publish_throughput(results, plan.version_path)
    link = plan.version_path if "://" in plan.version_path else f"file://{plan.version_path}"
    create_link_artifact(
        key=artifact_key("store"), link=link, description="the hidden-state store version written by this run"
    )
    return results


def _pad_id(cfg: RunConfig) -> int:
    tok = load_tokenizer(resolve_model(cfg.target.tokenizer_path or cfg.target.model_path))
    return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
