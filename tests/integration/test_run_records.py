"""Issue 27: the run's own records. A worker spec never stays in TMPDIR after a SIGKILL of the run; a full disk
under output_dir is one error naming the file and the fix; artifact keys are the store's own; a run preparing the
regenerated JSONL waits for the run appending to it (and the other way round)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash_pipeline.drafter.regen_output import RegenOutput, reading_regenerated
from dflash_pipeline.errors import StoreError
from dflash_pipeline.stages import writing_output
from dflash_pipeline.tasks.common import artifact_key, artifacts_of_store
from tests.proctree import descendants, wait_gone

REPO = Path(__file__).resolve().parents[2]


def test_a_sigkilled_run_leaves_no_worker_spec_in_tmpdir(tmp_path):
    """The spec JSON was a NamedTemporaryFile in TMPDIR: a SIGKILL of the run before its worker read it left it there
    for good. It is written under output_dir/workers now (the next run's worker of that store and device replaces
    it)."""
    tmp, out = tmp_path / "tmp", tmp_path / "out"
    tmp.mkdir()
    overrides = {"data.max_samples": 4, "extract.isolation": "process"}
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)}
    run = subprocess.Popen(
        [sys.executable, "-m", "tests.extract_proc", str(out), json.dumps(overrides)],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    seen: list[Path] = []
    try:
        deadline = time.monotonic() + 240
        while not seen and time.monotonic() < deadline and run.poll() is None:
            seen = [p for d in (tmp, out / "workers") if d.exists() for p in d.glob("*.json")]
            time.sleep(0.02)
        assert seen, "no worker spec was written"
        children = descendants(run.pid)
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=30)
        assert not wait_gone(children, timeout=30)  # the worker notices its parent's death and exits
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert all(p.parent == out / "workers" for p in seen), seen
    assert not list(tmp.rglob("*.json")), list(tmp.rglob("*"))


@pytest.fixture
def full_disk(tmp_path):
    mnt = tmp_path / "full"
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a tmpfs here: {getattr(e, 'stderr', e)!r}")
    try:
        try:
            with open(mnt / "filler", "wb") as f:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
        except OSError:  # full
            pass
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_output_dir_is_one_error_naming_the_file_and_the_fix(full_disk, tokenizer):
    """probe.json on a full disk was 106 lines of `OSError: [Errno 28]` traceback; the prepared dataset the same."""
    from dflash_pipeline.dataprep.config import DataConfig
    from dflash_pipeline.dataprep.prepare import prepare_dataset
    from dflash_pipeline.embedded import resolve_source
    from dflash_pipeline.storage.commit import write_atomic

    out = full_disk / "run"
    out.mkdir()
    with pytest.raises(StoreError) as e, writing_output(out, out / "probe.json"):  # as tasks/probe.py does
        write_atomic(out / "probe.json", json.dumps({"layers": list(range(20_000))}).encode())
    msg = str(e.value)
    assert "probe.json" in msg and "No space left" in msg and "output_dir" in msg and "\n" not in msg, msg
    with pytest.raises(StoreError, match=r"cannot write .*No space left.*another output_dir"), writing_output(out):
        prepare_dataset(DataConfig(), resolve_source("embedded"), tokenizer, out / "prepared")


def test_artifact_keys_are_scoped_to_the_store():
    a, b = "/data/team-a/store", "/data/team-b/store"
    assert artifact_key("run-summary", store=a) != artifact_key("run-summary", store=b)
    assert artifact_key("run-summary", store=a).startswith("run-summary-store-")
    with artifacts_of_store(a):
        key = artifact_key("Store")
    assert key == artifact_key("store", store=a) and len(key) <= 100
    assert all(c.isdigit() or c.islower() or c == "-" for c in key), key
    long = artifact_key("x" * 200, store="s3://Bucket/My Store_01")
    assert len(long) <= 100 and long.endswith(artifact_key("", store="s3://Bucket/My Store_01"))
    assert artifact_key("run-summary") == "run-summary"  # outside a run of a store


def _settings():
    return {"backend": "openai", "model": "m"}


def test_preparing_the_regenerated_file_waits_for_the_run_appending_to_it(tmp_path):
    path = tmp_path / "regenerated.jsonl"
    writer = RegenOutput(path, _settings())
    writer._files["kept"].write('{"id": "a", "messages": []}\n')
    read: list[str] = []

    def prepare() -> None:
        with reading_regenerated(path):
            read.append(path.read_text())

    t = threading.Thread(target=prepare)
    t.start()
    t.join(0.5)
    assert t.is_alive() and not read  # waits: the writer is appending
    writer._files["kept"].write('{"id": "b", "messages": []}\n')
    writer.close()
    t.join(10)
    assert read == ['{"id": "a", "messages": []}\n{"id": "b", "messages": []}\n']

    got: list[RegenOutput] = []
    with reading_regenerated(path):  # and a writer waits for a run that is preparing the file
        w = threading.Thread(target=lambda: got.append(RegenOutput(path, _settings())))
        w.start()
        w.join(0.5)
        assert w.is_alive() and not got
    w.join(10)
    assert got and got[0].done == {"a", "b"}
    got[0].close()
