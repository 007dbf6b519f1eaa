"""The pipeline's order: `run_pipeline` runs the configured stages in it, through a runner that calls each stage."""

from __future__ import annotations

from typing import Any, Protocol

from dflash_pipeline import progress as display
from dflash_pipeline import threads as cpu_threads
from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataprep.prepare import PrepareResult
from dflash_pipeline.drafter.checkpoint import drafter_dir_lock
from dflash_pipeline.drafter.evaluate import AcceptanceReport
from dflash_pipeline.drafter.regenerate import RegenerateResult
from dflash_pipeline.drafter.train import TrainResult
from dflash_pipeline.errors import ConfigError, PipelineError
from dflash_pipeline.extraction.devicelock import check_gpus_free
from dflash_pipeline.extraction.extract import WorkerResult
from dflash_pipeline.extraction.probe import ProbeReport
from dflash_pipeline.extraction.validate import ValidationReport, raise_if_failed
from dflash_pipeline.stages import (
    estimate,
    evaluate,
    extract,
    plan,
    plan_for_validation,
    prepare,
    probe,
    regenerate,
    regenerated_data,
    resolve_paths,
    retain,
    target_paths,
    train,
    validate,
    worker_specs,
)
from dflash_pipeline.storage.heal import heal_failed_versions
from dflash_pipeline.storage.store import PlanResult, Store
from dflash_pipeline.summary import RunSummary

# How long a run waits for the store lock when its holder is retention deleting data (storage/store_lock.py `hold`);
# any other holder (another run extracting the store) fails the run at once.
STORE_BRIEF_WAIT_S = 600.0


class Runner(Protocol):
    """How each stage runs: directly (LocalRunner) or as a Prefect task (flows/pipeline.py)."""

    def probe(self, cfg: RunConfig) -> ProbeReport: ...
    def regenerate(self, cfg: RunConfig, report: ProbeReport) -> RegenerateResult: ...
    def prepare(self, cfg: RunConfig, report: ProbeReport) -> PrepareResult: ...
    def estimate(self, cfg: RunConfig, report: ProbeReport, prepared: PrepareResult): ...
    def plan(self, cfg: RunConfig, report: ProbeReport, prepared: PrepareResult) -> PlanResult: ...
    def extract(self, cfg: RunConfig, report: ProbeReport, plan: PlanResult) -> list[WorkerResult]: ...
    def validate(
        self, cfg: RunConfig, report: ProbeReport, prepared: PrepareResult, version: str
    ) -> ValidationReport: ...
    def train(self, cfg: RunConfig, report: ProbeReport, version: str) -> TrainResult: ...
    def retain(self, cfg: RunConfig, version: str, export_dir: str | None): ...
    def evaluate(self, cfg: RunConfig, report: ProbeReport, export_dir: str) -> AcceptanceReport: ...


