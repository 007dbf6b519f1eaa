"""CPU threads sized to the work: a small model's operations are too small to split across cores.

Measured on the 2-core machine (bench/RESULTS.md, "The first run on a shared machine"; 32 x 256-token forwards,
32-prompt generate, the embedded drafter's training step): with the embedded target (hidden 64) two intra-op
threads gain about 1.5x on an idle machine (forward 0.46 vs 0.72 s, a training step 0.115 vs 0.17 s; generate about
the same), and beside two CPU-bound processes they lose 2-25x (generate 14 s vs 0.55 s; a training step 3.8 s vs
0.23 s): every small op ends in an OpenMP barrier, and a barrier whose other thread is descheduled waits for a
whole time slice. Even on an idle machine the run's own other processes (Prefect's server, the flow's threads)
do that: `make run` with two threads took 98 s against 75 s with one (bench/RESULTS.md). So a small model runs one
thread. Large models keep torch's default (one thread per core); nothing changes for them
or on GPUs.

torch's CPU build uses GNU OpenMP (libgomp): `OMP_WAIT_POLICY=PASSIVE` (set by the CLI, before torch is loaded)
makes its idle threads sleep instead of spinning, for the runs that do use several threads.

The count is per thread in OpenMP: `torch.set_num_threads` sets it for the calling thread and for threads that
run their first torch op afterwards (Prefect's task threads), so `apply` is called before any stage runs.
Processes that a run starts get it explicitly (WorkerSpec.threads, `env`).
"""

from __future__ import annotations

import os

from dflash_pipeline.extraction.modelfiles import read_model_config

SMALL_HIDDEN = 512  # models with a hidden size up to this run on one CPU thread per process


def cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def for_hidden(hidden_size: int | None) -> int | None:
    """Intra-op threads for a model of this hidden size: 1 for a small one (OMP_NUM_THREADS, if set, wins), None
    (torch's default) for a larger one."""
    if hidden_size is None or hidden_size > SMALL_HIDDEN:
        return None
    fixed = os.environ.get("OMP_NUM_THREADS", "")
    return int(fixed) if fixed.isdigit() and int(fixed) > 0 else 1


def for_model(model_dir: str) -> int | None:
    """`for_hidden` of the checkpoint in `model_dir` (its config.json; None when it cannot be read)."""
    try:
        mc = read_model_config(model_dir)
    except Exception:  # noqa: BLE001 - the probe reports a bad model directory; threads keep the default
        return None
    hidden = (mc.get("text_config") or mc).get("hidden_size")
    return for_hidden(int(hidden)) if isinstance(hidden, int) else None


def apply(threads: int | None) -> None:
    """This process's torch threads (None: leave torch's default)."""
    if threads is None:
        return
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # once inter-op work started it can no longer be set (and it does not spin)
        pass


def env(threads: int | None) -> dict[str, str]:
    """Environment of a child process that runs torch with `threads` intra-op threads."""
    if threads is None:
        return {}
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
