"""Whether the store's disk keeps extraction GPU-bound, per precision (issue 29, "disk-aware defaults").

A fresh cloud disk can write slower than extraction produces: the 8B pipeline on one H200 produced ~1.1 GB/s of
bf16 store (39k tokens/s x 28 KB) and waited 12 s for its writers at 1.65M tokens, (b)/(a) 0.884, where a disk
written before gave 0.97 (bench/RESULTS.md). `measure_write_bandwidth` writes a few GB into the store's directory
the way the disk sees shards (large sequential writes, bypassing the page cache where it can), and `advise`
compares what each precision would produce with it.

A few GB measure a disk's burst rate, not what it sustains over tens of GB. The GPU machines' fresh disks measured
2,412-2,538 MB/s over 4 GiB, and the 8B pipeline producing ~1.27 GB/s of bf16 store ran GPU-bound for a 34 GB store
(2026-12-05, writer wait 0.1 s) but not for a 56 GB one (2026-12-05, (b)/(a) 0.873): the 6.5 s that run lost say the
disk took ~0.93 GB/s past ~34 GB, ~0.39 of its burst (SUSTAINED 0.35 holds if the burst ended as late as ~40 GB;
bench/RESULTS.md). So the advice trusts HEADROOM of the measured rate for the first BURST_BYTES of the store (or
what the test wrote, if more) and SUSTAINED of it beyond: a run stays GPU-bound while it produces at most what
each part allows.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# Extraction counts as GPU-bound while it produces at most this share of the measured bandwidth. The measurement is
# one sequential stream; the store's writers add compression, several files at once, fsyncs and commit records, and
# a fresh disk's speed varies. A margin: on a fresh H200 disk (2,538 MB/s measured) the 8B pipeline producing 1,782
# MB/s of full precision (70%) waited 0.10 s for its writers in 28 s, (b)/(a) 0.968
# (bench/RESULTS.md, Compact stores, 2026-12-05).
HEADROOM = 0.8
# A fresh disk's burst and what it keeps up after, as measured on the GPU machine's (the module doc). A disk that
# holds its rate is advised conservatively past BURST_BYTES; a longer write test (plan.write_test_mib) extends the
# trusted part to what it wrote.
BURST_BYTES = 34 * 10**9
SUSTAINED = 0.35
# The recommendation is the first of these that keeps extraction GPU-bound. int8 is listed but not preferred: its
# group steps make it the closest compact precision (relative L2 ~0.007 against fp8's ~0.026,
# tests/unit/test_quant.py), but it takes more bytes than fp8 (0.516 of bf16 before Blosc, 0.5005) and fp8's
# drafters were within noise of full precision's on the real-text target (bench/RESULTS.md, Compact stores, 2026-12-04).
PREFERENCE = ("full", "fp8", "int4")
BLOCK = 16 << 20  # bytes per write: a multiple of every O_DIRECT alignment, about a chunk of a shard


@dataclass(frozen=True)
class WriteTest:
    """A measured sustained write: `bytes` written in `seconds` (data on the disk: O_DIRECT, or fsync'd)."""

    bytes_per_s: float
    bytes: int
    seconds: float
    method: str  # "O_DIRECT" or "buffered + fsync"
    directory: str

    def line(self) -> str:
        return (
            f"{self.bytes_per_s / 1e6:,.0f} MB/s sustained write ({self.bytes / 2**20:,.0f} MiB, {self.method}, "
            f"{self.seconds:.1f} s) in {self.directory}"
        )


def _open(path: str) -> tuple[int, str]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o600), "O_DIRECT"
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: the filesystem has no O_DIRECT (tmpfs, some FUSE mounts)
                raise
    return os.open(path, flags, 0o600), "buffered + fsync"


