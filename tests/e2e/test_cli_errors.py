"""The CLI's errors: one clear message naming field, value and fix, a non-zero exit, no traceback (unless --debug),
and early: before Prefect starts and before any dataset preparation (issue 16)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.local_prefect import check_api
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
    [
        "model path",
        "layer id",
        "layer id of the embedded target",
        "draft layers of the embedded target",
        "unwritable output",
        "empty stages",
    ],
)
def test_early_errors_in_seconds_before_any_preparation(case, model_dir, tmp_path, readonly_dir):
    out = tmp_path / "out"
    sets, expect = {
        "model path": ([f"target.model_path={tmp_path}/no-such-model"], "target.model_path"),
        "layer id": ([f"target.model_path={model_dir}", "layers.preset=explicit", "layers.ids=[1, 99]"], "99"),
        # the default target: its shipped config.json is read (before, the probe found these after Prefect's start)
        "layer id of the embedded target": (["layers.preset=explicit", "layers.ids=[1,50]"], "valid ids are 0..7"),
        "draft layers of the embedded target": (["layers.num_draft_layers=20"], "layers.num_draft_layers=5"),
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


def _model_without_weights(d: Path, model_dir: str, layers: int | None = None, tokenizer: bool = True) -> Path:
    """A checkpoint directory as the pre-flight checks see it: config.json and (links to) the tokenizer files."""
    d.mkdir()
    config = json.loads((Path(model_dir) / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **({"num_hidden_layers": layers} if layers else {})}))
    for f in Path(model_dir).iterdir():
        if tokenizer and (f.name.startswith("tokenizer") or f.name.startswith("chat_template")):
            (d / f.name).symlink_to(f)
    return d


# A user mistake found without a model forward: one line naming the thing and the fix, before any Prefect server
# starts (before, data mistakes came after 80-106 s, three times each; the model ones with a misleading message).
CASES = {
    "missing data file": (lambda t, m: [f"data.source={t}/no-such.jsonl"], "data.source", "does not exist"),
    "csv data file": (
        lambda t, m: [f"data.source={_write(t / 'data.csv', 'a,b')}"],
        "unsupported suffix '.csv'",
        "use a file (.jsonl, .ndjson, .json, .parquet, .arrow) or a directory saved with datasets' save_to_disk",
    ),
    "json object, not a list": (
        lambda t, m: ["data.source=" + str(_write(t / "d.json", json.dumps({"messages": []})))],
        "data.source",
        "holds a dict; a .json source must hold a list of rows",
    ),
    "rows that are no conversations": (
        lambda t, m: ["data.source=" + str(_write(t / "d.jsonl", json.dumps({"text": "hi"})))],
        "none of its first 1 rows is a usable conversation (line 1",
        '{"messages": [{"role": "user"',
    ),
    "model without tokenizer files": (
        lambda t, m: [f"target.model_path={_model_without_weights(t / 'm', m, tokenizer=False)}"],
        "has no tokenizer files",
        "set target.tokenizer_path",
    ),
    "base model tokenizer": (
        lambda t, m: [f"target.tokenizer_path={_base_tokenizer(t / 'tok', m)}"],
        "has no chat template",
        "set target.tokenizer_path to the chat (instruct) model's",
    ),
    "6-layer model, 5 layers asked": (
        lambda t, m: [f"target.model_path={_model_without_weights(t / 'm', m, layers=6)}", "layers.num_draft_layers=5"],
        "this target's 6 decoder layers",
        "Set layers.num_draft_layers=3, or name the layers: layers.preset=explicit layers.ids=[0,1,2,4,5]",
    ),
    "key typo": (lambda t, m: ["data.max_sample=3"], "data.max_sample: unknown key", "did you mean data.max_samples?"),
    # an empty path was the current directory: the whole run went into it (here: the source tree), exit 0
    "empty output_dir": (lambda t, m: ["output_dir="], "output_dir is empty (''): give a directory"),
    # a damage hunt: a 4,010-character output_dir failed in plan with chained ENAMETOOLONG tracebacks
    "output_dir past the path limit": (
        lambda t, m: [f"output_dir={t}/" + "/".join(["d" * 200] * 20)],
        "output_dir is 4,",
        "the files a run writes below it would pass this system's path limit",
    ),
    "directory name past the limit": (lambda t, m: [f"output_dir={t}/{'n' * 300}"], "a directory name of 300 bytes"),
    # the weights were missed until the probe, after Prefect's start, without naming the setting
    "model without weights": (
        lambda t, m: [f"target.model_path={_model_without_weights(t / 'm', m)}"],
        "target.model_path",
        "has no weights files (*.safetensors or pytorch_model*.bin)",
    ),
    # the evaluate stage's prompts were read after extraction and training (56 s into the embedded run)
    "missing prompts file": (
        lambda t, m: ["evaluate.prompts=~/no-such-prompts.jsonl"],
        "evaluate.prompts='~/no-such-prompts.jsonl': no such file",
    ),
    # a row ending with the reply was scored as a prompt (a fresh-user check)
    "a prompt ending with the reply": (
        lambda t, m: [
            "evaluate.prompts="
            + str(
                _write(
                    t / "p.jsonl",
                    json.dumps(
                        {
                            "id": "bad",
                            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                        }
                    ),
                )
            )
        ],
        "p.jsonl line 1 (id 'bad'): its messages end with a turn of role 'assistant'",
        "a prompt ends with the user's turn",
    ),
    "a slice field the prompts lack": (
        lambda t, m: ["evaluate.slice_by=[source]"],
        "evaluate.slice_by names 'source'",
        "the rows' fields are ['domain', 'id', 'messages']",
    ),
}


def _write(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    return path


def _base_tokenizer(d: Path, model_dir: str) -> Path:
    d.mkdir()
    (d / "tokenizer.json").symlink_to(Path(model_dir) / "tokenizer.json")
    config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("case", list(CASES))
def test_mistakes_found_without_a_model_forward_are_one_line_in_seconds(case, model_dir, tmp_path):
    sets, *expect = CASES[case]
    out = tmp_path / "out"
    res, seconds = _run(tmp_path, f"output_dir={out}", *sets(tmp_path, model_dir))
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-2000:]
    assert all(e in lines[0] for e in expect), lines[0]
    assert "Traceback" not in res.stderr and "prefect" not in res.stderr.lower() and not res.stdout
    assert seconds < 10, f"{case}: {seconds:.1f} s (idle: under 1 s)"  # generous: the machine is shared
    assert not (out / "prepared").exists()


def test_unwritable_output_dir_as_any_user(tmp_path):
    """As root (CI containers) permissions do not stop writes; a path under a file does, for everyone."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    res, seconds = _run(tmp_path, f"output_dir={blocker}/run")
    assert res.returncode == 2 and seconds < 10 and "output_dir" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_an_unwritable_dflash_home_is_one_line_before_prefect_starts(tmp_path):
    """The embedded target is built under $DFLASH_HOME on first use: one that cannot be written was a 62-line
    traceback from the probe, after Prefect's start. (A path under a file: read-only for root too.)"""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    res, seconds = _run(tmp_path, f"output_dir={tmp_path}/out", env={"DFLASH_HOME": f"{blocker}/home"})
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and seconds < 10, res.stderr[-2000:]
    assert lines[0].startswith("error: the embedded target cannot be built under ") and "DFLASH_HOME" in lines[0]


