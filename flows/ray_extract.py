"""Extraction on a Ray cluster: one Prefect task per Ray worker, each holding one GPU (or the GPUs of one
split replica, target/placement.py).

Why Ray (through prefect-ray's RayTaskRunner) rather than a home-made launcher: it already schedules
tasks onto nodes by resources (`num_gpus=1` sets CUDA_VISIBLE_DEVICES per task), restarts dead workers,
and is what multi-node GPU users tend to run. Each task is a Ray worker process, so isolation comes from
Ray; our worker runs in it directly. The store must be on a filesystem every node mounts at the same path,
or on object storage (s3://) that every node reaches.
"""

from __future__ import annotations

from prefect import flow
from prefect_ray import RayTaskRunner
from prefect_ray.context import remote_options

from dflash_pipeline import stages
from dflash_pipeline.config import RunConfig
from dflash_pipeline.extraction.extract import WorkerResult
from dflash_pipeline.extraction.placement import replica_devices
from dflash_pipeline.extraction.probe import ProbeReport
from dflash_pipeline.flows.pipeline import gather
from dflash_pipeline.storage.store import PlanResult
from dflash_pipeline.tasks.extract import extract_worker_task


def _ray_workers(cfg: RunConfig, report: ProbeReport) -> tuple[int, dict]:
    """(workers, Ray resources of each): a worker holds one GPU, or as many as the probe's split replica."""
    import ray

    per = len(replica_devices(report.replicas[0]))
    gpus = int(ray.cluster_resources().get("GPU", 0))
    n = cfg.extract.ray_workers or gpus // per or 1
    return n, ({"num_gpus": per} if gpus else {"num_cpus": cfg.extract.ray_cpus_per_worker})


@flow(name="extract-on-ray", flow_run_name="extract on ray ({plan.version})")
def ray_extract(cfg: RunConfig, report: ProbeReport, plan: PlanResult) -> list[WorkerResult]:
    n, resources = _ray_workers(cfg, report)
    worker = extract_worker_task.with_options(retries=cfg.extract.task_retries)
    specs = stages.worker_specs(cfg, report, plan, [f"ray:{i}" for i in range(n)])
    with remote_options(**resources):
        futures = [worker.submit(spec) for spec in specs]
    return gather(futures)


def run_on_ray(cfg: RunConfig, report: ProbeReport, plan: PlanResult) -> list[WorkerResult]:
    from prefect.settings import PREFECT_API_URL

    env = {"PREFECT_API_URL": PREFECT_API_URL.value()} if PREFECT_API_URL.value() else {}
    init = {"runtime_env": {"env_vars": env}} if env else {}
    if not cfg.extract.ray_address:
        init["num_cpus"] = max(cfg.extract.ray_workers, 1) * cfg.extract.ray_cpus_per_worker
    runner = RayTaskRunner(address=cfg.extract.ray_address, init_kwargs=init)
    return ray_extract.with_options(task_runner=runner)(cfg, report, plan)
