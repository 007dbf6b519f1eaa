"""Validation catches what a peer's users trained on for days: zeros, NaN, corruption, wrong states."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from dflash_pipeline.errors import ValidationFailed
from dflash_pipeline.extraction.config import ValidateConfig
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


def _recommit(store_root: Path, version: str, unit: str) -> None:
    """Record the unit's files as they are now in its commit record: what a writer that produced these values
    would have committed (the checks below are about values, not about damage after the commit)."""
    s = Store(store_root)
    rec = s.commit_record(version, unit)
    loc = s.unit_location(version, unit)
    rec["files"] = {f: loc.digest_of(f) for f in rec["files"]}
    loc.write_json_atomic("commit.json", rec)


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
    assert r.n_samples == 60 and len(r.recomputed) == 6 and len(r.layer_stats) == 4  # 3 layers + last_hidden
    assert all(x["max_rel_err"] < 1e-5 for x in r.recomputed)
    raise_if_failed(r)


def test_all_zero_row_names_sample_and_layer(small_store, copy):
    u, g, samples = _unit(copy, small_store.plan.version)
    sid, start, length = samples[2]
    h = g["hidden"][:]
    h[start + 5, 1] = 0  # one token, second captured layer (id 2)
    g["hidden"][:] = h
    _recommit(copy, small_store.plan.version, u)
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
    _recommit(copy, small_store.plan.version, u)
    r = _validate(small_store, copy)
    assert any("non-finite values" in f and samples[0][0] in f and "layer 3" in f for f in r.failures), r.failures
    # the record names the unit, for a nightly run to extract it again (core/order.py heal_failed_versions)
    (values,) = [c for c in r.to_dict()["checks"] if c["check"].startswith("values finite")]
    assert values["states"] is True and values["units"] == [u]


def test_flipped_byte_is_a_decode_error_with_its_shard(small_store, copy):
    """A flipped byte in a shard whose commit record still matches it (damage before the commit): zarr's
    CRC32C per chunk makes it a decode error, reported with its unit, array and shard."""
    u, _, _ = _unit(copy, small_store.plan.version)
    for array in ("hidden", "last_hidden"):
        shard = [
            p for p in sorted((copy / small_store.plan.version / "units" / u / array / "c").rglob("*")) if p.is_file()
        ][0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 3] ^= 0xFF
        shard.write_bytes(bytes(data))
    _recommit(copy, small_store.plan.version, u)
    r = _validate(small_store, copy)
    for array in ("hidden", "last_hidden"):
        assert any(f"unit {u} array {array} shard" in f and "cannot be decoded" in f for f in r.failures), r.failures


def test_wrong_states_fail_the_recompute(small_store, copy, model):
    u, g, samples = _unit(copy, small_store.plan.version)
    g["hidden"][:] = g["hidden"][:] * np.float32(1.01)  # plausible-looking but not the target's states
    _recommit(copy, small_store.plan.version, u)
    r = _validate(small_store, copy, model, n=len(samples) + 20)
    assert any("equal a fresh batch-1 forward" in f and "relative error" in f for f in r.failures), r.failures
    # the unit is named, with the way out (a damage hunt found only sample and layer, and verify calling it healthy)
    assert any(f"(unit {u}) layer" in f and f"delete the unit's directory {u}" in f for f in r.failures), r.failures


def test_missing_commit_and_wrong_input_ids_and_mask(small_store, copy):
    version = small_store.plan.version
    u0, _, _ = _unit(copy, version, 0)
    (copy / version / "units" / u0 / "commit.json").unlink()
    u1, g, samples = _unit(copy, version, 1)
    ids, mask = g["input_ids"][:], g["loss_mask"][:]
    ids[0] += 1
    mask[samples[1][1]] ^= 1
    g["input_ids"][:] = ids
    g["loss_mask"][:] = mask
    _recommit(copy, version, u1)
    r = _validate(small_store, copy)
    failed = " ".join(r.failures)
    assert f"unit {u0}" in failed and "commit.json" in failed
    assert f"input_ids equal the prepared ones: sample {samples[0][0]}" in failed
    assert f"loss_mask equals the prepared one: sample {samples[1][0]}" in failed


def test_damaged_index_and_ids_are_report_lines_not_exceptions(small_store, copy):
    """A shard index and an input_ids chunk that cannot be decoded, committed as they are: lines, no raise."""
    version = small_store.plan.version
    u, _, _ = _unit(copy, version, 0)
    unit = copy / version / "units" / u
    shard = unit / "hidden" / "c" / "0" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # inside the shard index
    shard.write_bytes(bytes(data))
    ids = unit / "input_ids" / "c" / "0"
    ids.write_bytes(ids.read_bytes()[:-7] + b"garbage")
    _recommit(copy, version, u)
    r = _validate(small_store, copy, n=0)
    assert not r.ok and any(f"unit {u}" in f for f in r.failures), r.failures


def test_last_decoder_layer_validates_pre_norm(model_dir, tmp_path, model):
    """layers.ids=[7] on the 8-layer embedded target: the stored value is the layer's own output, before the
    final norm; validation compares it with that, not with HF's post-norm hidden_states[-1]."""
    from tests.helpers import extract_local

    ex = extract_local(
        tmp_path,
        {"data.max_samples": 8, "layers.preset": "explicit", "layers.ids": [7], "layers.capture_last": True},
    )
    assert len(model.model.layers) == 8
    r = validate_store(ex.store, ex.plan.version, ex.prepared, ValidateConfig(recompute_samples=4), model=model)
    assert r.ok, r.failures
    assert len(r.recomputed) == 4 and all(x["max_rel_err"] < 1e-5 for x in r.recomputed)


def test_a_unit_changed_since_the_last_validation_is_recomputed(small_store, copy, model):
    """A unit replaced after a validation with records that agree with its files (here: states 1% off, recommitted;
    in the field: a unit directory copied in from a store of another layer set) passes every scan; only a forward
    tells. Revalidating (what verify advises for a changed unit) recomputes a sample of it, not only the seeded
    pick, which may never land in it."""
    import json

    from dflash_pipeline.storage.layout import VALIDATION

    version = small_store.plan.version
    first = _validate(small_store, copy, model, n=1)
    assert first.ok, first.failures
    Store(copy).loc.write_atomic(f"{version}/{VALIDATION}", json.dumps(first.to_dict()).encode())  # as the stage does
    picked = first.recomputed[0]["sample_id"]
    u = next(
        u
        for u in Store(copy).units(version)
        if picked not in {s[0] for s in Store(copy).unit_attrs(version, u)["samples"]}
    )
    g = Store(copy).open_unit(version, u, mode="r+")
    g["hidden"][:] = g["hidden"][:] * 1.01
    _recommit(copy, version, u)
    again = _validate(small_store, copy, model, n=1)
    assert len(again.recomputed) == 2 and again.recomputed[0]["sample_id"] == picked
    assert not again.ok and any(f"(unit {u})" in f and "differ from the target's forward" in f for f in again.failures)
