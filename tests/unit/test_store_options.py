"""The store on S3-compatible object storage, against moto's S3 server on loopback (the real S3 API, in this
process): the same bytes as a local store, the same kill-and-resume guarantees, versions, the lease lock,
and clear errors for an unreachable endpoint, missing credentials and a missing bucket."""

from __future__ import annotations

import pytest

from dflash_pipeline.config import load_config
from dflash_pipeline.errors import ConfigError, StoreError
from dflash_pipeline.storage.store import Store


def test_config_keeps_secrets_out_and_options_for_object_storage(tmp_path, monkeypatch):
    for options in ({"key": "AKIAEXAMPLE"}, {"client_kwargs": {"aws_secret_access_key": "hunter2"}}):
        with pytest.raises(ConfigError, match="AWS_ACCESS_KEY_ID") as e:
            load_config(None, {"store_path": "s3://b/p", "store_options": options})
        assert "AKIAEXAMPLE" not in str(e.value) and "hunter2" not in str(e.value)
    with pytest.raises(ConfigError, match="only apply to an s3:// store_path"):
        load_config(None, {"output_dir": str(tmp_path), "store_options": {"endpoint_url": "http://x"}})
    cfg = load_config(None, {"store_path": "s3://b/p/", "store_options": {"endpoint_url": "http://127.0.0.1:9"}})
    assert cfg.store == "s3://b/p/" and cfg.dump()["store_options"] == {"endpoint_url": "http://127.0.0.1:9"}

    monkeypatch.setitem(__import__("sys").modules, "s3fs", None)  # s3fs not installed
    with pytest.raises(StoreError, match=r"pip install 'dflash-pipeline\[s3\]'"):
        Store("s3://b/p").current()
    with pytest.raises(StoreError, match="only local paths and s3://"):
        Store("gs://b/p")
