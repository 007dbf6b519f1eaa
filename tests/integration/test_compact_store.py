"""Compact precisions (extract.store_precision fp8 / int8 / int4): round trip within the documented bound, a decode
with plain zarr + numpy exactly as docs/STORE.md describes it (int4: the decoder written there, run as it is),
validation of a compact store (and of a damaged scale), and a version never mixing precisions."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_pipeline.errors import StoreError
from dflash_pipeline.storage import digest, quant
from dflash_pipeline.storage.reader import HiddenStateDataset
from dflash_pipeline.storage.store import Store
from tests.helpers import extract_local

ROOT = Path(__file__).resolve().parents[2]
COMPACT = ["fp8", "int8", "int4"]

OVERRIDES = {
    "data.max_samples": 24,
    "layers.preset": "explicit",
    "layers.ids": [1, 2, 3],
    "layers.capture_last": True,
    "extract.unit_tokens": 1200,
}


@pytest.fixture(scope="module")
def stores(model_dir, tmp_path_factory):
    """The same samples extracted at full precision (float32 on CPU) and in each compact precision, each validated
    and published (CURRENT) as a run publishes it: what readers and training read by default."""
    root = tmp_path_factory.mktemp("compact")
    return {
        p: extract_local(root / p, {**OVERRIDES, "extract.store_precision": p}, validate=True)
        for p in ("full", *COMPACT)
    }


@pytest.mark.parametrize("precision", COMPACT)
def test_round_trip_within_the_documented_bound(stores, precision):
    """Each row read back is within quant.error_bound of the full-precision row (the same forward, same batches:
    the compact store holds exactly Q(x) of the x the full store holds), and the data takes 1 byte a value (int4:
    half a byte, with a scale byte per 32 channels and a float32 per row)."""
    full, compact = HiddenStateDataset(stores["full"].store), HiddenStateDataset(stores[precision].store)
    assert compact.precision == precision and len(compact) == len(full) == 24
    worst = 0.0
    for i in range(len(compact)):
        got = compact[i]
        ref = full[full.index_of(got["sample_id"])]
        assert got["hidden"].dtype == ref["hidden"].dtype == torch.float32  # dequantized into the logical dtype
        assert torch.equal(got["input_ids"], ref["input_ids"])
        g = Store(compact.store.url).open_unit(compact.version, compact.samples[i].unit)
        sl = slice(compact.samples[i].start, compact.samples[i].start + compact.samples[i].length)
        scales = torch.from_numpy(g["hidden_scale"][sl])
        for j in range(3):
            x, xq = ref["hidden"][:, j], got["hidden"][:, j]
            err = float((xq - x).norm())
            assert err <= quant.error_bound(precision, scales[:, j], x) * (1 + 1e-5) + 1e-6
            worst = max(worst, err / float(x.norm()))
        last_scale = torch.from_numpy(g["last_hidden_scale"][sl])
        err = float((got["last_hidden"] - ref["last_hidden"]).norm())
        assert err <= quant.error_bound(precision, last_scale, ref["last_hidden"]) * (1 + 1e-5) + 1e-6
    assert 0 < worst < {"fp8": 0.0625, "int8": 0.02, "int4": 0.2}[precision]
    shapes = quant.row_shapes(precision, np.dtype("float32"), 3, 64)  # the embedded target: hidden 64
    for name in ("hidden", "hidden_scale", "last_hidden", "last_hidden_scale"):
        assert (g[name].shape[1:], g[name].dtype) == shapes[name], name
    if precision == "int4":
        assert g["hidden"].shape[1:] == (3, 32) and g["hidden_scale"].shape[1:] == (3, 4 + 2)


def _documented(marker: str, **given) -> dict:
    """The names a python snippet of docs/STORE.md (the one containing `marker`) defines, run exactly as written
    with numpy as np and `given` (its inputs)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "STORE.md").read_text(), flags=re.S)
    space: dict = {"np": np, **given}
    exec(next(b for b in blocks if marker in b), space)  # the documented snippet, as written
    return space


def _documented_decode(scheme: str, q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """docs/STORE.md, "Compact precisions": stored values and scales -> float32, with numpy only (scheme: the
    version's precision, and int8-row for an int8 version without the `int8_scales` attribute)."""
    if scheme in ("int8", "int4"):
        return _documented("def decode_int4")[f"decode_{scheme}"](q, s)
    b = np.arange(256)
    e, m = (b >> 3) & 0xF, b & 0x7
    table = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e - 7.0))
    table = np.where((b & 0x7F) == 0x7F, np.nan, np.where(b & 0x80, -table, table)).astype(np.float32)
    values = table[q] if scheme == "fp8" else q.astype(np.float32)
    return values * s[..., None]


