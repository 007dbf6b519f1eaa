"""Compatibility probe: dtype keyword, layer selection, placement, refusals, bad model files."""

from __future__ import annotations

import pytest
import torch

from dflash_pipeline.config import LayersConfig
from dflash_pipeline.errors import ConfigError
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
    with pytest.raises(ConfigError, match="duplicates"):
        select_layer_ids(LayersConfig(preset="explicit", ids=[1, 1]), 8)


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
