"""Compatibility probe: dtype keyword, layer selection, placement, refusals, bad model files."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from dflash_pipeline.errors import CompatError
from dflash_pipeline.extraction.config import ExtractConfig, LayersConfig, TargetConfig
from dflash_pipeline.extraction.loader import load_target
from dflash_pipeline.extraction.probe import probe, probe_dtype_kwarg


def test_probe_reports_the_hybrid_model(model_dir):
    r = probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu"), model_dir, model_dir)
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


def test_refuses_gdn_with_old_transformers(model_dir, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.10.0")
    with pytest.raises(CompatError, match=r"transformers>=5\.15"):
        probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu"), model_dir, model_dir)


def test_placement_error_says_what_is_needed(model_dir):
    with pytest.raises(CompatError, match=r"needs ~\d+.*GiB.*extract.token_budget"):
        probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu", token_budget=10**9), model_dir, model_dir)


def test_missing_and_corrupt_model_files(model_dir, tmp_path):
    with pytest.raises(CompatError, match="not a directory"):
        probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu"), str(tmp_path / "nope"), model_dir)
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CompatError, match="model.safetensors is corrupt"):
        probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu"), str(broken), model_dir)
    (broken / "config.json").write_text("{oops")
    with pytest.raises(CompatError, match="config.json is corrupt"):
        probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu"), str(broken), model_dir)
    (broken / "config.json").unlink()
    with pytest.raises(CompatError, match="no config.json"):
        probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu"), str(broken), model_dir)
    shutil.copy(f"{model_dir}/config.json", broken / "config.json")
    with pytest.raises(CompatError, match="cannot load the target"):
        load_target(str(broken), "dtype", "float32", "cpu")
    json.loads((broken / "config.json").read_text())


def test_a_model_directory_without_tokenizer_files_names_them_in_the_probe(model_dir, tmp_path):
    """Deployments skip the CLI's pre-flight: the probe itself names the missing files and the setting (before, the
    tokenizer transformers built anyway was reported as 'has no chat_template')."""
    bare = tmp_path / "weights-only"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(f"{model_dir}/{f}", bare / f)
    with pytest.raises(CompatError, match=r"target\.model_path .* has no tokenizer files .*target\.tokenizer_path"):
        probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu"), str(bare), str(bare))
