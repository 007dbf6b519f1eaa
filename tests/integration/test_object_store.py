"""The store on S3-compatible object storage, against moto's S3 server on loopback (the real S3 API, in this
process): the same bytes as a local store, the same kill-and-resume guarantees, versions, the lease lock,
and clear errors for an unreachable endpoint, missing credentials and a missing bucket."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

from dflash_pipeline.config import load_config
from dflash_pipeline.errors import StoreError
from dflash_pipeline.order import LocalRunner, run_pipeline
from dflash_pipeline.storage.reader import HiddenStateDataset
from dflash_pipeline.storage.shardio import SharedBuffers
from dflash_pipeline.storage.store import Store
from tests.helpers import KILL_OVERRIDES, assert_same_store, config, extract_local, run_extract_proc, snapshot
from tests.s3server import BUCKET, closed_port


def test_extraction_on_s3_equals_local_and_reads_back(s3, clean_extraction, tmp_path):
    """The real worker code into s3://: bit-identical to the same extraction into a local store; the reader
    (also from DataLoader worker processes) and plain zarr + fsspec read it."""
    ex = extract_local(tmp_path, s3.overrides("same", KILL_OVERRIDES))
    store = Store(s3.url("same"), s3.options)
    assert ex.plan.version_path == f"{s3.url('same')}/v0001" and not (tmp_path / "store").exists()
    assert_same_store(
        snapshot(Store(clean_extraction.store), clean_extraction.plan.version), snapshot(store, ex.plan.version)
    )

    # what extraction wrote, not validated: read with unvalidated="warn"
    local = HiddenStateDataset(clean_extraction.store, clean_extraction.plan.version, unvalidated="warn")
    ds = HiddenStateDataset(s3.url("same"), ex.plan.version, store_options=s3.options, unvalidated="warn")
    assert len(ds) == len(local) == 40 and ds.layer_ids == [1, 3, 5]
    for i in (0, 17, 39):
        a, b = ds[i], local[local.index_of(ds.samples[i].sample_id)]
        assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "loss_mask", "hidden", "last_hidden"))
    picked = list(range(0, 40, 5))  # the workers open their own S3 clients after fork
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(ds, picked), batch_size=None, num_workers=2)
    assert [x["sample_id"] for x in loader] == [ds.samples[i].sample_id for i in picked]

    import zarr  # docs/STORE.md: plain zarr-python over fsspec, nothing of this package

    g = zarr.open_group(f"{s3.url('same')}/v0001", mode="r", storage_options=s3.options)
    unit = g["units"]["u00000"]
    sid, start, length = unit.attrs["samples"][0]
    assert torch.equal(torch.from_numpy(unit["hidden"][start : start + length]), local[local.index_of(sid)]["hidden"])

    # A writer killed inside a multipart upload leaves it unfinished: the next writer of the unit aborts it.
    fs = store.loc.fs
    key = f"same/store/{ex.plan.version}/units/u00000/hidden/c/1/0/0"
    fs.call_s3("create_multipart_upload", Bucket=BUCKET, Key=key)
    assert store.unit_location(ex.plan.version, "u00000").remove_partials() == 1
    assert not fs.call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix="same/").get("Uploads")


def test_killed_extraction_on_s3_resumes_bit_identical(s3, clean_extraction, tmp_path):
    """A worker process SIGKILLed after a shard write, a second one during a commit (the record is ready,
    not yet PUT), then a rerun (in this process; the first and the last with writer processes): the store
    equals an uninterrupted run and committed shards were not recomputed. The workers get the endpoint
    through the run config (store_options) and the credentials from the environment."""
    overrides = s3.overrides("killed", KILL_OVERRIDES)
    store = Store(s3.url("killed"), s3.options)

    def committed() -> int:
        v = store.versions()[0]
        return sum(store.commit_record(v, u)["committed_tokens"] for u in store.units(v))

    procs = {**overrides, "extract.store_writers": "processes"}  # shards PUT by writer processes (a GPU's way)
    shm = SharedBuffers().dir
    shm_before = set(shm.glob(f"{SharedBuffers.PREFIX}*"))
    first = run_extract_proc(tmp_path, procs, "after_shard_write:3")
    assert set(shm.glob(f"{SharedBuffers.PREFIX}*")) > shm_before  # the killed worker's shared shard buffers
    assert first.returncode == -9, first.stderr[-2000:]
    after_first = committed()
    assert after_first > 0
    second = run_extract_proc(tmp_path, overrides, "during_commit:2")
    assert second.returncode == -9, second.stderr[-2000:]
    assert committed() > after_first  # resumed, committed once, killed before the second record was PUT

    resumed = extract_local(tmp_path, procs)
    assert 0 < resumed.result.forward_passes < clean_extraction.result.forward_passes
    assert_same_store(
        snapshot(Store(clean_extraction.store), clean_extraction.plan.version), snapshot(store, store.versions()[0])
    )
    resumed_ds = HiddenStateDataset(
        s3.url("killed"), resumed.plan.version, store_options=s3.options, unvalidated="warn"
    )
    assert len({s.sample_id for s in resumed_ds.samples}) == 40
    # the rerun removed the killed worker's shared buffers, and its own when it ended
    assert set(shm.glob(f"{SharedBuffers.PREFIX}*")) <= shm_before


def test_versions_snapshot_current_and_prune_on_s3(s3, tmp_path, model_dir):
    base = s3.overrides(
        "versions",
        {"layers.preset": "explicit", "layers.ids": [1, 3], "extract.unit_tokens": 1500, "extract.incremental": True},
    )
    store = Store(s3.url("versions"), s3.options)
    first = extract_local(tmp_path, {**base, "data.max_samples": 30}, validate=True)  # validated: CURRENT
    assert first.validation.ok and store.current() == first.plan.version == "v0001"
    second = extract_local(tmp_path, {**base, "data.max_samples": 40})
    assert (second.plan.version, second.plan.new_samples) == ("v0002", 10)
    assert second.result.tokens == sum(u.n_tokens for u in second.plan.new_units)  # old units copied, not redone
    assert store.current() == "v0001" and store.versions() == ["v0001", "v0002"]
    assert len(HiddenStateDataset(s3.url("versions"), store_options=s3.options)) == 30  # CURRENT
    with pytest.raises(StoreError, match="v0002 is not validated: validation never ran"):
        HiddenStateDataset(s3.url("versions"), "v0002", store_options=s3.options)
    run_pipeline(config(tmp_path, {**base, "data.max_samples": 40, "stages": ["prepare", "validate"]}), LocalRunner())
    assert store.current() == "v0002"  # validated (validation only looks: nothing extracted) and published
    assert store.prune(keep=1) == ["v0001"] and store.versions() == ["v0002"]
    ds = HiddenStateDataset(s3.url("versions"), store_options=s3.options)  # the copies outlive their source
    assert ds.version == "v0002" and len(ds) == 40 and ds[0]["hidden"].shape[1] == 2


def test_store_lease_is_exclusive_renewed_and_taken_over_when_expired(s3, monkeypatch, caplog):
    import dflash_pipeline.storage.s3 as s3_module

    url = s3.url("lease")
    with Store(url, s3.options).lock():
        with pytest.raises(StoreError, match=r"in use by another run \(pid \d+ on .* expires at"):
            with Store(url, s3.options).lock():
                pass
    with Store(url, s3.options).lock():  # released
        pass

    # A short lease, renewed every LEASE_S / 4 by the heartbeat; margins wide enough for a loaded 2-core CI
    # machine (with 0.5 s a starved heartbeat once let the lease expire).
    monkeypatch.setattr(s3_module, "LEASE_S", 3.0)
    with Store(url, s3.options).lock():
        time.sleep(4.0)  # > the lease: only the heartbeat keeps it
        with pytest.raises(StoreError, match="in use by another run"):
            with Store(url, s3.options).lock():
                pass

    # A holder that died: its lease is taken over once expired.
    fs = Store(url, s3.options).loc.fs
    fs.pipe_file(
        f"{BUCKET}/lease/store/.lock", json.dumps({"holder": "pid 1 on gone", "expires": time.time() - 1}).encode()
    )
    with caplog.at_level(logging.WARNING, logger="dflash_pipeline.storage.s3"):
        with Store(url, s3.options).lock():
            pass
    assert "took over the store lease of pid 1 on gone" in caplog.text
    assert not fs.exists(f"{BUCKET}/lease/store/.lock")

    # A holder that died on this host (a crashed run being resumed on the same box): no need to wait it out.
    dead = s3_module._PROCESS | {"pid": _exited_pid()}
    fs.pipe_file(
        f"{BUCKET}/lease/store/.lock",
        json.dumps({"holder": "pid N here", "expires": time.time() + 600, "process": dead}).encode(),
    )
    with caplog.at_level(logging.WARNING, logger="dflash_pipeline.storage.s3"):
        with Store(url, s3.options).lock():
            pass
    assert "took over the store lease of pid N here (its process no longer runs on this host)" in caplog.text
    # ... but a live one on this host is waited for.
    fs.pipe_file(
        f"{BUCKET}/lease/store/.lock",
        json.dumps({"holder": "me", "expires": time.time() + 600, "process": s3_module._PROCESS}).encode(),
    )
    with pytest.raises(StoreError, match=r"in use by another run \(me; its lease"):
        with Store(url, s3.options).lock():
            pass
    fs.rm(f"{BUCKET}/lease/store/.lock")


def _exited_pid() -> int:
    import subprocess

    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_unreachable_endpoint_fails_fast_and_says_so(s3, tmp_path):
    from dflash_pipeline.order import LocalRunner, run_pipeline

    endpoint = f"http://127.0.0.1:{closed_port()}"
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="unreachable"):  # before the first stage
        run_pipeline(
            load_config(
                None,
                {
                    "output_dir": str(tmp_path),
                    "store_path": f"s3://{BUCKET}/x/store",
                    "store_options": {"endpoint_url": endpoint},
                },
            ),
            LocalRunner(),
        )
    assert not list(tmp_path.iterdir())
    with pytest.raises(
        StoreError,
        match=f"object storage unreachable for store s3://{BUCKET}/x/store "
        rf"\(endpoint {endpoint}\).*endpoint_url",
    ):
        with Store(f"s3://{BUCKET}/x/store", {"endpoint_url": endpoint}).lock():
            pass
    with pytest.raises(StoreError, match="unreachable"):
        HiddenStateDataset(f"s3://{BUCKET}/x/store", store_options={"endpoint_url": endpoint})
    assert time.monotonic() - t0 < 10


def test_missing_credentials_and_bucket_are_clear_errors(s3, monkeypatch):
    with pytest.raises(StoreError, match="bucket 'no-such-bucket' does not exist"):
        with Store("s3://no-such-bucket/store", s3.options).lock():
            pass
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(
        StoreError,
        match="no AWS credentials found for store s3://dflash/c/store .*AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
    ):
        with Store(s3.url("c"), s3.options).lock():
            pass
