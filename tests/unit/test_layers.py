"""Compatibility probe: dtype keyword, layer selection, placement, refusals, bad model files."""

from __future__ import annotations

import pytest
import torch

from dflash_pipeline.config import load_config
from dflash_pipeline.errors import ConfigError
from dflash_pipeline.extraction.config import LayersConfig
from dflash_pipeline.extraction.layers import dflash_layer_ids, eagle3_layer_ids, select_layer_ids
from dflash_pipeline.extraction.probe import resolve_devices


@pytest.mark.parametrize(
    ("layers", "n", "expected"),
    [
        (36, 5, [1, 9, 17, 25, 33]),
        (32, 5, [1, 8, 15, 22, 29]),
        (64, 5, [1, 16, 31, 46, 61]),
        (8, 1, [4]),
    ],
)
def test_dflash_default_layers(layers, n, expected):
    assert dflash_layer_ids(layers, n) == expected


def test_eagle3_and_explicit_layers():
    assert eagle3_layer_ids(36) == [1, 17, 32]
    assert select_layer_ids(LayersConfig(preset="explicit", ids=[0, 7]), 8) == [0, 7]
    with pytest.raises(ConfigError, match=r"\[8\] out of range.*valid ids are 0..7"):
        select_layer_ids(LayersConfig(preset="explicit", ids=[1, 8]), 8)
    with pytest.raises(ConfigError, match=r"name a layer more than once: give each once, e.g. layers.ids=\[1\]"):
        select_layer_ids(LayersConfig(preset="explicit", ids=[1, 1]), 8)


def test_the_default_dflash_preset_adapts_to_a_small_target_and_says_so(caplog):
    """A 6-layer target has 3 distinct layers in the preset's range 1..L-3: before, the default 5 gave
    'layer ids [1, 2, 2, 2, 3] contain duplicates (from preset 'dflash')'."""
    with caplog.at_level("WARNING", logger="dflash_pipeline.extraction.layers"):
        assert select_layer_ids(load_config().layers, 6) == [1, 2, 3]
    assert "6 decoder layers: the dflash preset captures 3 layers [1, 2, 3], not the default 5" in caplog.text
    caplog.clear()
    assert select_layer_ids(load_config().layers, 6, announce=False) == [1, 2, 3] and not caplog.text
    assert [select_layer_ids(load_config().layers, n, announce=False) for n in (1, 4, 5, 8)] == [
        [0],
        [2],
        [1, 2],
        [1, 2, 3, 4, 5],
    ]


def test_a_layer_count_the_user_set_is_never_changed_the_error_names_the_fix():
    layers = load_config(None, ["layers.num_draft_layers=5"]).layers
    with pytest.raises(ConfigError) as e:
        select_layer_ids(layers, 6)
    assert "layers.num_draft_layers=5" in str(e.value) and "Set layers.num_draft_layers=3" in str(e.value)
    assert "layers.preset=explicit layers.ids=[0,1,2,4,5]" in str(e.value)
    with pytest.raises(
        ConfigError, match=r"eagle3 needs a target with at least 7.*this one has 6.*layers.ids=\[0,2,5\]"
    ):
        select_layer_ids(LayersConfig(preset="eagle3"), 6)
    assert select_layer_ids(LayersConfig(preset="eagle3"), 7) == [1, 2, 3]


def test_unknown_gpu_is_a_clear_error():
    n = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=f"cuda:{n + 3}.*only {n} GPU"):
        resolve_devices(f"cuda:{n + 3}")


def test_auto_token_budget_is_sized_from_free_gpu_memory():
    from dflash_pipeline.extraction.probe import auto_token_budget

    gib, per_token = 2**30, 234_000  # Qwen3-8B shape, 5 captured layers, bf16
    assert auto_token_budget({"cuda:0": 139 * gib}, 16 * gib, per_token) == 16384  # capped
    small = auto_token_budget({"cuda:0": 80 * gib, "cuda:1": 20 * gib}, 16 * gib, per_token)
    assert small == int(0.8 * 4 * gib / per_token) // 1024 * 1024 == 14336  # the smallest GPU decides
    assert auto_token_budget({"cuda:0": 40 * gib}, 54 * gib, per_token) == 8192  # split replicas
    assert auto_token_budget({"cpu": 500 * gib}, 16 * gib, per_token) == 16384
