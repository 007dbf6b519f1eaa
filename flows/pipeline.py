"""The pipeline flow: the stages of dflash_pipeline.order.run_pipeline (the one place that orders them),
each run as a Prefect task, extraction fanned out to one task per device.

    probe -> [regenerate] -> prepare -> plan -> extract (one task per device) -> validate -> promote CURRENT
    -> prune -> train -> [retain] -> evaluate

Every stage is resumable from its own durable record, so rerunning the flow after a crash (or on a finished
store) redoes no finished work.

Parameters compose: a deployment fixes its settings in `preset` (its stages, its store policy), and a user's
`overrides` (`prefect deployment run ... -p overrides='{...}'`, which replaces that one parameter) apply on top;
an override that contradicts the preset is an error naming the key, never a silent change of what the
deployment does.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import queue
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_link_artifact
from prefect.exceptions import CancelledRun, CrashedRun
from prefect.states import State
from prefect.task_runners import ThreadPoolTaskRunner

from dflash_pipeline import order, stages
from dflash_pipeline.config import RunConfig, load_config
from dflash_pipeline.errors import ConfigError
from dflash_pipeline.extraction import procs
from dflash_pipeline.extraction.extract import WorkerResult
from dflash_pipeline.extraction.probe import ProbeReport
from dflash_pipeline.local_prefect import FLOW_NAME
from dflash_pipeline.runguard import quiet_user_errors, raise_if_stopped, run_done, stop_asked, stops_remembered
from dflash_pipeline.storage.store import PlanResult
from dflash_pipeline.summary import RunSummary, StopReport
from dflash_pipeline.tasks.common import (
    IntendedStopLines,
    Stop,
    artifact_key,
    artifacts_of_store,
    finalize_orphans,
    finalize_task_runs,
    quiet_intended_stops,
    run_logger,
    stop_of,
)
from dflash_pipeline.tasks.drafter import evaluate_task, regenerate_task, train_task
from dflash_pipeline.tasks.extract import extract_worker_task, plan_task, publish_run_summary, publish_throughput
from dflash_pipeline.tasks.preflight import estimate_task
from dflash_pipeline.tasks.prepare import prepare_task
from dflash_pipeline.tasks.probe import probe_task
from dflash_pipeline.tasks.retention import retain_task
from dflash_pipeline.tasks.validate import validate_task

STOP_POLL_S = 0.5  # while extraction workers run: how often a remembered stop signal is checked


def compose_overrides(
    preset: dict[str, Any] | None, overrides: dict[str, Any] | None, who: str = "this deployment"
) -> dict[str, Any]:
    """The user's `overrides` on top of a deployment's `preset`. A key the preset fixes may be repeated with the
    same value (stages in any order), never changed: that would silently turn one deployment into another."""
    preset, overrides = dict(preset or {}), dict(overrides or {})
    for key, value in overrides.items():
        if key not in preset:
            continue
        fixed = preset[key]
        same = value == fixed or (key == "stages" and isinstance(value, list) and set(value) == set(fixed or []))
        if not same:
            raise ConfigError(
                f"overrides sets {key}={json.dumps(value)}, but {who} fixes {key}={json.dumps(fixed)}: "
                f"drop {key} from overrides, or run a deployment that does what you want "
                "(full, extract-only, train-only, nightly; see deployments/prefect.yaml)"
            )
    return {**preset, **overrides}


def config_digest(config_path: str | None, preset: dict | None, overrides: dict | None) -> str:
    """8 hex digits of the run's resolved configuration (the parameters', if they do not load)."""
    try:
        return load_config(config_path, {**(preset or {}), **(overrides or {})}).hash()[:8]
    except Exception:  # noqa: BLE001 - the flow itself reports a bad config; a name must never fail
        raw = json.dumps([config_path, preset, overrides], sort_keys=True, default=str)
        return hashlib.sha256(raw.encode()).hexdigest()[:8]


def _run_name() -> str:
    """What and when: `<deployment or cli> <UTC date time> <model> <- <data> cfg <digest>`."""
    from prefect.runtime import deployment, flow_run

    params = flow_run.parameters
    config_path, preset, overrides = params.get("config_path"), params.get("preset"), params.get("overrides")
    merged = {**(preset or {}), **(overrides or {})}
    try:  # the loaded config: a user's own YAML names model and data there, not in the overrides
        cfg = load_config(config_path, merged)
        model_path, source = cfg.target.model_path, cfg.data.source
    except Exception:  # noqa: BLE001 - the flow itself reports a bad config; a name must never fail
        model_path, source = merged.get("target.model_path", "?"), merged.get("data.source", "?")
    model = str(model_path).rstrip("/").split("/")[-1]
    data = str(source).rstrip("/").split("/")[-1]
    digest = config_digest(config_path, preset, overrides)
    config = f"{Path(str(config_path)).name} " if config_path else ""
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    return f"{deployment.name or 'cli'} {when} {model} <- {data} cfg {config}{digest}"


# No log_prints: Prefect's print patch ignores a swapped sys.stdout, so what a library prints into a capture
# (dill.detect.nestedglobals disassembles every function `datasets` fingerprints, into a StringIO) became UI log
# lines of bytecode. Our code logs through `logging`, which reaches the UI (tasks/common.forward_logic_logs).
@flow(name=FLOW_NAME, flow_run_name=_run_name, task_runner=ThreadPoolTaskRunner(max_workers=16))
def dflash_pipeline(
    config_path: str | None = None, overrides: dict[str, Any] | None = None, preset: dict[str, Any] | None = None
) -> RunSummary:
    """Run the configured stages. `overrides` are dotted keys, e.g. {"data.max_samples": 100}, applied on top of
    the deployment's fixed `preset` (its stages and store policy), which they may not contradict."""
    from prefect.runtime import deployment

    quiet_user_errors()
    quiet_intended_stops()
    IntendedStopLines.active = False
    who = f"the {deployment.name} deployment" if deployment.name else "the preset"
    cfg = load_config(config_path, compose_overrides(preset, overrides, who))
    procs.allow_workers()
    where = stages.resolve_paths(cfg)  # as run_pipeline resolves them: the artifact keys' scope is the store's path
    summary = RunSummary(output_dir=where.output_dir, store=where.store)  # filled in place: a failed run has it too
    runner = PrefectRunner()
    try:
        with stops_remembered(), artifacts_of_store(where.store):
            _settle_orphans()
            summary = order.run_pipeline(cfg, runner, summary)
            raise_if_stopped()  # dropped during the last stage: the run ends stopped, not completed
    except BaseException as e:  # Ctrl-C, SIGTERM, a cancelled run, a failed stage: no worker outlives the run
        stop = stop_of(e)
        if stop is not None:
            _finish_the_stop_first()
        if stop is not None and stop.state == "Cancelled":
            IntendedStopLines.active = True  # a stop someone asked for: no ERROR line or traceback in the UI
        stopped = procs.stop_workers()
        if stopped:  # a stop's own message says so (the CLI prints it): then a line for the UI only
            level = logging.INFO if stop is not None else logging.WARNING
            run_logger().log(level, "stopped extraction workers %s (%s)", stopped, type(e).__name__)
        if stop is None:  # a failure: the run fails with its error, as before
            _publish_failure(summary, runner.stage, e)
            _finalize_tasks(Stop("Failed", f"the run failed in {runner.stage}"), f"the run failed: {_why(e)}")
            raise
        report = _stop_report(cfg, stop, runner.stage)
        summary.record_failure(e)
        try:
            publish_run_summary(summary, stop=report)
        except Exception as err:  # noqa: BLE001 - no API any more: the stop itself is what matters
            run_logger().warning("could not publish the stopped run's summary: %s", err)
        _finalize_tasks(stop, report.line())
        run_logger().info(report.line())  # the run's last word: where it stopped, what resumes it
        return stop.prefect_state(report.line())
    run_done()  # the CLI's: a stop signal from here on has nothing to stop (runguard.run_done)
    run_logger().info("pipeline done: %s", summary.to_dict())
    try:  # one per run, at its end (a failed run's: _publish_failure); an API hiccup here fails no finished run
        publish_run_summary(summary)
    except Exception as err:  # noqa: BLE001
        run_logger().warning("could not publish the run summary: %s", err)
    return summary


