"""Placement of the target: one replica per GPU, or one replica split across GPUs when it does not fit."""

from __future__ import annotations

import pytest
import torch

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.extraction.capture import LayerCapture
from dflash_pipeline.extraction.devicelock import device_lock
from dflash_pipeline.extraction.loader import decoder_layers, load_target
from dflash_pipeline.extraction.placement import device_map_summary, split_device_map

GIB = 2**30


def gpus(*free_gib: float) -> dict[str, float]:
    return {f"cuda:{i}": f * GIB for i, f in enumerate(free_gib)}


def test_split_device_map_covers_the_checkpoint_in_contiguous_proportional_runs(model_dir):
    def layers(m):
        return [m[f"model.layers.{i}"] for i in range(8)]

    even = split_device_map(model_dir, ["cuda:0", "cuda:1"], [10.0, 10.0])
    assert even["model.embed_tokens"] == "cuda:0" and even["model.norm"] == "cuda:1"
    assert even["lm_head"] == "cuda:1"  # untied: its bytes count on the last GPU
    assert layers(even) == ["cuda:0"] * 4 + ["cuda:1"] * 4  # embeddings and lm_head weigh the same here
    assert device_map_summary(even) == "cuda:0: 4 layers, cuda:1: 4 layers"
    skewed = layers(split_device_map(model_dir, ["cuda:0", "cuda:1"], [1.0, 3.0]))
    assert skewed == sorted(skewed) and 0 < skewed.count("cuda:0") < 4


def test_the_split_map_loads_the_real_checkpoint_and_computes_the_same_states(model_dir):
    """On CPU both "GPUs" are the CPU: this checks that the map names every module of the checkpoint
    (transformers refuses a device_map that misses one) and that capture through it is unchanged. The real
    split across two GPUs is measured in bench/RESULTS.md."""
    plain = load_target(model_dir, "dtype", "float32", "cpu")
    mapped_on_cpu = {k: "cpu" for k in split_device_map(model_dir, ["cuda:0", "cuda:1"], [1.0, 1.0])}
    from transformers import AutoModelForCausalLM

    split = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device_map=mapped_on_cpu).eval()
    assert len(decoder_layers(split)) == 8
    ids = torch.randint(3, 200, (2, 17))
    rows = torch.arange(2 * 17)
    a = LayerCapture(plain, [1, 4, 6]).packed(ids, None, rows)[0]
    b = LayerCapture(split, [1, 4, 6]).packed(ids, None, rows)[0]
    assert torch.equal(a, b)


def test_a_split_replica_locks_each_of_its_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_LOCK_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # as in the worker of replica cuda:3+cuda:5
    with device_lock("cuda:3+cuda:5", "/stores/a"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # another run's worker on physical GPU 5
        with pytest.raises(PipelineError, match=r"cuda:5 is in use by another dflash-pipeline run .*/stores/a"):
            with device_lock("cuda:5", "/stores/b"):
                pass
