"""Alembic migrations produce exactly the schema declared in orchestrator/schema.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from orchestrator import migrate
from orchestrator.schema import metadata
from orchestrator.store import make_engine


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_migrations_match_schema(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    url = f"sqlite:///{tmp_path / 'm.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    engine = make_engine(url)
    try:
        if backend == "sqlite":
            migrate.upgrade(engine)
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), metadata)
        assert diff == [], diff
        assert migrate.current(engine) == migrate.head()
    finally:
        engine.dispose()


def test_downgrade_to_base_and_back(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'd.db'}")
    migrate.upgrade(engine)
    migrate.downgrade(engine, "base")
    assert migrate.current(engine) is None
    migrate.upgrade(engine)
    assert migrate.current(engine) == migrate.head()
    engine.dispose()


def test_downgrade_and_upgrade_on_postgres() -> None:
    """The hot path's server functions and the dropped foreign keys come and go with 0004."""
    from tests.conftest import ensure_database

    engine = make_engine(ensure_database("orchestrator_test_revisions"))
    try:
        migrate.reset(engine)
        migrate.downgrade(engine, "0003")
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT to_regproc('orc_succeed')").scalar_one() is None
        migrate.upgrade(engine)
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT to_regproc('orc_succeed')").scalar_one() is not None
            diff = compare_metadata(MigrationContext.configure(conn), metadata)
        assert diff == [], diff
    finally:
        engine.dispose()


def test_code_refuses_a_database_behind_the_newest_migration(tmp_path: Path) -> None:
    from orchestrator import Orchestrator, SchemaMissingError, Settings
    from orchestrator.publisher import RecordingPublisher
    from orchestrator.registry import StaticRegistry
    from orchestrator.store import Store
    from tests.conftest import ensure_database

    url = ensure_database("orchestrator_test_revisions")
    engine = make_engine(url)
    try:
        migrate.reset(engine)
        migrate.downgrade(engine, "0003")
    finally:
        engine.dispose()
    orc = Orchestrator(
        Settings.from_env({}, database_url=url),
        store=Store(url),
        publisher=RecordingPublisher(),
        registry=StaticRegistry(["t"]),
    )
    with pytest.raises(SchemaMissingError, match=r"revision 0003, this code needs 0008: run `orchestrator db upgrade`"):
        orc.store  # noqa: B018 - the first use checks the schema
