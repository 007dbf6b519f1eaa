"""Extraction through prefect-ray on a local Ray instance (2 CPU workers): same store, validated."""

from __future__ import annotations

import pytest

pytest.importorskip("prefect_ray")


def test_ray_engine_extracts_and_validates(prefect_harness, model_dir, tmp_path):
    from dflash_pipeline.flows.pipeline import dflash_pipeline
    from dflash_pipeline.storage.reader import HiddenStateDataset

    overrides = {
        "output_dir": str(tmp_path),
        "data.max_samples": 30,
        "extract.engine": "ray",
        "extract.ray_workers": 2,
        "extract.unit_tokens": 1000,
        "layers.num_draft_layers": 2,
        "validate.recompute_samples": 2,
        "extract.devices": "cpu",
        "stages": ["prepare", "probe", "extract", "validate"],
    }
    summary = dflash_pipeline(overrides=overrides)
    assert summary.validation == "PASS" and summary.new_samples == 30
    assert len(HiddenStateDataset(tmp_path / "store")) == 30
