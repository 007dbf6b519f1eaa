"""The planner's calibration (core/calibration.py): measured once per key and reused by a rerun, its scratch store
under output_dir/plan and gone afterwards, also when the process measuring it was SIGKILLed."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from pathlib import Path

from dflash_pipeline import calibration, planner
from dflash_pipeline.order import LocalRunner, run_pipeline
from dflash_pipeline.stages import resolve_paths
from tests.helpers import config


def test_a_rerun_reuses_the_calibration_and_leaves_no_scratch_store(model_dir, tmp_path, caplog):
    cfg = resolve_paths(config(tmp_path / "run", {"stages": ["prepare"], "data.max_samples": 30}))
    runner = LocalRunner()
    run_pipeline(cfg, runner)
    report, prepared = runner.results["probe"], runner.results["prepare"]
    with caplog.at_level(logging.INFO):
        first = planner.estimate(cfg, report, prepared, "float32")
    assert not first.calibration_reused and first.calibration.startswith("the target's own hidden states")
    assert not any("created store version" in r.getMessage() for r in caplog.records)  # the scratch store's
    plan = calibration.plan_dir(cfg)
    assert [p.name for p in plan.iterdir()] == [next(plan.glob("calibration-*.json")).name]  # no scratch left

    again = planner.estimate(cfg, report, prepared, "float32")
    assert again.calibration_reused and again.store_bytes == first.store_bytes
    assert "reused" in again.lines()[2]

    other = cfg.model_copy(update={"extract": cfg.extract.model_copy(update={"compression": "none"})})
    changed = planner.estimate(other, report, prepared, "float32")  # another key: measured again
    assert not changed.calibration_reused and len(list(plan.glob("calibration-*.json"))) == 2


HOLD_SCRATCH = """
import sys, time
from pathlib import Path
from dflash_pipeline.calibration import scratch_dir
with scratch_dir(Path(sys.argv[1])) as d:
    (d / "store").mkdir()
    print(d, flush=True)
    time.sleep(600)
"""


def test_a_scratch_store_left_by_a_sigkilled_run_is_removed_by_the_next(tmp_path):
    root = tmp_path / "plan"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_SCRATCH, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        left = Path(holder.stdout.readline().strip())
        assert left.parent == root and left.name.startswith(f"scratch-{holder.pid}-")
        with calibration.scratch_dir(root):  # the holder is alive: its scratch stays
            assert left.is_dir()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert left.is_dir()  # SIGKILL runs no clean-up
        with calibration.scratch_dir(root) as mine:
            assert not left.exists() and mine.is_dir()
        assert list(root.iterdir()) == []
    finally:
        holder.kill()
        holder.wait()
