"""The disk-aware precision choice (storage/diskcheck.py, core/planner.py::disk_check): which precisions keep
extraction GPU-bound on a disk of a given write bandwidth and how long each takes, with given numbers; the short
write test; the plan's lines."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest

from dflash_pipeline import planner
from dflash_pipeline.config import RunConfig
from dflash_pipeline.storage import diskcheck, quant

# The 8B shape (5 layers x hidden 4096) on one H200: 39,270 tokens/s (bench/RESULTS.md); bytes per token on disk:
# bf16 28.2 KB and fp8 16.8 KB measured there, int8 18.4 KB, int4 its format (10,905 bytes, uncompressed).
RATE = 39_270
BYTES = {"full": 28_200, "fp8": 16_800, "int8": 18_432, "int4": 10_905}
TOKENS = 10**6  # 28.2 GB of full: inside the disk's trusted burst (diskcheck.BURST_BYTES)


def by_name(advice: diskcheck.DiskAdvice) -> dict[str, diskcheck.PrecisionOption]:
    return {o.precision: o for o in advice.options}


def test_a_fast_disk_keeps_full_precision():
    a = diskcheck.advise(3e9, RATE, TOKENS, BYTES)
    assert a.recommended == "full" and all(o.gpu_bound for o in a.options)
    assert by_name(a)["full"].hours == pytest.approx(TOKENS / RATE / 3600)  # the GPU's time, every precision


def test_a_fresh_cloud_disk_recommends_fp8_and_says_how_long_full_would_take():
    """1 GB/s: bf16 produces 1.107 GB/s, above 0.8 of it; fp8 (660 MB/s) and int4 stay GPU-bound."""
    a = diskcheck.advise(1e9, RATE, TOKENS, BYTES)
    o = by_name(a)
    assert a.recommended == "fp8" and "full would wait for the disk" in a.reason
    assert not o["full"].gpu_bound and o["fp8"].gpu_bound and o["int8"].gpu_bound and o["int4"].gpu_bound
    assert o["full"].produced_bytes_per_s == pytest.approx(RATE * 28_200)
    assert o["full"].tokens_per_s == pytest.approx(0.8e9 / 28_200)  # what the disk takes of bf16
    assert o["full"].hours == pytest.approx(TOKENS * 28_200 / 0.8e9 / 3600)  # 35.3 s instead of 25.5
    assert o["fp8"].hours == pytest.approx(TOKENS / RATE / 3600)
    assert any("recommended precision: fp8" in line for line in a.lines())


def test_a_slow_disk_recommends_int4_and_a_slower_one_the_fewest_bytes():
    a = diskcheck.advise(0.6e9, RATE, TOKENS, BYTES)  # 0.48 GB/s usable: int4's 428 MB/s fits, fp8's 660 does not
    assert a.recommended == "int4" and by_name(a)["int4"].gpu_bound and not by_name(a)["fp8"].gpu_bound
    assert "full, fp8 would wait" in a.reason
    slow = diskcheck.advise(0.2e9, RATE, TOKENS, BYTES)
    assert slow.recommended == "int4" and not any(o.gpu_bound for o in slow.options)
    assert "no precision keeps extraction GPU-bound" in slow.reason
    assert by_name(slow)["int4"].hours == pytest.approx(TOKENS * 10_905 / 0.16e9 / 3600)


def test_past_its_burst_a_fresh_disk_is_trusted_with_less():
    """The GPU machine's fresh disk (bench/RESULTS.md): a 34 GB store at the burst rate ran GPU-bound (2026-12-05),
    a 56 GB one did not (2026-12-05, (b)/(a) 0.873): past BURST_BYTES the advice counts SUSTAINED of the rate."""
    s21 = diskcheck.advise(2.538e9, 43_509, 1_200_888, {"full": 28_229, "int4": 9_634})
    assert s21.recommended == "full" and by_name(s21)["full"].store_bytes == pytest.approx(33.9e9, rel=1e-3)
    per_token = {"full": 28_229, "fp8": 20_500, "int4": 9_634}
    s22 = diskcheck.advise(2.412e9, 44_989, 2_000_311, per_token, tested_bytes=4 << 30)
    o = by_name(s22)
    assert not o["full"].gpu_bound and not o["fp8"].gpu_bound and o["int4"].gpu_bound
    assert s22.recommended == "int4" and "full, fp8 would wait" in s22.reason
    full = 2_000_311 * 28_229
    seconds = 34e9 / (44_989 * 28_229) + (full - 34e9) / (0.35 * 2.412e9)
    assert o["full"].hours == pytest.approx(seconds / 3600) and o["full"].tokens_per_s < 44_989
    assert "for the first 34 GB of the store, 35% beyond" in s22.lines()[0]
    # a write test as long as the store extends the trusted part to what it wrote
    assert diskcheck.advise(2.412e9, 44_989, 2_000_311, per_token, tested_bytes=60e9).recommended == "full"


def test_int8_is_never_preferred_over_fp8():
    """int8 takes more bytes than fp8 for no acceptance measured (storage/diskcheck.py PREFERENCE)."""
    a = diskcheck.advise(0.9e9, RATE, TOKENS, {"full": 28_200, "int8": 16_000, "fp8": 16_800})
    assert a.recommended == "fp8"
    only_int8 = diskcheck.advise(0.9e9, RATE, TOKENS, {"full": 28_200, "int8": 16_000})
    assert only_int8.recommended == "int8"  # nothing in PREFERENCE fits: the fewest bytes


def test_advice_refuses_meaningless_inputs():
    for args in ((0, RATE, BYTES), (1e9, 0, BYTES), (1e9, RATE, {})):
        with pytest.raises(ValueError, match="positive bandwidth"):
            diskcheck.advise(args[0], args[1], TOKENS, args[2])


def test_the_write_test_writes_and_removes_its_file(tmp_path):
    t = diskcheck.measure_write_bandwidth(tmp_path, 4)
    assert t.bytes == 4 << 20 and t.bytes_per_s > 0 and t.method in ("O_DIRECT", "buffered + fsync")
    assert os.listdir(tmp_path) == [] and "MB/s" in t.line()
    with pytest.raises(ValueError, match="plan.write_test_mib"):
        diskcheck.measure_write_bandwidth(tmp_path, 0)
    with pytest.raises(OSError):
        diskcheck.measure_write_bandwidth(tmp_path / "missing", 1)


@dataclass
class _Report:  # what disk_check reads of a ProbeReport
    replicas: list[str] = field(default_factory=lambda: ["cuda:0", "cuda:1"])


def _estimate(**kw) -> planner.StoreEstimate:
    base = dict(
        samples=1000, tokens=1_000_000, supervised_tokens=500_000, rows_read=1000, quarantined=0, dropped={},
        precision="full", logical_dtype="bfloat16", compression="zstd", layers=[1, 9, 17, 25, 33], hidden_size=4096,
        capture_last=False, raw_bf16_bytes_per_token=40_960, bytes_per_token=28_200.0, metadata_bytes_per_sample=50.0,
        units=1, store_bytes=28_200 * 10**6, calibration="-", store="-", already_committed_tokens=0,
        needed_bytes=0, free_bytes=None, free_source="-", fits=True, gpu="H200", gpu_source="-",
        extract_tokens_per_s=RATE,
    )  # fmt: skip
    return planner.StoreEstimate(**{**base, **kw})


def test_the_plan_compares_each_precision_on_the_store_disk(tmp_path, monkeypatch):
    """plan.write_test_mib: the measured bandwidth against every precision at the rate of all GPU workers (two
    here); the run's own precision with its calibrated bytes, the others from their formats."""
    est = _estimate()
    per_token = planner.precision_bytes_per_token(est, "bfloat16")
    extra = 5 + 50 * 1000 / 1_000_000
    assert per_token == pytest.approx(
        {"full": 28_200, "fp8": 5 * 4100 + extra, "int8": 5 * 4228 + extra, "int4": 5 * 2180 + extra}
    )
    assert per_token["int4"] / est.raw_bf16_bytes_per_token < 0.28

    off = RunConfig.model_validate({"output_dir": str(tmp_path)})
    assert planner.disk_check(off, _Report(), est, "bfloat16")[0] is None  # plan.write_test_mib=0: skipped

    measured = diskcheck.WriteTest(1.5e9, 8 << 20, 0.01, "O_DIRECT", str(tmp_path))
    monkeypatch.setattr(diskcheck, "measure_write_bandwidth", lambda where, mib: measured)
    cfg = RunConfig.model_validate({"output_dir": str(tmp_path), "plan": {"write_test_mib": 8}})
    advice, lines = planner.disk_check(cfg, _Report(), est, "bfloat16")
    assert advice["gpu_tokens_per_s"] == 2 * RATE and advice["workers"] == 2
    assert advice["recommended"] == "int4"  # 78,540 tokens/s: fp8 1.6 GB/s, int4 0.86 GB/s of 1.2 usable
    assert any("set extract.store_precision=int4" in line for line in lines)
    est.disk_advice, est.disk_lines = advice, lines
    assert "recommended precision: int4" in est.to_markdown()
    slow = diskcheck.WriteTest(0.1e9, 8 << 20, 0.08, "O_DIRECT", str(tmp_path))
    monkeypatch.setattr(diskcheck, "measure_write_bandwidth", lambda where, mib: slow)
    assert "int4 to wait least for this disk" in planner.disk_check(cfg, _Report(), est, "bfloat16")[1][-1]


def test_a_real_write_test_in_the_plan(tmp_path):
    cfg = RunConfig.model_validate({"output_dir": str(tmp_path), "plan": {"write_test_mib": 2}})
    advice, lines = planner.disk_check(cfg, _Report(["cpu"]), _estimate(extract_tokens_per_s=1000.0), "bfloat16")
    assert advice["write_test"]["bytes"] == 2 << 20 and advice["workers"] == 1
    assert lines[0].startswith("disk write speed: ") and advice["recommended"] in quant.PRECISIONS
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # the test file is gone
