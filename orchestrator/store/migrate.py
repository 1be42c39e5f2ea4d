"""The database schema's two paths, behind one entry point (``orchestrator db upgrade`` and the
embedded default's migration on first use): an empty database is created from the current
schema in one step (:func:`create`: the tables of ``store/schema``, every server function of
``store/sql/``, the signing key) and stamped at the newest revision; a database that has a
revision is upgraded by the Alembic migrations, which only ever carry what they change
(``docs/reference/migrations.md``). ``tests/store/test_fresh_schema.py`` holds the two equal."""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection, Engine

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).with_name("migrations")


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


#: advisory lock key held while migrating: two processes starting at once (the embedded
#: default migrates itself) migrate one after the other, the second finding nothing to do
MIGRATION_LOCK = 0x6F7263_03

#: anything of ours in the schema being migrated: a table or a server function
_OURS = sa.text(
    """
    SELECT EXISTS (SELECT 1 FROM pg_class c WHERE c.relnamespace = to_regnamespace(current_schema())
                   AND c.relname LIKE 'orc\\_%' AND c.relkind IN ('r', 'p'))
        OR EXISTS (SELECT 1 FROM pg_proc p WHERE p.pronamespace = to_regnamespace(current_schema())
                   AND p.proname LIKE 'orc\\_%')
    """
)


def upgrade(engine: Engine, revision: str = "head", *, replay: bool = False) -> None:
    """Bring the database to ``revision`` (default: the newest), one migrator at a time. An
    empty database (no revision, no table or function of ours) bound for the newest revision is
    created from the current schema and stamped there; any other is migrated revision by
    revision (``replay``: always, even an empty one, as the schema test does)."""
    cfg = _config()
    with engine.begin() as conn:
        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
        cfg.attributes["connection"] = conn
        if not replay and revision in ("head", "heads", head()) and is_empty(conn):
            create(conn)
            command.stamp(cfg, "head")
            log.info("created the database schema at revision %s", head())
        else:
            command.upgrade(cfg, revision)


def is_empty(conn: Connection) -> bool:
    """Whether the connected schema has no revision and nothing of ours: what :func:`create` is for."""
    if MigrationContext.configure(conn).get_current_revision() is not None:
        return False
    return not conn.execute(_OURS).scalar_one()


def create(conn: Connection) -> None:
    """The current schema, in one transaction: the tables, indexes and constraints of
    ``store/schema``, every server function of ``store/sql/`` and the signing key; what replaying
    every migration on an empty database makes (``tests/store/test_fresh_schema.py``)."""
    from .functions import definitions
    from .schema import metadata
    from .schema import secrets as secrets_table

    metadata.create_all(conn)
    conn.exec_driver_sql(definitions())
    conn.execute(secrets_table.insert().values(name="signing_key", value=secrets.token_hex(32)))


def reset(engine: Engine) -> None:
    """Drop everything in the database's ``public`` schema and create it again at the newest
    revision (Postgres; tests and the chaos soak, on databases they own)."""
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