def test_ones_own_target_scored_on_the_embedded_prompts_is_a_warning(model_dir, tmp_path):
    """With one's own target the default evaluate.prompts (the bundled toy prompts) said nothing. The run stops right
    after the pre-flight here: at the check of an unreachable PREFECT_API_URL."""
    api = {"PREFECT_API_URL": f"http://127.0.0.1:{closed_port()}/api"}
    prompts = _write(tmp_path / "p.jsonl", json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}))
    warned = []
    for sets in ([f"target.model_path={model_dir}"], [f"target.model_path={model_dir}", f"evaluate.prompts={prompts}"]):
        res, _ = _run(tmp_path, f"output_dir={tmp_path}/out", *sets, env=api)
        assert res.returncode == 2 and "is unreachable" in res.stderr.splitlines()[-1], res.stderr[-2000:]
        warned.append([line for line in res.stderr.splitlines() if line.startswith("warning: ")])
    assert len(warned[0]) == 1 and "evaluate.prompts is 'embedded'" in warned[0][0], warned
    assert "--set evaluate.prompts=" in warned[0][0] and warned[1] == []


def test_an_error_of_a_task_with_retries_is_one_message(model_dir, prefect_harness, tmp_path):
    """The regenerate stage (retries=2; train too) refuses to retry a user error: Prefect then logs the task's
    'Finished in state Failed(...)' without the exception record, and the console showed it as a first
    `error: Finished in state Failed("Task run encountered an exception RegenerateError: ...")`."""
    url = f"http://127.0.0.1:{closed_port()}/v1"
    sets = [f"output_dir={tmp_path}/out", "extract.devices=cpu", "data.max_samples=4", "regenerate.enabled=true"]
    sets += ["regenerate.backend=openai", f"regenerate.base_url={url}", "regenerate.server_wait_s=0"]
    res, _ = _run(tmp_path, *sets, env={"PREFECT_API_URL": prefect_harness})
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert res.returncode == 2 and len(errors) == 1, res.stderr[-3000:]
    assert errors[0].startswith(f"error: cannot reach the OpenAI-compatible server at {url}"), errors
    assert "Finished in state Failed" not in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]


