"""The store on S3-compatible object storage, against moto's S3 server on loopback (the real S3 API, in this
process): the same bytes as a local store, the same kill-and-resume guarantees, versions, the lease lock,
and clear errors for an unreachable endpoint, missing credentials and a missing bucket."""

from __future__ import annotations

import json

from dflash_pipeline.storage.reader import HiddenStateDataset
from dflash_pipeline.storage.store import Store


def test_flow_on_s3_with_worker_processes(s3, prefect_harness, model_dir, tmp_path):
    """The Prefect flow into s3:// with the worker in its own process (its spec carries store_options):
    store lease, validation report, CURRENT, and a reader on the result."""
    from dflash_pipeline.flows.pipeline import dflash_pipeline

    url = s3.url("flow")
    summary = dflash_pipeline(
        overrides=s3.overrides(
            "flow",
            {
                "output_dir": str(tmp_path),
                "data.max_samples": 12,
                "extract.devices": "cpu",
                "extract.isolation": "process",
                "layers.num_draft_layers": 2,
                "validate.recompute_samples": 1,
                "stages": ["prepare", "probe", "extract", "validate"],
            },
        )
    )
    assert summary.validation == "PASS" and summary.store == url and summary.current == "v0001"
    assert summary.forward_passes > 0 and not (tmp_path / "store").exists()
    store = Store(url, s3.options)
    assert json.loads(store.loc.read_bytes("v0001/validation.json"))["ok"]
    assert not store.loc.exists(".lock")  # the lease was released
    assert len(HiddenStateDataset(url, store_options=s3.options)) == 12
