"""The package as a user installs it: `pip install .` (a wheel, not editable) gives exactly one top-level import
name, ships its deployments, and the installed CLI runs the pipeline from any directory, writing one store
where a relative output_dir says (resolved against the directory the user ran it in)."""

from __future__ import annotations

import json
import subprocess
import zipfile

from tests.serving import CLEAN_ENV


def test_the_wheel_installs_one_top_level_name(wheel_env):
    (wheel,) = wheel_env.parent.glob("dflash_pipeline-*.whl")
    top = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist() if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"dflash_pipeline"}, top
    out = subprocess.run(
        [
            str(wheel_env / "bin" / "python"),
            "-c",
            "import dflash_pipeline, dflash_pipeline.flows.pipeline as f, dflash_pipeline.deployments as d;"
            "print(dflash_pipeline.__file__, f.__file__, d.PREFECT_FILE.exists())",
        ],
        cwd=wheel_env.parent,
        env=CLEAN_ENV,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    site_dir = str(wheel_env / "lib")
    assert out[0].startswith(site_dir) and out[1].startswith(site_dir) and out[2] == "True", out


def test_the_installed_cli_runs_from_another_directory_with_a_relative_output_dir(wheel_env, model_dir, tmp_path):
    """Run as a user would, from a directory of their own: the store lands under that directory, once."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {**CLEAN_ENV, "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}
    env.pop("PREFECT_API_URL", None)
    res = subprocess.run(
        [str(wheel_env / "bin" / "dflash-pipeline"), "run", "--json"]
        + ["--set", "output_dir=out", "--set", "data.max_samples=8", "--set", "extract.devices=cpu"]
        + ["--set", "layers.num_draft_layers=2", "--set", "stages=[prepare,extract,validate]"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout)  # --json: the summary alone on stdout
    assert summary["validation"] == "PASS" and summary["store"] == str(cwd / "out" / "store")
    stores = [p for p in tmp_path.rglob("CURRENT")]
    assert stores == [cwd / "out" / "store" / "CURRENT"], stores
