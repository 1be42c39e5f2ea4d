"""Alembic migrations produce exactly the schema declared in orchestrator/store/schema/."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from orchestrator.store import make_engine, migrate
from orchestrator.store.schema import metadata


def test_migrations_match_schema(pg_url: str) -> None:
    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), metadata)
        assert diff == [], diff
        assert migrate.current(engine) == migrate.head()
    finally:
        engine.dispose()


def revisions_url() -> str:
    from tests.conftest import ensure_database, test_database

    return ensure_database(test_database("orchestrator_test_revisions"))


def test_downgrade_to_base_and_back() -> None:
    engine = make_engine(revisions_url())
    try:
        migrate.reset(engine)
        migrate.downgrade(engine, "base")
        assert migrate.current(engine) is None
        migrate.upgrade(engine)
        assert migrate.current(engine) == migrate.head()
    finally:
        engine.dispose()


def test_downgrade_and_upgrade_on_postgres() -> None:
    """The hot path's server functions and the dropped foreign keys come and go with 0004; the
    versioned functions with 0009, whose downgrade gives the unversioned ones back."""
    engine = make_engine(revisions_url())
    try:
        migrate.reset(engine)
        migrate.downgrade(engine, "0008")
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT to_regproc('orc_succeed_v1')").scalar_one() is None
            assert conn.exec_driver_sql("SELECT to_regproc('orc_admit_from')").scalar_one() is not None
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


def test_code_refuses_a_database_behind_the_newest_migration() -> None:
    from orchestrator import Orchestrator, SchemaMissingError, Settings
    from orchestrator.core.publisher import RecordingPublisher
    from orchestrator.core.registry import StaticRegistry
    from orchestrator.store import Store

    url = revisions_url()
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
    with pytest.raises(
        SchemaMissingError, match=rf"revision 0003, this code needs {migrate.head()}: run `orchestrator db"
    ):
        orc.store  # noqa: B018 - the first use checks the schema


def test_code_accepts_a_database_a_newer_release_migrated() -> None:
    """A rolling upgrade: the database is at a revision this code does not know (a newer
    release's); the migrations keep what older releases call, so the check lets it pass."""
    from orchestrator.store import Store

    url = revisions_url()
    engine = make_engine(url)
    try:
        migrate.reset(engine)
        with engine.begin() as conn:
            conn.exec_driver_sql("UPDATE alembic_version SET version_num = '9999_from_the_future'")
        Store(engine).check_schema()
        assert migrate.is_ahead("9999_from_the_future") and not migrate.is_ahead(migrate.head())
    finally:
        engine.dispose()
