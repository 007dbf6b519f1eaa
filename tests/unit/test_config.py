"""Configuration: errors name the field and value; the documented defaults file stays in sync."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_pipeline.config import defaults_yaml, load_config
from dflash_pipeline.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_config_errors_name_field_and_value():
    with pytest.raises(ConfigError, match=r"extract.token_budget.*got -3"):
        load_config(None, ["extract.token_budget=-3"])
    with pytest.raises(ConfigError, match=r"data.nonsense"):
        load_config(None, ["data.nonsense=1"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["data.max_samples"])


def test_yaml_file_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  max_samples: 7\nlayers:\n  preset: explicit\n  ids: [1, 2]\n")
    cfg = load_config(f, ["data.max_samples=9", "extract.devices=cpu"])
    assert cfg.data.max_samples == 9 and cfg.layers.ids == [1, 2] and cfg.extract.devices == "cpu"
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_committed_defaults_file_is_current():
    assert (ROOT / "configs" / "default.yaml").read_text() == defaults_yaml(), (
        "regenerate it: dflash-pipeline show-config > configs/default.yaml"
    )
    assert load_config(ROOT / "configs" / "default.yaml") == load_config()
