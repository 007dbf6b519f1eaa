"""Four small lies a damage check of the store and the probe found (issue 50, item 5), each now told straight:
a target config.json without the model's dimensions, a hand-edited `committed_samples`, a reader that went on
reading after saying it read nothing, and a repair that counted directories as files it could not delete."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from dflash_pipeline.errors import CompatError, StoreError
from dflash_pipeline.extraction.config import ExtractConfig, LayersConfig, TargetConfig
from dflash_pipeline.extraction.probe import probe
from dflash_pipeline.storage.discard import discard_units
from dflash_pipeline.storage.reader import HiddenStateDataset
from dflash_pipeline.storage.store import Store
from tests.integration.test_integrity import U0, U1, _flip


@pytest.mark.parametrize(
    ("content", "missing"),
    [
        ({}, "num_hidden_layers, hidden_size, num_attention_heads, vocab_size"),
        ({"text_config": {"num_hidden_layers": 8}}, "hidden_size, num_attention_heads, vocab_size"),
        ({"num_hidden_layers": "eight", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 9}, "num_hidden"),
    ],
)
def test_a_config_json_without_the_models_dimensions_is_one_error_naming_the_file(
    model_dir, tmp_path, content, missing
):
    """Before: `KeyError: 'num_hidden_layers'` out of the probe (a traceback in the task and one in the flow)."""
    target = tmp_path / "target"
    shutil.copytree(model_dir, target)
    (target / "config.json").write_text(json.dumps(content))
    with pytest.raises(CompatError) as e:
        probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu"), str(target), str(target))
    said = str(e.value)
    assert f"{target}/config.json" in said and missing in said and "re-download" in said, said


def test_a_reader_that_found_damage_reads_nothing_more(small_store, tmp_path):
    """Before: the error said "Nothing of this version is read", and the same reader went on returning the other
    units' samples."""
    root, version = tmp_path / "store", small_store.plan.version
    shutil.copytree(small_store.store, root)
    (root / version / U1 / "last_hidden/c/0/0").unlink()
    ds = HiddenStateDataset(root, version, unvalidated="warn")
    first_of_u1 = next(i for i, s in enumerate(ds.samples) if s.unit == "u00001")
    with pytest.raises(StoreError, match=r"last_hidden/c/0/0: missing") as e:
        ds[first_of_u1]
    said = str(e.value)
    assert "Nothing of this version is read:" not in said and "reads nothing more of this version" in said, said
    for i in (0, first_of_u1 - 1, len(ds) - 1):  # u00000's samples, which are intact, are refused too
        with pytest.raises(StoreError, match=r"found store version .* damaged .*last_hidden/c/0/0: missing"):
            ds[i]
    # at construction (a damaged record) it still says nothing is read, and nothing is
    (root / version / U0 / "commit.json").write_text("{")
    with pytest.raises(StoreError, match="Nothing of this version is read"):
        HiddenStateDataset(root, version, unvalidated="warn")


def test_a_discard_that_cannot_delete_one_file_counts_and_names_that_file(small_store, tmp_path):
    """Before: one immutable shard was reported as "6 of its files could not be deleted" (its five parent
    directories, left because they were not empty, counted as files)."""
    root, version = tmp_path / "store", small_store.plan.version
    shutil.copytree(small_store.store, root)
    shard = root / version / U1 / "hidden/c/0/0/0"
    _flip(shard)
    if subprocess.run(["chattr", "+i", str(shard)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (needs root and a filesystem with the immutable flag)")
    try:
        with pytest.raises(StoreError) as e:
            discard_units(Store(root), version, ["u00001"], {"u00001": "damaged"})
        said = str(e.value)
        assert "1 of its files could not be deleted" in said and "hidden/c/0/0/0" in said, said
        assert "Operation not permitted" in said, said
    finally:
        for p in (root / version / ".discarded").rglob("*"):
            subprocess.run(["chattr", "-i", str(p)], capture_output=True)