def _decode_as_documented(version_dir: Path) -> dict[str, np.ndarray]:
    """docs/STORE.md, "Compact precisions", followed with zarr and numpy only (no torch, no dflash_pipeline)."""
    import zarr

    g = zarr.open_group(str(version_dir), mode="r")
    out = {}
    for name, unit in g["units"].groups():
        commit = json.loads((version_dir / "units" / name / "commit.json").read_text())
        for sid, start, length in unit.attrs["samples"]:
            if start + length > commit["committed_tokens"]:
                continue
            q = unit["hidden"][start : start + length]
            s = unit["hidden_scale"][start : start + length]
            grouped = g.attrs["precision"] != "int8" or g.attrs.get("int8_scales") == "group32"
            out[sid] = _documented_decode(g.attrs["precision"] if grouped else quant.INT8_ROW, q, s)
    return out


@pytest.mark.parametrize("precision", [*COMPACT, quant.INT8_ROW])
def test_the_documented_rounding_into_bfloat16_is_the_readers(precision):
    """A GPU extraction's store dequantizes into bfloat16: docs/STORE.md's float32 decode, then its numpy rounding
    to bf16 bits, gives the bits the reader returns (its numpy path, the CPU's) and training computes (torch's)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 256, generator=g)
    x[::7, :, 5] *= 300  # massive activations, as trained LLMs have
    q, s = quant.quantize(x, precision)
    bits = _documented("0x7FFF", x=_documented_decode(precision, q.numpy(), s.numpy()))["bits"]
    for got in (
        quant.dequantize(q.numpy(), s.numpy(), precision, torch.bfloat16),
        quant.dequantize(q, s, precision, torch.bfloat16),
    ):
        np.testing.assert_array_equal(bits, got.view(torch.int16).numpy().view(np.uint16))


def test_the_documented_bfloat16_rounding_breaks_ties_to_even():
    """Values half way between two bf16 values (rare in data) go to the even neighbour, as torch rounds."""
    ties = ((np.arange(0x3F00, 0x3F40, dtype=np.uint32) << 16) | 0x8000).view(np.float32)
    want = torch.from_numpy(ties).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(_documented("0x7FFF", x=ties)["bits"], want)


@pytest.mark.parametrize("precision", COMPACT)
def test_third_party_decode_with_plain_zarr_equals_the_reader(stores, precision):
    version = stores[precision].plan.version  # (a later test adds another version beside it)
    decoded = _decode_as_documented(Path(stores[precision].store) / version)
    ds = HiddenStateDataset(stores[precision].store, version)
    assert len(decoded) == len(ds)
    for i in range(len(ds)):
        item = ds[i]
        np.testing.assert_array_equal(decoded[item["sample_id"]], item["hidden"].numpy())


def _read_as_documented(root: Path) -> list[tuple[str, np.ndarray]]:
    """docs/STORE.md, "Reading without this package", run as written on `root` (its `root = ...` line names the
    store), with one line added after its read of `hidden` to record what it read."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "STORE.md").read_text(), flags=re.S)
    code = next(b for b in blocks if 'open(f"{root}/CURRENT")' in b)
    root_line = next(line for line in code.splitlines() if line.startswith("root = "))
    rest = code.replace(root_line, "")
    read_line = '        h = unit["hidden"][start : start + length]'
    assert read_line in rest
    seen: list = []
    exec(rest.replace(read_line, f"{read_line}\n        seen.append((sid, h))"), {"root": str(root), "seen": seen})
    return seen


def test_the_documented_plain_zarr_recipe_reads_every_committed_sample_and_skips_an_uncommitted_unit(stores, tmp_path):
    """The recipe a user copies from docs/STORE.md reads what the reader reads; a unit planned but with nothing
    committed yet (no commit.json: extraction under way) is skipped, not a crash (a doc-only reader check)."""
    import shutil

    ds = HiddenStateDataset(stores["full"].store)
    seen = _read_as_documented(Path(stores["full"].store))
    assert [sid for sid, _ in seen] == [s.sample_id for s in ds.samples]
    for sid, h in seen:
        assert np.array_equal(h, ds[ds.index_of(sid)]["hidden"].numpy())
    copy = tmp_path / "store"
    shutil.copytree(stores["full"].store, copy)
    version = (copy / "CURRENT").read_text().strip()
    first = sorted((copy / version / "units").iterdir())[0]
    (first / "commit.json").unlink()
    left = _read_as_documented(copy)
    assert 0 < len(left) < len(seen) and {sid for sid, _ in left} < {sid for sid, _ in seen}


