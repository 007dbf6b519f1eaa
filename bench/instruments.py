"""Measuring instruments of the benchmarks: GEMM peak, matmul FLOPs of a forward, RSS and NVML sampling."""

from __future__ import annotations

import os
import threading
import time

import torch
from common import log


def rss_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _descendants(pid: int) -> list[int]:
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            kids = [int(k) for k in open(f"/proc/{pid}/task/{tid}/children").read().split()]
        except OSError:
            continue
        for k in kids:
            out += [k] + _descendants(k)
    return out


def pss_bytes() -> int:
    """Proportional set size of this process and every process below it (the store-writer processes): each
    shared page (the shard buffers in /dev/shm) counted once in all, unlike a sum of RSS."""
    total = 0
    for pid in [os.getpid()] + _descendants(os.getpid()):
        try:
            for line in open(f"/proc/{pid}/smaps_rollup"):
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:  # exited meanwhile
            pass
    return total


class Sampler(threading.Thread):
    """Samples this process's RSS, the PSS of it and its child processes, and (on a GPU) NVML utilization
    every `period` s."""

    def __init__(self, device: str, period: float = 0.1):
        super().__init__(daemon=True)
        self.period, self.samples, self._halt = period, [], threading.Event()
        self.nvml = None
        if device.startswith("cuda"):
            try:
                import pynvml

                pynvml.nvmlInit()
                self.nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.device(device).index or 0))
            except Exception as e:  # noqa: BLE001 - utilization sampling is optional
                log("NVML unavailable:", e)

    def run(self):
        while not self._halt.wait(self.period):
            util = None
            if self.nvml:
                try:
                    util = self.nvml[0].nvmlDeviceGetUtilizationRates(self.nvml[1]).gpu
                except Exception:  # noqa: BLE001
                    util = None
            self.samples.append((time.monotonic(), rss_bytes(), pss_bytes(), util))

    def stop(self):
        self._halt.set()
        self.join()

    def window(self, t0: float, t1: float):
        """(peak RSS, peak PSS with child processes, mean GPU utilization) between t0 and t1."""
        s = [x for x in self.samples if t0 <= x[0] <= t1]
        util = [x[3] for x in s if x[3] is not None]
        return (
            max((x[1] for x in s), default=rss_bytes()),
            max((x[2] for x in s), default=pss_bytes()),
            (sum(util) / len(util) / 100) if util else None,
        )


def sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def matmul_peak(device: str) -> float:
    """bf16 GEMM TFLOP/s (median of 20 after warm-up) on random data; fp32 on CPU."""
    if not device.startswith("cuda"):
        n = 512
        a, b = torch.randn(n, n), torch.randn(n, n)
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        return 2 * n**3 * 10 / (time.perf_counter() - t) / 1e12
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1000)
    return 2 * n**3 / sorted(times)[len(times) // 2] / 1e12


def linear_flops_per_token(model, stop_after: int) -> tuple[float, list[tuple[int, int]]]:
    """2 x (weights of every nn.Linear in decoder layers 0..stop_after); and (heads, head_dim) of each
    softmax-attention layer among them (for the T^2 term)."""
    from dflash_pipeline.extraction.loader import decoder_layers

    cfg = getattr(model.config, "text_config", None) or model.config
    lin, attn = 0, []
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    for i, layer in enumerate(decoder_layers(model)[: stop_after + 1]):
        lin += sum(
            m.in_features * m.out_features
            for m in layer.modules()
            if isinstance(m, torch.nn.Linear) or type(m).__name__ == "BlockFP8Linear"  # an FP8 target's linears
        )
        if types[i] == "full_attention":
            attn.append((cfg.num_attention_heads, cfg.head_dim))
    return 2.0 * lin, attn


def flops(lengths: list[int], lin: float, attn: list[tuple[int, int]]) -> float:
    # causal softmax attention: QK^T and PV, 2 flops per multiply-add, T(T+1)/2 pairs per head
    return sum(lin * t + sum(4 * h * d * t * (t + 1) / 2 for h, d in attn) for t in lengths)


def kernel_busy(prof) -> float | None:
    """Share of a torch.profiler span in which the GPU ran something: the union of its device events (kernels,
    copies) over the time from the first one's start to the last one's end. What it leaves out is the GPU waiting on
    the host (a synchronisation, launches slower than the kernels, the next batch). None without device events."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    if not spans:
        return None
    busy, (lo, hi) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > hi:
            busy, lo, hi = busy + hi - lo, s, e
        else:
            hi = max(hi, e)
    busy += hi - lo
    return busy / max(hi - spans[0][0], 1e-9)  # (hi: the last run's end, the latest end of all)
