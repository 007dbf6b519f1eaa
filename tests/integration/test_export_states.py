"""export-states --format speculators: the output read back with speculators' own loader (its ArrowDataset and
hs_connectors FileTransfer, on CPU) equals our reader's tensors, sample for sample; resume, identity and refusals."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.storage.export_states import HS_DIR, RECORD, SAMPLE_IDS, export_states, hs_name
from dflash_pipeline.storage.reader import HiddenStateDataset

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def validated_store(model_dir, tmp_path_factory):
    """A small validated (published) store: layers [1, 3] + the last hidden state."""
    from tests.helpers import extract_local

    out = tmp_path_factory.mktemp("export_store")
    return extract_local(
        out,
        {
            "data.max_samples": 12,
            "layers.preset": "explicit",
            "layers.ids": [1, 3],
            "layers.capture_last": True,
            "extract.unit_tokens": 1200,
        },
        validate=True,
    )


def _speculators_items(out: Path) -> list[dict]:
    """Every row of the export as speculators' training loader gives it (BaseDataset.__getitem__), on CPU."""
    data = pytest.importorskip(
        "speculators.train.data",
        reason="speculators 0.9.0 is not installed (docs/INTEROP.md: pip install --no-deps speculators==0.9.0 "
        "hs-connectors==0.9.0, and the reference extra)",
    )
    from hs_connectors import FileTransfer

    ds = data.ArrowDataset(max_len=4096, datapath=str(out), transfer=FileTransfer(out / HS_DIR), on_missing="raise")
    assert ds.approx_lengths == [len(ds.data[i]["input_ids"]) for i in range(len(ds))]
    return [ds[i] for i in range(len(ds))]


def test_round_trip_through_speculators_loader(validated_store, tmp_path):
    out = tmp_path / "spec"
    res = export_states(validated_store.store, out)
    ours = HiddenStateDataset(validated_store.store)
    ids = (out / SAMPLE_IDS).read_text().split()
    assert res.n_samples == len(ours) == len(ids) > 0 and res.written == len(ids) and res.skipped == 0
    assert ids == sorted(s.sample_id for s in ours.samples)
    record = json.loads((out / RECORD).read_text())
    assert record["complete"] and record["layer_ids"] == [1, 3] and record["speculators_target_layer_ids"] == [2, 4]
    assert record["version"] == ours.version and record["dtype"] == ours.logical

    items = _speculators_items(out)
    assert len(items) == len(ids)
    for sid, got in zip(ids, items):
        want = ours[ours.index_of(sid)]
        t, k, h = want["hidden"].shape
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(got["loss_mask"].bool(), want["loss_mask"]) and got["loss_mask"].dtype == torch.long
        # [T, K*H] in the store's layer order, then the verifier's last hidden state [T, H]: bit for bit
        assert got["hidden_states"].shape == (t, k * h) and got["hidden_states"].dtype == want["hidden"].dtype
        assert torch.equal(got["hidden_states"], want["hidden"].flatten(1))
        assert torch.equal(got["verifier_last_hidden_states"], want["last_hidden"])
        assert torch.equal(got["lengths"], torch.tensor([t])) and torch.equal(got["position_ids"], torch.arange(t))

    # speculators' collate (what its DataLoader batches with) takes the items as they are
    from speculators.train.data import CollateFn

    batch = CollateFn(max_len=512, hidden_size=h, num_target_layers=k, dtype=torch.float32)(items[:3])
    assert batch["hidden_states"].shape == (1, 512, k * h) and batch["verifier_last_hidden_states"].shape == (1, 512, h)


