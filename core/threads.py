"""CPU threads sized to the work: a small model's operations are too small to split across cores.

Measured on the 2-core machine (bench/RESULTS.md, "The first run on a shared machine"; 32 x 256-token forwards,
32-prompt generate, the embedded drafter's training step): with the embedded target (hidden 64) two intra-op
threads gain about 1.5x on an idle machine (forward 0.46 vs 0.72 s, a training step 0.115 vs 0.17 s; generate about
the same), and beside two CPU-bound processes they lose 2-25x (generate 14 s vs 0.55 s; a training step 3.8 s vs
0.23 s): every small op ends in an OpenMP barrier, and a barrier whose other thread is descheduled waits for a
whole time slice. So a small model takes two threads only where two cores are idle when the run starts
(`busy_elsewhere`), else one. Large models keep torch's default (one thread per core); nothing changes for them
or on GPUs.

torch's CPU build uses GNU OpenMP (libgomp): `OMP_WAIT_POLICY=PASSIVE` (set by the CLI, before torch is loaded)
makes its idle threads sleep instead of spinning, for the runs that do use several threads.

The count is per thread in OpenMP: `torch.set_num_threads` sets it for the calling thread and for threads that
run their first torch op afterwards (Prefect's task threads), so `apply` is called before any stage runs.
Processes that a run starts get it explicitly (WorkerSpec.threads, `env`).
"""

from __future__ import annotations

import os
import time

from dflash_pipeline.extraction.modelfiles import read_model_config

SMALL_HIDDEN = 512  # models with a hidden size up to this run on at most SMALL_MAX_THREADS threads per process
SMALL_MAX_THREADS = 2  # idle, a second thread gained 1.5x on the embedded target's training and extraction


def cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy_elsewhere(samples: int = 5, gap_s: float = 0.02) -> int:
    """How many threads other than this one are runnable now (Linux /proc/loadavg's running count, the median of a
    few samples; 0 where it cannot be read). The 1-minute load average lags by a minute and counts this run's own
    earlier stages; the instantaneous count does not."""
    counts = []
    for i in range(samples):
        try:
            with open("/proc/loadavg") as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)
        except (OSError, ValueError, IndexError):
            return 0
        if i + 1 < samples:
            time.sleep(gap_s)
    return max(0, sorted(counts)[len(counts) // 2])


def for_hidden(hidden_size: int | None) -> int | None:
    """Intra-op threads for a model of this hidden size: for a small one, the cores nothing else is running on, at
    most SMALL_MAX_THREADS and at least 1 (beside other CPU-bound work, one thread); None (torch's default) for a
    larger one."""
    if hidden_size is None or hidden_size > SMALL_HIDDEN:
        return None
    fixed = os.environ.get("OMP_NUM_THREADS", "")
    if fixed.isdigit() and int(fixed) > 0:  # the user's (or the test suite's) choice wins
        return int(fixed)
    return max(1, min(SMALL_MAX_THREADS, cpus() - busy_elsewhere()))


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
