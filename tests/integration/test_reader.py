"""The reader: committed samples only, random access, safe with DataLoader worker processes."""

from __future__ import annotations

import json
import shutil

import torch

from dflash_pipeline.storage.reader import HiddenStateDataset
from dflash_pipeline.storage.store import Store


def test_reader_sees_only_committed_samples(small_store, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(small_store.store, root)
    version = small_store.plan.version
    store = Store(root)
    full = HiddenStateDataset(root, version)
    assert len(full) == 60
    u = store.units(version)[0]
    samples = store.unit_attrs(version, u)["samples"]
    cut = samples[3][1] + samples[3][2] - 1  # sample 3 is one token short of committed
    (root / version / "units" / u / "commit.json").write_text(json.dumps({"committed_tokens": cut, "complete": False}))
    partial = HiddenStateDataset(root, version)
    visible = {s.sample_id for s in partial.samples if s.unit == u}
    assert visible == {s[0] for s in samples[:3]}


def test_items_and_dataloader_workers(small_store):
    ds = HiddenStateDataset(small_store.store)  # no CURRENT yet: the newest version
    item = ds[ds.index_of(ds.samples[5].sample_id)]
    t = len(item["input_ids"])
    assert item["hidden"].shape == (t, 3, 64) and item["last_hidden"].shape == (t, 64)
    assert item["loss_mask"].dtype == torch.bool and item["loss_mask"].any()
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, shuffle=False)
    seen = [x["sample_id"] for x in loader]
    assert seen == [s.sample_id for s in ds.samples]


def test_store_reads_with_plain_zarr_as_documented(small_store):
    """docs/STORE.md's recipe, with nothing of this package: committed samples and their states."""
    import json as _json

    import numpy as np
    import zarr

    root, version = small_store.store, small_store.plan.version
    g = zarr.open_group(f"{root}/{version}", mode="r")
    assert g.attrs["layer_ids"] == [1, 2, 3] and g.attrs["logical_dtype"] == "float32"
    ds = HiddenStateDataset(root, version)
    n = 0
    for name, unit in g["units"].groups():
        commit = _json.load(open(f"{root}/{version}/units/{name}/commit.json"))
        for sid, start, length in unit.attrs["samples"]:
            assert start + length <= commit["committed_tokens"]
            h = unit["hidden"][start : start + length]
            assert np.array_equal(h, ds[ds.index_of(sid)]["hidden"].numpy())
            n += 1
    assert n == len(ds) == 60
