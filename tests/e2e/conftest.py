"""The e2e layer's PostgreSQL: one throwaway cluster per session, and `dflash-pipeline serve` on it."""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pgserver import ThrowawayPostgres, missing_reason
from tests.serving import LOAD_SERVER_ENV, ROOT, SMALL, TINY_TRAINING, serve


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL cluster (initdb + pg_ctl into a temp dir, owned by an unprivileged user when we are root,
    on a free loopback port), stopped and removed at the end of the session, on failure and on Ctrl-C too.
    fsync is off: nothing in it outlives the session."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    with ThrowawayPostgres(fsync=False) as pg:
        yield pg


@pytest.fixture(scope="session")
def pg_server(postgres, tmp_path_factory, model_dir):
    """`dflash-pipeline serve --database postgresql://...` (server, work pool, deployments, a worker) on a fresh
    database of the session's cluster; shared by the PostgreSQL deployment, load and browser tests."""
    url = postgres.create_database("prefect")
    with serve(tmp_path_factory.mktemp("pg_prefect_home"), database=url, env=LOAD_SERVER_ENV) as lp:
        lp.database_url = url
        print(f"serve on PostgreSQL: up in {lp.startup_s:.0f} s")
        yield lp


# A full run that trains for two steps: every artifact the project publishes, in seconds of CPU.
FULL_TINY = {"data.max_samples": 8, **SMALL, **TINY_TRAINING}


@pytest.fixture(scope="session")
def pg_full_run(pg_server, tmp_path_factory):
    """The `full` deployment, triggered the README's way (`prefect deployment run -p overrides=...`), finished on
    the PostgreSQL-backed server: (server, flow run, output dir)."""
    from tests.serving import wait_final

    out = tmp_path_factory.mktemp("pg_full")
    run_id = pg_server.run_deployment("full", {**FULL_TINY, "output_dir": str(out)})
    (fr,) = wait_final(pg_server, [run_id], timeout=600)
    return pg_server, fr, out


def _source_copy(dest: Path) -> Path:
    """What the wheel is built from, copied from this checkout: pyproject.toml, the README and the package folders
    it names. setuptools builds in the source's build/ folder; in the checkout itself that folder is shared with any
    other build there (another suite, an install), and a build that one removed under it failed here with
    "[Errno 2] No such file or directory"."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = {p.split("/")[0] for p in project["tool"]["setuptools"]["package-dir"].values()}
    dest.mkdir()
    for name in ["pyproject.toml", "README.md", *sorted(folders)]:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif (ROOT / name).exists():
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="session")
def wheel_env(tmp_path_factory) -> Path:
    """A fresh virtualenv holding the wheel built from this checkout (`pip install .`, not editable; the installed
    CLI, `serve` and the deployments of tests/e2e/test_deployments.py run from it); its dependencies come from
    the test environment's site-packages (a path entry, so this environment's editable install is not seen)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_copy(tmp / "src")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if built.returncode:  # say why: a CalledProcessError hides pip's own message
        pytest.fail(f"pip wheel of {src} (a copy of {ROOT}) failed (exit {built.returncode}):\n{built.stderr[-3000:]}")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (wheel,) = tmp.glob("dflash_pipeline-*.whl")
    pyver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (venv / "lib" / pyver / "site-packages" / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-deps"]
        + [str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return venv
