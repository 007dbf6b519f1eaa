"""Threads sized to the work (core/threads.py): a small model takes one thread (two lost 2-25x beside other
CPU-bound work, and even beside the run's own processes), a large one keeps torch's default, OMP_NUM_THREADS wins."""

from __future__ import annotations

from dflash_pipeline import threads


def test_a_small_model_takes_one_thread_a_large_one_torchs_default(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.for_hidden(64) == 1
    assert threads.for_hidden(4096) is None


def test_omp_num_threads_is_the_users_choice(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.for_hidden(64) == 3