def test_e4m3_table_is_torchs_float8_e4m3fn():
    ref = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(quant.e4m3fn_table(), ref, equal_nan=True)


def test_nonfinite_and_zero_rows_stay_visible():
    """A NaN or infinite row dequantizes to non-finite values (validation reports them), a zero row to zeros."""
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, math.nan, 2.0], [math.inf, 1.0, 0.0], [3.0, -4.0, 0.5]])
    for p in ("fp8", "int8", quant.INT8_ROW):
        back = quant.dequantize(*quant.quantize(x, p), p)
        assert torch.equal(back[0], torch.zeros(3)) and not torch.isfinite(back[1:3]).all(-1).any()
        assert torch.isfinite(back[3]).all() and back[3, 1] == -4.0


def test_validation_passes_and_reports_a_corrupted_scale(stores, model_dir, tmp_path):
    """A compact store passes validation, the recompute check included (within its quantization bound); a scale
    shard whose bytes changed fails it, naming the scale array and file."""
    import shutil

    from dflash_pipeline.extraction.config import ValidateConfig
    from dflash_pipeline.extraction.loader import load_target
    from dflash_pipeline.extraction.validate import validate_store

    ex = stores["fp8"]
    model = load_target(model_dir, "dtype", "float32", "cpu")
    cfg = ValidateConfig(recompute_samples=3)
    report = validate_store(ex.store, ex.plan.version, ex.prepared, cfg, model=model)
    assert report.ok, report.failures
    assert all(0 < r["max_rel_err"] <= r["tolerance"] for r in report.recomputed)
    assert max(r["tolerance"] for r in report.recomputed) > 1e-4  # the fp8 bound was added to float32's

    copy = tmp_path / "store"
    shutil.copytree(ex.store, copy)
    unit = sorted((copy / ex.plan.version / "units").iterdir())[0]
    shard = next(p for p in (unit / "hidden_scale" / "c").rglob("*") if p.is_file())
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x10
    shard.write_bytes(bytes(data))
    bad = validate_store(Store(copy), ex.plan.version, ex.prepared, cfg, model=model)
    assert not bad.ok
    assert any("array hidden_scale" in f and "differs" in f for f in bad.failures), bad.failures
    with pytest.raises(StoreError, match="hidden_scale"):
        ds = HiddenStateDataset(copy, verify="digests")
        for i in range(len(ds)):
            ds[i]


def test_an_int4_store_passes_validation_within_its_bound(stores):
    """The run's validation (the fixture's validate stage) recomputed samples and found the int4 store within the
    logical dtype's tolerance plus int4's bound; the bound is what lets it pass."""
    report = stores["int4"].validation
    assert report.ok, report.failures
    assert report.recomputed and all(0 < r["max_rel_err"] <= r["tolerance"] for r in report.recomputed)
    assert max(r["max_rel_err"] for r in report.recomputed) > 1e-2  # int4's error: far above float32's 1e-4


def test_another_precision_never_mixes_into_a_version(stores):
    """Rerunning a store with another precision is refused (or, with extract.new_version, a new version)."""
    out = Path(stores["fp8"].cfg.output_dir)
    with pytest.raises(StoreError, match="precision"):
        extract_local(out, {**OVERRIDES, "extract.store_precision": "int8"})
    again = extract_local(out, {**OVERRIDES, "extract.store_precision": "int8", "extract.new_version": True})
    store = Store(again.store)
    assert again.plan.version != stores["fp8"].plan.version
    assert store.attrs(again.plan.version)["precision"] == "int8"
    assert store.attrs(stores["fp8"].plan.version)["precision"] == "fp8"


