"""Shared fixtures. Tests use real PostgreSQL and Redis; a missing Redis fails the test.

The databases live on the PostgreSQL server at ORCHESTRATOR_TEST_DATABASE_URL (default
127.0.0.1:5432, as in CI). Where no server answers there, or with
ORCHESTRATOR_TEST_DATABASE=embedded, they live on an embedded PostgreSQL 18 (the wheel the
embedded default uses), started for the session and stopped at its end: the unit and store
tiers need no server to install. The fault tier restarts and terminates a real server's
backends and needs the machine's.

The in-process Celery app (``orchestrator.runtime.celery_app.get_app``) is configured once from the
environment set here, before anything imports it: Postgres + Redis db 3.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

#: the embedded server's data directory when the tests use one (stopped when the session ends)
EMBEDDED_PG = Path(tempfile.gettempdir()) / "orchestrator-tests" / "pg"


def _database_server() -> tuple[str, str, bool]:
    """(base, query, embedded): a test database's URL is ``f"{base}/{name}{query}"``."""
    explicit = os.environ.get("ORCHESTRATOR_TEST_DATABASE_URL")
    if explicit:
        return explicit, "", False
    default = "postgresql+psycopg://postgres@127.0.0.1:5432"
    if os.environ.get("ORCHESTRATOR_TEST_DATABASE") != "embedded":
        import psycopg

        try:
            psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=postgres connect_timeout=3").close()
            return default, "", False
        except psycopg.OperationalError:
            pass  # no server here: the embedded one
    from orchestrator.store import embedded

    url = sa.engine.make_url(embedded.ensure(EMBEDDED_PG))
    return "postgresql+psycopg://postgres@", f"?host={url.query['host']}&port={url.query['port']}", True


PG_BASE, _PG_QUERY, PG_EMBEDDED = _database_server()


def db_url(name: str) -> str:
    """The URL of the test database ``name`` on the test server."""
    return f"{PG_BASE}/{name}{_PG_QUERY}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if PG_EMBEDDED:
        from orchestrator.store import embedded

        embedded.stop(EMBEDDED_PG)


REDIS_BASE = os.environ.get("ORCHESTRATOR_TEST_REDIS_URL", "redis://127.0.0.1:6379")
#: a suffix keeps two test runs on one server apart (each its own databases)
_SUFFIX = os.environ.get("ORCHESTRATOR_TEST_DB_SUFFIX", "")
IT_DB = "orchestrator_it" + _SUFFIX
STORE_DB = "orchestrator_test" + _SUFFIX
IT_DATABASE_URL = db_url(IT_DB)
STORE_DATABASE_URL = db_url(STORE_DB)
#: the integration tier's Redis database (another per concurrent run: ORCHESTRATOR_TEST_REDIS_DB)
IT_BROKER_URL = f"{REDIS_BASE}/{os.environ.get('ORCHESTRATOR_TEST_REDIS_DB', '3')}"
DATA_DIR = tempfile.mkdtemp(prefix="orc-tests-")

os.environ.update(
    {
        "ORCHESTRATOR_DATABASE_URL": IT_DATABASE_URL,
        "ORCHESTRATOR_BROKER_URL": IT_BROKER_URL,
        "ORCHESTRATOR_DATA_DIR": DATA_DIR,
        "ORCHESTRATOR_TICK_SECONDS": "0.2",
        "ORCHESTRATOR_LEASE_SECONDS": "5",
        "ORCHESTRATOR_HAZARD_PROBES": "1",
    }
)


def test_database(name: str) -> str:
    """A test database's name, kept apart from another test run's by ORCHESTRATOR_TEST_DB_SUFFIX."""
    return name + _SUFFIX


def ensure_database(name: str) -> str:
    """Create the database ``name`` if it does not exist; fail clearly if Postgres is down."""
    admin = sa.create_engine(db_url("postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            exists = conn.execute(sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}).first()
            if not exists:
                conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except sa.exc.OperationalError as exc:
        pytest.fail(f"PostgreSQL is required at {PG_BASE} ({exc.orig}); start it (see .ci/run)")
    finally:
        admin.dispose()
    return db_url(name)


def empty_tables(engine: sa.engine.Engine) -> None:
    """Delete every row of every table (children first): a clean database without migrating."""
    from orchestrator.store import schema

    with engine.begin() as conn:
        for table in reversed(schema.metadata.sorted_tables):
            conn.execute(table.delete())


def backend_orchestrator(request: pytest.FixtureRequest, data_dir: str, task_names: list[str]) -> object:
    """An orchestrator on the emptied test database, with an in-memory publisher and a static
    registry of ``task_names``."""
    from orchestrator import Orchestrator, Settings
    from orchestrator.core.publisher import RecordingPublisher
    from orchestrator.core.registry import StaticRegistry

    settings = Settings.from_env({}, data_dir=data_dir, database_url=request.getfixturevalue("pg_clean"))
    return Orchestrator(settings, publisher=RecordingPublisher(), registry=StaticRegistry(task_names))


def stop_embedded(data_dir: str | os.PathLike[str]) -> None:
    """Stop the embedded PostgreSQL a test started under ``data_dir`` (it outlives its processes)."""
    from pathlib import Path

    from orchestrator.store import embedded

    embedded.stop(Path(data_dir).absolute() / "pg")


def reset_schema(url: str) -> None:
    """Drop everything and migrate from scratch with Alembic."""
    from orchestrator.store import make_engine, migrate

    engine = make_engine(url)
    try:
        migrate.reset(engine)
    finally:
        engine.dispose()


_migrated: list[str] = []


def migrated_test_database() -> str:
    """The store tests' database, migrated from scratch once per test session."""
    if not _migrated:
        url = ensure_database(STORE_DB)
        reset_schema(url)
        _migrated.append(url)
    return _migrated[0]


def clean_test_database() -> str:
    """The store tests' database, emptied: a clean state without migrating again."""
    from orchestrator.store import make_engine

    url = migrated_test_database()
    engine = make_engine(url)
    try:
        empty_tables(engine)
    finally:
        engine.dispose()
    return url


@pytest.fixture(scope="session")
def pg_url() -> str:
    return migrated_test_database()


@pytest.fixture
def pg_clean() -> str:
    """The test database, emptied for this test."""
    return clean_test_database()


@pytest.fixture(scope="session")
def redis_client() -> Iterator[object]:
    import redis

    client = redis.Redis.from_url(IT_BROKER_URL)
    try:
        client.ping()
    except redis.exceptions.ConnectionError as exc:
        pytest.fail(f"Redis is required at {IT_BROKER_URL} ({exc}); start it (see .ci/run)")
    yield client
    client.close()
