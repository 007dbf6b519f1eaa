"""Compatibility probe: dtype keyword, layer selection, placement, refusals, bad model files."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from pipeline.config import ExtractConfig, LayersConfig, TargetConfig
from pipeline.errors import CompatError, ConfigError
from target.layers import dflash_layer_ids, eagle3_layer_ids, select_layer_ids
from target.loader import load_target
from target.probe import probe, probe_dtype_kwarg, resolve_devices


def test_probe_reports_the_hybrid_model(model_dir):
    r = probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu"), model_dir)
    assert r.dtype_kwarg == "dtype"  # transformers >= 4.56
    assert r.model_type == "qwen3_5_text" and r.num_layers == 8 and r.hidden_size == 64 and r.hybrid
    assert r.layer_types[3] == "full_attention" and r.layer_types[2] == "linear_attention"
    assert r.layer_ids == [1, 2, 3, 4, 5] and r.compute_dtype == "float32"
    assert "cpu" in r.placement and "Compatibility probe" in r.to_markdown()


def test_model_loads_through_probed_keyword_without_deprecation(model_dir, caplog):
    kw = probe_dtype_kwarg()
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            model = load_target(model_dir, kw, "bfloat16", "cpu")
    finally:
        hf_logging.disable_propagation()
    assert next(model.parameters()).dtype == torch.bfloat16
    assert not [r for r in caplog.records if "deprecat" in r.getMessage().lower()]


@pytest.mark.parametrize("layers, n, expected", [
    (36, 5, [1, 9, 17, 25, 33]), (32, 5, [1, 8, 15, 22, 29]), (64, 5, [1, 16, 31, 46, 61]), (8, 1, [4]),
])
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


def test_refuses_gdn_with_old_transformers(model_dir, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.10.0")
    with pytest.raises(CompatError, match=r"transformers>=5\.15"):
        probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu"), model_dir)


def test_placement_error_says_what_is_needed(model_dir):
    with pytest.raises(CompatError, match=r"needs ~\d+.*GiB.*extract.token_budget"):
        probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu", token_budget=10**9), model_dir)


def test_missing_and_corrupt_model_files(model_dir, tmp_path):
    with pytest.raises(CompatError, match="not a directory"):
        probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu"), str(tmp_path / "nope"))
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CompatError, match="model.safetensors is corrupt"):
        probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu"), str(broken))
    (broken / "config.json").write_text("{oops")
    with pytest.raises(CompatError, match="config.json is corrupt"):
        probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu"), str(broken))
    (broken / "config.json").unlink()
    with pytest.raises(CompatError, match="no config.json"):
        probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu"), str(broken))
    shutil.copy(f"{model_dir}/config.json", broken / "config.json")
    with pytest.raises(CompatError, match="cannot load the target"):
        load_target(str(broken), "dtype", "float32", "cpu")
    json.loads((broken / "config.json").read_text())


def test_auto_token_budget_is_sized_from_free_gpu_memory():
    from target.probe import auto_token_budget

    gib, per_token = 2**30, 234_000  # Qwen3-8B shape, 5 captured layers, bf16
    assert auto_token_budget({"cuda:0": 139 * gib}, 16 * gib, per_token) == 16384  # capped
    small = auto_token_budget({"cuda:0": 80 * gib, "cuda:1": 20 * gib}, 16 * gib, per_token)
    assert small == int(0.8 * 4 * gib / per_token) // 1024 * 1024 == 14336  # the smallest GPU decides
    assert auto_token_budget({"cuda:0": 40 * gib}, 54 * gib, per_token) == 8192  # split replicas
    assert auto_token_budget({"cpu": 500 * gib}, 16 * gib, per_token) == 16384
