"""Shared fixtures: one embedded target per session, one Prefect harness per session, tiny stores."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
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
_HEAVY_FIRST = [
    "tests/e2e/test_postgres.py",
    "tests/e2e/test_browser.py",
    "tests/e2e/test_deployments.py",
    "tests/e2e/test_signals.py",
    "tests/e2e/test_run_console.py",
    "tests/e2e/test_cli_errors.py",
    "tests/e2e/test_ray.py",
    "tests/e2e/test_wheel.py",
    "tests/e2e/test_flow.py",
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
