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
