"""Per-device worker processes: device pinning, one run per GPU, clear errors."""

from __future__ import annotations

from dflash_pipeline.extraction.procs import child_env


def test_child_sees_exactly_its_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    env, local = child_env("cuda:1")
    assert env["CUDA_VISIBLE_DEVICES"] == "5" and local == "cuda:0"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    env, local = child_env("cuda:2")
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    assert child_env("cpu:1")[1] == "cpu"
