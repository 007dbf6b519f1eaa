"""Extraction: stored states equal HF's own output_hidden_states; reruns do nothing; store identity errors."""

from __future__ import annotations

import os
import time

import pytest
import torch

from dflash_pipeline.errors import StoreError
from dflash_pipeline.extraction.loader import load_target
from dflash_pipeline.storage.reader import HiddenStateDataset
from dflash_pipeline.storage.store import Store
from tests.helpers import extract_local


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return load_target(model_dir, "dtype", "float32", "cpu")


def _reference(model, ids: torch.Tensor):
    with torch.inference_mode():
        out = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
        # HF's last entry is after the final norm; the stored last_hidden is before it.
        return out.hidden_states


def test_batch1_states_equal_output_hidden_states_exactly(tmp_path, model_dir, hf_model):
    # token_budget 16: every batch holds exactly one sample, so the comparison is bit-for-bit.
    ex = extract_local(
        tmp_path,
        {
            "data.max_samples": 12,
            "layers.preset": "explicit",
            "layers.ids": [2, 3, 6, 7],
            "layers.capture_last": True,
            "extract.token_budget": 16,
        },
    )
    assert ex.report.layer_types[2] == "linear_attention" and ex.report.layer_types[3] == "full_attention"
    ds = HiddenStateDataset(ex.store, ex.plan.version, unvalidated="warn")  # extracted, not validated
    assert len(ds) == 12
    for i in range(len(ds)):
        item = ds[i]
        hs = _reference(hf_model, item["input_ids"])
        for j, lid in enumerate([2, 3, 6]):
            assert torch.equal(item["hidden"][:, j], hs[lid + 1][0]), (item["sample_id"], lid)
        # Layer 7 is the last: stored as the layer's output (pre-norm); HF's entry 8 is post-norm.
        assert torch.equal(hf_model.model.norm(item["hidden"][:, 3]), hs[8][0])
        assert torch.equal(item["hidden"][:, 3], item["last_hidden"])
        normed = hf_model.model.norm(item["last_hidden"])
        assert torch.equal(normed, hs[-1][0])


def test_padded_batches_match_within_fp32_rounding(small_store, hf_model):
    ds = HiddenStateDataset(small_store.store, small_store.plan.version, unvalidated="warn")
    assert small_store.result.forward_passes < len(ds)  # batches really held several padded samples
    worst = 0.0
    for i in range(0, len(ds), 7):
        item = ds[i]
        hs = _reference(hf_model, item["input_ids"])
        for j, lid in enumerate(small_store.report.layer_ids):
            ref = hs[lid + 1][0]
            worst = max(worst, ((item["hidden"][:, j] - ref).abs().max() / ref.abs().max()).item())
    assert worst < 1e-5


def test_rerun_on_complete_store_does_no_forward(small_store):
    t0 = time.monotonic()
    again = extract_local(small_store.cfg.output_dir, _overrides(small_store))
    # Nothing pending, so no worker starts at all.
    assert again.result.forward_passes == 0 and again.plan.pending_units == [] and again.result.units == []
    assert again.plan.new_units == [] and again.plan.version == small_store.plan.version
    assert time.monotonic() - t0 < 30


def _overrides(ex):
    c = ex.cfg
    return {
        "data.max_samples": c.data.max_samples,
        "layers.preset": "explicit",
        "layers.ids": c.layers.ids,
        "layers.capture_last": c.layers.capture_last,
        "extract.unit_tokens": c.extract.unit_tokens,
    }


def test_store_of_another_layer_set_is_refused_or_versioned(small_store, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(small_store.cfg.output_dir, out)
    other = {**_overrides(small_store), "layers.ids": [1, 2]}
    with pytest.raises(
        StoreError,
        match=r"another target, layer set or forward \(layer_ids: store has \[1, 2, 3\], this run has \[1, 2\]\)"
        r".*extract.new_version=true",
    ):
        extract_local(out, other)
    ex = extract_local(out, {**other, "extract.new_version": True})
    assert ex.plan.version == "v0002" and Store(out / "store").versions() == ["v0001", "v0002"]


def test_another_dataset_needs_incremental(small_store, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(small_store.cfg.output_dir, out)
    more = {**_overrides(small_store), "data.max_samples": 70}
    with pytest.raises(StoreError, match="extract.incremental=true"):
        extract_local(out, more)
    ex = extract_local(out, {**more, "extract.incremental": True})
    assert ex.plan.new_samples == 10 and ex.plan.version == "v0001"
    assert len(HiddenStateDataset(out / "store", "v0001", unvalidated="warn")) == 70  # extended, not validated


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_store_path_nonroot(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    with pytest.raises(StoreError, match="cannot be written"):
        extract_local(tmp_path, {"data.max_samples": 4, "store_path": str(ro / "store")})


def test_store_path_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(StoreError, match="cannot be written"):
        extract_local(tmp_path, {"data.max_samples": 4, "store_path": str(f / "store")})


def test_compiled_norms_match_eager_and_a_failed_compile_falls_back(model_dir, monkeypatch, caplog):
    """extract.compile (on by default on a GPU) on the real tiny target: the stored rows match the eager
    forward's, and a compiler failure continues on the eager forward instead of failing the worker."""
    import numpy as np

    from dflash_pipeline.extraction.capture import LayerCapture
    from dflash_pipeline.extraction.extract import _Runner
    from dflash_pipeline.extraction.loader import compile_modules, decoder_layers

    model = load_target(model_dir, "dtype", "float32", "cpu")  # its own copy: compiling changes it
    seqs = [np.arange(7, 7 + n, dtype=np.int32) for n in (40, 23, 31)]

    def run() -> torch.Tensor:
        rows = _Runner(LayerCapture(model, [1, 3], True), "cpu", 0, torch.float32).run(seqs)
        return torch.cat([rows["hidden"].flatten(1), rows["last_hidden"]], dim=1)

    eager = run()
    norms = [m for m in model.modules() if type(m).__name__.endswith(("RMSNorm", "RMSNormGated"))]
    assert any(type(m).__name__.endswith("RMSNormGated") for m in norms)  # the hybrid's gated norms are in
    mlps = [layer.mlp for layer in decoder_layers(model)]
    assert compile_modules(model, "parts") == len(norms) + len(mlps) and "forward" in vars(mlps[0])
    assert compile_modules(model, "norms") == len(norms) > 0 and "forward" not in vars(mlps[0])
    compiled_forward = norms[0].forward
    assert compile_modules(model, "norms") == len(norms) and norms[0].forward is compiled_forward  # once only
    torch._dynamo.reset()
    fused = run()
    assert all(hasattr(m, "_dflash_eager_forward") for m in norms) and fused.shape == eager.shape
    assert torch.allclose(fused, eager, rtol=1e-4, atol=1e-5)
    assert compile_modules(model, "off") == 0 and not any("forward" in vars(m) for m in model.modules())

    def broken(*args, **kwargs):
        raise RuntimeError("injected compiler failure")

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", broken)
    compile_modules(model, "norms")
    torch._dynamo.reset()
    with caplog.at_level("WARNING"):
        out = run()
    assert "torch.compile failed" in caplog.text
    assert not any("forward" in vars(m) for m in model.modules())
    assert torch.equal(out, eager)
