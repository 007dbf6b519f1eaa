"""`serve --database`: which URL the server gets, how it is shown, and the one-line error for a bad one."""

from __future__ import annotations

import socket

import pytest

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.local_prefect import LocalPrefect
from dflash_pipeline.prefect_database import check_database, database_url, redact


def test_plain_postgres_urls_get_the_async_driver(monkeypatch):
    for k in ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL"):
        monkeypatch.delenv(k, raising=False)
    assert database_url(None) is None  # SQLite under the Prefect home
    for given in ("postgresql://u:p@h:5432/db", "postgres://u:p@h:5432/db", "postgresql+asyncpg://u:p@h:5432/db"):
        assert database_url(given) == "postgresql+asyncpg://u:p@h:5432/db"
    monkeypatch.setenv("PREFECT_API_DATABASE_CONNECTION_URL", "postgresql://legacy@h/db")
    assert database_url(None) == "postgresql+asyncpg://legacy@h/db"
    monkeypatch.setenv("PREFECT_SERVER_DATABASE_CONNECTION_URL", "postgresql://new@h/db")
    assert database_url(None) == "postgresql+asyncpg://new@h/db"  # Prefect's own order
    assert database_url("postgresql://flag@h/db") == "postgresql+asyncpg://flag@h/db"  # the flag wins


def test_bad_urls_are_named_without_their_password():
    with pytest.raises(PipelineError, match="not a URL"):
        database_url("localhost:5432")
    with pytest.raises(PipelineError, match=r"mysql://u:\*\*\*@h/db: unsupported scheme 'mysql'") as e:
        database_url("mysql://u:secret@h/db")
    assert "secret" not in str(e.value)
    assert redact("postgresql+asyncpg://u:s3cr%40t@h:1/db") == "postgresql+asyncpg://u:***@h:1/db"
    assert redact("postgresql+asyncpg://u@h/db") == "postgresql+asyncpg://u@h/db"


def test_the_server_process_gets_the_url():
    lp = LocalPrefect(database="postgresql+asyncpg://u:p@h/db", host="0.0.0.0")
    env = lp.env()
    assert env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] == "postgresql+asyncpg://u:p@h/db"
    assert env["PREFECT_SERVER_API_HOST"] == "0.0.0.0"
    assert env["PREFECT_API_URL"].startswith("http://127.0.0.1:")  # the local CLI and worker talk over loopback


def test_an_unreachable_database_is_one_line_naming_url_and_fix():
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"postgresql+asyncpg://prefect:hunter2@127.0.0.1:{port}/prefect"
    with pytest.raises(PipelineError) as e:
        check_database(url, timeout=5)
    msg = str(e.value)
    assert "\n" not in msg and "hunter2" not in msg
    assert f"the database postgresql+asyncpg://prefect:***@127.0.0.1:{port}/prefect is unreachable" in msg
    assert "Start PostgreSQL" in msg and "--database" in msg
