"""The CLI's errors: one clear message naming field, value and fix, a non-zero exit, no traceback (unless --debug),
and early: before Prefect starts and before any dataset preparation (issue 16)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.serve import check_api
from tests.s3server import closed_port


def _run(
    tmp_path: Path, *sets: str, debug: bool = False, env: dict | None = None
) -> tuple[subprocess.CompletedProcess, float]:
    args = [sys.executable, "-m", "dflash_pipeline.cli", "run", *(f"--set={s}" for s in sets)]
    t0 = time.monotonic()
    res = subprocess.run(
        args + (["--debug"] if debug else []),
        env={**os.environ, **(env or {})},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return res, time.monotonic() - t0


def test_unreachable_api_url_is_a_clear_error(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}/api"
    with pytest.raises(PipelineError, match="unreachable.*dflash-pipeline serve"):
        check_api(url, timeout=2)
    res, _ = _run(tmp_path, f"output_dir={tmp_path}", env={"PREFECT_API_URL": url})
    assert res.returncode == 2 and "is unreachable" in res.stderr


@pytest.fixture
def readonly_dir(tmp_path):
    d = tmp_path / "readonly"
    d.mkdir()
    d.chmod(0o500)
    yield d
    d.chmod(0o700)


@pytest.mark.parametrize(
    "case",
    ["model path", "layer id", "unwritable output", "empty stages"],
)
def test_early_errors_in_seconds_before_any_preparation(case, model_dir, tmp_path, readonly_dir):
    out = tmp_path / "out"
    sets, expect = {
        "model path": ([f"target.model_path={tmp_path}/no-such-model"], "target.model_path"),
        "layer id": ([f"target.model_path={model_dir}", "layers.preset=explicit", "layers.ids=[1, 99]"], "99"),
        "unwritable output": ([f"output_dir={readonly_dir}/run"], "output_dir"),
        "empty stages": (["stages=[]"], "stages is empty"),
    }[case]
    if case == "unwritable output" and os.geteuid() == 0:
        pytest.skip("root writes anywhere: a read-only directory cannot be tested as root")
    res, seconds = _run(tmp_path, f"output_dir={out}", *sets)
    assert res.returncode == 2, res.stderr[-2000:]
    assert seconds < 10, f"{case}: {seconds:.1f} s"
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "Repo id must be" not in res.stderr
    assert not (out / "prepared").exists()  # no dataset preparation happened


def test_unwritable_output_dir_as_any_user(tmp_path):
    """As root (CI containers) permissions do not stop writes; a path under a file does, for everyone."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    res, seconds = _run(tmp_path, f"output_dir={blocker}/run")
    assert res.returncode == 2 and seconds < 10 and "output_dir" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_an_error_in_the_flow_is_one_message_and_debug_shows_the_traceback(model_dir, prefect_harness, tmp_path):
    """A user error found by a stage inside the flow (here: validate without a store): one message, no Prefect
    traceback before it (a user's plain run, with Prefect's temporary server); --debug shows them (run against the
    session's server: what it shows does not depend on which server the flow reports to)."""
    sets = [f"output_dir={tmp_path}", "extract.devices=cpu", "data.max_samples=4", f"stages={json.dumps(['validate'])}"]
    res, _ = _run(tmp_path, *sets)
    assert res.returncode == 2 and "error: stages has validate without extract" in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    res, _ = _run(tmp_path, *sets, debug=True, env={"PREFECT_API_URL": prefect_harness})
    assert res.returncode == 2 and "Traceback" in res.stderr and "error: stages has validate" in res.stderr


def test_serve_on_a_port_in_use_says_so_and_starts_nothing(tmp_path):
    """Another server on the port: before, serve's health check found that one, printed the full 'ready' banner
    (and deployed onto the other server), then exited with 'the Prefect server exited'."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run(
            [sys.executable, "-m", "dflash_pipeline.cli", "serve", "--port", str(port), "--home", str(tmp_path / "h")],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"port {port} on 127.0.0.1 is in use" in res.stderr and "--port" in res.stderr
    assert "Prefect UI" not in res.stdout and not (tmp_path / "h").exists()
