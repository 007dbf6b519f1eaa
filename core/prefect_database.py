"""Which database Prefect's server uses: a PostgreSQL URL in the form Prefect takes, redacted, checked before start."""

from __future__ import annotations

import os
import urllib.parse

from dflash_pipeline.errors import PipelineError

DATABASE_ENV = ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL")


def database_url(url: str | None = None) -> str | None:
    """The PostgreSQL URL the server is to use, in the form Prefect takes (`postgresql+asyncpg://`): `url`, else
    Prefect's own setting from the environment; None = Prefect's default (SQLite under PREFECT_HOME). A plain
    `postgresql://` or `postgres://` URL (what psql and most tools print) gets the async driver Prefect needs."""
    url = url or next((os.environ[k] for k in DATABASE_ENV if os.environ.get(k)), None)
    if not url:
        return None
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise PipelineError(
            f"--database {url!r} is not a URL; give postgresql://USER:PASSWORD@HOST:PORT/DATABASE "
            "(or leave it out for SQLite)"
        )
    if scheme in ("postgres", "postgresql", "postgresql+asyncpg"):
        return f"postgresql+asyncpg://{rest}"
    if scheme.startswith("sqlite"):
        return url
    raise PipelineError(
        f"--database {redact(url)}: unsupported scheme {scheme!r}; Prefect's server runs on PostgreSQL "
        "(postgresql://USER:PASSWORD@HOST:PORT/DATABASE) or SQLite (the default: leave --database out)"
    )


def redact(url: str) -> str:
    """`url` with its password replaced by ***, for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def check_database(url: str, timeout: float = 10.0) -> None:
    """Connect once to a PostgreSQL URL (asyncpg, the driver Prefect's server uses) and raise one clear line
    naming the URL and the fix when that fails, instead of a server that dies with a traceback in its log."""
    if not url.startswith("postgresql"):
        return
    try:
        import asyncpg
    except ImportError:
        raise PipelineError(
            "a PostgreSQL database needs the asyncpg driver: pip install 'dflash-pipeline[postgres]'"
        ) from None
    import asyncio

    async def connect():
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1), timeout=timeout)
        await conn.close()

    try:
        asyncio.run(asyncio.wait_for(connect(), timeout + 5))
    except Exception as e:  # noqa: BLE001 - any failure to connect is the user's to fix, with this message
        reason = f"{type(e).__name__}: {e}".strip().rstrip(":")
        raise PipelineError(
            f"the database {redact(url)} is unreachable ({reason}). Start PostgreSQL, create the user and database "
            "(docs/OPERATIONS.md: 'One box (SQLite) or a team (PostgreSQL)'), or fix --database or "
            "PREFECT_SERVER_DATABASE_CONNECTION_URL"
        ) from None
