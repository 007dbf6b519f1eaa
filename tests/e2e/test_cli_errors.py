"""Per-device worker processes: device pinning, one run per GPU, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.serve import check_api
from tests.s3server import closed_port


def test_unreachable_api_url_is_a_clear_error(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}/api"
    with pytest.raises(PipelineError, match="unreachable.*dflash-pipeline serve"):
        check_api(url, timeout=2)
    res = subprocess.run(
        [sys.executable, "-m", "dflash_pipeline.cli", "run", "--set", f"output_dir={tmp_path}"],
        env={**os.environ, "PREFECT_API_URL": url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "is unreachable" in res.stderr