def measure_write_bandwidth(directory: str | Path, mib: int, max_seconds: float = 120.0) -> WriteTest:
    """Write `mib` MiB of incompressible bytes to a temporary file in `directory` (in BLOCK writes; O_DIRECT where
    the filesystem takes it, else buffered), fsync it, remove it, and return the rate. Stops early after
    `max_seconds` (a slow disk: the rate is measured on what was written). Raises OSError (no room, read-only: the
    caller says the test was skipped) and ValueError for mib < 1."""
    if mib < 1:
        raise ValueError(f"write test of {mib} MiB: give at least 1 MiB (plan.write_test_mib), or 0 to skip it")
    directory = str(directory)
    block = min(BLOCK, mib << 20)
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(block))  # incompressible, in case the filesystem compresses
    fd, path = None, os.path.join(directory, f".dflash-write-test-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd, method = _open(path)
        written, total = 0, mib << 20
        t0 = time.monotonic()
        while written < total and time.monotonic() - t0 < max_seconds:
            try:
                n = os.write(fd, memoryview(buf)[: min(block, total - written)])  # MiB multiples: aligned
            except OSError as e:
                if e.errno != errno.EINVAL or method != "O_DIRECT" or written:
                    raise
                os.close(fd)  # O_DIRECT accepted at open but not for this write: measure buffered instead
                os.unlink(path)
                fd, method = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "buffered + fsync"
                t0 = time.monotonic()
                continue
            written += n
        os.fsync(fd)
        seconds = time.monotonic() - t0
    finally:
        if fd is not None:
            os.close(fd)
        if os.path.exists(path):
            os.unlink(path)
        buf.close()
    return WriteTest(written / max(seconds, 1e-9), written, seconds, method, directory)


@dataclass(frozen=True)
class PrecisionOption:
    precision: str
    bytes_per_token: float
    produced_bytes_per_s: float  # what extraction at full GPU speed hands the writers
    store_bytes: float  # what the run writes of this precision
    gpu_bound: bool  # the disk keeps up with `produced` in the burst part and, past it, in the sustained part
    tokens_per_s: float  # the GPU's rate, or the whole run's average where the disk takes less
    hours: float  # the extraction's duration at that rate


@dataclass(frozen=True)
class DiskAdvice:
    bandwidth_bytes_per_s: float
    gpu_tokens_per_s: float
    tokens: int
    headroom: float
    burst_bytes: float  # written at headroom x the bandwidth; the rest at sustained x the bandwidth
    sustained: float
    options: list[PrecisionOption]
    recommended: str
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        each = "; ".join(
            f"{o.precision} {o.produced_bytes_per_s / 1e6:,.0f} MB/s "
            + ("GPU-bound" if o.gpu_bound else f"disk-bound: {o.tokens_per_s:,.0f} tokens/s on average")
            + f", {o.hours:.3g} h"
            for o in self.options
        )
        return [
            f"disk vs GPU: at {self.gpu_tokens_per_s:,.0f} tokens/s extraction produces {each} "
            f"(GPU-bound: at most {self.headroom:.0%} of the disk's {self.bandwidth_bytes_per_s / 1e6:,.0f} MB/s for "
            f"the first {self.burst_bytes / 1e9:,.0f} GB of the store, {self.sustained:.0%} beyond: a fresh disk's "
            "burst ends after tens of GB)",
            f"recommended precision: {self.recommended} ({self.reason})",
        ]


def advise(
    bandwidth_bytes_per_s: float,
    gpu_tokens_per_s: float,
    tokens: int,
    bytes_per_token: dict[str, float],
    headroom: float = HEADROOM,
    tested_bytes: float = 0,
) -> DiskAdvice:
    """Which precisions keep extraction GPU-bound on a disk measured at `bandwidth_bytes_per_s` (over
    `tested_bytes`), when the GPUs extract `gpu_tokens_per_s` (all workers writing to this disk together) and each
    precision stores `bytes_per_token[p]` bytes a token on disk; how long `tokens` take with each (the module doc:
    the burst rate for the first max(BURST_BYTES, tested_bytes), SUSTAINED of it beyond). The recommendation: the
    first of PREFERENCE that stays GPU-bound, else the precision of fewest bytes (the fastest on this disk)."""
    if bandwidth_bytes_per_s <= 0 or gpu_tokens_per_s <= 0 or not bytes_per_token:
        raise ValueError(
            f"disk advice needs a positive bandwidth ({bandwidth_bytes_per_s}) and GPU rate ({gpu_tokens_per_s}) "
            f"and bytes per token of at least one precision ({bytes_per_token})"
        )
    burst = max(BURST_BYTES, tested_bytes)
    sustained = min(SUSTAINED, headroom)  # (a caller's lower headroom holds past the burst too)
    usable, later = headroom * bandwidth_bytes_per_s, sustained * bandwidth_bytes_per_s
    options = []
    for p, bpt in bytes_per_token.items():
        produced, store = gpu_tokens_per_s * bpt, tokens * bpt
        first, rest = min(store, burst), max(store - burst, 0.0)
        seconds = first / min(produced, usable) + rest / min(produced, later)
        bound = produced <= (later if rest else usable)
        rate = tokens / seconds if seconds > 0 else gpu_tokens_per_s
        options.append(PrecisionOption(p, bpt, produced, store, bound, rate, seconds / 3600))
    bound = {o.precision for o in options if o.gpu_bound}
    pick = next((p for p in PREFERENCE if p in bound), None)
    if pick is not None:
        better = [p for p in PREFERENCE[: PREFERENCE.index(pick)] if p in bytes_per_token]
        reason = "keeps extraction GPU-bound" + (
            f"; {', '.join(better)} would wait for the disk" if better else " with the most faithful states"
        )
    else:
        pick = min(options, key=lambda o: o.bytes_per_token).precision
        reason = "no precision keeps extraction GPU-bound on this disk; the fewest bytes wait least for it"
    return DiskAdvice(
        bandwidth_bytes_per_s, gpu_tokens_per_s, tokens, headroom, burst, sustained, options, pick, reason
    )