class LocalRunner:
    """Every stage called in this process, workers one after another (tests, benchmarks)."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {}  # each stage's typed result, for callers that want more than the summary

    def _keep(self, name: str, value):
        self.results[name] = value
        return value

    def probe(self, cfg):
        return self._keep("probe", probe(cfg))

    def regenerate(self, cfg, report):
        return self._keep("regenerate", regenerate(cfg, report))

    def prepare(self, cfg, report):
        return self._keep("prepare", prepare(cfg, report))

    def estimate(self, cfg, report, prepared):
        return self._keep("estimate", estimate(cfg, report, prepared))

    def plan(self, cfg, report, prepared):
        return self._keep("plan", plan(cfg, report, prepared))

    def extract(self, cfg, report, plan_):
        return self._keep("extract", [extract(s) for s in worker_specs(cfg, report, plan_)])

    def validate(self, cfg, report, prepared, version):
        return self._keep("validate", validate(cfg, report, prepared, version))

    def train(self, cfg, report, version):
        return self._keep("train", train(cfg, report, version))

    def retain(self, cfg, version, export_dir):
        return self._keep("retain", retain(cfg, version, export_dir))

    def evaluate(self, cfg, report, export_dir):
        return self._keep("evaluate", evaluate(cfg, report, export_dir))


def run_pipeline(cfg: RunConfig, runner: Runner, summary: RunSummary | None = None) -> RunSummary:
    """Run the configured stages in the pipeline's order. Every stage resumes from its own durable record, so
    a rerun after a crash (or on a finished store) redoes no finished work. A given `summary` is filled in place:
    when a stage raises, the caller still knows what was done (the flow publishes it). The order, the only place
    it is said (a change to the pipeline's shape is made here, once):

        probe -> [regenerate] -> prepare -> estimate (disk check) -> plan -> extract (one worker per device)
        -> validate -> promote CURRENT -> prune -> train -> [retain] -> evaluate
    """
    cfg = resolve_paths(cfg)
    stages = set(cfg.stages)
    if not stages:
        raise ConfigError(
            "stages is empty: name at least one of regenerate, prepare, extract, validate, train, evaluate"
        )
    summary = summary or RunSummary(output_dir=cfg.output_dir, store=cfg.store)
    summary.output_dir, summary.store = cfg.output_dir, cfg.store
    store = Store(cfg.store, cfg.store_options)
    if stages & {"extract", "validate"}:  # an unwritable or unreachable store fails now, before any work
        store.check_writable()
    cpu_threads.apply(cpu_threads.for_model(target_paths(cfg)[0]))  # before any torch op of this run's threads
    run = display.Run(display.stage_names(cfg))
    summary.reused = run.reused  # filled as the stages end
    with run.stage("probe", "model, tokenizer, layers, devices") as st:
        report = runner.probe(cfg)  # model, tokenizer and layer ids are checked before the data is touched
        st.said(report)
    summary.layer_ids = report.layer_ids
    if "regenerate" in stages or cfg.regenerate.enabled:
        with run.stage("regenerate", "the dataset's replies, by the target itself") as st:
            regenerated = runner.regenerate(cfg, report)  # the target's own answers replace the dataset's
            st.said(regenerated)
        cfg = cfg.model_copy(update={"data": regenerated_data(cfg)})
        summary.regenerated = regenerated.path
    prepared = None
    if stages & {"prepare", "extract", "validate"}:
        with run.stage("prepare", "tokens and loss masks") as st:
            prepared = runner.prepare(cfg, report)
            st.said(prepared)
        summary.prepared = prepared.path
    if "extract" in stages:  # before any GPU work: refuse a store its disk cannot hold (plan.disk_check)
        from dflash_pipeline.planner import check_room

        with run.stage("plan", "store size, disk room") as st:
            est = runner.estimate(cfg, report, prepared)
            st.said(est)
        summary.planned_store_bytes = est.store_bytes
        check_room(est, cfg)
    if stages & {"extract", "validate"}:
        with store.lock(wait_for_brief_s=STORE_BRIEF_WAIT_S):  # one run per store at a time, whichever deployment
            summary.previous_current = store.current()
            if cfg.extract.new_version and "extract" in stages:  # nightly: heal after a failed night
                heal_failed_versions(store)
            # only a run that extracts may change the store (plan, repair): validation alone only looks
            plan_ = (
                runner.plan(cfg, report, prepared)
                if "extract" in stages
                else plan_for_validation(cfg, report, prepared)
            )
            summary.version, summary.units = plan_.version, plan_.n_units
            summary.new_units, summary.new_samples = len(plan_.new_units), plan_.new_samples
            if "extract" in stages:
                if cfg.extract.engine == "local":  # Ray's workers hold the GPUs of the nodes they run on
                    check_gpus_free(report.replicas)
                with run.stage("extract", f"hidden states into {display.shown(plan_.version_path)}") as st:
                    results = runner.extract(cfg, report, plan_)
                    st.said(plan_, results)
                summary.tokens_extracted = sum(r.tokens for r in results)
                summary.forward_passes = sum(r.forward_passes for r in results)
            elif plan_.pending_units or plan_.new_samples:
                raise PipelineError(
                    f"stages has validate without extract, but {len(plan_.pending_units)} units of "
                    f"{plan_.version_path} are not extracted yet and {plan_.new_samples} prepared samples are in no "
                    "unit: add extract to stages"
                )
            if "validate" in stages:
                with run.stage("validate", display.shown(plan_.version_path)) as st:
                    validation = runner.validate(cfg, report, prepared, plan_.version)
                    st.said(validation)
                summary.validation = "PASS" if validation.ok else "FAIL"
                raise_if_failed(validation)  # CURRENT stays where it was
                store.set_current(plan_.version)  # readers follow CURRENT: only ever a validated version
                summary.pruned = store.prune(cfg.extract.keep_versions)
            summary.current = store.current()
    if stages & {"train", "evaluate"}:
        with drafter_dir_lock(cfg.drafter_dir):
            if "train" in stages:
                version = summary.current or store.current()
                if version is None:
                    raise PipelineError(
                        f"no validated store version under {cfg.store} to train on: "
                        "run the extract and validate stages first"
                    )
                with run.stage("train", f"the drafter, on {version}") as st:
                    trained = runner.train(cfg, report, version)
                    st.said(trained)
                summary.drafter, summary.final_loss = trained.export_dir, trained.final_loss
                if cfg.retention.mode != "keep":  # off by default: then nothing is ever deleted
                    with run.stage("retain", f"retention.mode={cfg.retention.mode}") as st:
                        kept = runner.retain(cfg, version, trained.export_dir)
                        st.said(kept)
                    summary.retention, summary.bytes_freed = kept.line(), kept.bytes_freed
            if "evaluate" in stages:
                with run.stage("evaluate", "acceptance length on held-out prompts") as st:
                    acceptance = runner.evaluate(cfg, report, summary.drafter or str(cfg.drafter_dir / "export"))
                    st.said(acceptance)
                summary.acceptance_length = round(acceptance.acceptance_length, 3)
                untrained = acceptance.untrained_acceptance_length
                summary.untrained_acceptance_length = round(untrained, 3) if untrained is not None else None
                summary.acceptance_by = {
                    f: {e["value"]: round(e["acceptance_length"], 3) for e in entries}
                    for f, entries in acceptance.slices.items()
                }
    return summary
