"""Placement of the target: one replica per GPU, or one replica split across GPUs when it does not fit."""

from __future__ import annotations

import pytest

from dflash_pipeline.errors import CompatError
from dflash_pipeline.extraction.placement import plan_replicas
from dflash_pipeline.extraction.procs import child_env

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


def test_a_split_replica_worker_sees_exactly_its_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    env, local = child_env("cuda:1+cuda:3")
    assert env["CUDA_VISIBLE_DEVICES"] == "5,7" and local == "cuda:0+cuda:1"
