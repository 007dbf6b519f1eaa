"""Test helpers: the pipeline's stages composed without Prefect (the same logic the tasks call)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dataprep.prepare import PrepareResult, prepare_dataset, template_fingerprint, tokenizer_fingerprint
from embedded import resolve_model, resolve_source
from pipeline.config import RunConfig, load_config
from storage.store import PlanResult, Store
from target.extract import WorkerResult, run_worker
from target.plan import plan_extraction, store_dtype
from target.probe import ProbeReport, probe
from target.tokenizer import load_tokenizer


@dataclass
class Extracted:
    cfg: RunConfig
    prepared: PrepareResult
    report: ProbeReport
    plan: PlanResult
    result: WorkerResult

    @property
    def store(self) -> str:
        return str(self.cfg.store)


def config(out: Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    base = {"output_dir": str(out), "extract.devices": "cpu"}
    return load_config(None, {**base, **(overrides or {})})


def prepare(cfg: RunConfig) -> PrepareResult:
    tok = load_tokenizer(resolve_model(cfg.target.model_path))
    return prepare_dataset(cfg.data, resolve_source(cfg.data.source), tok, Path(cfg.output_dir) / "prepared")


def extract_local(out: Path, overrides: dict[str, Any] | None = None) -> Extracted:
    cfg = config(out, overrides)
    tok = load_tokenizer(resolve_model(cfg.target.model_path))
    prepared = prepare(cfg)
    report = probe(cfg.target, cfg.layers, cfg.extract, resolve_model(cfg.target.model_path))
    plan = plan_extraction(cfg, report, prepared, tokenizer_fingerprint(tok), template_fingerprint(tok))
    units = Store(cfg.store).units(plan.version)  # all of them: complete ones must be skipped cheaply
    result = run_worker(str(cfg.store), plan.version, units, report, "cpu",
                        cfg.extract, store_dtype(cfg, report), tok.pad_token_id)
    return Extracted(cfg, prepared, report, plan, result)