def test_resume_skips_written_files_and_refuses_another_version(validated_store, tmp_path, caplog):
    out = tmp_path / "spec"
    export_states(validated_store.store, out, dtype="bfloat16")
    hs = out / HS_DIR
    # a run cut short: two files never written, one temp file left behind, the record not complete
    (hs / hs_name(0)).unlink()
    (hs / hs_name(3)).unlink()
    (hs / f".{hs_name(3)}.999.tmp").write_bytes(b"partial")
    rec = json.loads((out / RECORD).read_text())
    (out / RECORD).write_text(json.dumps({**rec, "complete": False}))
    before = {p.name: p.stat().st_mtime_ns for p in hs.iterdir() if not p.name.startswith(".")}
    with caplog.at_level(logging.INFO):
        res = export_states(validated_store.store, out, dtype="bfloat16")
    assert (res.written, res.skipped, res.dataset_written) == (2, res.n_samples - 2, False)
    assert not list(hs.glob(".*")) and json.loads((out / RECORD).read_text())["complete"]
    assert all((hs / n).stat().st_mtime_ns == m for n, m in before.items())  # the others untouched
    assert "samples/s" in caplog.text and "ETA" in caplog.text
    items = _speculators_items(out)
    ours = HiddenStateDataset(validated_store.store)
    ids = (out / SAMPLE_IDS).read_text().split()
    for i in (0, 3):
        want = ours[ours.index_of(ids[i])]
        assert items[i]["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(items[i]["hidden_states"], want["hidden"].flatten(1).to(torch.bfloat16))

    # another dtype (or another version) into the same directory: refused, then --restart starts over
    with pytest.raises(PipelineError, match=r"differs from this one \(dtype: 'bfloat16' there, 'float32' now.*restart"):
        export_states(validated_store.store, out)
    res = export_states(validated_store.store, out, restart=True)
    assert res.written == res.n_samples and json.loads((out / RECORD).read_text())["dtype"] == "float32"


def test_refusals(validated_store, tmp_path):
    store = Path(validated_store.store)
    with pytest.raises(PipelineError, match="export format 'eagle' is not known"):
        export_states(store, tmp_path / "a", fmt="eagle")
    other = tmp_path / "busy"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(PipelineError, match=f"{other} is not empty and holds no {RECORD}"):
        export_states(store, other)
    assert (other / "notes.txt").read_text() == "mine"

    # an unvalidated version: refused, naming the version and what to do
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    version = (copy / "CURRENT").read_text().strip()
    (copy / version / "validation.json").unlink()
    (copy / "CURRENT").unlink()
    with pytest.raises(PipelineError, match=rf"{version} is not validated: .*export-states writes validated versions"):
        export_states(copy, tmp_path / "b", version=version)
    with pytest.raises(PipelineError, match="no store version 'v0099'"):
        export_states(store, tmp_path / "c", version="v0099")


def test_last_hidden_state_from_the_last_captured_layer(model_dir, tmp_path, monkeypatch):
    """A version without layers.capture_last whose layers include the last decoder layer (7 of 8): that layer's
    values are the last hidden state (both are its pre-norm output). With neither: refused, naming the fix."""
    from dflash_pipeline.storage.store import Store
    from tests.helpers import extract_local

    over = {"data.max_samples": 6, "layers.preset": "explicit", "layers.ids": [1, 7], "layers.capture_last": False}
    ex = extract_local(tmp_path / "run", over, validate=True)
    out = tmp_path / "spec"
    export_states(ex.store, out)
    assert json.loads((out / RECORD).read_text())["last_hidden_state_from"] == "layer 7"
    ours = HiddenStateDataset(ex.store)
    for sid, got in zip((out / SAMPLE_IDS).read_text().split(), _speculators_items(out)):
        want = ours[ours.index_of(sid)]
        assert torch.equal(got["hidden_states"], want["hidden"].flatten(1))
        assert torch.equal(got["verifier_last_hidden_states"], want["hidden"][:, 1])

    attrs = Store.attrs
    monkeypatch.setattr(Store, "attrs", lambda self, v: {**attrs(self, v), "layer_ids": [1, 3]})
    with pytest.raises(PipelineError, match=r"holds no last hidden state .*--set layers.capture_last=true"):
        export_states(ex.store, tmp_path / "other")


def test_cli(validated_store, tmp_path, capsys):
    from dflash_pipeline.cli import main

    out = tmp_path / "cli"
    assert main(["export-states", validated_store.store, "--format", "speculators", str(out)]) == 0
    assert json.loads((out / RECORD).read_text())["complete"]
    assert main(["export-states", validated_store.store, str(out), "--dtype", "float16"]) == 2
    assert "--restart" in capsys.readouterr().err
