"""Shared fixtures: one embedded target per session, one Prefect harness per session, tiny stores."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

pytest_plugins = ["tests.s3server"]  # the session's moto S3 server fixture, `s3`

# Never the user's Prefect: its home (~/.prefect: the SQLite database `dflash-pipeline serve` shows, profiles) and
# any server PREFECT_API_URL points at. Every Prefect of the session, and of the CLIs the tests start, lives here.
_PREFECT_HOME = tempfile.mkdtemp(prefix="dflash-tests-prefect-")
atexit.register(shutil.rmtree, _PREFECT_HOME, ignore_errors=True)
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ.pop("PREFECT_API_URL", None)
os.environ.pop("PREFECT_PROFILE", None)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"  # and in every process a test starts (core/threads.py honours it)

# Every process a test starts inherits this mark in its environment: what a failing test left running is found at the
# end of the session (below), orphans of a killed CLI included (they are no longer below pytest in the process tree).
# One mark per process: each pytest-xdist worker sweeps what it started, not what the other one still runs.
_SESSION_MARK = f"DFLASH_TEST_SESSION={os.getpid()}-{uuid.uuid4().hex[:12]}"
os.environ["DFLASH_TEST_SESSION"] = _SESSION_MARK.split("=", 1)[1]


@pytest.fixture(scope="session")
def dflash_home(tmp_path_factory) -> Path:
    """DFLASH_HOME for the session: the embedded target is built once, into a fresh directory, unless
    DFLASH_TEST_HOME points at an existing build (a developer speed-up; CI always builds)."""
    home = Path(os.environ.get("DFLASH_TEST_HOME") or tmp_path_factory.mktemp("dflash_home"))
    os.environ["DFLASH_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def model_dir(dflash_home) -> str:
    from dflash_pipeline.embedded.build import ensure_built

    return str(ensure_built())


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from dflash_pipeline.extraction.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect server (SQLite in a temp dir) for the session, set as this process's API; its API URL, for
    subprocesses (`PREFECT_API_URL=... dflash-pipeline run`) that need a server but are not about starting one."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def clean_extraction(model_dir, tmp_path_factory):
    """An uninterrupted extraction of helpers.KILL_OVERRIDES: what every killed-and-resumed run must equal."""
    from tests.helpers import KILL_OVERRIDES, extract_local

    return extract_local(tmp_path_factory.mktemp("clean"), KILL_OVERRIDES)


@pytest.fixture(scope="session")
def small_store(model_dir, tmp_path_factory):
    """A complete, validated-shape store of 60 samples, layers [1, 3, 7] (GDN, full, full) + last."""
    from tests.helpers import extract_local

    out = tmp_path_factory.mktemp("small_store")
    return extract_local(
        out,
        {
            "data.max_samples": 60,
            "layers.preset": "explicit",
            "layers.ids": [1, 2, 3],
            "layers.capture_last": True,
            "extract.unit_tokens": 2500,
        },
    )


_LAYERS = ("unit", "integration", "e2e")


# `make test` runs on two pytest-xdist workers (`-n 2 --dist loadgroup`). Each worker is its own process with its own
# PREFECT_HOME, session Prefect harness, tmp dirs and free ports; a module's tests stay on one worker (their module
# fixtures are built once), and the modules that share the session's PostgreSQL cluster and `serve` on it are one group
# (one cluster, one server), as are those that share the wheel's virtualenv. The heaviest modules are handed out
# first, so that the two workers finish together.
_SHARED_GROUPS = {
    "tests/e2e/test_postgres.py": "postgres",
    "tests/e2e/test_browser.py": "postgres",
    "tests/e2e/test_deployments.py": "wheel",  # both use the session's wheel_env (one wheel build)
    "tests/e2e/test_wheel.py": "wheel",
}
# Longest first (seconds of one module on a worker of `make test`, 2026-12-02), then the rest in collection order:
# the integration modules, then the many quick unit ones, which fill the end. Makefile passes --no-loadscope-reorder:
# xdist would otherwise hand out the modules with the most tests first, and these long ones last.
_HEAVY_FIRST = [
    "tests/e2e/test_deployments.py",  # with test_wheel.py: ~190 s
    "tests/e2e/test_postgres.py",  # with test_browser.py: ~60 s
    "tests/e2e/test_browser.py",
    "tests/e2e/test_signals.py",  # ~105 s
    "tests/integration/test_drafter_pipeline.py",  # ~70 s
    "tests/e2e/test_cli_errors.py",  # ~50 s
    "tests/integration/test_object_store.py",  # ~45 s
    "tests/integration/test_kill_resume.py",  # ~35 s
    "tests/integration/test_regenerate_server.py",  # ~35 s
    "tests/e2e/test_run_console.py",  # ~33 s
    "tests/e2e/test_flow.py",  # ~32 s
    "tests/e2e/test_ray.py",  # ~27 s
    "tests/integration/test_drafter_model.py",
    "tests/integration/test_integrity.py",
    "tests/e2e/test_wheel.py",
]


def _module(item) -> str:
    return item.path.relative_to(item.config.rootpath).as_posix()


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Mark each test with its layer, the folder it lives in (tests/unit, tests/integration, tests/e2e), and with its
    xdist group (its module, or the shared resource's group); order the heaviest modules first."""
    for item in items:
        layer = next((p for p in item.path.relative_to(config.rootpath / "tests").parts if p in _LAYERS), None)
        assert layer, f"{item.nodeid}: every test lives in tests/unit, tests/integration or tests/e2e"
        item.add_marker(getattr(pytest.mark, layer))
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(_SHARED_GROUPS.get(_module(item), _module(item))))
    rank = {m: i for i, m in enumerate(_HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(_module(item), len(rank)))  # stable: the same order on every worker


def _left_running() -> dict[int, str]:
    """pid -> command line of every live process (not this one) whose environment carries this session's mark."""
    from tests.proctree import alive

    mark, marked = _SESSION_MARK.encode(), []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                if mark in Path(f"/proc/{d}/environ").read_bytes().split(b"\0"):
                    marked.append(int(d))
            except OSError:  # gone, or a kernel thread
                continue
    return alive(marked)


_LEAKS: list[str] = []  # the xdist controller's: what its workers reported


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """(xdist controller) A worker is done: what it found left running, for the controller's summary."""
    _LEAKS.extend(getattr(node, "workeroutput", {}).get("left_running", []))


@pytest.hookimpl(trylast=True)  # after the session fixtures' teardown (servers, clusters, harness)
def pytest_sessionfinish(session, exitstatus):
    """No test leaves a process behind, even when it fails: what is still running now is killed and named, and the run
    fails (a leak is a bug). Each xdist worker sweeps what it started and reports it to the controller."""
    if session.config.pluginmanager.has_plugin("dsession"):  # the xdist controller: it starts no test process
        left = _LEAKS
    else:
        found = _left_running()
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        left = [f"{pid}: {cmd[:200]}" for pid, cmd in found.items()]
        if hasattr(session.config, "workeroutput"):  # an xdist worker: the controller says it
            session.config.workeroutput["left_running"] = left
            return
    if left:
        lines = "\n".join(f"  {line}" for line in left)
        print(f"\ntests left {len(left)} processes running; killed:\n{lines}", file=sys.__stderr__)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _workers_allowed():
    """A run stopped in this process (a cancelled in-process flow) refuses new extraction workers until the next
    run allows them (extraction/procs.py). Under pytest-xdist a worker process runs many modules' tests in turn, so
    a test that starts workers directly must not inherit an earlier test's stop."""
    from dflash_pipeline.extraction import procs

    procs.allow_workers()
