"""Validation catches what a peer's users trained on for days: zeros, NaN, corruption, wrong states."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from dflash_pipeline.config import ValidateConfig
from dflash_pipeline.errors import ValidationFailed
from dflash_pipeline.extraction.loader import load_target
from dflash_pipeline.extraction.validate import raise_if_failed, validate_store
from dflash_pipeline.storage.store import Store


@pytest.fixture(scope="module")
def model(model_dir):
    return load_target(model_dir, "dtype", "float32", "cpu")


@pytest.fixture
def copy(small_store, tmp_path):
    """A private copy of the small store, to damage."""
    dst = tmp_path / "store"
    shutil.copytree(small_store.store, dst)
    return dst


def _unit(store_root: Path, version: str, i: int = 0):
    s = Store(store_root)
    u = s.units(version)[i]
    return u, s.open_unit(version, u, mode="r+"), s.unit_attrs(version, u)["samples"]


def _validate(small_store, root, model=None, n=4):
    return validate_store(
        str(root), small_store.plan.version, small_store.prepared, ValidateConfig(recompute_samples=n), model=model
    )


def test_clean_store_passes(small_store, model):
    r = _validate(small_store, small_store.store, model, n=6)
    assert r.ok, r.failures
    assert r.n_samples == 60 and len(r.recomputed) == 6 and len(r.layer_stats) == 3
    assert all(x["max_rel_err"] < 1e-5 for x in r.recomputed)
    raise_if_failed(r)


def test_all_zero_row_names_sample_and_layer(small_store, copy):
    u, g, samples = _unit(copy, small_store.plan.version)
    sid, start, length = samples[2]
    h = g["hidden"][:]
    h[start + 5, 1] = 0  # one token, second captured layer (id 2)
    g["hidden"][:] = h
    r = _validate(small_store, copy)
    assert not r.ok
    assert any(f"all-zero token row in sample {sid}" in f and "layer 2" in f for f in r.failures), r.failures
    with pytest.raises(ValidationFailed, match=sid):
        raise_if_failed(r)


def test_nan_is_caught(small_store, copy):
    u, g, samples = _unit(copy, small_store.plan.version, 1)
    h = g["hidden"][:]
    h[samples[0][1], 2, 7] = np.nan
    g["hidden"][:] = h
    r = _validate(small_store, copy)
    assert any("non-finite values" in f and samples[0][0] in f and "layer 3" in f for f in r.failures), r.failures


def test_flipped_byte_is_a_decode_error_with_its_shard(small_store, copy):
    u, _, _ = _unit(copy, small_store.plan.version)
    shard = sorted((copy / small_store.plan.version / "units" / u / "hidden" / "c").rglob("*"))
    shard = [p for p in shard if p.is_file()][0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = _validate(small_store, copy)
    assert any(f"unit {u} shard" in f and "cannot be decoded" in f for f in r.failures), r.failures


def test_wrong_states_fail_the_recompute(small_store, copy, model):
    u, g, samples = _unit(copy, small_store.plan.version)
    g["hidden"][:] = g["hidden"][:] * np.float32(1.01)  # plausible-looking but not the target's states
    r = _validate(small_store, copy, model, n=len(samples) + 20)
    assert any("equal a fresh batch-1 forward" in f and "relative error" in f for f in r.failures), r.failures


def test_missing_commit_and_wrong_input_ids(small_store, copy):
    version = small_store.plan.version
    u, g, samples = _unit(copy, version)
    (copy / version / "units" / u / "commit.json").unlink()
    ids = g["input_ids"][:]
    ids[0] += 1
    g["input_ids"][:] = ids
    r = _validate(small_store, copy)
    failed = " ".join(r.failures)
    assert "units committed" in failed and u in failed
    assert f"input_ids equal the prepared ones: sample {samples[0][0]}" in failed
