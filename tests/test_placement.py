"""Placement of the target: one replica per GPU, or one replica split across GPUs when it does not fit."""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import CompatError, PipelineError
from target.capture import LayerCapture
from target.devicelock import device_lock
from target.loader import decoder_layers, load_target
from target.placement import device_map_summary, plan_replicas, split_device_map
from target.procs import child_env

GIB = 2**30


def gpus(*free_gib: float) -> dict[str, float]:
    return {f"cuda:{i}": f * GIB for i, f in enumerate(free_gib)}


def test_a_replica_per_gpu_when_it_fits():
    assert plan_replicas(gpus(80, 80), 16 * GIB, 4 * GIB, 0, True, "m") == (["cuda:0", "cuda:1"], [])


def test_too_large_for_one_gpu_is_split_across_the_fewest_that_hold_it():
    # 54 GiB of weights + 6 GiB working memory on 40 GiB cards: two GPUs hold (40-6)*2 = 68 >= 54 * 1.1.
    reps, warnings = plan_replicas(gpus(40, 40, 40, 40, 40), 54 * GIB, 6 * GIB, 0, True, "big")
    assert reps == ["cuda:0+cuda:1", "cuda:2+cuda:3"]
    assert warnings == ["cuda:4 left unused: replicas take 2 GPUs each"]
    # On 33 GiB cards two hold (33-6)*2 = 54 < 54 * 1.1 (layers are indivisible): three are needed.
    assert plan_replicas(gpus(33, 33, 33), 54 * GIB, 6 * GIB, 0, True, "big")[0] == ["cuda:0+cuda:1+cuda:2"]


def test_a_model_that_fits_some_gpus_uses_those_rather_than_splitting():
    reps, warnings = plan_replicas(gpus(80, 20, 80), 30 * GIB, 4 * GIB, 0, True, "m")
    assert reps == ["cuda:0", "cuda:2"] and "cuda:1 left unused" in warnings[0]


def test_forced_split_and_its_errors():
    assert plan_replicas(gpus(80, 80), 16 * GIB, 4 * GIB, 2, True, "m")[0] == ["cuda:0+cuda:1"]
    with pytest.raises(CompatError, match=r"gpus_per_replica=3 but only 2 device"):
        plan_replicas(gpus(80, 80), 16 * GIB, 4 * GIB, 3, True, "m")
    with pytest.raises(CompatError, match=r"does not fit extract.gpus_per_replica=1 .*cuda:0 20.0 GiB"):
        plan_replicas(gpus(20, 20), 30 * GIB, 4 * GIB, 1, True, "m")


def test_placement_refusals_name_the_fix():
    with pytest.raises(CompatError, match=r"needs ~60.0 GiB .*all 2 device\(s\) together 60.0 GiB.*token_budget"):
        plan_replicas(gpus(30, 30), 54 * GIB, 6 * GIB, 0, True, "big")
    with pytest.raises(CompatError, match="needs accelerate: pip install accelerate"):
        plan_replicas(gpus(40, 40), 54 * GIB, 6 * GIB, 0, False, "big")
    with pytest.raises(CompatError, match=r"only GPUs can share a replica \(cpu:0, cpu:1"):
        plan_replicas({"cpu:0": 40 * GIB, "cpu:1": 40 * GIB}, 54 * GIB, 6 * GIB, 0, True, "big")


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


def test_a_split_replica_worker_sees_exactly_its_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    env, local = child_env("cuda:1+cuda:3")
    assert env["CUDA_VISIBLE_DEVICES"] == "5,7" and local == "cuda:0+cuda:1"


def test_a_split_replica_locks_each_of_its_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_LOCK_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # as in the worker of replica cuda:3+cuda:5
    with device_lock("cuda:3+cuda:5", "/stores/a"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # another run's worker on physical GPU 5
        with pytest.raises(PipelineError, match=r"cuda:5 is in use by another dflash-pipeline run .*/stores/a"):
            with device_lock("cuda:5", "/stores/b"):
                pass