def _finish_the_stop_first() -> None:
    """In a worker's flow run that is stopping: a further SIGTERM (the dead worker's watcher, the worker's own kill
    after its cancel) no longer interrupts the stop's own work (its summary, its task runs, its final state): it
    made the run end with Prefect's "Execution was aborted by a termination signal" instead. The CLI's run keeps its
    second signal's stop at once (runguard)."""
    import signal
    import threading

    from dflash_pipeline import runguard

    if getattr(runguard, "_guarding", False) or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: None)


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _publish_failure(summary: RunSummary, stage: str | None, e: BaseException) -> None:
    """The run-summary artifact of a failed run: what was done, which stage failed and why. A failed night published
    none before. Never hides the run's own error."""
    summary.record_failure(e)
    try:
        publish_run_summary(summary, f"{stage or 'before the first stage'}: {_why(e)}")
    except Exception as err:  # noqa: BLE001 - no API any more (a stop): the run's error is what matters
        run_logger().warning("could not publish the failed run's summary: %s", err)


def resume_command(deployment_name: str, params: dict[str, Any]) -> str:
    """The shell command that runs a deployment again with a stopped run's own config file and overrides."""
    given = "".join(
        f" -p {key}={shlex.quote(value if isinstance(value, str) else json.dumps(value))}"
        for key in ("config_path", "overrides")
        if (value := params.get(key))
    )
    return f"prefect deployment run '{FLOW_NAME}/{deployment_name}'{given}"


