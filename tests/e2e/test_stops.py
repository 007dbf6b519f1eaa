"""How a run stops, as the API shows it (issue 50), on the session's PostgreSQL-backed `serve`: a cancel during
training looks clean (the run and its training task Cancelled, no ERROR line or traceback in the run's logs, the
run's last log line says where it stopped and how it resumes, a checkpoint and a run summary headed CANCELLED), and
a flow-run process killed mid-run (SIGKILL: the OOM killer) leaves no task run Running beside its Crashed flow run.
What every way of stopping leaves is read through the same helpers (`final_picture`); the stops of serve itself and
of its worker are in tests/e2e/test_postgres.py."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.e2e.test_postgres import LONG_TRAINING, _end, _training
from tests.serving import api, wait_final
from tests.stops import assert_no_task_left, final_picture, run_logs

CANCELLED_BOUND_S = 60.0  # from the cancel to a Cancelled run, training (a loaded 2-core machine)


@pytest.mark.load
def test_a_cancel_during_training_looks_clean(pg_server, tmp_path):
    """`prefect flow-run cancel` (the UI's Cancel) while the `full` deployment trains: the run ends Cancelled with
    its training task Cancelled (not Crashed) and every other task final; no log line of the run is an ERROR or
    holds a traceback; the run's last log line says where it stopped (the checkpoint saved at the stop) and the
    command that resumes it; the run summary is headed CANCELLED at train-drafter and names the cause."""
    from prefect.states import Cancelling

    lp = pg_server
    out = tmp_path / "a"
    run_id = lp.run_deployment("full", {**LONG_TRAINING, "output_dir": str(out)})
    try:
        _training(lp, run_id)
        time.sleep(2)  # a few steps in
        wall0 = time.time()
        api(lp, lambda client: client.set_flow_run_state(run_id, Cancelling(message="cancelled in the test")))
        wait_final(lp, [run_id], timeout=CANCELLED_BOUND_S + 60)
        time.sleep(15)  # the worker's own end of the cancel (it sets the run Cancelled again once the process is gone)
        p = final_picture(lp.database_url, run_id, wall0)
        logs = run_logs(lp.database_url, run_id)
    finally:
        _end(lp, [run_id])
    train = [t for t in p["tasks"] if t["name"].startswith("train drafter")]
    print(
        f"cancel during training: Cancelled {p['first_final_s']:.1f} s after the cancel (set again by the worker "
        f"at {p['final_s']:.1f} s), task runs final "
        f"{p['tasks_after_flow_s']:+.1f} s from it: {p['counts']}"
    )
    assert p["state"] == "Cancelled" and p["final_s"] < CANCELLED_BOUND_S, p
    assert_no_task_left(p)
    assert [t["state"] for t in train] == ["Cancelled"], train
    assert "cancelled by the user" in (train[0]["message"] or ""), train
    errors = [g for g in logs if g["level"] >= 40 or "Traceback" in g["message"]]
    assert not errors, errors
    last = logs[-1]["message"]
    assert "cancelled by the user" in last and "Resume:" in last and "dflash-pipeline/full" in last, logs[-5:]
    assert "checkpoint step-" in last, last
    assert list((out / "drafter" / "checkpoints").glob("step-*")), "no checkpoint at the stop"
    summary = p["summary"] or ""
    assert summary.startswith("# Run summary: CANCELLED at train-drafter"), summary
    assert "cancelled by the user" in summary and "prefect deployment run 'dflash-pipeline/full'" in summary, summary


@pytest.mark.load
def test_a_killed_flow_run_process_leaves_no_task_running(pg_server, tmp_path):
    """SIGKILL of the flow-run process while it trains (what the OOM killer does): nothing of it can report, its
    worker reports the flow run Crashed, and `serve` sets the task runs it left Running Crashed too, naming the
    flow run's end."""
    lp = pg_server
    run_id = lp.run_deployment("full", {**LONG_TRAINING, "output_dir": str(tmp_path / "a")})
    try:
        fr = _training(lp, run_id)
        wall0 = time.time()
        os.killpg(int(fr.infrastructure_pid), signal.SIGKILL)
        p = final_picture(lp.database_url, run_id, wall0)
    finally:
        _end(lp, [run_id])
    print(
        f"flow-run process SIGKILL: {p['state']} {p['final_s']:.1f} s after the kill, task runs final "
        f"{p['tasks_after_flow_s']:+.1f} s from it: {p['counts']}"
    )
    assert p["state"] == "Crashed", p
    assert_no_task_left(p)
    train = [t for t in p["tasks"] if t["name"].startswith("train drafter")]
    assert [t["state"] for t in train] == ["Crashed"] and "while it ran" in (train[0]["message"] or ""), train


@pytest.mark.load
def test_serve_stopped_by_ctrl_c_mid_training_ends_the_run_and_its_tasks(postgres, model_dir, tmp_path):
    """Ctrl-C (SIGINT) of `serve` while its run trains, as test_postgres.py's SIGTERM: the run ends Crashed by its own
    hand ("serve was stopped"), every task run with it, the checkpoint saved at the stop and the summary published."""
    from tests.serving import serve

    url = postgres.create_database("ctrl_c")
    home = tmp_path / "home"
    home.mkdir()
    out = tmp_path / "a"
    with serve(home, database=url) as lp:
        run_id = lp.run_deployment("full", {**LONG_TRAINING, "output_dir": str(out)})
        _training(lp, run_id)
        wall0 = time.time()
        lp.serve_proc.send_signal(signal.SIGINT)
        assert lp.serve_proc.wait(timeout=90) == 0
    p = final_picture(url, run_id, wall0)
    print(
        f"serve Ctrl-C: {p['state']} {p['final_s']:.1f} s after the signal, task runs final "
        f"{p['tasks_after_flow_s']:+.1f} s from it: {p['counts']}"
    )
    assert p["state"] == "Crashed" and "serve was stopped" in p["message"], p
    assert_no_task_left(p)
    summary = p["summary"] or ""
    assert summary.startswith("# Run summary: CRASHED at train-drafter") and "serve was stopped" in summary, summary
    assert list((out / "drafter" / "checkpoints").glob("step-*")), "no checkpoint at serve's Ctrl-C"
    assert "Ctrl-C: stopping" in (home / "serve.out").read_text()
