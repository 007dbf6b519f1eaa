"""What `dflash-pipeline run` prints, off a terminal (issue 32): a line per stage as it starts and ends, a few
progress lines, no duplicates, no GPU-kernel notes on a CPU run, the summary once; `--json` prints the summary as
JSON and nothing else on stdout; a rerun of the finished run says what it reused.

The first run starts Prefect's temporary server, as a user's first run does; the rerun reports to the session's
server (PREFECT_API_URL, as with `dflash-pipeline serve`): what it reuses is decided by the run directory, not by the
server, and a second temporary server's start-up (~8 CPU-seconds) proves nothing more (issue 32: the suite's time)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from tests.serving import CLEAN_ENV, ROOT, SMALL, TINY_TRAINING

SETTINGS = {**SMALL, **TINY_TRAINING, "data.max_samples": 16, "regenerate.max_new_tokens": 8}


def _run(out: Path, *extra: str, api_url: str | None = None) -> subprocess.CompletedProcess:
    sets = [f"--set={k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in SETTINGS.items()]
    env = {**CLEAN_ENV, "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}
    env.pop("PREFECT_API_URL", None)  # a user's first run: Prefect's temporary server
    if api_url:
        env["PREFECT_API_URL"] = api_url
    args = [sys.executable, "-m", "dflash_pipeline.cli", "run", "--config", str(ROOT / "configs" / "embedded.yaml")]
    args += [*sets, f"--set=output_dir={out}", *extra]
    with subprocess.Popen(
        args, env=env, cwd=out.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        stdout, stderr = proc.communicate(timeout=600)
    res = subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
    res.pid = proc.pid  # (the temporary server's log names the run by it)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_the_console_of_a_run_and_of_its_rerun(tmp_path, model_dir, prefect_harness):
    out = tmp_path / "run"
    res = _run(out)
    lines = [line for line in (res.stderr + res.stdout).splitlines() if line.strip()]
    assert len(lines) <= 40, "\n".join(lines)
    repeated = [line for line, n in Counter(lines).items() if n > 1]
    assert not repeated, repeated
    names = ["probe", "regenerate", "prepare", "plan", "extract", "validate", "train", "evaluate"]
    for i, name in enumerate(names, 1):
        starts = [x for x in lines if x.startswith(f"[{i}/8] {name} ...")]
        ends = [x for x in lines if x.startswith(f"[{i}/8] {name}: ") and x.endswith(" s)")]
        assert len(starts) == 1 and len(ends) >= 1, (name, lines)
    text = res.stderr + res.stdout
    for noise in ("falling back", "flash-linear-attention", "train step", "Finished in state", "{", "Traceback"):
        assert noise not in text, (noise, text)
    # the temporary server's own output (a shutdown traceback at times) goes to its log under Prefect's home
    log = (Path(CLEAN_ENV["PREFECT_HOME"]) / "temporary-server.log").read_text()
    assert f"temporary server of pid {res.pid} on port " in log, log
    assert res.stdout.count("acceptance length") == 1
    # paths as the user sees them from where the command ran (the run resolved them to absolute ones)
    assert res.stdout.count(f"store: {out.name}/store version") == 1 and str(out) not in res.stdout
    assert res.stdout.splitlines()[0].startswith("done in ")

    again = _run(out, "--json", api_url=prefect_harness)  # the finished run again: what it already did is reused
    summary = json.loads(again.stdout)  # stdout is the JSON summary, nothing else
    assert summary["validation"] == "PASS" and summary["tokens_extracted"] == 0
    assert "(calibration reused)" in again.stderr and "nothing to extract" in again.stderr
    assert "reused: all" in again.stderr  # regenerate