def test_an_error_in_the_flow_is_one_message_and_debug_shows_the_traceback(model_dir, prefect_harness, tmp_path):
    """A user error found by a stage inside the flow (here: validate without a store): one message, no Prefect
    traceback before it (a user's plain run, with Prefect's temporary server); --debug shows them (run against the
    session's server: what it shows does not depend on which server the flow reports to)."""
    sets = [f"output_dir={tmp_path}", "extract.devices=cpu", "data.max_samples=4", f"stages={json.dumps(['validate'])}"]
    res, _ = _run(tmp_path, *sets)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert res.returncode == 2 and len(errors) == 1 and "add extract to stages" in errors[0], res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    # once: before, Prefect's 'Task run failed' / 'Finished in state Failed(...)' lines repeated it
    assert res.stderr.count("add extract to stages") == 1 and "Finished in state Failed" not in res.stderr
    res, _ = _run(tmp_path, *sets, debug=True, env={"PREFECT_API_URL": prefect_harness})
    assert res.returncode == 2 and "Traceback" in res.stderr and errors[0] in res.stderr


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


def test_ctrl_c_prints_the_stop_message_without_prefects_crash_lines(model_dir, prefect_harness, tmp_path):
    """Before: two 'ERROR ... Crash detected! Execution was aborted by an interrupt signal.' lines and 'Finished in
    state Crashed(...)' came before the stop message. The UI keeps them (the filter is on the console only). A
    second Ctrl-C while it shuts down changes nothing."""
    env = {**os.environ, "PREFECT_API_URL": prefect_harness, "PYTHONUNBUFFERED": "1"}
    sets = [f"output_dir={tmp_path}/out", "extract.devices=cpu", "data.max_samples=8"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_pipeline.cli", "run", *(f"--set={s}" for s in sets)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "err", "w"),
        start_new_session=True,  # its own process group, as a shell gives a foreground job
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # not the caller's (a background shell's)
    )
    try:
        deadline = time.monotonic() + 120
        while "] probe ..." not in (tmp_path / "err").read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "err").read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(1.0)  # inside the first stage, the probe (a task: its engine and the flow's both report the crash)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C goes to the whole foreground group
        while "stopped (" not in (tmp_path / "err").read_text() and proc.poll() is None:
            time.sleep(0.05)
        try:  # an impatient second Ctrl-C while it shuts down: was a traceback from Prefect's exit handler
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
        rc = proc.wait(timeout=120)
        # 130, or death by SIGINT itself (-2): a shell shows both as $? = 130, "stopped by Ctrl-C". The second was
        # seen about once in 35 runs under load, after the stop message had been printed (its cause inside the
        # interpreter's shutdown is not pinned down). What the user reads is checked below either way.
        assert rc in (130, -signal.SIGINT), (rc, (tmp_path / "err").read_text()[-3000:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = (tmp_path / "err").read_text()
    assert "Crash detected" not in err and "Finished in state Crashed" not in err, err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    assert err.rstrip().splitlines()[-1].startswith("stopped (Ctrl-C): what was committed"), err[-3000:]
    # the UI shows a stop the user asked for as Cancelled, as a cancel from the UI (it was Crashed)
    state = _state_of_run_into(f"{tmp_path}/out")
    assert state.is_cancelled() and "`dflash-pipeline run` stopped (Ctrl-C)" in state.message, state


def _state_of_run_into(output_dir: str):
    """The state of the flow run (on the harness's server) whose overrides write to `output_dir`."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(limit=200)
    (run,) = [r for r in runs if (r.parameters.get("overrides") or {}).get("output_dir") == output_dir]
    return run.state
