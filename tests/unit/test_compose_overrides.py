"""A deployment's preset (its stages, its store policy) survives a user's overrides (issue 16)."""

from __future__ import annotations

import pytest

from dflash_pipeline.errors import ConfigError
from dflash_pipeline.flows.pipeline import compose_overrides, config_digest

NIGHTLY = {"stages": ["prepare", "probe", "extract", "validate"], "extract.incremental": True}


def test_user_overrides_apply_on_top_of_the_preset():
    merged = compose_overrides(NIGHTLY, {"data.max_samples": 100})
    assert merged == {**NIGHTLY, "data.max_samples": 100}
    assert compose_overrides(NIGHTLY, None) == NIGHTLY and compose_overrides(None, {"a": 1}) == {"a": 1}


def test_repeating_a_fixed_value_is_fine_changing_it_is_an_error():
    same = compose_overrides(NIGHTLY, {"stages": ["validate", "extract", "probe", "prepare"]})
    assert same["stages"] == ["validate", "extract", "probe", "prepare"]
    with pytest.raises(ConfigError, match=r"stages=\[\"train\"\].*nightly deployment fixes stages"):
        compose_overrides(NIGHTLY, {"stages": ["train"]}, "the nightly deployment")
    with pytest.raises(ConfigError, match="extract.incremental"):
        compose_overrides(NIGHTLY, {"extract.incremental": False})


def test_config_digest_names_the_resolved_config():
    a = config_digest(None, NIGHTLY, {"data.max_samples": 100})
    assert a == config_digest(None, {**NIGHTLY, "data.max_samples": 100}, None) and len(a) == 8
    assert a != config_digest(None, NIGHTLY, {"data.max_samples": 101})
    assert len(config_digest(None, {"no.such.key": 1}, None)) == 8  # a bad config still gets a name
