"""Threads sized to the work and to the machine (core/threads.py): a small model takes one thread beside other
CPU-bound work (two lost 2-25x there), a large one keeps torch's default, and OMP_NUM_THREADS wins."""

from __future__ import annotations

import subprocess
import sys
import time

from dflash_pipeline import threads


def test_a_small_model_takes_one_thread_beside_busy_processes(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(threads.cpus())]
    try:
        time.sleep(0.5)
        assert threads.busy_elsewhere() >= threads.cpus() - 1
        assert threads.for_hidden(64) == 1
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert threads.for_hidden(4096) is None  # a real model: torch's default
    assert 1 <= threads.for_hidden(64) <= threads.SMALL_MAX_THREADS


def test_omp_num_threads_is_the_users_choice(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.for_hidden(64) == 3