def test_an_older_int8_store_is_read_validated_and_never_extended(stores, tmp_path, monkeypatch):
    """An int8 version from before int8 took group steps (no `int8_scales` attribute: one float32 scale per row;
    written here by today's code in that scheme) is read, decoded as docs/STORE.md says and validated as such; a
    run with store_precision int8 refuses to extend it (another identity), as the documented message says."""
    monkeypatch.setattr(quant, "precision_attrs", lambda p: {"precision": p})
    old = extract_local(tmp_path / "old", {**OVERRIDES, "extract.store_precision": "int8"}, validate=True)
    monkeypatch.undo()
    assert old.validation.ok and old.validation.recomputed, old.validation.failures
    ds, full = HiddenStateDataset(old.store), HiddenStateDataset(stores["full"].store, stores["full"].plan.version)
    assert ds.precision == quant.INT8_ROW and "int8_scales" not in ds.attrs
    decoded = _decode_as_documented(Path(old.store) / old.plan.version)
    for i in range(len(ds)):
        item = ds[i]
        u, sl = ds.samples[i].unit, slice(ds.samples[i].start, ds.samples[i].start + ds.samples[i].length)
        scale = Store(old.store).open_unit(old.plan.version, u)["hidden_scale"][sl]
        assert scale.dtype == np.float32 and scale.shape[1:] == (3,)
        np.testing.assert_array_equal(decoded[item["sample_id"]], item["hidden"].numpy())
        ref = full[full.index_of(item["sample_id"])]["hidden"][:, 0]
        bound = quant.error_bound(quant.INT8_ROW, torch.from_numpy(scale[:, 0]), ref)
        assert float((item["hidden"][:, 0] - ref).norm()) <= bound * (1 + 1e-5) + 1e-6
    with pytest.raises(StoreError, match="int8_scales: store has None, this run has 'group32'"):
        extract_local(tmp_path / "old", {**OVERRIDES, "extract.store_precision": "int8"})

    # Found by a damage check: int8_scales added to the old version's zarr.json made a rerun rebuild the version
    # record around it and extend the version with group-step units. Now the rerun refuses, naming the fix.
    meta = Path(old.store) / old.plan.version / "zarr.json"
    as_made = meta.read_text()
    doc = json.loads(as_made)
    doc["attributes"]["int8_scales"] = "group32"
    meta.write_text(json.dumps(doc))
    with pytest.raises(StoreError, match=r"attributes \['int8_scales'\] are in its zarr.json but not covered"):
        extract_local(tmp_path / "old", {**OVERRIDES, "extract.store_precision": "int8"})
    with pytest.raises(StoreError, match="does not cover attributes"):
        HiddenStateDataset(old.store)
    # attributes and record edited together (digest included): the arrays' own layout still disagrees
    record = meta.parent / "version.json"
    rec = json.loads(record.read_text())
    rec["attrs"]["int8_scales"] = digest.of_attr("group32")
    record.write_text(json.dumps(rec))
    with pytest.raises(StoreError, match=r"hidden.*stored as float32 \[3\] per token, but .* say uint8 \[3, 6\]"):
        HiddenStateDataset(old.store, unvalidated="warn")[0]
    from dflash_pipeline.cli import main as cli

    assert cli(["verify", old.store, "--unvalidated"]) == 1
    meta.write_text(as_made)


@pytest.mark.parametrize("precision", COMPACT)
def test_training_dequantizes_on_its_device_to_the_readers_values(stores, precision):
    """Training reads a compact store as stored (half the bytes to its device, no CPU decoding) and dequantizes
    in the batch: the same values the reader returns when it dequantizes; a couple of steps train."""
    from dflash_pipeline.drafter.batching import collate, states

    store, version = stores[precision].store, stores[precision].plan.version  # (a later version may exist)
    raw, deq = HiddenStateDataset(store, version, dequantize=False), HiddenStateDataset(store, version)
    bq, b = collate([raw[i] for i in range(4)]), collate([deq[i] for i in range(4)])
    scale_dtype = torch.float32 if precision == "fp8" else torch.uint8
    assert bq["hidden"].dtype == quant.STORED_TORCH[precision] and bq["hidden_scale"].dtype == scale_dtype
    for name in ("hidden", "last_hidden"):
        assert torch.equal(states(bq, name, precision, raw.logical_torch, torch.float32), b[name].float())


def test_a_drafter_trains_from_a_compact_store(stores, tmp_path):
    from dflash_pipeline import stages

    ex = stores["fp8"]
    cfg = ex.cfg.model_copy(
        update={
            "train": ex.cfg.train.model_copy(
                update={"max_steps": 2, "num_workers": 0, "output_dir": str(tmp_path), "distill": True}
            )
        }
    )
    result = stages.train(cfg, ex.report, ex.plan.version)
    assert math.isfinite(result.final_loss) and (tmp_path / "export" / "config.json").exists()
