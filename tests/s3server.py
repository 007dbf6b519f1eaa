"""The S3 fixture's server: moto on loopback (shared by the integration and e2e layers)."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import pytest

BUCKET = "dflash"


@dataclass
class S3:
    endpoint: str

    @property
    def options(self) -> dict:
        return {"endpoint_url": self.endpoint}

    def url(self, name: str) -> str:
        return f"s3://{BUCKET}/{name}/store"

    def overrides(self, name: str, base: dict) -> dict:
        return {**base, "store_path": self.url(name), "store_options": self.options}


@pytest.fixture(scope="session")
def s3():
    """moto's S3 server on 127.0.0.1 (a free port), fake credentials in the environment (inherited by the
    worker subprocesses), nothing of the developer's AWS setup, never a non-loopback address: a client
    that is not given the endpoint (store_options lost on the way to a worker) meets a closed loopback
    port instead of AWS."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    with pytest.MonkeyPatch.context() as mp:
        for k in [k for k in os.environ if k.startswith("AWS_")]:
            mp.delenv(k)
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookups (169.254.169.254)
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        mp.setenv("NO_PROXY", "127.0.0.1,localhost")
        mp.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
        import s3fs

        s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True).mkdir(BUCKET)
        yield S3(endpoint)
    server.stop()


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
