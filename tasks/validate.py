"""Prefect task: store validation. A failure fails the flow and is never retried."""

from __future__ import annotations

import json

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataprep.prepare import PrepareResult
from dflash_pipeline.extraction.loader import load_compiled
from dflash_pipeline.extraction.placement import input_device
from dflash_pipeline.extraction.probe import ProbeReport
from dflash_pipeline.extraction.validate import ValidationReport, raise_if_failed, validate_store
from dflash_pipeline.storage.store import Store
from dflash_pipeline.tasks.common import artifact_key


@task(name="validate-store", task_run_name="validate {version}", cache_policy=NO_CACHE, retries=0)
def validate_task(
    cfg: RunConfig, report: ProbeReport, prepared: PrepareResult, version: str, promote: bool = True
) -> ValidationReport:
    device = report.replicas[0]  # one GPU, or the GPUs of a split replica
    store = Store(cfg.store, cfg.store_options)
    model = None
    if cfg.validate_.recompute_samples:  # the forward extraction ran (extract.compile), on the same devices
        model, _, _ = load_compiled(report, device, cfg.extract.compile, cfg.target.attn_implementation)
    result = validate_store(store, version, prepared, cfg.validate_, model=model, device=input_device(device))
    store.loc.write_atomic(f"{version}/validation.json", json.dumps(result.to_dict(), indent=1).encode())
    create_markdown_artifact(
        key=artifact_key("validation"),
        markdown=result.to_markdown(),
        description=f"validation of {cfg.store}/{version}",
    )
    create_table_artifact(key=artifact_key("validation-checks"), table=result.checks, description="validation checks")
    raise_if_failed(result)
    if promote:  # readers follow CURRENT; it only ever points at a validated version
        store.set_current(version)
    return result