def _stop_report(cfg: RunConfig, stop: Stop, stage: str | None) -> StopReport:
    """Where a stopped run stopped and what resumes it, for its summary, its final state and its last log line."""
    from prefect.runtime import deployment, flow_run

    stage = stage or "the start (before the first stage)"
    where = "the store's commit records (every committed unit is kept)"
    if "train" in stage:
        try:
            from dflash_pipeline.drafter.checkpoint import latest_checkpoint

            ck = latest_checkpoint(cfg.drafter_dir)
        except Exception:  # noqa: BLE001 - a summary never fails the stop
            ck = None
        where = (
            f"checkpoint {ck.name} ({ck})" if ck is not None else "no checkpoint yet: training starts again at step 0"
        )
    if stop_asked() is not None:
        resume = "run the same `dflash-pipeline run` command again"
    elif deployment.name:
        resume = (
            f"`{resume_command(deployment.name, flow_run.parameters or {})}` (or Run in the UI with the same "
            "parameters): it resumes from there"
        )
        if deployment.name == "nightly":
            resume += "; the next night does so too"
    else:
        resume = "run the flow again with the same parameters: it resumes from there"
    return StopReport(state=stop.state, stage=stage, cause=stop.cause, where=where, resume=resume)


def _finalize_tasks(stop: Stop, message: str) -> None:
    """Every task run of this flow run the API still shows unfinished ends now, in the stop's state (issue 50)."""
    from prefect.runtime import flow_run

    if not flow_run.id:
        return
    try:
        finalize_task_runs(flow_run.id, stop, message)
    except Exception as err:  # noqa: BLE001 - no API any more: the parent side settles them (serve, the next run)
        run_logger().warning("could not set this run's unfinished task runs %s: %s", stop.state, err)


def _settle_orphans() -> None:
    """At a run's start: task runs that ended flow runs left unfinished (their process was killed) end now."""
    try:
        for name in finalize_orphans():
            run_logger().info("task run %s was left unfinished by its ended flow run: set final", name)
    except Exception as err:  # noqa: BLE001 - never fails the run
        run_logger().debug("could not settle task runs of ended flow runs: %s", err)


def _stage(task: Callable[..., Any]) -> Callable[..., Any]:
    """`task`, run only if no stop signal came before it (runguard.raise_if_stopped); the runner remembers it as
    the stage in progress (a failed run's summary names it)."""

    def run(self: PrefectRunner, *args: Any, **kwargs: Any) -> Any:
        raise_if_stopped()
        self.stage = task.name
        result = task(*args, **kwargs)
        if isinstance(result, State):  # a stop ended the task (tasks/common.ends_stopped): the run stops too
            raise (CancelledRun if result.is_cancelled() else CrashedRun)(result.message or result.name)
        self.stage = f"after {task.name}"  # an error between tasks (a store lock, no published version) is not its
        return result

    return functools.update_wrapper(run, task, updated=())


def gather(futures: list, poll_s: float = STOP_POLL_S) -> list:
    """The results of task futures, in order. The first to fail raises as soon as it is done (the flow's clean-up
    then stops the other workers), and a stop signal whose KeyboardInterrupt was dropped is acted on within
    `poll_s` (runguard.raise_if_stopped)."""
    finished: queue.SimpleQueue = queue.SimpleQueue()
    for f in futures:
        f.add_done_callback(finished.put)
    for _ in futures:
        while True:
            raise_if_stopped()
            try:
                finished.get(timeout=poll_s).result()  # raises the failed task's error
                break
            except queue.Empty:
                continue
    return [f.result() for f in futures]


class PrefectRunner:
    """Each stage as its Prefect task (artifacts, retries); extraction one task per device."""

    probe = _stage(probe_task)
    prepare = _stage(prepare_task)
    plan = _stage(plan_task)
    validate = _stage(validate_task)
    train = _stage(train_task)
    retain = _stage(retain_task)
    evaluate = _stage(evaluate_task)
    regenerate = _stage(regenerate_task)
    estimate = _stage(estimate_task)
    stage: str | None = None  # the stage in progress, by its task's name

    def extract(self, cfg: RunConfig, report: ProbeReport, plan: PlanResult) -> list[WorkerResult]:
        """Fan out: one worker task per device, units balanced by tokens; a crashed worker is retried and
        resumes from its units' commit records."""
        raise_if_stopped()
        self.stage = "extract-hidden-states"
        if cfg.extract.engine == "ray":
            from dflash_pipeline.flows.ray_extract import run_on_ray

            results = run_on_ray(cfg, report, plan)
        else:
            worker = extract_worker_task.with_options(retries=cfg.extract.task_retries)
            results = gather([worker.submit(spec) for spec in stages.worker_specs(cfg, report, plan)])
        publish_throughput(results, plan.version_path)
        link = plan.version_path if "://" in plan.version_path else Path(plan.version_path).absolute().as_uri()
        create_link_artifact(
            key=artifact_key("store"), link=link, description="the hidden-state store version written by this run"
        )
        self.stage = "after extract-hidden-states"
        return results
