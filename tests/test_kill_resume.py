"""SIGKILL the extraction at several points; a rerun completes the store bit-identical to a clean run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr

from helpers import extract_local
from storage.reader import HiddenStateDataset
from storage.store import Store

HERE = Path(__file__).parent
# Several units, several 273-token shards each, several batches per shard.
OVERRIDES = {"data.max_samples": 40, "layers.preset": "explicit", "layers.ids": [1, 3, 5], "layers.capture_last": True,
             "extract.unit_tokens": 1500, "extract.shard_mib": 0.2, "extract.chunk_mib": 0.05,
             "extract.token_budget": 300}


@pytest.fixture(scope="module")
def clean(tmp_path_factory, model_dir):
    return extract_local(tmp_path_factory.mktemp("clean"), OVERRIDES)


def _run(out: Path, kill_at: str | None) -> subprocess.CompletedProcess:
    env = {**os.environ}
    if kill_at:
        env["DFLASH_KILL_AT"] = kill_at
    return subprocess.run([sys.executable, str(HERE / "extract_proc.py"), str(out), json.dumps(OVERRIDES)],
                          env=env, capture_output=True, text=True, timeout=300)


def _snapshot(store_root: Path, version: str) -> dict:
    store, snap = Store(store_root), {}
    for u in store.units(version):
        g = zarr.open_group(str(store.unit_dir(version, u)), mode="r")
        snap[u] = {k: g[k][:] for k in ("hidden", "last_hidden", "input_ids", "loss_mask")}
        snap[u]["samples"] = g.attrs["samples"]
        snap[u]["commit"] = store.commit_record(version, u)
    return snap


@pytest.mark.parametrize("kill_at", ["forward:3", "after_shard_write:3", "during_commit:2"])
def test_killed_extraction_resumes_bit_identical(clean, tmp_path, kill_at):
    assert clean.plan.n_units >= 2
    killed = _run(tmp_path, kill_at)
    assert killed.returncode == -9, killed.stderr[-2000:]
    version = Store(tmp_path / "store").versions()[0]
    committed_before = sum(Store(tmp_path / "store").commit_record(version, u)["committed_tokens"]
                           for u in Store(tmp_path / "store").units(version))
    if kill_at == "during_commit:2":  # the temp file of the interrupted commit is still there
        assert list((tmp_path / "store").rglob("*.partial"))

    resumed = _run(tmp_path, None)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    forwards = json.loads(resumed.stdout.strip().splitlines()[-1])["forward_passes"]
    if not kill_at.startswith("forward"):  # shards had been committed: resumed from there, not restarted
        assert committed_before > 0 and forwards < clean.result.forward_passes
    assert not list((tmp_path / "store").rglob("*.partial"))  # orphans cleaned

    a, b = _snapshot(Path(clean.store), clean.plan.version), _snapshot(tmp_path / "store", version)
    assert a.keys() == b.keys()
    for u in a:
        assert a[u]["samples"] == b[u]["samples"] and a[u]["commit"] == b[u]["commit"]
        for k in ("hidden", "last_hidden", "input_ids", "loss_mask"):
            assert np.array_equal(a[u][k], b[u][k]), (u, k)  # bit-identical (raw stored bytes)
    ids = [s.sample_id for s in HiddenStateDataset(tmp_path / "store", version).samples]
    assert len(ids) == len(set(ids)) == 40  # nothing duplicated, nothing missing
