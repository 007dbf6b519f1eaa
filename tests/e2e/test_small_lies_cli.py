"""Two small lies of `dflash-pipeline run` a damage check found (issue 50, item 5): a target whose config.json is
`{}` ended in two tracebacks (`KeyError: 'num_hidden_layers'`), and a stop signal that came after the run had
completed ("pipeline done"), while Prefect's temporary server stopped, killed the CLI with no message (SIGTERM) or
printed a traceback from Prefect's exit handler (Ctrl-C), or, a moment earlier, called the completed run stopped."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _foreground_signals() -> None:
    """SIGINT as a terminal's foreground job has it (tests/e2e/test_signals.py)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(cwd: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)  # the run's own temporary server, as a user's first run has
    return subprocess.Popen(
        [sys.executable, "-m", "dflash_pipeline.cli", "run", *args],
        cwd=cwd,
        env=env,
        stdout=open(cwd / "cli.out", "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_foreground_signals,
    )


@pytest.mark.parametrize("config", ["{}", '{"num_hidden_layers": "eight", "hidden_size": 64}'])
def test_a_target_config_json_of_nothing_is_one_error_line(model_dir, tmp_path, config):
    """Named in one line before Prefect starts (the pre-flight check reads the layer count), not as a traceback."""
    target = tmp_path / "target"
    shutil.copytree(model_dir, target)
    (target / "config.json").write_text(config)
    p = _cli(tmp_path, f"--set=target.model_path={target}", "--set=output_dir=out", '--set=stages=["probe"]')
    rc = p.wait(timeout=300)
    out = (tmp_path / "cli.out").read_text()
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert rc == 2 and "Traceback" not in out and "KeyError" not in out, out
    assert len(errors) == 1 and f"{target}/config.json" in errors[0] and "num_hidden_layers" in errors[0], out


@pytest.mark.parametrize(
    ("sig", "when"),
    [
        (signal.SIGTERM, "pipeline done"),  # the flow logged it; Prefect still records the run's end
        (signal.SIGINT, "done in"),  # the CLI printed its summary; Prefect's temporary server stops at exit
    ],
)
def test_a_stop_signal_after_the_run_completed_stops_nothing(model_dir, tmp_path, sig, when):
    p = _cli(tmp_path, "--set=output_dir=out", f"--set=stages={json.dumps(['probe'])}", "--verbose")
    deadline = time.monotonic() + 300
    while when not in (tmp_path / "cli.out").read_text():
        assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "cli.out").read_text()
        time.sleep(0.02)
    os.kill(p.pid, sig)
    rc = p.wait(timeout=60)
    out = (tmp_path / "cli.out").read_text()
    said = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
    assert rc == 0 and "Traceback" not in out and "stopped (" not in out, (rc, out)
    assert "done in " in out and f"{said} came after the run had completed: nothing was stopped" in out, out
    assert "Finished in state Completed()" in out.split("pipeline done", 1)[1], out  # the flow run too
