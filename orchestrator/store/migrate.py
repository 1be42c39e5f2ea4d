"""Alembic migrations driven from code (``orchestrator db upgrade``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

MIGRATIONS = Path(__file__).with_name("migrations")


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


#: advisory lock key held while migrating: two processes starting at once (the embedded
#: default migrates itself) migrate one after the other, the second finding nothing to do
MIGRATION_LOCK = 0x6F7263_03


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Migrate the database to ``revision`` (default: the newest), one migrator at a time."""
    cfg = _config()
    with engine.begin() as conn:
        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def reset(engine: Engine) -> None:
    """Drop everything in the database's ``public`` schema and migrate from scratch (Postgres;
    tests and the chaos soak, on databases they own)."""
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP SCHEMA public CASCADE")
        conn.exec_driver_sql("CREATE SCHEMA public")
    upgrade(engine)


def downgrade(engine: Engine, revision: str) -> None:
    cfg = _config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def current(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def schema_diff(engine: Engine) -> list[Any]:
    """Differences between the live database and ``orchestrator.store.schema`` (empty when equal)."""
    from alembic.autogenerate import compare_metadata

    from .probes import probe_metadata
    from .schema import metadata

    def product_only(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        # probe instrumentation is created on demand and is not part of the product schema
        return not (type_ == "table" and name in probe_metadata.tables)

    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"include_object": product_only})
        return list(compare_metadata(context, metadata))


def head() -> str | None:
    return ScriptDirectory.from_config(_config()).get_current_head()


def is_ahead(revision: str | None) -> bool:
    """Whether ``revision`` is one this code does not know: a newer release migrated the database."""
    if revision is None:
        return False
    return revision not in {s.revision for s in ScriptDirectory.from_config(_config()).walk_revisions()}
